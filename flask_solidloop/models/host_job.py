"""The tables behind the host's own jobs (flask_solidloop.jobs).

* ``solidloop_host_jobs``: one row per RQ-style job (``q.enqueue(...)``), keyed
  by its RQ job id, holding what RQ keeps in its job hash: status, meta,
  description, return value, failure info and the TTLs after which the janitor
  deletes it. The message itself lives in ``solidloop_jobs`` (one row per
  delivery attempt, linked by ``message_id``).
* ``solidloop_results``: the dramatiq ``Results`` backend on PostgreSQL
  (``store_results=True`` actors), keyed like dramatiq's other backends.
* ``solidloop_periodic``: the last period each periodic schedule enqueued; the
  conditional upsert on it is what makes one job per period across workers.

Rows are written with raw SQL from flask_solidloop/queue/sql.py; these
mappings exist for migrations and for reading.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Index, Integer, String, Text, Uuid, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base

#: What ``solidloop_host_jobs.status`` records. ``started`` and ``scheduled`` are
#: read from the job's live row in ``solidloop_jobs`` (see jobs/rq.py).
HOST_JOB_STATUSES = ("queued", "scheduled", "finished", "failed", "canceled")


class HostJob(Base):
    __tablename__ = "solidloop_host_jobs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued','scheduled','finished','failed','canceled')",
            name="status_valid",
        ),
        Index("ix_solidloop_host_jobs_queue_status", "queue_name", "status"),
        Index("ix_solidloop_host_jobs_expires_at", "expires_at",
              postgresql_where=text("expires_at IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    message_id: Mapped[uuid.UUID] = mapped_column(Uuid, nullable=False)
    queue_name: Mapped[str] = mapped_column(String(200), nullable=False)
    func_name: Mapped[str] = mapped_column(Text, nullable=False)
    description: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(10), nullable=False)
    meta: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    result: Mapped[Any | None] = mapped_column(JSONB)
    exc_info: Mapped[str | None] = mapped_column(Text)
    #: Seconds to keep a finished / failed job; NULL keeps it forever (RQ's -1).
    result_ttl: Mapped[int | None] = mapped_column(Integer)
    failure_ttl: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class JobResult(Base):
    __tablename__ = "solidloop_results"
    __table_args__ = (
        Index("ix_solidloop_results_expires_at", "expires_at"),
    )

    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    value: Mapped[Any] = mapped_column(JSONB, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class PeriodicRun(Base):
    __tablename__ = "solidloop_periodic"

    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    last_period: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
