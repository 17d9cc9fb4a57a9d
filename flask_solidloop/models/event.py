"""The wire log: one row per LLM request, tool call or inbound MCP request.

An LLM request put on record before it was sent has its answer in a row of
its own (:class:`~flask_solidloop.models.LlmAnswer`); :class:`Event` reads
the two as one: its ``payload``, ``status_code``, ``duration_ms`` and
``error`` are the request's merged with its answer's.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Text, func, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, column_property, mapped_column

from .base import Base, Timestamps
from .llm_answer import LlmAnswer

_ANSWERS = LlmAnswer.__table__


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
    # The row's own columns, written by loops/sql and by an Event made here
    # (the inbound MCP log: see __init__); read through the merged attributes
    # below.
    own_status_code: Mapped[int | None] = mapped_column("status_code", Integer)
    own_duration_ms: Mapped[float | None] = mapped_column("duration_ms")
    own_error: Mapped[str | None] = mapped_column("error", Text)
    own_payload: Mapped[dict[str, Any]] = mapped_column(
        "payload", JSONB, nullable=False, default=dict)

    # The record as a reader knows it: the row's own values, or, for a request
    # answered in its own row (solidloop_llm_answers), the answer's status,
    # duration and error, and the answer's fields merged into the payload, as
    # the turn's end merged them into the row before migration 0027.
    status_code: Mapped[int | None] = column_property(func.coalesce(
        select(_ANSWERS.c.status_code).where(_ANSWERS.c.event_id == id).scalar_subquery(),
        own_status_code))
    duration_ms: Mapped[float | None] = column_property(func.coalesce(
        select(_ANSWERS.c.duration_ms).where(_ANSWERS.c.event_id == id).scalar_subquery(),
        own_duration_ms))
    error: Mapped[str | None] = column_property(func.coalesce(
        select(_ANSWERS.c.error).where(_ANSWERS.c.event_id == id).scalar_subquery(),
        own_error))
    payload: Mapped[dict[str, Any]] = column_property(own_payload.op("||", return_type=JSONB)(
        func.coalesce(select(_ANSWERS.c.answer).where(_ANSWERS.c.event_id == id)
                      .scalar_subquery(), text("'{}'::jsonb"))))

    def __init__(self, **values: Any) -> None:
        """A new row, its ``payload``, ``status_code``, ``duration_ms`` and
        ``error`` the row's own (the merged attributes are read-only; only
        loops/sql writes an answer)."""
        for name in _OWN:
            if name in values:
                values[f"own_{name}"] = values.pop(name)
        super().__init__(**values)


#: The attributes a reader gets merged with the answer, each over the row's
#: own column ``own_<name>``.
_OWN = ("payload", "status_code", "duration_ms", "error")
