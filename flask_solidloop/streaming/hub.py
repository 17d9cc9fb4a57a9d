"""The process's one LISTEN connection, and the feeds it keeps for the loops
its streams watch (docs/decisions/0024-loop-event-stream.md).

A notification on ``solidloop_live`` is ``<loop>:<id>:<prev>``, plus a line
holding the event itself when it is small (a delta, a status). ``prev`` is the
loop's event just before it, drawn under the same row lock, so a feed whose
newest id is ``prev`` can take the event as it comes, with no read. Anything
else (no event inside, a broken chain, the LISTEN connection lost and back)
leaves the feed *stale*: the next stream reads the table, once for every
stream of that loop in the process, and hands the feed what it read.

A stream waits on the hub's condition for its loop's version to move: it
holds a thread and nothing else (no connection, no lease). A browser's stream
of many loops waits for any of theirs to move (:meth:`LiveHub.wait_any`).

A notification ``client <id>`` with a token on its second line says that
browser opened a newer stream: its older streams in every process end
(:meth:`LiveHub.claim`), so reconnects never pile up.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psycopg

from .events import StreamEvent, from_notification

logger = logging.getLogger("flask_solidloop.streaming")

#: application_name of the LISTEN connection (benchmarks count it in pg_stat_activity).
LISTEN_APPLICATION_NAME = "solidloop-live"
#: The channel every event of a watched loop (and every status) is notified on.
CHANNEL = "solidloop_live"
#: A notification that a browser opened a newer stream: ``client <id>\n<token>``.
CLIENT_PREFIX = "client "
#: Seconds the LISTEN thread stays up with no stream watching; it closes its
#: connection then, and the next stream starts it again.
IDLE_SECONDS = 60.0
#: Events a feed keeps: a stream further behind reads the table.
FEED_EVENTS = 256


@dataclass
class Feed:
    """What the process knows of one watched loop's newest events: ``events``,
    every event of the loop after ``first`` up to ``last``; ``last`` None
    means stale (the table must be read)."""

    events: deque[StreamEvent] = field(default_factory=deque)
    first: int = 0
    last: int | None = None
    version: int = 0
    watchers: int = 0
    loading: bool = False
    marked_at: float = 0.0

    def covers(self, after: int) -> bool:
        """Whether the feed alone knows every event after ``after``."""
        return self.last is not None and self.first <= after <= self.last

    def after(self, after: int) -> list[StreamEvent]:
        return [event for event in self.events if event.seq > after]

    def append(self, event: StreamEvent) -> None:
        if len(self.events) >= FEED_EVENTS:
            self.first = self.events.popleft().seq
        self.events.append(event)
        self.last = event.seq

    def reset(self, after: int, events: list[StreamEvent], tail: int) -> None:
        kept = events[-FEED_EVENTS:]
        self.events = deque(kept)
        self.first = events[-FEED_EVENTS - 1].seq if len(events) > FEED_EVENTS else after
        self.last = tail


class LiveHub:
    """The process's LISTEN connection and the feeds of the loops it watches."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._feeds: dict[int, Feed] = {}
        #: Browser id -> the newest stream token heard, and the streams of it here.
        self._clients: dict[str, str] = {}
        self._client_streams: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.connected = threading.Event()
        #: Notifications received, and those whose event came inside (for benchmarks).
        self.received = 0
        self.inline = 0

    def start(self) -> LiveHub:
        with self._cond:
            self._ensure_thread()
        return self

    def _ensure_thread(self) -> None:
        # Under self._cond: _idle() retires the thread under the same lock, so a
        # stream registered here is never left without a LISTEN thread.
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="solidloop-live",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _idle(self, since: list[float]) -> bool:
        with self._cond:
            if self._feeds:
                since[0] = time.monotonic()
                return False
            if time.monotonic() - since[0] < IDLE_SECONDS:
                return False
            self._thread = None  # start() makes a new one for the next stream
            return True

    def _unwatched(self) -> bool:
        """Retire the thread now if no stream watches anything."""
        with self._cond:
            if self._feeds:
                return False
            self._thread = None
            return True

    def _run(self) -> None:
        since = [time.monotonic()]
        while not self._stop.is_set() and not self._idle(since):
            try:
                with psycopg.connect(self.conninfo, autocommit=True,
                                     application_name=LISTEN_APPLICATION_NAME) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    # Whatever was notified while no connection listened is
                    # gone: every feed reads the table once.
                    self._all_stale()
                    self.connected.set()
                    while not self._stop.is_set() and not self._idle(since):
                        for note in conn.notifies(timeout=1.0):
                            self.dispatch(note.payload)
            except Exception as exc:  # the streams' heartbeat reads cover the gap
                if self._unwatched():
                    return  # nobody to listen for: the next stream starts a new thread
                logger.warning("live LISTEN connection lost (%s); retrying", exc)
                self._stop.wait(1.0)
            finally:
                self.connected.clear()
                self._all_stale()

    def _all_stale(self) -> None:
        with self._cond:
            for feed in self._feeds.values():
                feed.last = None
                feed.version += 1
            self._cond.notify_all()

    def dispatch(self, payload: str) -> None:
        """One notification: extend the loop's feed with the event it carries,
        or leave the feed stale; wake the loop's streams either way."""
        head, _, body = payload.partition("\n")
        if head.startswith(CLIENT_PREFIX):
            self._newer_stream(head[len(CLIENT_PREFIX):], body)
            return
        parts = head.split(":")
        try:
            loop_id = int(parts[0])
        except ValueError:
            return
        with self._cond:
            self.received += 1
            feed = self._feeds.get(loop_id)
            if feed is None:
                return
            event = None
            if len(parts) == 3 and body:
                try:
                    seq, prev = int(parts[1]), int(parts[2])
                    event = from_notification(loop_id, seq, json.loads(body))
                except (ValueError, KeyError, TypeError):
                    event = None
            if event is not None and feed.last is not None and prev == feed.last:
                feed.append(event)
                self.inline += 1
            elif len(parts) == 3 and feed.last is not None and parts[1].isdigit() \
                    and int(parts[1]) <= feed.last:
                pass  # an event the feed already holds (read before it was heard)
            else:
                feed.last = None
            feed.version += 1
            self._cond.notify_all()

    # -- browsers' streams of many loops -----------------------------------------

    def claim(self, client: str, token: str) -> None:
        """A stream of browser ``client`` starts with ``token`` (tokens grow
        with time): this process's older streams of that browser end."""
        with self._cond:
            self._client_streams[client] = self._client_streams.get(client, 0) + 1
            self._newer_stream(client, token)

    def release(self, client: str) -> None:
        with self._cond:
            left = self._client_streams.get(client, 0) - 1
            if left > 0:
                self._client_streams[client] = left
            else:
                self._client_streams.pop(client, None)
                self._clients.pop(client, None)

    def _newer_stream(self, client: str, token: str) -> None:
        # A client no stream here belongs to is ignored: the map stays as small
        # as this process's streams.
        with self._cond:
            if client in self._client_streams and token > self._clients.get(client, ""):
                self._clients[client] = token
                self._cond.notify_all()

    def superseded(self, client: str, token: str) -> bool:
        """Whether the browser opened a newer stream than ``token``."""
        with self._cond:
            return self._clients.get(client, token) != token

    def wait_any(self, seen: Mapping[int, int], timeout: float,
                 stop: Callable[[], bool] | None = None) -> bool:
        """Block until any of the loops' versions moves past ``seen`` (or
        ``stop()`` says so, or ``timeout`` passes); True unless it timed out."""
        def moved() -> bool:
            return (stop is not None and stop()) or any(
                self._version(loop_id) != version for loop_id, version in seen.items())
        with self._cond:
            return self._cond.wait_for(moved, timeout)

    # -- streams ----------------------------------------------------------------

    def watch(self, loop_id: int) -> None:
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None:
                feed = self._feeds[loop_id] = Feed()
            feed.watchers += 1
            self._ensure_thread()

    def unwatch(self, loop_id: int) -> None:
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None:
                return
            feed.watchers -= 1
            if feed.watchers <= 0:
                del self._feeds[loop_id]

    def version(self, loop_id: int) -> int:
        with self._cond:
            feed = self._feeds.get(loop_id)
            return feed.version if feed is not None else 0

    def wait(self, loop_id: int, seen: int, timeout: float) -> int:
        """Block (holding nothing but this thread) until the loop's version moves
        past ``seen`` or ``timeout`` passes; return the version."""
        with self._cond:
            self._cond.wait_for(lambda: self._version(loop_id) != seen, timeout)
            return self._version(loop_id)

    def _version(self, loop_id: int) -> int:
        feed = self._feeds.get(loop_id)
        return feed.version if feed is not None else 0

    def newest(self, loop_id: int) -> int | None:
        """The newest event id the loop's feed knows (None: stale)."""
        with self._cond:
            feed = self._feeds.get(loop_id)
            return feed.last if feed is not None else None

    def cached(self, loop_id: int, after: int) -> list[StreamEvent] | None:
        """The events after ``after`` if the feed knows them all; None when the
        table must be read."""
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None or not feed.covers(after):
                return None
            return feed.after(after)

    def begin_read(self, loop_id: int, timeout: float) -> tuple[bool, int]:
        """Whether this stream should read the table (no other stream of the
        loop is reading it; if one is, wait up to ``timeout`` for it first), and
        the feed's version the read starts from."""
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None:
                return True, 0
            if feed.loading:
                self._cond.wait_for(lambda: not feed.loading, timeout)
                if feed.loading:
                    return True, feed.version
                return False, feed.version
            feed.loading = True
            return True, feed.version

    def end_read(self, loop_id: int, version: int, events: Iterable[StreamEvent],
                 after: int, tail: int | None) -> None:
        """A read of the table ended: when it reached the loop's newest event and
        nothing was heard meanwhile, the feed takes it and is fresh again."""
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None:
                return
            feed.loading = False
            if tail is not None and feed.version == version:
                feed.reset(after, list(events), tail)
            self._cond.notify_all()

    def should_mark(self, loop_id: int, every: float) -> bool:
        """Whether it is this stream's turn to push the loop's ``watched_until``
        (at most once per ``every`` seconds per loop and process)."""
        now = time.monotonic()
        with self._cond:
            feed = self._feeds.get(loop_id)
            if feed is None or now - feed.marked_at < every:
                return False
            feed.marked_at = now
            return True

    @property
    def streams(self) -> int:
        with self._cond:
            return sum(feed.watchers for feed in self._feeds.values())
