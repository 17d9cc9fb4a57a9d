"""A message of a loop's conversation: system, user, assistant or tool."""

from __future__ import annotations

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
    Numeric,
    String,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from .base import Base, Timestamps

if TYPE_CHECKING:
    from .loop import Loop
    from .tool_call import ToolCall


class Message(Timestamps, Base):
    """One entry of the history.

    An assistant turn starts as a hidden ``processing`` shell (so a partial
    stream never enters the history the model sees) and becomes ``completed``
    in the same commit that records its tool calls. ``is_hidden`` rows are
    never sent to the model. A ``summary`` (``kind``) replaces, in the
    history the model sees, the messages marked ``compacted_by`` it
    (pipeline/compaction.py); they stay, folded in the admin.
    """

    __tablename__ = "solidloop_messages"
    __table_args__ = (
        CheckConstraint("role IN ('system','user','assistant','tool')", name="role_valid"),
        CheckConstraint("status IN ('processing','completed','failed')", name="status_valid"),
        CheckConstraint("kind IN ('message','summary')", name="kind_valid"),
        Index("ix_solidloop_messages_loop_id_id", "loop_id", "id"),
        Index(
            "ix_solidloop_messages_processing",
            "loop_id",
            postgresql_where=text("status = 'processing'"),
        ),
        # A tool call has one answer. Partial: only tool answers have a
        # tool_call_id, and no other message pays for an entry (migration 0010).
        Index(
            "uq_solidloop_messages_tool_call_id",
            "tool_call_id",
            unique=True,
            postgresql_where=text("tool_call_id IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loop_id: Mapped[int] = mapped_column(
        ForeignKey("solidloop_loops.id", ondelete="CASCADE"), nullable=False
    )
    role: Mapped[str] = mapped_column(String(20), nullable=False)
    content: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(
        String(20), nullable=False, default="completed", server_default="completed"
    )
    is_hidden: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=False, server_default=text("false")
    )
    reasoning: Mapped[str | None] = mapped_column(Text)
    # For role='tool': the tool call this message answers.
    tool_call_id: Mapped[int | None] = mapped_column(
        ForeignKey("solidloop_tool_calls.id", ondelete="CASCADE", use_alter=True)
    )
    finish_reason: Mapped[str | None] = mapped_column(String(50))
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    cost: Mapped[Decimal | None] = mapped_column(Numeric(18, 8))
    meta: Mapped[dict[str, Any]] = mapped_column(
        "metadata", JSONB, nullable=False, default=dict, server_default=text("'{}'::jsonb")
    )
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: ``message``, or ``summary``: the text that replaced older messages in
    #: the history (migration 0030).
    kind: Mapped[str] = mapped_column(
        String(20), nullable=False, default="message", server_default="message"
    )
    #: The summary that replaced this message in the history the model sees.
    compacted_by: Mapped[int | None] = mapped_column(BigInteger)

    loop: Mapped[Loop] = relationship(back_populates="messages")
    tool_calls: Mapped[list[ToolCall]] = relationship(
        back_populates="message",
        order_by="ToolCall.position",
        foreign_keys="ToolCall.message_id",
        lazy="select",
    )

    def __repr__(self) -> str:
        return f"<Message {self.id} {self.role} {self.status}>"
