"""The worker process's one LISTEN connection, shared by its consumers (decision 0014).

:class:`Listener` owns one autocommit connection and one daemon thread that
LISTENs on the channel of every subscribed queue. A notification bumps that
queue's *generation* and wakes only the consumers waiting on that queue. A
consumer reads the generation before it claims and waits until it moves (or
its poll timeout passes), so a notification that arrives between an empty
claim and the wait is never lost.

While the listener hears a queue (:meth:`Listener.hears`), its consumers
look at the table only when notified, when a delayed job falls due, or at a
long idle poll; while its connection is down they poll every
``poll_interval``. On reconnect it LISTENs again and bumps every generation,
since notifications sent meanwhile are gone.

Other parts of the process may hear a channel of their own on the same
connection (:meth:`Listener.on_notify`): a handler is called with each
payload on the listener's thread, while the listener runs (it runs while the
process has consumers). Such a channel is a hint, never a duty: what is
notified while the connection is down is lost, and its owner must not need it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from .sql import CHANNEL_PREFIX, LISTENER_CHANNEL_PREFIX, LISTENING

logger = logging.getLogger("flask_solidloop.broker")

#: application_name of the listener's connection (visible in pg_stat_activity).
LISTENER_APPLICATION_NAME = "solidloop-listener"
#: Seconds a new consumer waits for its channel to be LISTENed before it
#: starts anyway, in poll mode (the listener LISTENs when it gets through).
SUBSCRIBE_TIMEOUT = 5.0
#: Seconds the thread waits in one ``notifies()`` call before its housekeeping.
TICK = 1.0
#: Seconds of silence after which the thread checks its connection with ``SELECT 1``.
QUIET_CHECK = 10.0
RECONNECT_MIN = 0.1
RECONNECT_MAX = 2.0


@dataclass
class _Queue:
    channel: str
    cond: threading.Condition
    generation: int = 0
    subscribers: int = 0
    #: A subscriber stopped waiting for the LISTEN (and polls): once the channel
    #: is LISTENed, the queue's generation moves so that it claims again.
    unheard: bool = False


@dataclass
class _Session:
    """One run of the listener thread: its stop flag and what it LISTENs on."""

    stop: threading.Event = field(default_factory=threading.Event)
    listening: set[str] = field(default_factory=set)
    backend_pid: int | None = None
    thread: threading.Thread | None = None
    connects: int = 0


class Listener:
    """One LISTEN connection fanned out to the consumers of one broker in one process.

    ``poke(channel)`` sends a NOTIFY on ``channel`` from another connection (the
    broker's pool): it interrupts the thread's wait when there is a channel to
    add or the thread must stop.
    """

    def __init__(self, conninfo: str, poke: Callable[[str], None]) -> None:
        self.conninfo = conninfo
        self.pid = os.getpid()
        self.control_channel = LISTENER_CHANNEL_PREFIX + uuid.uuid4().hex
        self._poke = poke
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a session's state moved
        self._queues: dict[str, _Queue] = {}
        self._by_channel: dict[str, _Queue] = {}
        self._handlers: dict[str, Callable[[str], None]] = {}
        self._session: _Session | None = None
        #: Connections made so far (a reconnect adds one), and failed attempts.
        self.connects = 0
        self.failures = 0

    # -- consumers' side ---------------------------------------------------------

    def subscribe(self, queue_name: str) -> bool:
        """Count a consumer of ``queue_name`` in; return once its channel is
        LISTENed (True), or after SUBSCRIBE_TIMEOUT or a failed connection
        attempt (False: the consumer polls until the listener gets through)."""
        with self._lock:
            q = self._queues.get(queue_name)
            if q is None:
                q = _Queue(channel=CHANNEL_PREFIX + queue_name,
                           cond=threading.Condition(self._lock))
                self._queues[queue_name] = q
                self._by_channel[q.channel] = q
            q.subscribers += 1
            session = self._ensure_session()
            if q.channel in session.listening:
                return True
            failures = self.failures
            # Not connected yet: the thread LISTENs on every queue once it is.
            # Connected: it is blocked in notifies() and must be poked.
            poke = session.backend_pid is not None
        if poke:
            self._poke_quietly()
        with self._lock:
            self._changed.wait_for(
                lambda: (self._session is not session or q.channel in session.listening
                         or self.failures != failures),
                SUBSCRIBE_TIMEOUT,
            )
            if q.channel in session.listening:
                return True
            q.unheard = True  # under the same lock as the check: see _listen_new
            return False

    def unsubscribe(self, queue_name: str) -> None:
        """Count a consumer out; the thread stops when no consumer is left."""
        with self._lock:
            q = self._queues.get(queue_name)
            if q is None or q.subscribers <= 0:
                return
            q.subscribers -= 1
            if any(other.subscribers for other in self._queues.values()):
                return
            if self._detach() is None:
                return
        self._poke_quietly()

    def on_notify(self, channel: str, handler: Callable[[str], None]) -> None:
        """Call ``handler(payload)`` for each notification on ``channel`` while the
        listener runs (from the next LISTEN on; it does not start the listener).
        The handler runs on the listener's thread: it must be quick and must not
        raise (an exception is logged and dropped)."""
        with self._lock:
            self._handlers[channel] = handler
            session = self._session
            poke = session is not None and session.backend_pid is not None \
                and channel not in session.listening
        if poke:
            self._poke_quietly()

    def generation(self, queue_name: str) -> int:
        """The queue's wake-up counter: read it before a claim, pass it to :meth:`wait`."""
        with self._lock:
            q = self._queues.get(queue_name)
            return q.generation if q is not None else 0

    def wait(self, queue_name: str, seen: int, timeout: float) -> bool:
        """Block until the queue's generation differs from ``seen`` (True) or
        ``timeout`` seconds pass (False)."""
        with self._lock:
            q = self._queues.get(queue_name)
            if q is None:
                return False
            return q.cond.wait_for(lambda: q.generation != seen, timeout)

    def hears(self, queue_name: str) -> bool:
        """Whether the live connection LISTENs on the queue's channel now (as
        PostgreSQL confirmed): its consumers may then poll rarely, since every
        enqueue notifies. Until the next reconnect, which bumps every
        generation, no notification of it can be missed."""
        with self._lock:
            session = self._session
            return (session is not None and session.backend_pid is not None
                    and CHANNEL_PREFIX + queue_name in session.listening)

    # -- observability (tests, benchmarks) ------------------------------------------

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend pid of the live connection, None while down."""
        with self._lock:
            return self._session.backend_pid if self._session else None

    def listening(self) -> set[str]:
        """Channels the live connection has LISTENed on (as PostgreSQL confirmed)."""
        with self._lock:
            return set(self._session.listening) if self._session else set()

    def wait_connected(self, timeout: float, *, after: int = 0) -> bool:
        """Block until the listener has made more than ``after`` connections and is up."""
        with self._lock:
            return self._changed.wait_for(
                lambda: (self.connects > after and self._session is not None
                         and self._session.backend_pid is not None), timeout)

    # -- lifecycle -------------------------------------------------------------

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and close its connection (consumers fall back to polling)."""
        with self._lock:
            session = self._detach()
            if session is None:
                return
        self._poke_quietly()
        if session.thread is not None and session.thread is not threading.current_thread():
            session.thread.join(timeout)

    def _detach(self) -> _Session | None:
        """Under self._lock: take the live session away and tell its thread to stop."""
        session = self._session
        self._session = None
        if session is not None:
            session.stop.set()
            self._changed.notify_all()
        return session

    def _ensure_session(self) -> _Session:
        # Under self._lock: a stopping session's thread may still be winding
        # down; the new one has its own connection and its own state.
        session = self._session
        if session is None or session.thread is None or not session.thread.is_alive():
            session = _Session()
            session.thread = threading.Thread(target=self._run, args=(session,),
                                              name="solidloop-listener", daemon=True)
            self._session = session
            session.thread.start()
        return session

    def _poke_quietly(self) -> None:
        try:
            self._poke(self.control_channel)
        except Exception as exc:  # the thread's TICK covers a poke that did not get through
            logger.debug("could not poke the listener: %s", exc)

    # -- the thread --------------------------------------------------------------

    def _run(self, session: _Session) -> None:
        delay = RECONNECT_MIN
        lost = False
        while not session.stop.is_set():
            try:
                conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                       application_name=LISTENER_APPLICATION_NAME)
            except Exception as exc:
                with self._lock:
                    self.failures += 1
                    self._changed.notify_all()
                if not lost:
                    logger.warning("queue listener cannot connect (%s); consumers poll "
                                   "every poll_interval meanwhile", exc)
                lost = True
                session.stop.wait(delay)
                delay = min(delay * 2, RECONNECT_MAX)
                continue
            if lost:
                logger.info("queue listener connected again")
            lost = False
            delay = RECONNECT_MIN
            try:
                with conn:
                    self._serve(conn, session)
            except Exception as exc:
                if not session.stop.is_set():
                    logger.warning("queue listener connection lost (%s); reconnecting, "
                                   "consumers poll meanwhile", exc)
                    lost = True
            finally:
                with self._lock:
                    session.listening.clear()
                    session.backend_pid = None
                    self._changed.notify_all()
                with contextlib.suppress(Exception):
                    conn.close()
            if not session.stop.is_set():
                session.stop.wait(delay)
                delay = min(delay * 2, RECONNECT_MAX)

    def _serve(self, conn: psycopg.Connection, session: _Session) -> None:
        with self._lock:
            session.backend_pid = conn.info.backend_pid
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.control_channel)))
        self._listen_new(conn, session)
        with self._lock:
            session.connects += 1
            self.connects += 1
            if session.connects > 1:
                # A reconnect: whatever was notified while we were down is lost,
                # so every queue claims once. (On a session's first connection
                # its subscribers have not claimed yet; _listen_new handled any
                # that stopped waiting.)
                for q in self._queues.values():
                    q.generation += 1
                    q.cond.notify_all()
            self._changed.notify_all()
        quiet_since = time.monotonic()
        while not session.stop.is_set():
            heard = False
            for note in conn.notifies(timeout=TICK, stop_after=1):
                heard = True
                self._dispatch(note.channel, note.payload)
            if session.stop.is_set():
                return
            self._listen_new(conn, session)
            now = time.monotonic()
            if heard:
                quiet_since = now
            elif now - quiet_since >= QUIET_CHECK:
                conn.execute("SELECT 1")  # a dead connection raises here
                quiet_since = now

    def _listen_new(self, conn: psycopg.Connection, session: _Session) -> None:
        with self._lock:
            new = [q.channel for q in self._queues.values()
                   if q.subscribers and q.channel not in session.listening]
            new += [channel for channel in self._handlers if channel not in session.listening]
        if not new and session.listening:
            return
        for channel in new:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        # What PostgreSQL says this session listens on, not what we asked for.
        confirmed = {row[0] for row in conn.execute(LISTENING).fetchall()}
        with self._lock:
            session.listening = confirmed
            for q in self._queues.values():
                if q.unheard and q.channel in confirmed:
                    q.unheard = False
                    q.generation += 1
                    q.cond.notify_all()
            self._changed.notify_all()

    def _dispatch(self, channel: str, payload: str = "") -> None:
        with self._lock:
            q = self._by_channel.get(channel)
            if q is not None:
                q.generation += 1
                q.cond.notify_all()
            handler = self._handlers.get(channel)
        if handler is not None:
            try:
                handler(payload)
            except Exception:
                logger.exception("a handler of channel %s failed", channel)
