"""The worker registry: each dramatiq worker process keeps one heartbeat row.

At boot a process registers ``host:pid`` (the value its leases carry in
``lease_holder``), its queues and thread count in ``solidloop_workers``; one
daemon thread then refreshes ``last_seen_at`` every
``SOLIDLOOP_WORKER_HEARTBEAT`` seconds, one short statement through the
broker's pool (never a pool slot a job needs, and no connection held between
beats; a registry started outside a worker uses a connection of its own),
and a clean shutdown stamps ``stopped_at``. A row whose heartbeat went
silent names a worker that died. Every :data:`PRUNE_EVERY` beats the same
thread deletes rows gone longer than ``SOLIDLOOP_WORKER_RETENTION``, so the
table stays small with no janitor configured. Every statement is in
queue/sql.py; :func:`list_workers` is the read that ``flask solidloop
workers``, ``status`` and the admin share, and
:func:`live_queues` the one that ``flask solidloop jobs`` and the enqueue-time
warning about unconsumed queues share (queue/middleware/queue_consumers.py).

Staleness is measured on the database clock (``now()``), never a worker's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dramatiq
import psycopg
from psycopg.types.json import Jsonb

from ...errors import BrokerUnavailableError
from ...leases import worker_identity
from .. import sql

logger = logging.getLogger("flask_solidloop.workers")

#: A worker that missed this many heartbeats in a row is reported lost.
MISSED_BEATS = 3
#: Heartbeats between two prunes of long-gone rows (and at the first beat).
PRUNE_EVERY = 30


class WorkerRegistryMiddleware(dramatiq.Middleware):
    """Registers this worker process at boot and keeps its row fresh until shutdown."""

    def __init__(self, conninfo: str, *, interval: float, retention: float) -> None:
        self.conninfo = conninfo
        self.interval = float(interval)
        self.retention = float(retention)
        self.identity: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        self._row: dict[str, Any] = {}
        self._run_statement: Any = None
        #: Heartbeats written by this process (tests and the admin read it).
        self.beats = 0

    # -- dramatiq hooks -------------------------------------------------------------

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        run = getattr(broker, "_run", None)
        if callable(run):
            self._run_statement = run
        declared = worker.consumer_whitelist or broker.get_declared_queues()
        queues = sorted(q for q in declared if not q.endswith((".DQ", ".XQ")))
        self.start(queues=queues, threads=int(getattr(worker, "worker_threads", 0)))

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        self.stop()

    # -- the heartbeat ----------------------------------------------------------------

    def start(self, *, queues: list[str], threads: int) -> None:
        # Computed here, not in __init__: the broker is built before dramatiq forks.
        self.identity = worker_identity()
        self._row = {"identity": self.identity, "host": socket.gethostname(),
                     "pid": os.getpid(), "queues": Jsonb(queues), "threads": threads}
        try:
            self._execute(sql.WORKER_REGISTER, self._row)
        except (psycopg.Error, BrokerUnavailableError):
            logger.exception("worker registry: could not register %s; retrying with "
                             "the next heartbeat", self.identity)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="solidloop-worker-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        if self.identity is not None:
            with contextlib.suppress(psycopg.Error, BrokerUnavailableError):
                self._execute(sql.WORKER_STOPPED, {"identity": self.identity})
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except (psycopg.Error, BrokerUnavailableError) as exc:
                logger.warning("worker registry: heartbeat of %s failed (%s); retrying in "
                               "%.0fs", self.identity, " ".join(str(exc).split()),
                               self.interval)
                conn, self._conn = self._conn, None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    def beat(self) -> None:
        """One heartbeat (re-registering if the row was pruned), and now and
        then the prune."""
        if not self._execute(sql.WORKER_HEARTBEAT, {"identity": self.identity}):
            self._execute(sql.WORKER_REGISTER, self._row)
        if self.beats % PRUNE_EVERY == 0:
            self._execute(sql.WORKER_PRUNE, {"age": self.retention})
        self.beats += 1

    def _execute(self, statement: str, params: dict[str, Any]) -> int:
        """Run ``statement``; how many rows it returned or changed."""
        if self._run_statement is not None:
            return len(self._run_statement(statement, params))
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                         application_name="solidloop-worker-registry")
        return self._conn.execute(statement, params).rowcount


@dataclass(frozen=True)
class WorkerRow:
    """A registered worker process and what it holds now."""

    identity: str
    host: str
    pid: int
    queues: list[str]
    threads: int
    started_at: datetime
    last_seen_at: datetime
    stopped_at: datetime | None
    silent_for: float
    loops: list[int]
    tool_calls: list[int]

    def state(self, interval: float) -> str:
        """``live``, ``stopped`` (a clean shutdown) or ``lost`` (its heartbeat went silent)."""
        if self.stopped_at is not None:
            return "stopped"
        return "live" if self.silent_for <= interval * MISSED_BEATS else "lost"


def list_workers(connection: Any, *, recent: float, identities: list[str] | None = None
                 ) -> list[WorkerRow]:
    """Workers live or gone within ``recent`` seconds (or exactly ``identities``).

    ``connection``: a psycopg connection, or a SQLAlchemy session's DBAPI one.
    """
    cursor = connection.cursor()
    try:
        cursor.execute(sql.WORKER_LIST, {"recent": recent, "identities": identities or []})
        return [WorkerRow(*row) for row in cursor.fetchall()]
    finally:
        cursor.close()


def live_queues(connection: Any, *, interval: float) -> set[str]:
    """Every queue some live worker consumes (live: not stopped, and heard from
    within ``MISSED_BEATS`` heartbeats of ``interval`` seconds).

    ``connection``: a psycopg connection, or a SQLAlchemy session's DBAPI one.
    """
    cursor = connection.cursor()
    try:
        cursor.execute(sql.WORKER_LIVE_QUEUES, {"silent": interval * MISSED_BEATS})
        return {row[0] for row in cursor.fetchall()}
    finally:
        cursor.close()
