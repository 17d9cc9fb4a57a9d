"""A loop's events as Server-Sent Events for Flask views: ``sse_response()``.

Each event goes out as ``id:`` (the event's id, which the browser sends back
as ``Last-Event-ID`` when it reconnects), ``event:`` (its kind) and ``data:``
(JSON, or what the view's ``render`` makes of it). The response also sends a
``retry:`` first, a comment line at each heartbeat (proxies and load balancers
close idle connections), and ends after SOLIDLOOP_STREAM_SECONDS so a
stream never pins a WSGI thread for long: the browser reconnects where it
was. A stream that reaches the loop's end sends ``end`` and stops; a page
closes its EventSource on it (``sse-close="end"`` with htmx).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator

from flask import Response, abort, request, stream_with_context
from sqlalchemy.orm import Session

from ..dbapi import is_transient
from ..errors import InvalidArgumentError
from ..models import Loop
from ..state import SolidLoopState
from .events import StreamEvent, parse_after, read_events
from .follow import engine_of, follow

logger = logging.getLogger("flask_solidloop.streaming")

#: Milliseconds the browser waits before reconnecting a stream that ended.
RETRY_MS = 500
#: ... and one that could not start because the database was down.
RETRY_WHILE_DOWN_MS = 2000
#: The headers every event stream carries: no caching, and no buffering by a
#: proxy in front (nginx honours X-Accel-Buffering).
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

#: What a view's ``render`` turns an event into: the ``data:`` text, a
#: ``(event name, data)`` pair, a list of such pairs, or None to skip it.
Rendered = str | tuple[str, str] | list[tuple[str, str]] | None


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def frame(name: str, data: str, event_id: str | None = None) -> str:
    """One SSE event (a multi-line ``data`` becomes several ``data:`` lines)."""
    lines = [f"event: {name}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    # An SSE line ends at CR, LF or CRLF: each of them starts a new data line,
    # so a render that returns a bare CR loses nothing.
    lines.extend(f"data: {line}" for line in _LINE_BREAK.split(data))
    return "\n".join(lines) + "\n\n"


def as_json(event: StreamEvent) -> str:
    return json.dumps(event.as_dict(), ensure_ascii=False, separators=(",", ":"), default=str)


def last_event_id() -> str | None:
    """The id a reconnecting browser (``Last-Event-ID``) or a page
    (``?last_event_id=``) resumes after."""
    return request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or None


def body(state: SolidLoopState, loop_id: int, after: int, *, seconds: float,
         heartbeat: float, reasoning: bool = False,
         render: Callable[[StreamEvent], Rendered] | None = None) -> Iterator[str]:
    """The SSE text of one stream of the loop's events after ``after``."""
    yield f"retry: {RETRY_MS}\n\n"
    cursor = after
    for event in follow(state, loop_id, after, seconds=seconds, heartbeat=heartbeat,
                        reasoning=reasoning):
        if event is None:
            yield ": heartbeat\n\n"
            continue
        rendered: Rendered = as_json(event) if render is None else render(event)
        for name, data in _frames(event, rendered):
            yield frame(name, data, event.id)
        cursor = event.seq
    status = _finished_status(state, loop_id, cursor)
    if status is not None:
        yield frame("end", status)


def _frames(event: StreamEvent, rendered: Rendered) -> list[tuple[str, str]]:
    if rendered is None:
        return []
    if isinstance(rendered, str):
        return [(event.kind, rendered)]
    if isinstance(rendered, tuple):
        return [rendered]
    return list(rendered)


def _finished_status(state: SolidLoopState, loop_id: int, cursor: int) -> str | None:
    """The loop's status when this stream has sent all there is and the loop
    has finished (or is gone: ``gone``); None when the browser should
    reconnect: the stream only reached its time limit, events came after what
    it sent, or the database cannot tell now (it restarts; the stream then ends
    whole, as at its time limit, and the reconnect asks again)."""
    try:
        with Session(engine_of(state)) as session:
            page = read_events(session, loop_id, cursor, limit=1, reasoning=True)
    except Exception as exc:
        if not is_transient(exc):
            raise
        return None
    if page.status is None:
        return "gone"
    if page.status in ("completed", "failed") and page.tail <= cursor:
        return page.status
    return None


def sse_response(state: SolidLoopState, loop_id: int, *,
                 authorize: Callable[[Loop], bool] | None = None,
                 after: str | int | None = None, reasoning: bool = False,
                 render: Callable[[StreamEvent], Rendered] | None = None,
                 seconds: float | None = None, heartbeat: float | None = None) -> Response:
    """A streaming response of the loop's events, resuming after the request's
    ``Last-Event-ID`` (or ``?last_event_id=``, or ``after``).

    ``authorize(loop)`` decides whether the current user may watch the loop:
    False answers 403, and a loop that does not exist answers 404 (before any
    stream starts). ``render(event)`` turns an event into the ``data:`` the
    page wants (an HTML fragment for htmx, say); JSON by default."""
    config = state.config
    try:
        cursor = parse_after(last_event_id() or after)
    except InvalidArgumentError as exc:
        return Response(f"{exc}\n", status=400, mimetype="text/plain")
    try:
        with Session(engine_of(state)) as session:
            loop = session.get(Loop, loop_id)
            allowed = loop is not None and (authorize is None or authorize(loop))
    except Exception as exc:
        if not is_transient(exc):
            raise
        # The database restarts: an empty stream that asks the browser to come
        # back (an EventSource gives up for good on any answer but 200). It
        # sends no event, so nothing is shown before the loop is authorized.
        logger.info("loop %s: a stream could not read its loop (%s); the browser retries",
                    loop_id, type(exc).__name__)
        return Response(f"retry: {RETRY_WHILE_DOWN_MS}\n\n", mimetype="text/event-stream",
                        headers=dict(HEADERS))
    if loop is None:
        abort(404)
    if not allowed:
        abort(403)
    text = body(state, loop_id, cursor,
                seconds=config.stream_seconds if seconds is None else seconds,
                heartbeat=config.stream_heartbeat if heartbeat is None else heartbeat,
                reasoning=reasoning, render=render)
    return Response(stream_with_context(text), mimetype="text/event-stream",
                    headers=dict(HEADERS))

