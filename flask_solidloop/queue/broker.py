"""A dramatiq 2.x broker whose queue is a PostgreSQL table, over psycopg 3.

Why our own (docs/decisions/0002-postgres-broker.md): the job that follows a
state change must commit in the *same* transaction as that change. So
:meth:`PostgresBroker.enqueue` can write the job row on the caller's
connection (a SQLAlchemy session or a psycopg connection, passed explicitly),
and the NOTIFY that wakes consumers is transactional too: a rollback leaves
neither the state, nor the job, nor a wake-up.

Shape of the table (``solidloop_jobs``): one row per message, ``state`` in
queued → running → done | dead, ``eta`` for delays (nothing is held in worker
memory), ``lease_token``/``lease_until`` for redelivery when a worker dies.

* claim: ``UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n)``
* wake-up: one LISTEN connection per process (queue/listener.py) wakes the
  consumers of the queue notified, with a timed poll as fallback
* ack/nack: fenced on the lease token, so a stale holder changes nothing
* renewal: the consumer extends the leases of the jobs it holds
* recovery: expired leases go back to queued (or dead after too many tries)

Messages are encoded with ``dramatiq.get_encoder()`` (so a host's encoder is
honoured) and must come out as JSON: the row keeps them as JSONB, which the
reaper and operators query. An argument the encoder rejects raises at send.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.encoder import JSONEncoder
from dramatiq.errors import BrokerConnectionError
from dramatiq.message import Message
from psycopg_pool import ConnectionPool

from ..dbapi import execute_on
from ..errors import (
    BrokerUnavailableError,
    InvalidJobError,
    JobEncodeError,
    QueueNotDeclaredError,
    WaitTimeoutError,
)
from ..urls import libpq_url, redact_url
from . import sql as jobs_sql
from .claims import Claim, ClaimBook, ClaimBookMiddleware
from .listener import Listener

logger = logging.getLogger("flask_solidloop.broker")

#: dramatiq's own rule for queue names (dramatiq.actor enforces it too).
QUEUE_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")
#: PostgreSQL identifiers (our NOTIFY channels) are at most 63 bytes.
MAX_QUEUE_NAME_BYTES = 63 - len(jobs_sql.CHANNEL_PREFIX)


def check_queue_name(queue_name: Any) -> str:
    """Return ``queue_name`` if it is a valid queue name, else raise naming the rule."""
    if not isinstance(queue_name, str) or not QUEUE_NAME_RE.fullmatch(queue_name):
        raise InvalidJobError(
            f"queue name {queue_name!r} is invalid: start with a letter or '_', then use "
            "letters, digits, '_', '.' or '-' (e.g. 'default', 'reports.daily')"
        )
    if len(queue_name.encode()) > MAX_QUEUE_NAME_BYTES:
        raise InvalidJobError(
            f"queue name {queue_name!r} is too long: its NOTIFY channel would exceed "
            f"PostgreSQL's 63-byte identifier limit; use at most {MAX_QUEUE_NAME_BYTES} bytes"
        )
    return queue_name


def encode_message(message: Message) -> str:
    """The message as JSON text, through dramatiq's global encoder.

    Raises JobEncodeError at send time, naming the actor and the fix, when the
    encoder rejects an argument or produces something that is not JSON.
    """
    encoder = dramatiq.get_encoder()
    try:
        data = encoder.encode(message.asdict())
    except Exception as exc:
        raise JobEncodeError(
            f"cannot send {message.actor_name!r}: {type(encoder).__name__} could not encode "
            f"its arguments ({type(exc).__name__}: {exc}). Pass JSON-friendly values (ids, "
            "strings, numbers, lists, dicts), or install an encoder that handles this type "
            "with dramatiq.set_encoder()"
        ) from exc
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else str(data)
        if type(encoder) is not JSONEncoder:  # dramatiq's own always writes JSON
            json.loads(text)
    except ValueError as exc:
        raise JobEncodeError(
            f"cannot send {message.actor_name!r}: {type(encoder).__name__} does not produce "
            "JSON, but the job table stores messages as JSONB. Use a JSON-based encoder "
            "(subclass dramatiq.encoder.JSONEncoder to add your own types)"
        ) from exc
    return text


def decode_message(data: Any) -> Message:
    """A job row's ``message`` column (JSONB) back into a dramatiq Message,
    through the global encoder's ``decode`` unless it is dramatiq's plain JSON one."""
    encoder = dramatiq.get_encoder()
    if isinstance(data, str | bytes):
        data = json.loads(data)
    if type(encoder) is not JSONEncoder:
        # The host's decoder revives its own types (dates, decimals, ...) from the JSON it wrote.
        data = encoder.decode(json.dumps(data).encode("utf-8"))
    return Message(**data)


def session_database(session: Any) -> Any:
    """The SQLAlchemy URL a ``session=`` argument writes to, or InvalidJobError
    naming the fix when it is not a SQLAlchemy session or connection."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, scoped_session

    bind: Any
    if isinstance(session, Session | scoped_session):
        bind = session.get_bind()
    elif isinstance(session, Connection):
        bind = session
    else:
        raise InvalidJobError(
            f"session= must be a SQLAlchemy session of this app's database (e.g. db.session), "
            f"so the job commits with it; got {type(session).__name__}"
        )
    engine = getattr(bind, "engine", bind)
    return engine.url

class PostgresMessageProxy(MessageProxy):
    """A dramatiq message plus the job row that carries it."""

    def __init__(self, message: Message, job_id: int, lease_token: uuid.UUID, attempts: int):
        super().__init__(message)
        #: Set when the actor committed its job done itself (no ack needed).
        self.done_in_transaction = False
        self.job_id = job_id
        self.lease_token = lease_token
        self.attempts = attempts


class PostgresBroker(dramatiq.Broker):
    """dramatiq broker over the ``solidloop_jobs`` table.

    Parameters:
      url: a PostgreSQL URL (SQLAlchemy or libpq form).
      job_lease: seconds before an unacknowledged claimed job is redelivered.
      poll_interval: seconds between a consumer's looks at its queue while
        the listener does not hear it (down, or not LISTENing yet).
      idle_poll_interval: seconds between those looks while it does (every
        enqueue notifies; this is a safety net).
      max_deliveries: deliveries without an ack before a job is dead-lettered.
    """

    def __init__(
        self,
        url: str,
        *,
        middleware: list[dramatiq.Middleware] | None = None,
        job_lease: float = 60.0,
        poll_interval: float = 1.0,
        idle_poll_interval: float = 30.0,
        max_deliveries: int = 5,
        promote_after: float | None = None,
        fair_share_quantum: float = 0.0,
        session_url: str | None = None,
    ) -> None:
        super().__init__(middleware=middleware)
        self.url = url
        #: The URL the app's sessions use, when it differs from ``url`` (a
        #: transaction pooler in front of them, decision 0028): ``session=``
        #: may be bound to it.
        self.session_url = session_url
        #: Seconds a loop's job moves back in the claim order per unit of its loop's
        #: fair rank (SOLIDLOOP_FAIR_SHARE_QUANTUM); 0 turns fair shares off.
        self.fair_share_quantum = float(fair_share_quantum)
        #: Seconds after which a tier-1 job joins tier 0 (continuation-first's
        #: starvation bound); None when every job is tier 1 anyway.
        self.promote_after = promote_after
        self.conninfo = libpq_url(url)
        self.job_lease = float(job_lease)
        self.poll_interval = float(poll_interval)
        self.idle_poll_interval = max(float(idle_poll_interval), self.poll_interval)
        #: This process's claims, shared by its consumers (queue/claims.py).
        self.claims = ClaimBook(self.job_lease)
        # First, so no other middleware has begun a message whose claim lapsed.
        self.add_middleware(ClaimBookMiddleware(self.claims),
                            before=type(self.middleware[0]) if self.middleware else None)
        self.max_deliveries = int(max_deliveries)
        self.queues: dict[str, None] = {}
        self._pool: ConnectionPool | None = None
        self._pool_lock = threading.Lock()
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()
        self._notify_handlers: dict[str, Callable[[str], None]] = {}
        self._last_recover = 0.0
        #: Whether consumers run recovery passes themselves: True unless the
        #: in-worker reaper, whose passes begin with one, runs (decision 0029).
        self.recover_in_consumers = True
        #: URLs of sessions already checked by check_session (the check runs once per engine).
        self._session_urls: set[str] = set()

    # -- connections -------------------------------------------------------

    def connect(self, *, application_name: str | None = None) -> psycopg.Connection:
        """A new autocommit connection, with errors dramatiq's consumers understand."""
        extra: dict[str, Any] = {"application_name": application_name} if application_name else {}
        try:
            return psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10, **extra)
        except psycopg.OperationalError as exc:
            raise BrokerUnavailableError(
                f"cannot reach PostgreSQL at {redact_url(self.url)}: {exc}"
            ) from exc

    @property
    def pool(self) -> ConnectionPool:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.conninfo,
                    min_size=1,
                    max_size=4,
                    kwargs={"autocommit": True},
                    open=True,
                    name="solidloop-broker",
                )
            return self._pool

    def _run(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        try:
            with self.pool.connection() as conn:
                cur = conn.execute(query, params)
                return cur.fetchall() if cur.description else []
        except psycopg.OperationalError as exc:
            raise BrokerUnavailableError(str(exc)) from exc

    @property
    def listener(self) -> Listener:
        """This process's LISTEN connection for this broker's consumers (decision 0014);
        a forked child gets its own."""
        with self._listener_lock:
            if self._listener is None or self._listener.pid != os.getpid():
                self._listener = Listener(self.conninfo, self._poke)
                for channel, handler in self._notify_handlers.items():
                    self._listener.on_notify(channel, handler)
            return self._listener

    def on_notify(self, channel: str, handler: Callable[[str], None]) -> None:
        """Hand the notifications of ``channel`` to ``handler`` on this process's
        listener while it runs (:meth:`Listener.on_notify`), and on the listener
        of a forked child too."""
        with self._listener_lock:
            self._notify_handlers[channel] = handler
            listener = self._listener if self._listener is not None \
                and self._listener.pid == os.getpid() else None
        if listener is not None:
            listener.on_notify(channel, handler)

    def _poke(self, channel: str) -> None:
        self._run(jobs_sql.NOTIFY, (channel,))

    def close(self) -> None:
        with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None and listener.pid == os.getpid():
            listener.stop()  # before the pool closes: stopping pokes through it
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- dramatiq Broker API -------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        if queue_name not in self.queues:
            check_queue_name(queue_name)
            self.emit_before("declare_queue", queue_name)
            self.queues[queue_name] = None
            self.emit_after("declare_queue", queue_name)

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> Consumer:
        if queue_name not in self.queues:
            raise QueueNotDeclaredError(queue_name)
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    def enqueue(
        self,
        message: Message,
        *,
        delay: int | None = None,
        connection: Any = None,
        eta: datetime | None = None,
    ) -> Message:
        """Write ``message`` as a job row.

        ``connection`` binds the write to a transaction: a SQLAlchemy
        ``Session``/``Connection`` or a psycopg connection. The job (and its
        NOTIFY) then commits or rolls back with the caller's state change.
        Without it the job is written and committed on the broker's own pool,
        which is what dramatiq's own callers (``actor.send``, Retries) get.

        A ``session`` message option (``actor.send_with_options(session=db.session)``
        on any actor of this broker) is taken out of the message and used as
        ``connection``, after checking it is a session of this broker's
        database. ``eta`` (an aware datetime) is an absolute due time, the
        alternative to ``delay`` in milliseconds.
        """
        if message.queue_name not in self.queues:
            raise QueueNotDeclaredError(message.queue_name)
        options = dict(message.options)
        options.pop("eta", None)  # delays live in the row's eta, never in worker memory
        if "connection" in options:
            raise InvalidJobError(
                f"send_with_options(connection=...) is not an option of {message.actor_name!r}: "
                "pass session=db.session to enqueue inside that session's transaction"
            )
        session = options.pop("session", None)
        if session is not None:
            if connection is not None:
                raise InvalidJobError("pass either session= or connection=, not both")
            self.check_session(session)
            connection = session
        # Message.copy() merges options, so it cannot drop one; and Retries hands us a
        # MessageProxy, not the dataclass. Build the Message to store from its fields.
        message = Message(queue_name=message.queue_name, actor_name=message.actor_name,
                          args=message.args, kwargs=message.kwargs, options=options,
                          message_id=message.message_id,
                          message_timestamp=message.message_timestamp)
        self.emit_before("enqueue", message, delay)
        params = {
            "queue_name": message.queue_name,
            "actor_name": message.actor_name,
            "message_id": message.message_id,
            "message": encode_message(message),
            "delay": (delay or 0) / 1000.0,
            "eta": eta,
            "loop_id": options.get("solidloop_loop_id"),
            "quantum": self.fair_share_quantum,
            "tier": 0 if options.get("solidloop_continuation") else 1,
            "channel": jobs_sql.CHANNEL_PREFIX + message.queue_name,
        }
        # Delayed jobs notify too: a consumer that LISTENs looks at its table only
        # when told (or at its rare idle poll), and must learn the new due time.
        query = jobs_sql.INSERT_AND_NOTIFY
        if connection is None:
            self._run(query, params)
        else:
            execute_on(connection, query, params)
        self.emit_after("enqueue", message, delay)
        return message

    def enqueue_many(self, messages: Sequence[Message], *, connection: Any) -> int:
        """Write ``messages`` as job rows due now, in one statement with one NOTIFY,
        on ``connection``'s transaction (a bulk start's first turns). They must
        share a queue, an actor and a tier; each carries its loop id as
        :meth:`enqueue` reads it. Returns how many were written."""
        if not messages:
            return 0
        first = messages[0]
        if first.queue_name not in self.queues:
            raise QueueNotDeclaredError(first.queue_name)
        tier = 0 if first.options.get("solidloop_continuation") else 1
        for message in messages:
            if (message.queue_name, message.actor_name) != (first.queue_name,
                                                            first.actor_name):
                raise InvalidJobError("enqueue_many() takes messages of one queue and one "
                                      "actor; call it once per actor")
            self.emit_before("enqueue", message, None)
        params = {
            "queue_name": first.queue_name, "actor_name": first.actor_name, "tier": tier,
            "quantum": self.fair_share_quantum,
            "message_ids": [message.message_id for message in messages],
            "messages": [encode_message(message) for message in messages],
            "loop_ids": [message.options.get("solidloop_loop_id") for message in messages],
            "channel": jobs_sql.CHANNEL_PREFIX + first.queue_name,
        }
        rows = execute_on(connection, jobs_sql.INSERT_MANY_AND_NOTIFY, params, fetch=True)
        for message in messages:
            self.emit_after("enqueue", message, None)
        return int(rows[0][0])

    def enqueue_host_job(
        self,
        message: Message,
        record: dict[str, Any],
        *,
        delay: int | None = None,
        eta: datetime | None = None,
        connection: Any = None,
    ) -> bool:
        """Write an RQ-style job: its ``solidloop_host_jobs`` record and its first
        delivery, in one statement on ``connection`` (or on the pool).

        Returns False, writing nothing, when the record's job id is taken.
        """
        if message.queue_name not in self.queues:
            raise QueueNotDeclaredError(message.queue_name)
        self.emit_before("enqueue", message, delay)
        params = {
            **record,
            "queue_name": message.queue_name,
            "actor_name": message.actor_name,
            "message_id": message.message_id,
            "message": encode_message(message),
            "delay": (delay or 0) / 1000.0,
            "eta": eta,
            "channel": jobs_sql.CHANNEL_PREFIX + message.queue_name,
        }
        query = jobs_sql.HOST_JOB_ENQUEUE_AND_NOTIFY  # delayed ones too, as enqueue() says
        if connection is None:
            rows = self._run(query, params)
        else:
            rows = execute_on(connection, query, params, fetch=True)
        if not rows:
            return False
        self.emit_after("enqueue", message, delay)
        return True

    def check_session(self, session: Any) -> None:
        """InvalidJobError, naming the fix, unless ``session`` is a SQLAlchemy
        session or connection on this broker's database (its own URL, or the
        app's session URL when the two differ)."""
        url = session_database(session)
        key = str(url)
        if key in self._session_urls:
            return
        from sqlalchemy.engine import make_url

        mine = make_url(self.url)
        def where(u: Any) -> tuple[str, str, int, str | None]:
            return (u.get_backend_name(), u.host or "", u.port or 5432, u.database)

        known = {where(mine)}
        if self.session_url:
            known.add(where(make_url(self.session_url)))
        if where(url) not in known:
            raise InvalidJobError(
                f"session= is bound to {redact_url(key)}, not to this app's job database "
                f"{redact_url(self.url)}: pass a session of the app whose jobs these are "
                "(e.g. db.session), so the job commits in the same database transaction"
            )
        self._session_urls.add(key)

    def get_declared_delay_queues(self) -> set[str]:
        return set()

    def flush(self, queue_name: str) -> None:
        self._run(jobs_sql.FLUSH, (queue_name,))

    def flush_all(self) -> None:
        for queue_name in self.queues:
            self.flush(queue_name)

    def join(self, queue_name: str, *, timeout: int | None = None) -> None:
        """Block until ``queue_name`` has no queued or running jobs (tests only)."""
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            rows = self._run(jobs_sql.LIVE_COUNT, (queue_name,))
            if rows[0][0] == 0:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeoutError(f"queue {queue_name!r} still has {rows[0][0]} live jobs")
            time.sleep(0.05)

    # -- maintenance -----------------------------------------------------------

    def recover_expired(self, connection: Any = None) -> int:
        """Return jobs whose holder stopped renewing to the queue, and apply
        continuation-first's starvation bound (``promote_after``), in one
        statement. Idempotent."""
        params = {"max_deliveries": self.max_deliveries, "promote_after": self.promote_after}
        rows = self._run(jobs_sql.RECOVER, params) if connection is None else execute_on(
            connection, jobs_sql.RECOVER, params, fetch=True
        )
        for job_id, queue_name, state in rows:
            if state == "dead":
                logger.error("job %s on %s dead-lettered after %s deliveries",
                             job_id, queue_name, self.max_deliveries)
            else:
                logger.warning("job %s on %s redelivered: its lease expired", job_id, queue_name)
        for queue_name in {row[1] for row in rows if row[2] == "queued"}:
            notify = (jobs_sql.NOTIFY, (jobs_sql.CHANNEL_PREFIX + queue_name,))
            if connection is None:
                self._run(*notify)
            else:  # wake consumers when the caller's transaction commits, not before
                execute_on(connection, *notify)
        return len(rows)

    def cancel_loop_jobs(self, connection: Any, loop_id: int, *, reason: str) -> None:
        """Mark every queued job of ``loop_id`` done, inside the caller's transaction."""
        execute_on(connection, jobs_sql.CANCEL_LOOP_JOBS, (reason, loop_id))

    def maybe_recover_expired(self) -> None:
        """A consumer's own recovery pass, every quarter of the job lease, unless
        the reaper runs it in the workers (``recover_in_consumers`` False)."""
        if not self.recover_in_consumers:
            return
        now = time.monotonic()
        if now - self._last_recover < max(self.job_lease / 4, 1.0):
            return
        self._last_recover = now
        try:
            self.recover_expired()
        except BrokerConnectionError:
            raise
        except Exception:
            logger.exception("recovering expired job leases failed")


class PostgresConsumer(Consumer):
    """Iterates over the jobs of one queue. Used by one ConsumerThread.

    Every statement goes through the broker's pool (the consumer holds no
    connection of its own); it waits for work on the broker's shared
    :class:`~flask_solidloop.queue.listener.Listener`, which wakes only the
    consumers of the queue notified. Every enqueue notifies, delayed ones
    included, so a consumer whose queue's channel is LISTENed looks at the
    table only when told, when a delayed job falls due, or every
    ``idle_poll_interval`` as a safety net; while the listener is down it
    polls every ``poll_interval``. It claims no more than the broker's
    :class:`~flask_solidloop.queue.claims.ClaimBook` has room for (this
    process's free threads) and renews only jobs that have started.
    """

    def __init__(self, broker: PostgresBroker, queue_name: str, prefetch: int, timeout: int):
        self.broker = broker
        self.book = broker.claims
        self.queue_name = queue_name
        self.prefetch = max(1, prefetch)
        self.timeout = timeout / 1000.0
        self.buffer: deque[PostgresMessageProxy] = deque()
        self.held: dict[int, uuid.UUID] = {}
        self.held_lock = threading.Lock()
        self.last_renewal = time.monotonic()
        #: Claim statements run, and waits a notification ended (the rest timed out).
        self.claims = 0
        self.wakeups = 0
        #: When the table must be looked at again though nothing was notified
        #: (the poll, or the next delayed job's due time); 0: at once.
        self.next_look = 0.0
        self.looked_at = 0.0
        self.listener = broker.listener
        # Returns once the queue's channel is LISTENed, so no commit can fall
        # between our first empty claim and the listening (or after a bounded
        # wait if the listener cannot connect: we poll until it does).
        self.listener.subscribe(queue_name)
        self._subscribed = True
        #: The queue's wake-up generation when the table was last looked at.
        self.seen = self.listener.generation(queue_name)

    def __next__(self) -> MessageProxy | None:
        try:
            self._renew_if_due()
            self.broker.maybe_recover_expired()
            if self.buffer:
                return self.buffer.popleft()
            if self._due() and self._look():
                return self.buffer.popleft()
            self._wait()
            if self._due() and self._look():
                return self.buffer.popleft()
            return None
        except psycopg.OperationalError as exc:
            raise BrokerUnavailableError(str(exc)) from exc

    def _due(self) -> bool:
        """Whether the table may hold a job for us now: a notification since
        the last look, the poll or a delayed job's due time reached."""
        now = time.monotonic()
        return (self.listener.generation(self.queue_name) != self.seen
                or now >= self.next_look
                # The listener lost the queue since the look was planned: poll.
                or (now - self.looked_at >= self.broker.poll_interval
                    and not self.listener.hears(self.queue_name)))

    def _look(self) -> bool:
        """Claim what there is room for; plan the next look. True if it claimed."""
        with self.held_lock:
            room = self.prefetch - len(self.held)
        reserved = self.book.reserve(room) if room > 0 else 0
        if reserved <= 0:
            return False  # no room: _wait waits for some, then the look is still due
        # Read before the claim: a notification landing after this read (even
        # before the wait begins) makes the next look due at once.
        self.seen = self.listener.generation(self.queue_name)
        self.looked_at = time.monotonic()
        claims: list[Claim] = []
        try:
            self.claims += 1
            sent_at = time.monotonic()
            rows = self.broker._run(jobs_sql.CLAIM, {
                "lease": self.broker.job_lease, "queue": self.queue_name, "limit": reserved,
            })
            rows.sort(key=lambda row: row[0])
            for job_id, lease_token, data, attempts in rows:
                message: Message = decode_message(data)
                claims.append(Claim(job_id, lease_token, sent_at))
                with self.held_lock:
                    self.held[job_id] = lease_token
                self.buffer.append(PostgresMessageProxy(message, job_id, lease_token, attempts))
        finally:
            self.book.settle(reserved, claims)
        if len(claims) >= reserved:
            self.next_look = 0.0  # the claim was cut short by room: there may be more
        else:
            self._plan_next_look()
        return bool(claims)

    def _plan_next_look(self) -> None:
        """After a claim that emptied the queue's due jobs: look again at the
        next delayed job's due time, or after the poll interval (the long one
        while the listener hears this queue)."""
        hears = self.listener.hears(self.queue_name)
        poll = self.broker.idle_poll_interval if hears else self.broker.poll_interval
        rows = self.broker._run(jobs_sql.NEXT_ETA, (self.queue_name,))
        if rows and rows[0][0] is not None:
            poll = max(0.0, min(poll, float(rows[0][0])))
        self.next_look = time.monotonic() + poll

    def _wait(self) -> None:
        """Wait for work, at most the consumer's timeout (so dramatiq can stop
        or pause it) and never past the next renewal: room in the claim book
        when there is none, else a notification of this queue or the next look."""
        wait = min(self.timeout, self._until_renewal())
        with self.held_lock:
            full = len(self.held) >= self.prefetch
        if full or not self.book.has_room():
            # Nothing can be claimed until a job is released, and releases send
            # no NOTIFY: wait for the release itself. The look that follows
            # sees every row announced meanwhile (its generation moved).
            self.book.wait_for_room(wait, also=lambda: len(self.held) < self.prefetch)
            return
        wait = min(wait, self.next_look - time.monotonic())
        if not self.listener.hears(self.queue_name):
            wait = min(wait, self.looked_at + self.broker.poll_interval - time.monotonic())
        if wait <= 0:
            return
        if self.listener.wait(self.queue_name, self.seen, wait):
            self.wakeups += 1

    def _until_renewal(self) -> float:
        with self.held_lock:
            holding = bool(self.held)
        if not holding:
            return float("inf")
        return max(0.0, self.last_renewal + self.broker.job_lease / 3 - time.monotonic())

    def _renew_if_due(self) -> None:
        now = time.monotonic()
        if now - self.last_renewal < self.broker.job_lease / 3:
            return
        self.last_renewal = now
        with self.held_lock:
            held = dict(self.held)
        # Only started jobs: a claim no thread has reached lapses (queue/claims.py).
        started = self.book.started(list(held))
        if started:
            self.broker._run(jobs_sql.RENEW, (self.broker.job_lease, started,
                                              [held[job_id] for job_id in started]))

    def _release(self, message: MessageProxy) -> tuple[int, uuid.UUID] | None:
        if not isinstance(message, PostgresMessageProxy):
            return None
        with self.held_lock:
            self.held.pop(message.job_id, None)
        self.book.release(message.job_id)
        return message.job_id, message.lease_token

    def ack(self, message: MessageProxy) -> None:
        lapsed = isinstance(message, PostgresMessageProxy) and self.book.lapsed(message.job_id)
        key = self._release(message)
        if key and lapsed:
            # Never run here (ClaimLapsedError): back to its queue unless another
            # holder has it already (the requeue is fenced on our lease token).
            self._requeue(key)
        # An actor that marked its job done in its own committed transaction
        # leaves nothing to acknowledge (the statement would match no row).
        elif key and not getattr(message, "done_in_transaction", False):
            self.broker._run(jobs_sql.MARK_DONE, key)

    def nack(self, message: MessageProxy) -> None:
        key = self._release(message)
        if key:
            error = (message.options.get("traceback")
                     or str(getattr(message, "_exception", "")) or None)
            self.broker._run(jobs_sql.NACK, (error, *key))

    def _requeue(self, key: tuple[int, uuid.UUID]) -> None:
        """Hand a claimed job back, and wake the consumers of its queue (which
        poll rarely while they LISTEN)."""
        try:
            if self.broker._run(jobs_sql.REQUEUE_AND_NOTIFY, {
                    "id": key[0], "lease_token": key[1],
                    "channel": jobs_sql.CHANNEL_PREFIX + self.queue_name}):
                logger.info("job %s on %s handed back to its queue", key[0], self.queue_name)
        except Exception:  # the lease will expire and redeliver it anyway
            logger.warning("could not requeue job %s; its lease will expire", key[0])

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        for message in [*messages, *self.buffer]:
            key = self._release(message)
            if key:
                self._requeue(key)
        self.buffer.clear()

    def close(self) -> None:
        try:
            self.requeue([])
        finally:
            if self._subscribed:
                self._subscribed = False
                self.listener.unsubscribe(self.queue_name)
