"""Following a loop: its events from an id on, as they commit, and its status
until it settles (docs/decisions/0024-loop-event-stream.md).

:func:`follow` is the one loop every face uses (``events()``, the SSE
responses, the admin's live page): serve from the hub's feed when it knows the
events, read the table otherwise (a short-lived session, returned at once),
then wait on the hub holding no connection. Each heartbeat reads the table
too, so a lost notification costs at most one heartbeat. A database that
fails meanwhile is waited out: the stream goes on from the same id.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from ..dbapi import is_transient
from ..errors import InvalidArgumentError
from ..loops import store
from ..state import SolidLoopState
from ..urls import libpq_url
from .events import Page, StreamEvent, read_events
from .hub import LiveHub

logger = logging.getLogger("flask_solidloop.streaming")

#: Seconds a stream's mark keeps its loop watched; renewed every third of it.
WATCH_SECONDS = 30.0
#: Statuses a loop stays in until something outside it acts.
SETTLED_STATUSES = ("init", "completed", "failed", "paused", "waiting")

_hub_lock = threading.Lock()


def hub_for(state: SolidLoopState) -> LiveHub:
    """The app's hub in this process (a forked gunicorn worker starts its own)."""
    with _hub_lock:
        hub = state.extras.get("streaming.hub")
        if hub is None or hub.pid != os.getpid():
            hub = LiveHub(libpq_url(state.broker.url))
            state.extras["streaming.hub"] = hub
        return hub.start()


def engine_of(state: SolidLoopState) -> Engine:
    """The app's engine, from any thread: a stream may be read outside an app
    context (a script, a thread of the host's)."""
    try:
        return state.db.engine
    except RuntimeError:  # no app context here
        with state.app.app_context():
            return state.db.engine


def mark_watched(state: SolidLoopState, loop_id: int, seconds: float = WATCH_SECONDS) -> None:
    """Tell the loop's writers someone watches: its events are notified and its
    text flushes at SOLIDLOOP_STREAM_MAX_HZ for ``seconds``. A database that
    fails here costs speed, never the stream."""
    try:
        with Session(engine_of(state)) as session:
            store.mark_watched(session, loop_id, seconds)
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger.warning("loop %s: could not mark it watched (%s)", loop_id, type(exc).__name__)


def read_page(state: SolidLoopState, hub: LiveHub, loop_id: int, after: int,
          wait: float) -> Page | None:
    """The table's events after ``after`` (the hub's feed takes them when they
    reach the end); None when another stream's read served the feed meanwhile."""
    mine, version = hub.begin_read(loop_id, wait)
    if not mine:
        return None
    page: Page | None = None
    try:
        with Session(engine_of(state)) as session:
            page = read_events(session, loop_id, after, reasoning=True)
    finally:
        hub.end_read(loop_id, version, page.events if page else (), after,
                     page.tail if page is not None and page.complete else None)
    return page


def follow(state: SolidLoopState, loop_id: int, after: int, *, seconds: float | None,
           heartbeat: float, reasoning: bool = False,
           watch: bool = True) -> Iterator[StreamEvent | None]:
    """The loop's events after ``after``, in order, as they commit; None at each
    heartbeat that found nothing new. Ends after a terminal event that is the
    loop's newest (or at once, for a finished loop with nothing new), when the
    loop no longer exists, or after ``seconds`` (None: no bound). ``watch``
    marks the loop watched (its deltas flush fast); a caller that only waits
    for its status does not."""
    hub = hub_for(state)
    hub.watch(loop_id)
    deadline = None if seconds is None else time.monotonic() + seconds
    cursor = after
    backoff = 0.2
    try:
        if watch and hub.should_mark(loop_id, WATCH_SECONDS / 3):
            mark_watched(state, loop_id)
        seen = hub.version(loop_id)
        must_read = True
        while True:
            batch = None if must_read else hub.cached(loop_id, cursor)
            status: str | None = None  # known only from a read of the table
            newest: int | None
            if batch is None:
                try:
                    page = read_page(state, hub, loop_id, cursor, heartbeat)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    logger.info("loop %s: a stream's read failed (%s); it goes on",
                                loop_id, type(exc).__name__)
                    if _sleep(deadline, backoff):
                        return
                    backoff = min(backoff * 2, 2.0)
                    continue
                backoff = 0.2
                if page is None:  # another stream filled the feed: take it from there
                    must_read = False
                    continue
                if page.status is None:
                    return  # the loop was deleted
                batch, status, newest = page.events, page.status, page.tail
            else:
                newest = hub.newest(loop_id)
            for event in batch:
                cursor = event.seq
                if event.kind == "reasoning_delta" and not reasoning:
                    continue
                yield event
            at_end = newest is not None and cursor >= newest
            if at_end and (batch[-1].terminal if batch else status in ("completed", "failed")):
                return
            if status is not None and not at_end:
                must_read = True  # a long backlog: read its next page at once
                continue
            left = heartbeat if deadline is None else min(heartbeat, deadline - time.monotonic())
            if left <= 0:
                return
            if watch and hub.should_mark(loop_id, WATCH_SECONDS / 3):
                mark_watched(state, loop_id)
            moved = hub.wait(loop_id, seen, left)
            must_read = moved == seen  # a heartbeat: read the table
            if must_read:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                yield None
            seen = moved
    finally:
        hub.unwatch(loop_id)


def _sleep(deadline: float | None, seconds: float) -> bool:
    """Sleep ``seconds`` (less if the deadline comes first); True when the
    deadline has passed."""
    if deadline is not None:
        seconds = min(seconds, deadline - time.monotonic())
    if seconds > 0:
        time.sleep(seconds)
    return deadline is not None and time.monotonic() >= deadline


_STATUS = text("SELECT status FROM solidloop_loops WHERE id = :loop_id")


def wait_settled(state: SolidLoopState, loop_id: int, timeout: float | None,
                 heartbeat: float) -> str | None:
    """The loop's status once it is settled (not queued or running), or its
    status when ``timeout`` passes; None when the loop does not exist. Woken by
    the status notifications every loop sends; reads the status once per wake."""
    hub = hub_for(state)
    hub.watch(loop_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            seen = hub.version(loop_id)
            try:
                with Session(engine_of(state)) as session:
                    status = session.scalar(_STATUS, {"loop_id": loop_id})
            except Exception as exc:
                if not is_transient(exc):
                    raise
                status = "?"
            if status is None or status in SETTLED_STATUSES:
                return status
            left = heartbeat if deadline is None else min(heartbeat, deadline - time.monotonic())
            if left <= 0:
                return None if status == "?" else status
            hub.wait(loop_id, seen, left)
    finally:
        hub.unwatch(loop_id)


def require_loop(state: SolidLoopState, loop_id: int) -> None:
    """InvalidArgumentError, in one line, when the loop does not exist (never
    did, or SOLIDLOOP_LOOP_RETENTION deleted it): what ``events()`` says
    before it follows a loop. One read on a session of its own, so the
    caller's session and transaction are left alone."""
    with Session(engine_of(state)) as session:
        if session.scalar(_STATUS, {"loop_id": loop_id}) is None:
            raise InvalidArgumentError(
                f"there is no loop {loop_id}: it never existed, or it ended and "
                "SOLIDLOOP_LOOP_RETENTION deleted it")
