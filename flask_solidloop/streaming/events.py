"""A loop's events as the product hands them out: :class:`StreamEvent`, the
kinds, and the one read of the table (docs/decisions/0024-loop-event-stream.md).

The rows hold ids and small facts; the read joins the message and the tool
call an event names, which are immutable once the event exists, so a replay
reads exactly what a live reader read. An event's ``id`` is opaque to callers
(a string); inside, it is the row's id, increasing per loop in commit order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from .._typing import SessionLike
from ..errors import InvalidArgumentError

#: Every kind, in the order a turn usually produces them.
KINDS = ("status_changed", "message_started", "reasoning_delta", "text_delta",
         "message_completed", "message_discarded", "tool_call", "approval_requested",
         "approval_decided", "tool_result", "completed", "failed")
#: The kinds that end a stream when no event follows them.
TERMINAL_KINDS = ("completed", "failed")
#: Kinds the table's notifications carry whole (the hub builds them with no read).
INLINE_KINDS = ("text_delta", "reasoning_delta", "status_changed", "completed", "failed")


@dataclass(frozen=True)
class StreamEvent:
    """One event of a loop's stream.

    ``data`` holds the kind's fields:

    * ``status_changed`` / ``completed`` / ``failed``: ``status``,
      ``previous`` (absent for a new loop), ``error`` (failed or paused);
    * ``message_started``: ``role``, and ``text`` for a user message;
    * ``text_delta`` / ``reasoning_delta``: ``text``, ``offset`` (characters
      of the message streamed before it);
    * ``message_completed``: ``role``, ``text`` (the stored text: replace what
      the deltas built), ``finish_reason``;
    * ``message_discarded``: ``role`` (a turn that will be retried: drop it);
    * ``tool_call``: ``name``, ``arguments``, ``waits_for``;
    * ``approval_requested``: ``name``, ``arguments``, ``deadline``;
    * ``approval_decided``: ``decision``, ``by``, ``reason``;
    * ``tool_result``: ``name``, ``text``, ``is_error``.
    """

    id: str
    kind: str
    loop_id: int
    message_id: int | None = None
    tool_call_id: int | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    at: datetime | None = None

    @property
    def seq(self) -> int:
        return int(self.id)

    @property
    def text(self) -> str | None:
        """The event's text, for the kinds that carry one."""
        value = self.data.get("text")
        return value if isinstance(value, str) else None

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: what an SSE ``data:`` line carries."""
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "loop_id": self.loop_id}
        if self.message_id is not None:
            out["message_id"] = self.message_id
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        out.update(self.data)
        if self.at is not None:
            out["at"] = self.at.isoformat()
        return out


def parse_after(value: str | int | None) -> int:
    """An ``after=`` / ``Last-Event-ID`` value as the row id it names (0: from
    the start); a clear error for anything else."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise InvalidArgumentError(f"after must be an event id; got {value!r}")
    try:
        seq = int(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"after must be an event id (a StreamEvent.id); got {value!r}") from None
    if seq < 0:
        raise InvalidArgumentError(f"after must be an event id; got {value!r}")
    return seq


def from_notification(loop_id: int, seq: int, body: Mapping[str, Any]) -> StreamEvent:
    """The event a notification carried whole (INLINE_KINDS)."""
    kind = str(body["k"])
    data: dict[str, Any] = dict(body.get("d") or {})
    if body.get("t") is not None:
        data["text"] = body["t"]
    at = body.get("a")
    return StreamEvent(id=str(seq), kind=kind, loop_id=loop_id, message_id=body.get("m"),
                       data=data, at=datetime.fromtimestamp(float(at), UTC) if at else None)


#: The events of a loop after an id, with what they name, and the loop's status
#: and newest event id, in one statement (one snapshot): the stream's end and
#: its feed are judged on what the events were read with. A loop with no new
#: event gives one row whose event columns are NULL; none, a loop that is gone.
_READ = text(
    "WITH head AS (SELECT l.status, (SELECT max(id) FROM solidloop_stream_events s "
    "WHERE s.loop_id = l.id) AS tail FROM solidloop_loops l WHERE l.id = :loop_id) "
    "SELECT head.status AS loop_status, head.tail, e.* FROM head LEFT JOIN LATERAL ("
    "SELECT e.id, e.kind, e.message_id, e.tool_call_id, e.data, e.text, e.created_at, "
    "m.role, m.content, m.finish_reason, "
    "c.name, c.arguments, c.waits_for, c.wait_deadline, c.is_success "
    "FROM solidloop_stream_events e "
    "LEFT JOIN solidloop_messages m ON m.id = e.message_id "
    "AND e.kind IN ('message_started', 'message_completed', 'tool_result') "
    "LEFT JOIN solidloop_tool_calls c ON c.id = e.tool_call_id "
    "WHERE e.loop_id = :loop_id AND e.id > :after "
    "AND (:reasoning OR e.kind <> 'reasoning_delta') "
    "ORDER BY e.id LIMIT :limit) e ON true ORDER BY e.id")


@dataclass(frozen=True)
class Page:
    """What one read found: the events, the loop's status and its newest event
    id (None when the loop no longer exists), and whether ``events`` reaches
    that newest id."""

    events: list[StreamEvent]
    status: str | None
    tail: int
    complete: bool


def read_events(session: SessionLike, loop_id: int, after: int, *, limit: int = 500,
                reasoning: bool = False) -> Page:
    """The loop's events after ``after``, at most ``limit``, with its status and
    newest event id, in one statement; the transaction is ended before
    returning, so the caller's connection goes back to its pool."""
    try:
        rows = session.execute(_READ, {"loop_id": loop_id, "after": after, "limit": limit,
                                       "reasoning": reasoning}).all()
    finally:
        session.rollback()
    if not rows:
        return Page([], None, 0, True)
    events = [_event(loop_id, row) for row in rows if row.id is not None]
    tail = int(rows[0].tail or 0)
    last = events[-1].seq if events else after
    return Page(events, str(rows[0].loop_status), tail, last >= tail or len(events) < limit)


def _event(loop_id: int, row: Any) -> StreamEvent:
    kind = row.kind
    data: dict[str, Any] = dict(row.data or {})
    if kind in ("text_delta", "reasoning_delta"):
        data["text"] = row.text or ""
    elif kind == "message_started":
        if row.role == "user":
            data["text"] = row.content or ""
    elif kind == "message_completed":
        data["text"] = row.content or ""
        data["finish_reason"] = row.finish_reason
    elif kind in ("tool_call", "approval_requested"):
        data.update(name=row.name, arguments=row.arguments)
        if kind == "tool_call":
            data["waits_for"] = row.waits_for
        else:
            data["deadline"] = row.wait_deadline.isoformat() if row.wait_deadline else None
    elif kind == "tool_result":
        data.update(name=row.name, text=row.content or "", is_error=row.is_success is False)
    return StreamEvent(id=str(row.id), kind=kind, loop_id=loop_id, message_id=row.message_id,
                       tool_call_id=row.tool_call_id, data=data, at=row.created_at)
