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

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from markupsafe import escape
from sqlalchemy import text

from ..errors import InvalidArgumentError
from ..state import SolidLoopState
from ..streaming import (
    StreamEvent,
    claim_client,
    follow_many,
    hub_for,
    new_stream_token,
    parse_after,
    release_client,
    sse,
)

#: The newest event of the loop, and the text of every assistant message since
#: the loop's last user message (the current turn sequence: answers between
#: tool rounds too) up to that event, in one statement (one snapshot). A
#: message still streaming shows its deltas so far; one that failed or was
#: discarded shows nothing.
_START = text(
    "WITH tail AS (SELECT max(id) AS id FROM solidloop_stream_events WHERE loop_id = :loop_id), "
    "asked AS (SELECT coalesce(max(id), 0) AS id FROM solidloop_messages "
    "WHERE loop_id = :loop_id AND role = 'user'), "
    "replies AS (SELECT id, status, content FROM solidloop_messages "
    "WHERE loop_id = :loop_id AND role = 'assistant' AND id > (SELECT id FROM asked) "
    "AND status IN ('processing', 'completed')) "
    "SELECT (SELECT id FROM tail) AS tail, r.id, CASE WHEN r.status = 'processing' "
    "THEN coalesce((SELECT string_agg(e.text, '' ORDER BY e.id) "
    "FROM solidloop_stream_events e WHERE e.loop_id = :loop_id AND e.message_id = r.id "
    "AND e.kind = 'text_delta' AND e.id <= (SELECT id FROM tail)), r.content, '') "
    "ELSE r.content END AS text "
    "FROM (SELECT 1) AS one LEFT JOIN replies r ON true ORDER BY r.id")

#: Loops one browser stream carries at most (a browser with more open loop
#: pages than this opens a second stream for the rest).
MAX_STREAM_LOOPS = 50
_CLIENT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_LOOP_CURSOR = re.compile(r"(\d{1,18})(?::(\d{0,18}))?")


@dataclass(frozen=True)
class Start:
    """Where a freshly rendered page's stream starts (an event id), and the
    text of each assistant message of the current turn sequence before it, as
    (message id, text) pairs."""

    cursor: str
    parts: tuple[tuple[int, str], ...]


def start(session: Any, loop_id: int) -> Start:
    rows = session.execute(_START, {"loop_id": loop_id}).all()
    parts = tuple((int(row.id), row.text) for row in rows if row.id is not None and row.text)
    return Start(str(rows[0].tail or 0), parts)


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


def parse_loops(values: list[str], client: str | None) -> dict[int, int | None]:
    """A browser stream's ``loop=ID:CURSOR`` parameters as loop id -> cursor
    (None: from what a page would render now); a one-line error naming the fix."""
    if not values:
        raise InvalidArgumentError(
            "give at least one loop=ID:CURSOR (a loop id and the event id its page shows up to)")
    if len(values) > MAX_STREAM_LOOPS:
        raise InvalidArgumentError(
            f"{len(values)} loops asked; one stream carries at most {MAX_STREAM_LOOPS}: "
            "open a second stream for the rest")
    if client is not None and not _CLIENT.fullmatch(client):
        raise InvalidArgumentError(
            f"client={client[:80]!r} is not a browser id: use 1-64 letters, digits, '-' or '_'")
    cursors: dict[int, int | None] = {}
    for value in values:
        match = _LOOP_CURSOR.fullmatch(value)
        if match is None:
            raise InvalidArgumentError(
                f"loop={value[:80]!r} is not ID:CURSOR: give a loop id and the event id its "
                "page shows up to, e.g. loop=42:1200")
        loop_id = int(match.group(1))
        if loop_id in cursors:
            raise InvalidArgumentError(f"loop {loop_id} is asked twice: give each loop once")
        cursors[loop_id] = int(match.group(2)) if match.group(2) else None
    return cursors


def _message(loop_id: int, name: str, data: str, event_id: str | None = None) -> str:
    body: dict[str, Any] = {"loop": loop_id, "event": name, "data": data}
    if event_id is not None:
        body["id"] = event_id
    return sse.frame("message", json.dumps(body, ensure_ascii=False, separators=(",", ":")))


def stream_many(state: SolidLoopState, cursors: dict[int, int], client: str | None, *,
                seconds: float, heartbeat: float) -> Iterator[str]:
    """The SSE body of a browser's one stream of many loops: each ``message``
    carries JSON ``{"loop", "event", "data", "id"}`` (``event`` as on a loop
    page's own stream: ``token``, ``refresh``, ``end``). A newer stream of the
    same ``client`` ends this one with ``superseded``."""
    yield f"retry: {sse.RETRY_MS}\n\n"
    token = new_stream_token()
    stop = None
    if client is not None:
        claim_client(state, client, token)
        hub = hub_for(state)

        def stop() -> bool:
            return hub.superseded(client, token)
    try:
        for item in follow_many(state, cursors, seconds=seconds, heartbeat=heartbeat,
                                stop=stop):
            if item is None:
                yield ": heartbeat\n\n"
                continue
            loop_id, what = item
            if isinstance(what, str):
                yield _message(loop_id, "end", what)
                continue
            rendered = render(what)
            if rendered is not None:
                yield _message(loop_id, rendered[0], rendered[1], what.id)
        if stop is not None and stop():
            yield sse.frame("superseded", "a newer stream of this browser took over")
    finally:
        if client is not None:
            release_client(state, client)
