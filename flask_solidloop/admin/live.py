"""The admin's live loop page: the loop's event stream (flask_solidloop.streaming)
rendered for htmx.

The page renders the loop and the text its current turn streamed so far, read
in one statement with the id of the loop's newest event; its stream starts
after that id, so page and stream meet exactly. Text deltas become ``token``
events (escaped HTML spans the page appends, each with its message and
offset); any other event becomes ``refresh`` (the page re-renders its regions);
the loop's end, ``end``. The machinery (one LISTEN per process, no connection
held while waiting, ``Last-Event-ID``) is the streaming package's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from markupsafe import escape
from sqlalchemy import text

from ..state import SolidLoopState
from ..streaming import StreamEvent, parse_after, sse

#: The newest event of the loop, and the text its current (or latest) assistant
#: message streamed up to that event, in one statement (one snapshot).
_START = text(
    "WITH tail AS (SELECT max(id) AS id FROM solidloop_stream_events WHERE loop_id = :loop_id), "
    "reply AS (SELECT id, status, content FROM solidloop_messages "
    "WHERE loop_id = :loop_id AND role = 'assistant' ORDER BY id DESC LIMIT 1) "
    "SELECT (SELECT id FROM tail) AS tail, reply.id, CASE WHEN reply.status = 'processing' "
    "THEN coalesce((SELECT string_agg(e.text, '' ORDER BY e.id) "
    "FROM solidloop_stream_events e WHERE e.loop_id = :loop_id AND e.message_id = reply.id "
    "AND e.kind = 'text_delta' AND e.id <= (SELECT id FROM tail)), reply.content, '') "
    "WHEN reply.status = 'completed' THEN reply.content ELSE '' END AS text "
    "FROM (SELECT 1) AS one LEFT JOIN reply ON true")


@dataclass(frozen=True)
class Start:
    """Where a freshly rendered page's stream starts (an event id), and the
    text the page shows before it."""

    cursor: str
    message_id: int
    text: str


def start(session: Any, loop_id: int) -> Start:
    row = session.execute(_START, {"loop_id": loop_id}).one()
    return Start(str(row.tail or 0), int(row.id or 0), row.text or "")


def token_html(message_id: int, offset: int, chunk: str) -> str:
    """One chunk of streamed text as the page appends it (escaped: it is model output)."""
    return (f'<span class="tok" data-m="{message_id}" data-o="{offset}">'
            f"{escape(chunk)}</span>")


def render(event: StreamEvent) -> tuple[str, str] | None:
    """An event as the admin's loop page takes it."""
    if event.kind == "text_delta":
        return "token", token_html(event.message_id or 0, int(event.data.get("offset", 0)),
                                   event.text or "")
    if event.kind in ("reasoning_delta", "message_started"):
        return None
    return "refresh", event.kind


def stream(state: SolidLoopState, loop_id: int, cursor: str, *, seconds: float,
           heartbeat: float) -> Iterator[str]:
    """The SSE body of the loop page's live stream, after event ``cursor``."""
    return sse.body(state, loop_id, parse_after(cursor), seconds=seconds,
                    heartbeat=heartbeat, render=render)
