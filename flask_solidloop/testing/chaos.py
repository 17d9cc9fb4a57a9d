"""A chaos fixture for users: run your own agent under random worker SIGKILLs, with
real dramatiq worker subprocesses, and check the durability contract.

:func:`run_user_chaos` starts ``workers`` independent worker fleets of your app
(``FLASK_APP=app_import``), calls ``start_loops()`` (in your test, inside your
app context) to start the loops, SIGKILLs a random fleet every
``kill_min``..``kill_max`` seconds and starts a replacement, waits for every
loop to end and then for the host's own jobs (those on queues other than
``solidloop_*`` enqueued during the run: a tool's ``session=`` enqueue, a job
``start_loops`` sent) to be done, so the workers are stopped only when nothing
of the run is left to do, then checks (:func:`verify_contract`):

* every loop completed;
* every tool call is answered by exactly one tool message;
* no ``processing`` shell is left, and no failed shell is visible;
* no job of those loops is left queued, running or dead-lettered.

The wait follows progress, not the clock: it fails only when nothing (a loop
finishing, an answer, an assistant turn, a host job ending) has happened for
``stall_seconds``,
so a loaded machine is slower, never red. Recovery after a kill takes one
liveness TTL: with ``app.config.from_prefixed_env()`` in your factory, the
``FLASK_SOLIDLOOP_*`` variables set here shorten it to ``liveness_ttl``.

Our own chaos suite (tests/support/chaos.py) is built on the same :class:`Fleet`,
:func:`progress_marker`, :class:`ProgressWatch` and :func:`verify_contract`,
which it extends with what its harness knows (tool side effects, turn counts).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from ..urls import libpq_url


class Fleet:
    """``size`` independent dramatiq masters (each its own process group), each
    killable on its own."""

    def __init__(self, size: int, *, threads: int, env: dict[str, str], log_dir: Path,
                 cwd: str | Path | None = None) -> None:
        self.size = size
        self.threads = threads
        self.env = env
        self.log_dir = Path(log_dir)
        self.cwd = cwd
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.started = 0

    def start(self, index: int) -> None:
        log = open(self.log_dir / f"worker-{index}-{self.started}.log", "wb")  # noqa: SIM115
        self.started += 1
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "1",
             "--threads", str(self.threads)],
            cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_all(self) -> None:
        for index in range(self.size):
            self.start(index)

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for index, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill(index)


_PROGRESS = """
SELECT (SELECT count(*) FROM solidloop_loops WHERE id = ANY(%(ids)s)
          AND status IN ('completed', 'failed')),
       (SELECT count(*) FROM solidloop_messages WHERE loop_id = ANY(%(ids)s)
          AND status = 'completed' AND role IN ('assistant', 'tool')),
       (SELECT count(*) FROM solidloop_tool_calls WHERE loop_id = ANY(%(ids)s)
          AND executed_at IS NOT NULL)
"""


def progress_marker(conn: psycopg.Connection, loop_ids: Sequence[int]) -> tuple[int, ...]:
    """(loops finished, completed assistant/tool messages, executed tool calls):
    any change means the fleet is getting somewhere."""
    row = conn.execute(_PROGRESS, {"ids": list(loop_ids)}).fetchone()
    return tuple(row) if row else (0, 0, 0)


class ProgressWatch:
    """A deadline that moves with progress: stalled only after ``stall_seconds``
    with the same marker."""

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self.marker: Any = None
        self.since = time.monotonic()

    def update(self, marker: Any) -> None:
        if marker != self.marker:
            self.marker = marker
            self.since = time.monotonic()

    @property
    def stalled(self) -> bool:
        return time.monotonic() - self.since > self.stall_seconds

    @property
    def silent_for(self) -> float:
        return time.monotonic() - self.since


# Host jobs of the run: on the host's queues, written after the run began. A job
# is left to do while it runs or is due; one scheduled for later is not waited for.
_HOST_JOBS = """
SELECT count(*) FILTER (WHERE state = 'running' OR (state = 'queued' AND eta <= now())),
       count(*) FILTER (WHERE state IN ('done', 'dead'))
  FROM solidloop_jobs WHERE id > %(after)s AND queue_name NOT LIKE 'solidloop\\_%%'
"""
_HOST_JOB_STATES = """
SELECT state, count(*) FROM solidloop_jobs
 WHERE id > %(after)s AND queue_name NOT LIKE 'solidloop\\_%%' GROUP BY 1
"""


def last_job_id(conn: psycopg.Connection) -> int:
    """The newest job row's id: the run's host jobs are those written after it."""
    row = conn.execute("SELECT coalesce(max(id), 0) FROM solidloop_jobs").fetchone()
    return int(row[0]) if row else 0


def host_jobs_marker(conn: psycopg.Connection, after: int) -> tuple[int, int]:
    """(host jobs left to do, host jobs ended) among those written after job ``after``."""
    row = conn.execute(_HOST_JOBS, {"after": after}).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def verify_contract(database_url: str, loop_ids: Sequence[int]) -> list[str]:
    """What the durability contract forbids, found among ``loop_ids`` (empty: kept)."""
    problems: list[str] = []
    ids = list(loop_ids)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as pg:
        statuses: dict[str, int] = dict(pg.execute(
            "SELECT status, count(*) FROM solidloop_loops WHERE id = ANY(%s) GROUP BY 1",
            (ids,)).fetchall())
        if statuses.get("completed", 0) != len(ids):
            stuck = pg.execute("SELECT id, status, error_message FROM solidloop_loops "
                               "WHERE id = ANY(%s) AND status <> 'completed' LIMIT 5",
                               (ids,)).fetchall()
            problems.append(f"not every loop completed: {statuses}; e.g. {stuck}")
        unanswered = pg.execute(
            "SELECT t.id FROM solidloop_tool_calls t LEFT JOIN solidloop_messages m "
            "ON m.id = t.response_message_id AND m.tool_call_id = t.id "
            "WHERE t.loop_id = ANY(%s) AND m.id IS NULL", (ids,)).fetchall()
        if unanswered:
            problems.append(f"tool calls without their one tool message: {unanswered[:10]}")
        doubled = pg.execute(
            "SELECT tool_call_id, count(*) FROM solidloop_messages WHERE loop_id = ANY(%s) "
            "AND role = 'tool' GROUP BY 1 HAVING count(*) > 1", (ids,)).fetchall()
        if doubled:
            problems.append(f"tool calls answered more than once: {doubled[:10]}")
        shells = pg.execute("SELECT id, loop_id FROM solidloop_messages "
                            "WHERE status = 'processing' AND loop_id = ANY(%s)", (ids,)).fetchall()
        if shells:
            problems.append(f"processing shells left: {shells[:10]}")
        visible_failed = pg.execute(
            "SELECT id FROM solidloop_messages WHERE status = 'failed' AND NOT is_hidden "
            "AND loop_id = ANY(%s)", (ids,)).fetchall()
        if visible_failed:
            problems.append(f"failed shells visible in history: {visible_failed[:10]}")
        jobs: dict[str, int] = dict(pg.execute("SELECT state, count(*) FROM solidloop_jobs "
                               "WHERE loop_id = ANY(%s) GROUP BY 1", (ids,)).fetchall())
        if jobs.get("queued") or jobs.get("running"):
            problems.append(f"jobs left live after every loop finished: {jobs}")
        if jobs.get("dead"):
            problems.append(f"{jobs['dead']} job(s) of these loops dead-lettered")
    return problems


@dataclass
class ChaosReport:
    """What a chaos run did. ``problems`` is empty when the contract held."""

    loops: list[int] = field(default_factory=list)
    kills: int = 0
    wall_time: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    #: States of the host's jobs written during the run (``done``, ``dead``, ...).
    host_jobs: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def chaos_env(app_import: str, database_url: str, *, liveness_ttl: float,
              extra: dict[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: the app, and short leases for
    ``app.config.from_prefixed_env()`` factories."""
    env = dict(os.environ)
    env["FLASK_APP"] = app_import
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    for key, value in {"SOLIDLOOP_LIVENESS_TTL": liveness_ttl,
                       "SOLIDLOOP_REAPER_INTERVAL": 0.5, "SOLIDLOOP_LEASE_MARGIN": 1,
                       "SOLIDLOOP_QUEUED_REAP_THRESHOLD": 4}.items():
        env.setdefault(f"FLASK_{key}", json.dumps(value))
    env.update(extra or {})
    return env


def run_user_chaos(app_import: str, start_loops: Callable[[], Sequence[int]], *,
                   database_url: str, log_dir: Path, workers: int = 2, threads: int = 4,
                   kill_min: float = 1.0, kill_max: float = 3.0, min_kills: int = 1,
                   stall_seconds: float = 60.0, liveness_ttl: float = 3.0,
                   seed: int | None = None, env: dict[str, str] | None = None) -> ChaosReport:
    """Run the loops ``start_loops()`` returns under random worker kills; raise
    AssertionError listing every broken promise, or return the report."""
    rng = random.Random(seed)
    report = ChaosReport()
    fleet = Fleet(workers, threads=threads, log_dir=log_dir,
                  env=chaos_env(app_import, database_url, liveness_ttl=liveness_ttl,
                                extra=env))
    stop = threading.Event()

    def killer() -> None:
        # At least min_kills, however quickly the loops finish.
        while not stop.wait(rng.uniform(kill_min, kill_max)):
            index = rng.randrange(workers)
            fleet.kill(index)
            report.kills += 1
            fleet.start(index)

    started = time.monotonic()
    watch = ProgressWatch(stall_seconds)
    thread = threading.Thread(target=killer, daemon=True, name="solidloop-chaos-killer")
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        before = last_job_id(conn)
    try:
        fleet.start_all()
        report.loops = list(start_loops())
        thread.start()
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            while True:
                marker = progress_marker(conn, report.loops)
                watch.update(marker)
                if marker[0] == len(report.loops) and report.kills >= min_kills:
                    break
                if watch.stalled:
                    report.problems.append(
                        f"no progress for {watch.silent_for:.0f}s ({marker[0]}/"
                        f"{len(report.loops)} loops finished); worker logs in {log_dir}")
                    break
                time.sleep(0.3)
            # The loops are done; the host jobs they (or start_loops) enqueued may
            # not be. Stopping the workers now would leave them queued.
            while not report.problems:
                left, ended = host_jobs_marker(conn, before)
                watch.update((marker, ended))
                if not left:
                    break
                if watch.stalled:
                    report.problems.append(
                        f"no host job ended for {watch.silent_for:.0f}s ({left} still queued "
                        f"or running); worker logs in {log_dir}")
                    break
                time.sleep(0.3)
    finally:
        stop.set()
        thread.join(timeout=30)
        fleet.stop_all()
    report.wall_time = time.monotonic() - started
    report.problems.extend(verify_contract(database_url, report.loops))
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        report.statuses.update(dict(conn.execute(
            "SELECT status, count(*) FROM solidloop_loops WHERE id = ANY(%s) GROUP BY 1",
            (report.loops,)).fetchall()))
        report.host_jobs.update(dict(conn.execute(_HOST_JOB_STATES, {"after": before})
                                     .fetchall()))
    assert not report.problems, "durability contract broken:\n  " + "\n  ".join(report.problems)
    return report
