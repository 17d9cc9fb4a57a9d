"""Live loop pages over Server-Sent Events: one LISTEN connection per web
process, fanned out to every stream in it; no stream holds a database
connection while it waits.

Turns announce their writes with ``pg_notify`` in the same transaction
(``loops/store/``: each partial and each finished turn), so a notification
means the row is committed. :class:`LiveHub` runs one thread per process that
LISTENs on its own psycopg connection and bumps a per-loop counter under a
``threading.Condition``; a stream waits on that condition (no connection),
then reads what is new with a short-lived session and lets it go at once.

A stream's position is ``<message_id>:<offset>``: the assistant message it is
streaming and how many characters of it were sent. That is every token
event's id, so a browser reconnecting with ``Last-Event-ID`` (or a fresh page
that renders the text so far and starts from there) gets exactly what it has
not seen: no gap, no duplicate. Streams end after SOLIDLOOP_ADMIN_STREAM_SECONDS
(at most 60) with a heartbeat every SOLIDLOOP_ADMIN_HEARTBEAT seconds, which
also polls the loop, so a lost notification costs at most one heartbeat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from markupsafe import escape
from sqlalchemy.orm import Session

from ..loops import queries
from ..loops.sql import LIVE_CHANNEL
from ..state import SolidLoopState
from ..urls import libpq_url

logger = logging.getLogger("flask_solidloop.admin.live")

#: application_name of the LISTEN connection (benchmarks count it in pg_stat_activity).
LISTEN_APPLICATION_NAME = "solidloop-admin-live"
#: Milliseconds the browser waits before reconnecting a stream that ended.
RETRY_MS = 500
#: A waiting loop streams too: a decision taken elsewhere shows at once.
LIVE_STATUSES = ("queued", "running", "waiting")
#: Seconds the LISTEN thread stays up with no stream watching; it closes its
#: connection then, and the next stream starts it again.
IDLE_SECONDS = 60.0


class LiveHub:
    """The process's LISTEN connection and the streams waiting on it."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._versions: dict[int, int] = {}
        self._waiters: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.connected = threading.Event()

    def start(self) -> LiveHub:
        with self._cond:
            self._ensure_thread()
        return self

    def _ensure_thread(self) -> None:
        # Under self._cond: _idle() retires the thread under the same lock, so a
        # stream registered here is never left without a LISTEN thread.
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="solidloop-admin-live",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _idle(self, since: list[float]) -> bool:
        with self._cond:
            if self._waiters:
                since[0] = time.monotonic()
                return False
            if time.monotonic() - since[0] < IDLE_SECONDS:
                return False
            self._thread = None  # start() makes a new one for the next stream
            return True

    def _run(self) -> None:
        since = [time.monotonic()]
        while not self._stop.is_set() and not self._idle(since):
            try:
                with psycopg.connect(self.conninfo, autocommit=True,
                                     application_name=LISTEN_APPLICATION_NAME) as conn:
                    conn.execute(f"LISTEN {LIVE_CHANNEL}")
                    self.connected.set()
                    while not self._stop.is_set() and not self._idle(since):
                        for note in conn.notifies(timeout=1.0):
                            self._bump(note.payload)
            except Exception as exc:  # the heartbeat poll covers the gap
                logger.warning("admin live LISTEN connection lost (%s); retrying", exc)
                self._stop.wait(1.0)
            finally:
                self.connected.clear()

    def _bump(self, payload: str) -> None:
        try:
            loop_id = int(payload.split(":", 1)[0])
        except ValueError:
            return
        with self._cond:
            if loop_id in self._waiters:
                self._versions[loop_id] = self._versions.get(loop_id, 0) + 1
                self._cond.notify_all()

    def version(self, loop_id: int) -> int:
        with self._cond:
            return self._versions.get(loop_id, 0)

    def watch(self, loop_id: int) -> None:
        with self._cond:
            self._waiters[loop_id] = self._waiters.get(loop_id, 0) + 1
            self._ensure_thread()

    def unwatch(self, loop_id: int) -> None:
        with self._cond:
            left = self._waiters.get(loop_id, 0) - 1
            if left <= 0:
                self._waiters.pop(loop_id, None)
                self._versions.pop(loop_id, None)
            else:
                self._waiters[loop_id] = left

    def wait(self, loop_id: int, seen: int, timeout: float) -> int:
        """Block (holding nothing but this thread) until the loop's counter moves
        past ``seen`` or ``timeout`` passes; return the counter."""
        with self._cond:
            self._cond.wait_for(lambda: self._versions.get(loop_id, 0) != seen, timeout)
            return self._versions.get(loop_id, 0)

    @property
    def streams(self) -> int:
        with self._cond:
            return sum(self._waiters.values())


_hub_lock = threading.Lock()


def hub_for(state: SolidLoopState) -> LiveHub:
    """The app's hub in this process (a forked gunicorn worker starts its own)."""
    with _hub_lock:
        hub = state.extras.get("admin.live_hub")
        if hub is None or hub.pid != os.getpid():
            hub = LiveHub(libpq_url(state.broker.url))
            state.extras["admin.live_hub"] = hub
        return hub.start()


@dataclass(frozen=True)
class Cursor:
    message_id: int
    offset: int

    def __str__(self) -> str:
        return f"{self.message_id}:{self.offset}"

    @classmethod
    def parse(cls, value: str | None) -> Cursor | None:
        if not value:
            return None
        try:
            message_id, offset = value.split(":", 1)
            cursor = cls(int(message_id), int(offset))
        except ValueError:
            return None
        return cursor if cursor.message_id >= 0 and cursor.offset >= 0 else None


@dataclass(frozen=True)
class Start:
    """Where a freshly rendered page's stream starts, and the text the page shows
    before it: read together, so the page and its stream meet exactly."""

    cursor: Cursor
    text: str


def start(session: Any, loop_id: int) -> Start:
    """The latest assistant message's text so far and the cursor just after it.

    One read serves both: a page that rendered text from a later read than its
    cursor would show characters the stream then sends again (a turn streams
    between the two reads)."""
    messages = queries.live_messages(session, loop_id)
    replies = [m for m in messages if m.role == "assistant"]
    if replies:
        return Start(Cursor(replies[-1].id, len(replies[-1].content)), replies[-1].content)
    return Start(Cursor(messages[-1].id if messages else 0, 0), "")


def _event(name: str, data: str, event_id: str | None = None) -> str:
    lines = [f"event: {name}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"


def token_html(message_id: int, offset: int, text: str) -> str:
    """One chunk of streamed text as the page appends it (escaped: it is model output)."""
    return (f'<span class="tok" data-m="{message_id}" data-o="{offset}">'
            f"{escape(text)}</span>")


def stream(state: SolidLoopState, loop_id: int, cursor: Cursor, *,
           seconds: float, heartbeat: float) -> Iterator[str]:
    """The SSE body of one loop's live stream, from ``cursor`` on."""
    hub = hub_for(state)
    engine = state.db.engine
    hub.watch(loop_id)
    try:
        yield f"retry: {RETRY_MS}\n\n"
        deadline = time.monotonic() + seconds
        seen = hub.version(loop_id)
        version: Any = None
        while True:
            with Session(engine) as session:
                # The status first: a turn's last text commits no later than the
                # status that ends the stream, so text read after a final status
                # is whole. (Read the other way round, a turn finishing between
                # the two reads ended the stream short of its last characters.)
                fingerprint = queries.loop_version(session, loop_id)
                messages = [m for m in queries.live_messages(
                    session, loop_id, after_id=cursor.message_id) if m.role == "assistant"]
            # The session is closed here: the wait below holds no connection.
            if fingerprint is None:
                yield _event("end", "the loop no longer exists")
                return
            for message in messages:
                start = cursor.offset if message.id == cursor.message_id else 0
                text = message.content[start:]
                if text:
                    cursor = Cursor(message.id, start + len(text))
                    yield _event("token", token_html(message.id, start, text), str(cursor))
                elif message.id != cursor.message_id:
                    cursor = Cursor(message.id, 0)
            if version is not None and fingerprint != version:
                yield _event("refresh", str(fingerprint[0]))
            version = fingerprint
            if fingerprint[0] not in LIVE_STATUSES:
                yield _event("end", f"loop is {fingerprint[0]}")
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return  # the browser reconnects with Last-Event-ID
            moved = hub.wait(loop_id, seen, min(heartbeat, left))
            if moved == seen:
                yield ": heartbeat\n\n"
            seen = moved
    finally:
        hub.unwatch(loop_id)
