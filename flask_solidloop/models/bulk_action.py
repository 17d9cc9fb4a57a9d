"""A bulk admin action: one row per confirmed action, walked by a job
(loops/bulk.py; docs/decisions/0046-bulk-actions-as-jobs.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, Timestamps

#: A bulk action's statuses: waiting for its job, walking, finished, ended by an error.
BULK_STATUSES = ("queued", "running", "done", "failed")


class BulkAction(Timestamps, Base):
    """One confirmed bulk action and its progress.

    The set is frozen at confirmation: ``search`` (the list's filters) with
    ``max_id`` (loops created later are left alone), or the operator's
    selected ``loop_ids``. ``token`` is the confirmation form's idempotency
    token. The walk goes newest first; ``cursor`` is the lowest loop id acted
    on so far (every matching id at or above it is done), advanced in the
    transaction of each loop's own transition, so a walk that dies resumes
    below it and no loop is acted on twice.
    """

    __tablename__ = "solidloop_bulk_actions"
    __table_args__ = (UniqueConstraint("token", name="uq_solidloop_bulk_actions_token"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    token: Mapped[str] = mapped_column(String(64), nullable=False)
    action: Mapped[str] = mapped_column(String(32), nullable=False)
    options: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False,
                                                    server_default=text("'{}'::jsonb"))
    search: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    max_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    loop_ids: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger), nullable=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="queued")
    total: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    done: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    skipped: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    cursor: Mapped[int] = mapped_column(BigInteger, nullable=False)
    requested_by: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")
