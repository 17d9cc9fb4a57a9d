"""Following many loops on one stream: what a browser's one connection carries
for all its open loop pages (docs/decisions/0045-one-stream-per-browser.md).

:func:`follow_many` is :func:`.follow.follow` for a set of loops on one thread:
each loop keeps its own cursor, is served from the hub's feed when it can and
read from the table otherwise, and the thread waits on the hub for any of them
to move. Every loop is read again once a heartbeat went by without a read of
it, so a lost notification costs at most one heartbeat, as for one loop. A loop
whose stream is over (its terminal event sent, or the loop deleted) leaves the
set with its final status; the stream ends when none is left, at its time
limit, or when the same browser opened a newer stream (:func:`claim_client`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

from ..dbapi import is_transient
from ..loops import store
from ..state import SolidLoopState
from .events import StreamEvent
from .follow import WATCH_SECONDS, engine_of, hub_for, read_page
from .hub import CHANNEL, CLIENT_PREFIX

logger = logging.getLogger("flask_solidloop.streaming")

#: What :func:`follow_many` yields: an event of a loop, a loop's stream that is
#: over with its final status (``completed``, ``failed`` or ``gone``), or None
#: at a heartbeat with nothing to send.
Item = tuple[int, StreamEvent] | tuple[int, str] | None

_NOTIFY = text(f"SELECT pg_notify('{CHANNEL}', :payload)")


@dataclass
class _Loop:
    """One followed loop: its cursor, the hub version it has seen, whether the
    table must be read, and when it was last read."""

    loop_id: int
    cursor: int
    seen: int = 0
    must_read: bool = True
    read_at: float = 0.0


def new_stream_token() -> str:
    """A token that sorts after every earlier one (time first), unique."""
    return f"{time.time_ns():020d}-{secrets.token_hex(4)}"


def claim_client(state: SolidLoopState, client: str, token: str) -> None:
    """A new stream of browser ``client``: its older streams end, in this process
    at once and in the others when they hear the notification."""
    hub_for(state).claim(client, token)
    try:
        with Session(engine_of(state)) as session:
            session.execute(_NOTIFY, {"payload": f"{CLIENT_PREFIX}{client}\n{token}"})
            session.commit()
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger.info("client %s: could not announce its new stream (%s)", client,
                    type(exc).__name__)


def release_client(state: SolidLoopState, client: str) -> None:
    hub_for(state).release(client)


def mark_all_watched(state: SolidLoopState, loop_ids: list[int], seconds: float) -> None:
    """Push ``watched_until`` of the loops on one session: someone watches them."""
    if not loop_ids:
        return
    try:
        with Session(engine_of(state)) as session:
            for loop_id in loop_ids:
                store.mark_watched(session, loop_id, seconds)
    except Exception as exc:
        if not is_transient(exc):
            raise
        logger.warning("could not mark loops %s watched (%s)", loop_ids, type(exc).__name__)


def follow_many(state: SolidLoopState, cursors: Mapping[int, int], *, seconds: float,
                heartbeat: float, reasoning: bool = False,
                stop: Callable[[], bool] | None = None,
                watch_seconds: float | None = None) -> Iterator[Item]:
    """The events of every loop in ``cursors`` (loop id -> the event id to
    resume after), each loop's in order, as they commit, on this one thread.
    Marks them watched while it runs (``watch_seconds``, renewed every third
    of it). Ends after ``seconds``, when every loop's stream is over, or when
    ``stop()`` says so."""
    ttl = WATCH_SECONDS if watch_seconds is None else watch_seconds
    hub = hub_for(state)
    loops = {loop_id: _Loop(loop_id, after) for loop_id, after in cursors.items()}
    for loop_id in loops:
        hub.watch(loop_id)
    deadline = time.monotonic() + seconds
    quiet_since = time.monotonic()
    backoff = 0.2
    try:
        while loops:
            if stop is not None and stop():
                return
            due = [i for i in loops if hub.should_mark(i, ttl / 3)]
            mark_all_watched(state, due, ttl)
            failed = False
            for follower in list(loops.values()):
                if not follower.must_read and hub.version(follower.loop_id) == follower.seen:
                    continue
                try:
                    items = list(_step(state, follower, reasoning, heartbeat))
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    logger.info("loop %s: a stream's read failed (%s); it goes on",
                                follower.loop_id, type(exc).__name__)
                    follower.must_read = failed = True
                    continue
                for item in items:
                    if item is not None and isinstance(item[1], str):
                        hub.unwatch(follower.loop_id)
                        del loops[follower.loop_id]
                    quiet_since = time.monotonic()
                    yield item
            if failed:
                time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
                backoff = min(backoff * 2, 2.0)
            else:
                backoff = 0.2
            now = time.monotonic()
            if now >= deadline or not loops:
                return
            if any(f.must_read for f in loops.values()) and not failed:
                continue
            # Wake for any loop's news, a loop due for its heartbeat read, the
            # stream's keep-alive, or its end.
            next_read = min(f.read_at for f in loops.values()) + heartbeat
            left = min(next_read, quiet_since + heartbeat, deadline) - now
            if left > 0:
                hub.wait_any({f.loop_id: f.seen for f in loops.values()}, left, stop)
            now = time.monotonic()
            for follower in loops.values():
                if now - follower.read_at >= heartbeat:
                    follower.must_read = True
            if now - quiet_since >= heartbeat:
                quiet_since = now
                yield None
    finally:
        for loop_id in loops:
            hub.unwatch(loop_id)


def _step(state: SolidLoopState, follower: _Loop, reasoning: bool,
          wait: float) -> Iterator[Item]:
    """One loop's news: its events after its cursor (from the feed, or the
    table), then ``(loop, status)`` when its stream is over."""
    hub = hub_for(state)
    loop_id = follower.loop_id
    follower.seen = hub.version(loop_id)
    batch = None if follower.must_read else hub.cached(loop_id, follower.cursor)
    status: str | None = None
    newest: int | None
    if batch is None:
        page = read_page(state, hub, loop_id, follower.cursor, wait)
        follower.read_at = time.monotonic()
        if page is None:  # another stream's read filled the feed
            batch = hub.cached(loop_id, follower.cursor)
            if batch is None:
                follower.must_read = True
                return
            newest = hub.newest(loop_id)
        elif page.status is None:
            yield loop_id, "gone"
            return
        else:
            batch, status, newest = page.events, page.status, page.tail
    else:
        newest = hub.newest(loop_id)
    for event in batch:
        follower.cursor = event.seq
        if event.kind == "reasoning_delta" and not reasoning:
            continue
        yield loop_id, event
    at_end = newest is not None and follower.cursor >= newest
    if at_end and batch and batch[-1].terminal:
        yield loop_id, batch[-1].kind
        return
    if at_end and not batch and status in ("completed", "failed"):
        yield loop_id, str(status)
        return
    follower.must_read = status is not None and not at_end  # a backlog: read on
