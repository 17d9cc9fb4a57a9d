"""A tool call the model asked for, its per-call lease and its canonical result."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from .base import Base, Timestamps

if TYPE_CHECKING:
    from .loop import Loop
    from .message import Message


class ToolCall(Timestamps, Base):
    """One tool invocation.

    ``executed_at`` is the exactly-once checkpoint: once set, the tool body is
    never run again for this row. ``lease_token``/``leased_until`` let the
    reaper reclaim one dead parallel call without fencing its siblings.
    ``response_message`` is the single tool message that answers the call.
    """

    __tablename__ = "solidloop_tool_calls"
    __table_args__ = (
        UniqueConstraint("message_id", "position", name="uq_solidloop_tool_calls_message_position"),
        Index("ix_solidloop_tool_calls_loop_id", "loop_id"),
        Index(
            "ix_solidloop_tool_calls_unresolved",
            "loop_id",
            postgresql_where=text("response_message_id IS NULL"),
        ),
        # The foreign key's own lookups: deleting a message (a loop's cascade)
        # sets response_message_id NULL WHERE response_message_id = <its id>, one
        # probe per deleted message, a sequential scan of the table without this.
        # Partial: a call is inserted unanswered, and pays for the entry only
        # when its answer is written (migration 0009).
        Index("ix_solidloop_tool_calls_response_message_id", "response_message_id",
              postgresql_where=text("response_message_id IS NOT NULL")),
        # The calls still awaiting a decision or a result, by deadline (the
        # approvals listing, the reaper's expired waits): a call pays for the
        # entry only while it waits (migration 0012).
        Index("ix_solidloop_tool_calls_awaiting", "wait_deadline",
              postgresql_where=text("waits_for IS NOT NULL AND decision IS NULL")),
        CheckConstraint("waits_for IN ('approval','result')", name="waits_for_valid"),
        CheckConstraint("decision IN ('approved','denied','completed')", name="decision_valid"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loop_id: Mapped[int] = mapped_column(
        ForeignKey("solidloop_loops.id", ondelete="CASCADE"), nullable=False
    )
    message_id: Mapped[int] = mapped_column(
        ForeignKey("solidloop_messages.id", ondelete="CASCADE"), nullable=False
    )
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    call_id: Mapped[str | None] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(300), nullable=False)
    server_name: Mapped[str | None] = mapped_column(String(200))
    tool_name: Mapped[str | None] = mapped_column(String(200))
    arguments_raw: Mapped[str | None] = mapped_column(Text)
    arguments: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    is_success: Mapped[bool | None] = mapped_column(Boolean)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    error_kind: Mapped[str | None] = mapped_column(String(50))
    executed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_token: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    leased_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The worker process (``host:pid``) holding the lease, for status and the admin.
    lease_holder: Mapped[str | None] = mapped_column(String(200))
    #: Facts about the call, e.g. ``{"sanitized": [...]}`` when text had to be made storable.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    duration_ms: Mapped[float | None] = mapped_column()
    #: Runs of this call whose lease lapsed before a result (the reaper took the
    #: call over each time); at SOLIDLOOP_TOOL_MAX_ATTEMPTS it is not run again.
    lapsed_runs: Mapped[int] = mapped_column(Integer, nullable=False, default=0,
                                             server_default="0")
    #: What the call waits for before it may run or be answered: ``approval``
    #: (a person decides), ``result`` (a deferred tool: the host supplies it);
    #: None for a call that runs at once.
    waits_for: Mapped[str | None] = mapped_column(String(20))
    #: The one decision on a waiting call: ``approved``, ``denied`` or
    #: ``completed`` (its result supplied), with who took it and when.
    decision: Mapped[str | None] = mapped_column(String(20))
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    decided_by: Mapped[str | None] = mapped_column(String(200))
    decision_reason: Mapped[str | None] = mapped_column(Text)
    #: The model's arguments, when an approval ran the call with edited ones.
    requested_arguments: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    #: When the wait times out (its tool's ``approval_timeout`` or ``result_timeout``).
    wait_deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    response_message_id: Mapped[int | None] = mapped_column(
        ForeignKey("solidloop_messages.id", ondelete="SET NULL")
    )

    loop: Mapped[Loop] = relationship(back_populates="tool_calls")
    message: Mapped[Message] = relationship(back_populates="tool_calls", foreign_keys=[message_id])
    response_message: Mapped[Message | None] = relationship(foreign_keys=[response_message_id])

    @property
    def idempotency_key(self) -> str:
        return f"solidloop:tool_call:{self.id}"

    def __repr__(self) -> str:
        return f"<ToolCall {self.id} {self.name} success={self.is_success}>"
