"""The record of maintenance passes: one row per task (``reap``, ``prune``).

Written only by flask_solidloop/maintenance/runs.py, one upsert at the end of
every pass, wherever the pass ran (a worker's periodic thread, the
maintenance actor, ``flask solidloop reap`` / ``prune``); read by the admin
dashboard. It lives in the database, not in a process, so any web process
sees what any worker did.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, Float, String, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class MaintenanceRun(Base):
    """The last pass of one maintenance task, and its last failure."""

    __tablename__ = "solidloop_maintenance_runs"

    #: ``reap`` or ``prune``.
    task: Mapped[str] = mapped_column(String(50), primary_key=True)
    last_started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    #: When the last pass ended, successful or not (the database clock).
    last_finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    duration_ms: Mapped[float] = mapped_column(Float, nullable=False)
    #: Whether the last pass finished without an exception.
    last_ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    #: What the last pass did in all: loops and jobs healed, or rows pruned.
    total: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    #: The same, per case (``{"expired_llm": 1, ...}`` / ``{"events": 30, ...}``);
    #: for a failed pass, what it did before it failed.
    counts: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    #: The latest failure (exception class and message, URLs redacted), kept
    #: after later passes succeed so a transient failure stays visible.
    last_error: Mapped[str | None] = mapped_column(Text)
    last_error_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: ``host:pid`` of the process that ran the last pass (leases.worker_identity()).
    holder: Mapped[str] = mapped_column(String(200), nullable=False)
    #: Passes recorded since the row was created.
    passes: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="1")
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())

    def __repr__(self) -> str:
        return f"<MaintenanceRun {self.task} ok={self.last_ok} at {self.last_finished_at}>"
