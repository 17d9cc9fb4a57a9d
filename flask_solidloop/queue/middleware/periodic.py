"""Run a maintenance task every few seconds inside the worker fleet: one leader
runs every pass, the other processes stand by (docs/decisions/0029-fleet.md).

Each worker process runs one thread per task. The thread of the *leader*
renews the task's row in ``solidloop_leaders`` (one UPDATE, matched only for
its holder) and runs a pass, every ``interval`` seconds. The other processes'
threads check the row every ``follow_interval`` seconds (a third of the
leadership's lifetime, at least ``interval``) with the same UPDATE, which
matches nothing while the leadership is alive: no write, no row lock, no
connection held between checks. A leader that dies or freezes stops renewing;
one ``ttl`` (three intervals, at least 10 s) later the first follower to check
takes over. A clean shutdown hands the leadership over at once.

So however many worker processes run, the fleet runs one pass per interval,
and each process's standby cost is one short statement now and then. Two
passes may still overlap for a moment (a leader frozen mid-pass thaws after
its successor took over): every pass is idempotent and safe concurrently
(the reaper's cases select with ``SKIP LOCKED`` and write compare-and-set),
which the leadership only makes rare. This is how recovery works with
nothing but workers running: the reaper needs no separate process (``flask
solidloop reap`` stays for hosts that want it elsewhere).

Statements go through the broker's pool in worker processes (``broker=``),
or through a connection of the thread's own (``conninfo=``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dramatiq
import psycopg

from ...errors import SetupError
from ...leases import worker_identity
from .. import sql

if TYPE_CHECKING:
    from ..broker import PostgresBroker

logger = logging.getLogger("flask_solidloop.periodic")

#: The shortest leadership: a leader silent this long (or three intervals) is replaced.
MIN_TTL = 10.0


class PeriodicTaskMiddleware(dramatiq.Middleware):
    """Runs ``task()`` every ``interval`` seconds in the fleet's leading worker
    process for ``name``. Started at worker boot, stopped at shutdown."""

    def __init__(self, name: str, interval: float, task: Callable[[], Any], *,
                 conninfo: str | None = None, broker: PostgresBroker | None = None,
                 ttl: float | None = None) -> None:
        if conninfo is None and broker is None:
            raise SetupError(f"periodic task {name!r}: pass conninfo= (its own connection) "
                             "or broker= (the broker's pool)")
        self.name = name
        self.interval = float(interval)
        #: Seconds a leadership lasts without renewal.
        self.ttl = float(ttl) if ttl is not None else max(MIN_TTL, 3 * self.interval)
        #: Seconds between a follower's checks.
        self.follow_interval = max(self.interval, self.ttl / 3)
        self.task = task
        self.conninfo = conninfo
        self.broker = broker
        self.holder = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        #: Whether this thread led at its last check.
        self.leading = False
        #: Passes this process ran (it led) and checks that found another leader.
        self.passes = 0
        self.skipped = 0

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        self.start()

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"solidloop-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and hand the leadership over. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        if self.leading:
            self.leading = False
            with contextlib.suppress(Exception):
                self._execute(sql.LEADER_RELEASE, {"name": self.name, "holder": self.holder})
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _run(self) -> None:
        # A random first wait, so a fleet started at once does not check in step.
        wait = self.interval * (0.5 + (uuid.uuid4().int % 1000) / 2000)
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                self.run_once()
            except Exception:
                logger.exception("%s: pass failed; trying again in %.1fs", self.name,
                                 self.interval)
                self._close()
            period = self.interval if self.leading else self.follow_interval
            wait = max(0.0, period - (time.monotonic() - started)) if self.leading else period

    def run_once(self) -> bool:
        """Take or keep the leadership, and run one pass if it is ours. True
        when this process ran the task."""
        if not self.holder:
            # Per process and per thread object: a fork, or two instances in one
            # process (tests), are different holders.
            self.holder = f"{worker_identity()}:{uuid.uuid4().hex[:8]}"
        was_leading = self.leading
        self.leading = self._take()
        if not self.leading:
            if was_leading:
                logger.warning("%s: another worker process took over the leadership",
                               self.name)
            self.skipped += 1
            return False
        if not was_leading:
            logger.info("%s: this worker process leads (%s), one pass every %.1fs",
                        self.name, self.holder, self.interval)
        self.task()
        self.passes += 1
        return True

    def _take(self) -> bool:
        return bool(self._execute(sql.LEADER_TAKE, {"name": self.name, "holder": self.holder,
                                                    "ttl": self.ttl}))

    def _execute(self, statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        if self.broker is not None:
            return self.broker._run(statement, params)
        if self._conn is None or self._conn.closed:
            assert self.conninfo is not None
            self._conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                         application_name=f"solidloop-{self.name}")
        cur = self._conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


# A class per task, because every worker runs both and dramatiq warns ("a
# middleware of the same type twice") when two middlewares share a class.


class ReaperTaskMiddleware(PeriodicTaskMiddleware):
    """The in-worker reaper's periodic thread."""


class JanitorTaskMiddleware(PeriodicTaskMiddleware):
    """The in-worker janitor's periodic thread."""


class RollupTaskMiddleware(PeriodicTaskMiddleware):
    """The in-worker charts' rollup's periodic thread."""
