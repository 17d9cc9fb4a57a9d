"""The worker registry row (one per dramatiq worker process, kept fresh by its
heartbeat) and the maintenance leaders (one row per in-worker periodic task).

Written only by the heartbeat of queue/middleware/worker_registry.py (its SQL
is in queue/sql.py) and pruned by the same heartbeat and by the janitor. What
a worker *holds* is not stored here: it is read live from the lease holders of
solidloop_loops and solidloop_tool_calls, which name the same ``host:pid``.
A leader row is written only by queue/middleware/periodic.py (its SQL in
queue/sql.py too).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Index, Integer, String, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class Worker(Base):
    __tablename__ = "solidloop_workers"
    __table_args__ = (Index("ix_solidloop_workers_last_seen_at", "last_seen_at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: ``host:pid``, as leases.worker_identity() writes it into lease_holder columns.
    identity: Mapped[str] = mapped_column(String(200), nullable=False, unique=True)
    host: Mapped[str] = mapped_column(String(200), nullable=False)
    pid: Mapped[int] = mapped_column(Integer, nullable=False)
    queues: Mapped[list[Any]] = mapped_column(
        JSONB, nullable=False, default=list, server_default=text("'[]'::jsonb"))
    threads: Mapped[int] = mapped_column(Integer, nullable=False)
    started_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False)
    last_seen_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False)
    #: Set by a clean shutdown; a row whose heartbeat stopped without it was lost.
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    def __repr__(self) -> str:
        return f"<Worker {self.identity}>"


class Leader(Base):
    """Which worker process runs one periodic task's passes, and until when."""

    __tablename__ = "solidloop_leaders"

    #: The task: ``reaper`` or ``janitor``.
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    #: ``host:pid:<instance>`` of the leading process's periodic thread.
    holder: Mapped[str] = mapped_column(String(300), nullable=False)
    #: The leadership lapses then unless the holder renews it (before each pass).
    until: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    #: When this holder took the leadership.
    since: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False)

    def __repr__(self) -> str:
        return f"<Leader {self.name}: {self.holder}>"
