"""The loop row: one autonomous agent run, its status, generation fence and lease."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from ..errors import InvalidArgumentError
from .base import Base, Timestamps

if TYPE_CHECKING:
    from .message import Message
    from .tool_call import ToolCall


class LoopStatus(enum.StrEnum):
    INIT = "init"
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    PAUSED = "paused"
    #: The tool phase has nothing left to run but calls that wait for a
    #: decision or a result: no job, lease or thread is held.
    WAITING = "waiting"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def check(cls, status: str) -> str:
        """``status`` if it is a loop status; InvalidArgumentError otherwise."""
        if status not in cls._value2member_map_:
            raise InvalidArgumentError(
                f"unknown loop status {status!r}; statuses: {', '.join(cls)}")
        return status


ALL_STATUSES = tuple(s.value for s in LoopStatus)
#: Statuses ``resume()`` may re-enter. queued/running are live and never resumable.
RESUMABLE_STATUSES: tuple[str, ...] = ("init", "paused", "failed", "completed")
TERMINAL_STATUSES: tuple[str, ...] = ("completed", "failed")


class Loop(Timestamps, Base):
    __tablename__ = "solidloop_loops"
    __table_args__ = (
        CheckConstraint(
            "status IN ('init','queued','running','completed','failed','paused','waiting')",
            name="status_valid",
        ),
        Index("ix_solidloop_loops_status", "status"),
        Index("ix_solidloop_loops_subject", "subject_type", "subject_id"),
        # The reaper's scan of queued loops stays tiny however many have finished.
        # No index covers a column that a running loop's updates change (lease,
        # token, counters, updated_at): those updates keep the status, so
        # PostgreSQL can make them HOT (migration 0009 also gives the table a
        # fillfactor, so the new row version fits on its page). The reaper finds
        # expired leases through ix_solidloop_loops_status: running loops are
        # bounded by the fleet's threads.
        Index(
            "ix_solidloop_loops_queued_at",
            "queued_at",
            postgresql_where=text("status = 'queued'"),
        ),
        # Fair shares and caps (docs/decisions/0023-fair-shares.md): a subject's
        # live loops (its new loops' rank), the loops admitted under a cap, and
        # the loops a cap holds. Partial over columns a running loop's updates
        # never change, so those updates stay HOT.
        CheckConstraint("held_by IN ('agent','subject')", name="held_by_valid"),
        Index("ix_solidloop_loops_subject_live", "subject_type", "subject_id",
              postgresql_where=text("status IN ('queued','running','waiting')")),
        Index("ix_solidloop_loops_capped_subject", "subject_type", "subject_id",
              postgresql_where=text("capped_at IS NOT NULL")),
        Index("ix_solidloop_loops_capped_agent", "agent_name",
              postgresql_where=text("capped_at IS NOT NULL")),
        Index("ix_solidloop_loops_held_subject", "subject_type", "subject_id", "held_since",
              postgresql_where=text("held_by = 'subject'")),
        Index("ix_solidloop_loops_held_agent", "agent_name", "held_since",
              postgresql_where=text("held_by = 'agent'")),
        # The loop retention's scan (docs/decisions/0030-loop-retention.md):
        # ended loops, oldest first. A running loop's updates change neither
        # column, so they stay HOT; a loop pays for the entry when it ends.
        Index("ix_solidloop_loops_ended", "finished_at", "id",
              postgresql_where=text("status IN ('completed','failed')")),
        # Child agents (docs/decisions/0037-child-agents.md): a loop's children,
        # for the cascades' walk and the retention's check.
        Index("ix_solidloop_loops_parent", "parent_loop_id",
              postgresql_where=text("parent_loop_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    agent_name: Mapped[str] = mapped_column(String(200), nullable=False)
    subject_type: Mapped[str | None] = mapped_column(String(200))
    subject_id: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), nullable=False, default="init")
    execution_token: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The worker process (``host:pid``) holding the running LLM turn's lease.
    lease_holder: Mapped[str | None] = mapped_column(String(200))
    error_message: Mapped[str | None] = mapped_column(Text)
    #: When the loop last became ``queued`` (the reaper's ``stuck_queued`` age).
    queued_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    step_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Limits (max_steps, max_duration) apply per run: from the first claim after
    # start or resume. resume() moves the base forward and clears run_started_at.
    run_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    run_step_base: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0"
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    input_tokens: Mapped[int] = mapped_column(
        BigInteger, nullable=False, default=0, server_default="0"
    )
    output_tokens: Mapped[int] = mapped_column(
        BigInteger, nullable=False, default=0, server_default="0"
    )
    cost: Mapped[Decimal] = mapped_column(
        Numeric(18, 8), nullable=False, default=Decimal(0), server_default="0"
    )
    # Admin controls: a frozen loop is paused and refuses resume() until
    # unfrozen; an observed loop is one somebody is watching live.
    frozen: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=False, server_default=text("false")
    )
    observed: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=False, server_default=text("false")
    )
    state: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, server_default=text("'{}'::jsonb")
    )
    # A provider outage that keeps deferring the loop's turn: since when, how
    # many turns it deferred, its last error (cleared by the turn's end).
    provider_wait_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    provider_wait_attempts: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0")
    provider_wait_error: Mapped[str | None] = mapped_column(Text)
    # Budgets and rate limits (limits/): the loop's own limits over its agent's,
    # the turns a rate limit deferred, and the reservation a deferred turn
    # holds for its LLM step.
    budget: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    capacity_deferrals: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0")
    capacity_slot: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    # Fair shares and concurrency caps (loops/store/caps.py): the loop's rank in
    # the claim order (its subject's live loops when it was created); when a cap
    # admitted it (it counts against the caps until it leaves flight); since when
    # and by which cap (``agent`` or ``subject``) it is held before its first turn.
    fair_rank: Mapped[int] = mapped_column(Integer, nullable=False, default=0,
                                           server_default="0")
    capped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    held_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    held_by: Mapped[str | None] = mapped_column(String(10))
    # Until when an open stream watches the loop (streaming/): its events are
    # then NOTIFYed and its partial text flushes at SOLIDLOOP_STREAM_MAX_HZ.
    watched_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A conversation's queued messages (loops/store/conversation.py): sent while
    # the loop was live, not yet in its history, oldest first; NULL when none.
    inbox: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB(none_as_null=True))
    # The current run's OpenTelemetry context (telemetry/tracing.new_run): its
    # invoke_agent span's traceparent, its parent, start and previous run;
    # NULL when tracing was off when it started.
    trace: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    # A fork (loops/store/forks.py): the loop and the message it was forked
    # from, kept as a record (no foreign key: the original may be deleted by
    # retention while its fork lives on).
    forked_from_loop_id: Mapped[int | None] = mapped_column(BigInteger)
    forked_at_message_id: Mapped[int | None] = mapped_column(BigInteger)
    # Provider settings over the agent's ``llm`` option for this loop only
    # (``{"model": ...}`` for a replay against another model); NULL when none.
    llm_override: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    # A child agent's loop (loops/store/children.py): the loop and the tool call
    # that started it (the call's result is this loop's answer), and how many
    # ancestors it has (0: started by the host).
    parent_loop_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("solidloop_loops.id", ondelete="SET NULL"))
    # No foreign key: the retention holds the parent while the child lives, and
    # a key to the calls would give loops and calls two join paths.
    parent_tool_call_id: Mapped[int | None] = mapped_column(BigInteger)
    depth: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # Structured output (docs/decisions/0036-structured-output.md): the JSON
    # Schema the loop was started with (its agent's ``output_type``), and the
    # validated answer its completing turn wrote; NULL without structured output.
    # JSON, not JSONB: JSONB sorts keys, and a schema's property order is the
    # order a model writes the fields in.
    output_schema: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    output: Mapped[Any] = mapped_column(JSONB(none_as_null=True), nullable=True)

    messages: Mapped[list[Message]] = relationship(
        back_populates="loop", order_by="Message.id", lazy="select", passive_deletes=True
    )
    tool_calls: Mapped[list[ToolCall]] = relationship(
        back_populates="loop", order_by="ToolCall.id", lazy="select", passive_deletes=True
    )

    @property
    def subject_label(self) -> str | None:
        if self.subject_type is None and self.subject_id is None:
            return None
        return f"{self.subject_type} #{self.subject_id}"

    def __repr__(self) -> str:
        return f"<Loop {self.id} {self.agent_name!r} {self.status}>"
