"""The job table behind the Postgres broker (flask_solidloop.queue.broker).

Rows are written with raw SQL by the broker for speed; this mapping exists so
migrations, the reaper, the CLI and the admin can read the same table.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class Job(Base):
    __tablename__ = "solidloop_jobs"
    __table_args__ = (
        CheckConstraint("state IN ('queued','running','done','dead')", name="state_valid"),
        # The claim query's index: only queued rows, in claim order (tier, then
        # their fair place: when they are due, moved back by their loop's rank).
        Index(
            "ix_solidloop_jobs_claim",
            "queue_name",
            "tier",
            text("coalesce(fair_at, eta)"),
            "id",
            postgresql_where=text("state = 'queued'"),
        ),
        Index(
            "ix_solidloop_jobs_running_lease",
            "lease_until",
            postgresql_where=text("state = 'running'"),
        ),
        Index(
            "ix_solidloop_jobs_live_loop",
            "loop_id",
            postgresql_where=text("state IN ('queued','running')"),
        ),
        Index("ix_solidloop_jobs_finished", "finished_at", postgresql_where=text("state = 'done'")),
        # Dead-lettered rows, by id: the admin's count and newest-first list and
        # requeue-all read only them (a few rows among millions of done ones).
        Index("ix_solidloop_jobs_dead", "id", postgresql_where=text("state = 'dead'")),
        # An RQ-style job's deliveries, found by message id (only those rows pay for it).
        Index("ix_solidloop_jobs_host_message", "message_id",
              postgresql_where=text("actor_name = 'solidloop.job'")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    queue_name: Mapped[str] = mapped_column(String(200), nullable=False)
    actor_name: Mapped[str] = mapped_column(String(200), nullable=False)
    message_id: Mapped[uuid.UUID] = mapped_column(Uuid, nullable=False)
    message: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    state: Mapped[str] = mapped_column(
        String(10), nullable=False, default="queued", server_default="queued"
    )
    eta: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    #: Claim order before ``eta``: 0 for the continuations of started loops (their
    #: next LLM turn, their tool calls), 1 for everything else; a tier-1 job that
    #: waited past SOLIDLOOP_FIRST_TURN_MAX_WAIT is promoted to 0, so nothing starves.
    tier: Mapped[int] = mapped_column(SmallInteger, nullable=False, default=1,
                                      server_default="1")
    #: The job's place in the claim order when its loop's fair rank moves it back
    #: (``eta`` + rank x SOLIDLOOP_FAIR_SHARE_QUANTUM); NULL: its due time.
    fair_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_token: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    loop_id: Mapped[int | None] = mapped_column(BigInteger)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
