"""A watcher's arrival, heard by the streaming turns of this process.

A loop nobody watches flushes its streaming text rarely
(SOLIDLOOP_STREAM_UPDATE_INTERVAL); when somebody starts watching it (an open
stream, the admin's Observe), the store notifies ``loops.sql.WATCH_CHANNEL``
with the loop's id in the commit of the mark. This module hears that channel
on the process's one LISTEN connection (the broker's listener, which runs
while the process has consumers: a worker) and tells the loop's streaming
turn, which flushes what it has with its next token and goes on at
SOLIDLOOP_STREAM_MAX_HZ (pipeline/llm_stack.PartialWriter).

It is a hint: an arrival missed (the listener down, a process without
consumers, a turn that starts just after) costs the watcher speed, never text:
the turn learns it is watched from its next flush anyway.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Protocol

from ..loops import sql as loops_sql

#: Seconds an arrival is remembered for a turn that has not registered yet
#: (its request was on record before the mark, its writer not made).
REMEMBER_SECONDS = 5.0


class Arrivable(Protocol):
    def watcher_arrived(self) -> None: ...


_lock = threading.Lock()
_turns: dict[int, weakref.ReferenceType[Any]] = {}
_recent: dict[int, float] = {}
_heard: weakref.WeakSet[Any] = weakref.WeakSet()


def listen(broker: Any) -> None:
    """Hear arrivals on ``broker``'s listener (once per broker; the actors'
    declaration calls it, so the channel is LISTENed with the first queue): a
    broker without a listener (not ours) leaves the turns to their own pace."""
    on_notify = getattr(broker, "on_notify", None)
    if on_notify is None:
        return
    with _lock:
        if broker in _heard:
            return
        _heard.add(broker)
    on_notify(loops_sql.WATCH_CHANNEL, arrived)


def register(loop_id: int, turn: Arrivable) -> bool:
    """Let ``turn`` hear its loop's watchers from now on; True when one
    arrived a moment ago (the turn should flush at once)."""
    now = time.monotonic()
    with _lock:
        _turns[loop_id] = weakref.ref(turn)
        at = _recent.pop(loop_id, None)
    return at is not None and now - at < REMEMBER_SECONDS


def unregister(loop_id: int, turn: Arrivable) -> None:
    with _lock:
        ref = _turns.get(loop_id)
        if ref is not None and ref() in (None, turn):
            del _turns[loop_id]


def pending(loop_id: int) -> bool:
    """Whether an arrival for the loop was heard and not yet flushed by its turn
    (or remembered for a turn to come): for diagnostics and tests."""
    with _lock:
        ref = _turns.get(loop_id)
        turn = ref() if ref is not None else None
        if turn is None:
            return loop_id in _recent
    return bool(getattr(turn, "arrival", False))


def arrived(payload: str) -> None:
    """The listener's handler: ``payload`` is the loop's id."""
    try:
        loop_id = int(payload)
    except ValueError:
        return
    now = time.monotonic()
    with _lock:
        ref = _turns.get(loop_id)
        turn = ref() if ref is not None else None
        if turn is None:
            if len(_recent) > 10_000:  # bounded: forget what is stale
                for key in [k for k, at in _recent.items() if now - at >= REMEMBER_SECONDS]:
                    del _recent[key]
            _recent[loop_id] = now
    if turn is not None:
        turn.watcher_arrived()
