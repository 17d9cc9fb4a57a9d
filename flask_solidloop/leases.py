"""The lease renewer: one thread and one connection per process for every lease.

This module owns lease *renewal* only: it extends ``lease_expires_at`` and
``leased_until`` of leases a turn already holds, and never changes a loop's
status, token or anything else (loops/store/ owns every state change; the
layering test checks that these are the only columns written here). It sits
low in the layer order so the queue's worker middleware can start and stop it.

Every lease is a liveness lease (decision 0012): an LLM turn's
(``solidloop_loops.lease_expires_at``) and a running tool call's
(``solidloop_tool_calls.leased_until``) are ``SOLIDLOOP_LIVENESS_TTL`` long
whatever the work, not derived from a timeout. A live process keeps its work
however long the work takes, because each in-flight turn and tool call
registers here and one background thread re-stamps every registered lease
about every quarter of the smallest one (never more often than once a second),
on a connection of its own. A dead or frozen process stops renewing, so its
work is taken over by the reaper one TTL after the last renewal; a healthy
slow tool is never reclaimed and run a second time. How long the work may take
is a separate limit (the read timeout, a tool's timeout, ``max_duration``),
enforced on the work itself and, as the leak ceiling below, on the
registration.

Why one connection for everything (and not one per turn): at full worker
occupancy each worker thread holds a pooled connection; per-turn heartbeats
that each need a connection would starve, read the starvation as a lost lease,
yield healthy turns, and livelock. Here renewal costs one connection per
process whatever the concurrency, so the pool is sized threads + 1.

Ownership rules:

* a renewal is ``UPDATE ... WHERE id AND status='running' AND execution_token``
  and ``lease_expires_at IS NOT NULL``: it never revives a lease that was
  cleared on purpose (the tool phase, a finished turn);
* a renewal that touches no row marks the registration *lost* only when the
  loop is no longer this generation's; a lease cleared by our own commit is not
  a loss;
* a broken connection is replaced and the renewal retried at once, so one
  blip (a killed backend, a restarted pooler) loses nothing; if the retry
  fails too (the database is away), a registration is marked lost once its
  lease may have lapsed: its last renewal (stamped before the statement was
  sent) is older than the lease, less a second. Until then the lease is
  still valid in the database and the turn goes on (its writes are fenced
  whatever this flag says); after, a dead renewer never lets a dead lease
  look alive. The turns see the flag before their next canonical write and
  yield; the reaper heals the loops;
* a registration older than its ceiling is dropped (a leak ceiling that does
  not depend on the turn's ``finally``): the agent's max_duration for an LLM
  turn, the tool's limit (its timeout, at most max_duration) for a tool call,
  plus lease_leak_grace either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .errors import LostLeaseError
from .telemetry import metrics

logger = logging.getLogger("flask_solidloop.renewer")

MIN_INTERVAL = 1.0
#: Seconds a lease is taken to lapse early, when renewals fail: the claim that
#: set it committed a moment before the registration's first stamp.
LAPSE_SLACK = 1.0


def worker_identity() -> str:
    """``host:pid`` of this process: who holds a lease, for status and the admin.
    Computed per call, so a forked worker process names itself, not its parent."""
    return f"{socket.gethostname()}:{os.getpid()}"

#: Shown in pg_stat_activity, so an operator can find the renewer connections.
APPLICATION_NAME = "solidloop-lease-renewer"

_RENEW = """
UPDATE solidloop_loops AS l
   SET lease_expires_at = now() + make_interval(secs => r.lease)
  FROM unnest(%s::bigint[], %s::uuid[], %s::float8[]) AS r(id, token, lease)
 WHERE l.id = r.id AND l.execution_token = r.token AND l.status = 'running'
   AND l.lease_expires_at IS NOT NULL
RETURNING l.id, l.execution_token
"""
_STILL_OURS = """
SELECT l.id, l.execution_token FROM solidloop_loops AS l
  JOIN unnest(%s::bigint[], %s::uuid[]) AS r(id, token)
    ON l.id = r.id AND l.execution_token = r.token AND l.status = 'running'
"""

_RENEW_TOOL = """
UPDATE solidloop_tool_calls AS t
   SET leased_until = now() + make_interval(secs => r.lease)
  FROM unnest(%s::bigint[], %s::uuid[], %s::float8[]) AS r(id, token, lease)
 WHERE t.id = r.id AND t.lease_token = r.token AND t.executed_at IS NULL
RETURNING t.id, t.lease_token
"""
_STILL_OURS_TOOL = """
SELECT t.id, t.lease_token FROM solidloop_tool_calls AS t
  JOIN unnest(%s::bigint[], %s::uuid[]) AS r(id, token)
    ON t.id = r.id AND t.lease_token = r.token
"""
_SQL = {"loop": (_RENEW, _STILL_OURS), "tool": (_RENEW_TOOL, _STILL_OURS_TOOL)}
#: Of the tool calls whose lease went missing, those answered meanwhile: the
#: turn's own answer releases its lease, usually just before the turn lets go of
#: its registration. Not a takeover.
_ANSWERED_TOOLS = """
SELECT t.id FROM solidloop_tool_calls AS t
 WHERE t.id = ANY(%s::bigint[]) AND t.lease_token IS NULL AND t.response_message_id IS NOT NULL
"""

#: Of the loops whose lease went missing, those that left ``running`` for a
#: status only a turn's end or a host command gives (completed, failed, paused,
#: waiting): usually the turn's own end, committed just before it lets go of
#: its registration. Not a takeover (which leaves the loop running under a new
#: generation, or queued).
_ENDED_LOOPS = """
SELECT l.id FROM solidloop_loops AS l
 WHERE l.id = ANY(%s::bigint[]) AND l.status NOT IN ('running', 'queued')
"""


@dataclass
class Registration:
    """One lease being kept alive: a loop's LLM-turn lease or a tool call's lease."""

    kind: str  # "loop" or "tool"
    row_id: int
    token: uuid.UUID
    lease_seconds: float
    ceiling_seconds: float
    registered_at: float = field(default_factory=time.monotonic)
    lost_event: threading.Event = field(default_factory=threading.Event)
    #: When the lease was last known good: stamped before a renewal is sent
    #: (the database's new expiry is no earlier than this plus the lease).
    renewed_at: float = field(default_factory=time.monotonic)

    def may_have_lapsed(self, now: float) -> bool:
        """Whether the lease may have expired in the database since its last
        renewal (a second of slack for the claim that set it first)."""
        return now - self.renewed_at >= self.lease_seconds - LAPSE_SLACK

    @property
    def key(self) -> tuple[str, int, uuid.UUID]:
        return (self.kind, self.row_id, self.token)

    @property
    def loop_id(self) -> int:
        return self.row_id

    @property
    def execution_token(self) -> uuid.UUID:
        return self.token

    def lost(self) -> bool:
        return self.lost_event.is_set()


class LeaseRenewer:
    """Renews every registered LLM-turn lease from one thread and one connection."""

    def __init__(self, conninfo: str, *, connect: Any = None) -> None:
        self.conninfo = conninfo
        self._connect = connect or (lambda: psycopg.connect(
            conninfo, autocommit=True, connect_timeout=10, application_name=APPLICATION_NAME))
        self._registrations: dict[tuple[str, int, uuid.UUID], Registration] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        #: Monotonic time of the thread's next planned tick.
        self._next_tick = 0.0
        self.renewals = 0
        self.errors = 0

    # -- registrations ----------------------------------------------------------

    def register(self, loop_id: int, execution_token: uuid.UUID, *, lease_seconds: float,
                 ceiling_seconds: float) -> Registration:
        """Keep an LLM turn's loop lease alive."""
        return self._add(Registration("loop", loop_id, execution_token, float(lease_seconds),
                                      float(ceiling_seconds)))

    def register_tool(self, tool_call_id: int, lease_token: uuid.UUID, *, lease_seconds: float,
                      ceiling_seconds: float) -> Registration:
        """Keep a running tool call's lease alive, so a healthy slow tool is never
        reclaimed (and run twice) while a dead worker's still is."""
        return self._add(Registration("tool", tool_call_id, lease_token, float(lease_seconds),
                                      float(ceiling_seconds)))

    def _add(self, registration: Registration) -> Registration:
        with self._lock:
            self._registrations[registration.key] = registration
            # The claim has just stamped this lease: the planned tick is soon
            # enough unless it falls later than a quarter of the new lease (a
            # thread sleeping out a longer interval computed for bigger leases).
            # Waking for nothing would re-renew a fresh lease every turn.
            due = time.monotonic() + max(MIN_INTERVAL, registration.lease_seconds / 4)
            wake = self._next_tick > due
        self.start()
        if wake:
            self._wake.set()
        return registration

    def deregister(self, registration: Registration) -> None:
        with self._lock:
            self._registrations.pop(registration.key, None)

    def is_registered(self, registration: Registration) -> bool:
        with self._lock:
            return registration.key in self._registrations

    def interval(self) -> float:
        """About a quarter of the smallest registered lease, never under a second."""
        with self._lock:
            leases = [r.lease_seconds for r in self._registrations.values()]
        return max(MIN_INTERVAL, min(leases) / 4) if leases else MIN_INTERVAL

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="solidloop-lease-renewer",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, join it and close its connection. Idempotent."""
        self._stopping.set()
        self._wake.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        self._close()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            interval = self.interval()
            with self._lock:
                self._next_tick = time.monotonic() + interval
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self.renew_once()
            except Exception:
                logger.exception("lease renewer tick failed")

    # -- renewal ------------------------------------------------------------------

    def renew_once(self) -> None:
        """One pass: drop leaked registrations, renew the rest, flag the lost."""
        now = time.monotonic()
        with self._lock:
            leaked = [r for r in self._registrations.values()
                      if now - r.registered_at > r.ceiling_seconds]
            for registration in leaked:
                del self._registrations[registration.key]
            live = [r for r in self._registrations.values() if not r.lost()]
        for registration in leaked:
            logger.warning(
                "lease renewer dropped %s %s: registered for longer than its ceiling (%.0fs: "
                "max_duration for a turn, the tool timeout for a tool call, + lease_leak_grace); "
                "its lease will lapse and the reaper will recover it",
                registration.kind, registration.row_id, registration.ceiling_seconds,
            )
        if not live:
            self._close()  # an idle connection only invites idle timeouts and NAT drops
            return
        try:
            try:
                self._renew(live, now)
            except psycopg.OperationalError as exc:
                # One blip (a restarted pooler, a killed backend) must not discard
                # every turn in flight: reconnect and try once more right away.
                logger.warning("lease renewer: connection failed (%s); reconnecting", exc)
                self._close()
                self._renew(live, time.monotonic())
            self.renewals += 1
        except Exception as exc:
            self.errors += 1
            self._close()
            now = time.monotonic()
            lapsed = [r for r in live if r.may_have_lapsed(now)]
            logger.error("lease renewer: renewal failed (%s); %d lease(s) may have lapsed and "
                         "are marked lost, %d kept for the next try", exc, len(lapsed),
                         len(live) - len(lapsed))
            for registration in lapsed:
                registration.lost_event.set()
                metrics.lease_lost(registration.kind, "renewal_failed")

    def _renew(self, live: list[Registration], sent_at: float) -> None:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        conn = self._conn
        for kind, (renew_sql, still_ours_sql) in _SQL.items():
            batch = [r for r in live if r.kind == kind]
            if not batch:
                continue
            renewed = {(kind, row[0], row[1]) for row in conn.execute(
                renew_sql, ([r.row_id for r in batch], [r.token for r in batch],
                            [r.lease_seconds for r in batch])).fetchall()}
            for registration in batch:
                if registration.key in renewed:
                    registration.renewed_at = sent_at
            missing = [r for r in batch if r.key not in renewed]
            if not missing:
                continue
            still_ours = {(kind, row[0], row[1]) for row in conn.execute(
                still_ours_sql, ([r.row_id for r in missing],
                                 [r.token for r in missing])).fetchall()}
            gone = [r for r in missing if r.key not in still_ours]
            ended: set[int] = set()
            if gone:
                ended = {row[0] for row in conn.execute(
                    _ANSWERED_TOOLS if kind == "tool" else _ENDED_LOOPS,
                    ([r.row_id for r in gone],)).fetchall()}
            for registration in gone:
                # Still ours but not renewed: our own commit ended the lease on
                # purpose (tool phase, checkpoint). Anything else: it moved on.
                registration.lost_event.set()
                if registration.row_id in ended:
                    logger.debug("%s %s: %s; its lease has ended", kind, registration.row_id,
                                 "answered" if kind == "tool" else "its turn ended")
                else:
                    metrics.lease_lost(kind, "taken_over")
                    logger.info("%s %s: lease lost (taken over)", kind, registration.row_id)


class RenewerHandle:
    """What a turn holds: its registration, and a check before canonical writes."""

    def __init__(self, renewer: LeaseRenewer | None, registration: Registration | None) -> None:
        self.renewer = renewer
        self.registration = registration

    def lost(self) -> bool:
        return self.registration is not None and self.registration.lost()

    def check(self) -> None:
        registration = self.registration
        if registration is not None and registration.lost():
            raise LostLeaseError(
                f"loop {registration.loop_id}: the lease renewer lost this turn's lease"
            )

    def release(self) -> None:
        if self.renewer is not None and self.registration is not None:
            self.renewer.deregister(self.registration)
        self.registration = None


class RenewerSlot:
    """This process's renewer, created on first use and shared by every thread."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self._renewer: LeaseRenewer | None = None
        self._lock = threading.Lock()

    def get(self) -> LeaseRenewer:
        with self._lock:
            if self._renewer is None:
                self._renewer = LeaseRenewer(self.conninfo)
            return self._renewer

    def stop(self) -> None:
        """Stop and forget the renewer (the next get() starts a new one)."""
        with self._lock:
            renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()
