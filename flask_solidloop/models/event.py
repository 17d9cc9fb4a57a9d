"""The wire log: one row per LLM request, tool call or inbound MCP request."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, Timestamps


class Event(Timestamps, Base):
    """A redacted record of one exchange with the outside world.

    Secrets (Authorization headers, API keys) are removed before a row is
    written; see flask_solidloop.llm.redact.
    """

    __tablename__ = "solidloop_events"
    __table_args__ = (
        Index("ix_solidloop_events_loop_id", "loop_id"),
        # The janitor's retention scan. BRIN: events are append-only, so their
        # created_at follows the heap order, and a block-range summary finds old
        # rows with no B-tree entry written per event (migration 0009).
        Index("ix_solidloop_events_created_at", "created_at", postgresql_using="brin"),
        # Inbound MCP requests (kind 'mcp_inbound', loop_id NULL), newest first,
        # all of them or one session's: the admin's Inbound MCP page, and the
        # janitor deleting an old session's events. Partial, so loop events
        # (nearly every row) never pay for them.
        Index("ix_solidloop_events_mcp_inbound", "id",
              postgresql_where=text("kind = 'mcp_inbound'")),
        Index("ix_solidloop_events_mcp_inbound_session", text("(payload ->> 'session_id')"), "id",
              postgresql_where=text("kind = 'mcp_inbound'")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loop_id: Mapped[int | None] = mapped_column(
        ForeignKey("solidloop_loops.id", ondelete="CASCADE")
    )
    # The message and the tool call the event is about, by id and without a
    # foreign key (migration 0011): the log keeps the ids it was written with,
    # and the loop's cascade removes its events. Neither column is indexed, so
    # a SET NULL key would scan the table for every message or call deleted.
    message_id: Mapped[int | None] = mapped_column(BigInteger)
    tool_call_id: Mapped[int | None] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(50), nullable=False)
    status_code: Mapped[int | None] = mapped_column(Integer)
    duration_ms: Mapped[float | None] = mapped_column()
    error: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
