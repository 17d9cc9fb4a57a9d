"""Run a maintenance task every few seconds inside each worker process, one
pass at a time across every process of every machine.

Each worker process runs one thread per task. Before a pass the thread takes
a PostgreSQL advisory lock (``pg_try_advisory_lock``) on a connection of its
own; a process that does not get it skips the pass, so however many workers
run, one pass runs at a time, and a killed process's lock dies with its
connection. This is how recovery works with nothing but workers running:
the reaper needs no separate process (``flask solidloop reap`` stays for hosts
that want it elsewhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import dramatiq
import psycopg

logger = logging.getLogger("flask_solidloop.periodic")


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for task ``name``."""
    digest = hashlib.sha256(f"solidloop:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PeriodicTaskMiddleware(dramatiq.Middleware):
    """Runs ``task()`` every ``interval`` seconds in each worker process, under a
    cluster-wide advisory lock. Started at worker boot, stopped at shutdown."""

    def __init__(self, name: str, interval: float, task: Callable[[], Any], *,
                 conninfo: str) -> None:
        self.name = name
        self.interval = float(interval)
        self.task = task
        self.conninfo = conninfo
        self.key = lock_key(name)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        #: Passes this process ran (it held the lock) and skipped (another did).
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
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception:
                logger.exception("%s: pass failed; trying again in %.1fs", self.name,
                                 self.interval)
                self._close()

    def run_once(self) -> bool:
        """One pass if this process gets the lock. True when it ran the task."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                         application_name=f"solidloop-{self.name}")
        conn = self._conn
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
        if not row or not row[0]:
            self.skipped += 1
            return False
        try:
            self.task()
            self.passes += 1
            return True
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))


# A class per task, because every worker runs both and dramatiq warns ("a
# middleware of the same type twice") when two middlewares share a class.


class ReaperTaskMiddleware(PeriodicTaskMiddleware):
    """The in-worker reaper's periodic thread."""


class JanitorTaskMiddleware(PeriodicTaskMiddleware):
    """The in-worker janitor's periodic thread."""
