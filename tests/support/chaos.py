"""The chaos harness: many loops, real worker processes, a killer, a reaper.

Used by tests/acceptance/test_chaos.py (the acceptance run) and bench/chaos.py (longer,
with knobs). Each loop makes ``turns`` LLM turns, each with ``tools_per_turn``
parallel calls of a tool whose side effect is written outside our transactions
(like any external system), then a final answer. While they run, a killer
SIGKILLs a random worker fleet member every ``kill_min``..``kill_max`` seconds
and starts a replacement, and a reaper heals whatever the kills left behind,
with short leases so recovery is quick.

At the end :func:`verify` checks the durability contract: every loop
completed; each tool call answered by exactly one tool message; no assistant
turn duplicated; no ``processing`` shell left; no job lost, stranded or
dead-lettered; every side effect carries its own call's idempotency key.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing.chaos import Fleet as SharedFleet
from flask_solidloop.testing.chaos import ProgressWatch, progress_marker, verify_contract

ROOT = Path(__file__).resolve().parents[2]
CHAOS_PROMPT = "You run chaos tools."


@dataclass
class ChaosSettings:
    loops: int = 50
    turns: int = 3
    tools_per_turn: int = 2
    workers: int = 3
    threads: int = 4
    kill_min: float = 1.0
    kill_max: float = 3.0
    llm_latency: float = 0.4
    read_timeout: float = 2.0
    lease_margin: int = 1
    #: Every lease's length: a killed worker's work is taken over this long after
    #: its last heartbeat.
    liveness_ttl: float = 3.0
    tool_timeout: int = 2
    job_lease: int = 4
    reap_every: float = 0.5
    #: The run fails when nothing progressed (a loop finished, a message or a tool
    #: result was written) for this long; a slow machine is never failed for being slow.
    stall_timeout: float = 90.0
    seed: int | None = None
    #: SIGKILL random workers (the chaos run) ...
    kill_workers: bool = True
    #: ... and/or restart PostgreSQL this many seconds in (the restart fault test).
    restart_postgres_after: float | None = None
    #: SIGSTOP a random worker every ``freeze_every`` (a range, seconds) for
    #: ``freeze_for`` (a range) and SIGCONT it: a frozen VM, a GC pause, a stall
    #: longer or shorter than the lease.
    freeze_every: tuple[float, float] | None = None
    freeze_for: tuple[float, float] = (5.0, 40.0)
    #: Restart PostgreSQL every this many seconds, the modes in turn (``restart``
    #: of run_chaos takes the mode).
    restart_every: float | None = None
    restart_modes: tuple[str, ...] = ("fast", "immediate")

    def app_config(self) -> dict[str, Any]:
        return {
            "SOLIDLOOP_LEASE_MARGIN": self.lease_margin,
            "SOLIDLOOP_LIVENESS_TTL": self.liveness_ttl,
            "SOLIDLOOP_DEFAULT_TOOL_TIMEOUT": self.tool_timeout,
            "SOLIDLOOP_JOB_LEASE": self.job_lease,
            "SOLIDLOOP_QUEUED_REAP_THRESHOLD": max(2, self.job_lease),
        }


@dataclass
class ChaosResult:
    loops: int = 0
    statuses: Counter = field(default_factory=Counter)
    llm_requests: int = 0
    assistant_turns: int = 0
    tool_calls: int = 0
    kills: int = 0
    freezes: int = 0
    recoveries: Counter = field(default_factory=Counter)
    effects: int = 0
    duplicate_effects: int = 0
    #: What each duplicate effect followed (see classify_duplicates).
    duplicate_causes: Counter = field(default_factory=Counter)
    #: The faults as they happened: (wall clock, kind, pids it hit).
    faults: list[tuple[float, str, frozenset[int]]] = field(default_factory=list)
    wall_time: float = 0.0
    reaper_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("loops", self.loops),
            ("completed", self.statuses.get("completed", 0)),
            ("LLM requests", self.llm_requests),
            ("assistant turns", self.assistant_turns),
            ("tool calls", self.tool_calls),
            ("worker kills", self.kills),
            ("worker freezes", self.freezes),
            ("reaper recoveries", sum(self.recoveries.values())),
            *((f"  {k}", v) for k, v in sorted(self.recoveries.items())),
            ("side effects", self.effects),
            ("duplicate effects (same key)", self.duplicate_effects),
            *((f"  after a {k}", v) for k, v in sorted(self.duplicate_causes.items())),
            ("reaper passes that failed", len(self.reaper_errors)),
            ("wall time (s)", f"{self.wall_time:.1f}"),
            ("problems", len(self.problems)),
        ]
        return "\n".join(f"{name:<32}{value:>10}" for name, value in rows)


def chaos_reply(settings: ChaosSettings, rng: random.Random):
    """The scripted model: ``turns`` tool turns, then a final answer."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        time.sleep(rng.uniform(0.0, settings.llm_latency))
        done = sum(1 for m in body["messages"] if m["role"] == "assistant" and m.get("tool_calls"))
        if done < settings.turns:
            return {"content": f"turn {done + 1}", "tool_calls": [
                {"name": "effect", "arguments": {"n": (done + 1) * 100 + i}}
                for i in range(settings.tools_per_turn)]}
        return {"content": "all effects done"}

    return reply


def is_chaos(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or [{}]
    return messages[0].get("content") == CHAOS_PROMPT


class Fleet(SharedFleet):
    """``settings.workers`` independent dramatiq masters of the support app."""

    def __init__(self, settings: ChaosSettings, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(settings.workers, threads=settings.threads, env=env, log_dir=log_dir,
                         cwd=ROOT)
        self.settings = settings


def postgres_restart_command() -> list[str] | None:
    """How to restart the local cluster, or None when this machine cannot."""
    import shutil

    custom = os.environ.get("SOLIDLOOP_TEST_PG_RESTART")
    if custom:
        return custom.split()
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        return None
    versions = sorted(p.name for p in Path("/etc/postgresql").iterdir()
                      if (p / "main").is_dir())
    if not versions:
        return None
    return ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart",
            "-m", "fast"]


def restart_postgres() -> None:
    command = postgres_restart_command()
    if command is None:
        raise RuntimeError("no way to restart PostgreSQL on this machine")
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def group_pids(pgid: int) -> frozenset[int]:
    """The processes of process group ``pgid`` (a worker master and its children)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.add(int(stat.parent.name))
    return frozenset(found)


def classify_duplicates(runs: list[tuple[str, int, float]],
                        faults: list[tuple[float, str, frozenset[int]]]) -> Counter:
    """Why each extra run of a side effect happened. ``runs``: (idempotency key,
    pid, wall clock) per effect; ``faults``: (wall clock, kind, pids hit). An
    extra run follows the fault that hit the earlier run's process (a ``kill``
    or a ``freeze``) or the whole server (a ``restart``) between the two runs;
    ``other`` when none did (a defect to look into)."""
    by_key: dict[str, list[tuple[float, int]]] = {}
    for key, pid, at in runs:
        by_key.setdefault(key, []).append((at, pid))
    causes: Counter = Counter()
    for entries in by_key.values():
        entries.sort()
        for (first_at, first_pid), (next_at, _) in itertools.pairwise(entries):
            hits = [kind for at, kind, pids in faults
                    if first_at - 1.0 <= at <= next_at
                    and (kind == "restart" or first_pid in pids)]
            causes[hits[0] if hits else "other"] += 1
    return causes


def prepare_effects_table(database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS chaos_effects")
        conn.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, idempotency_key text,"
                     " loop_id bigint, n int, pid int, created_at timestamptz DEFAULT now())")


def run_chaos(settings: ChaosSettings, *, database_url: str, emulator: Any, log_dir: Path,
              make_app: Any, progress: Any = None,
              restart: Any = None) -> ChaosResult:
    """Run the whole scenario and return what happened (verified). ``restart``
    (a mode: ``fast`` or ``immediate``) restarts the server at
    ``settings.restart_postgres_after``, or every ``settings.restart_every``
    (default: the local cluster, see :func:`restart_postgres`; a test passes
    its throwaway cluster's, tests/support/pg_cluster.py)."""
    from flask_solidloop.maintenance.reaper import reap

    rng = random.Random(settings.seed)
    result = ChaosResult(loops=settings.loops)
    prepare_effects_table(database_url)
    emulator.script(is_chaos, chaos_reply(settings, rng))
    requests_before = len(emulator.requests)

    env = dict(os.environ)
    env["FLASK_APP"] = "tests.support.support_app:create_app()"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["SOLIDLOOP_TEST_APP_CONFIG"] = json.dumps(settings.app_config())
    env["SOLIDLOOP_CHAOS_READ_TIMEOUT"] = str(settings.read_timeout)
    env["SOLIDLOOP_TEST_DATABASE_URL"] = database_url

    app = make_app(**settings.app_config())
    state = app.extensions["solidloop"]
    fleet = Fleet(settings, env, log_dir)
    fleet_lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    faults_lock = threading.Lock()

    def fault(kind: str, pids: frozenset[int] = frozenset()) -> None:
        with faults_lock:
            result.faults.append((time.time(), kind, pids))

    def killer() -> None:
        while not stop.wait(rng.uniform(settings.kill_min, settings.kill_max)):
            index = rng.randrange(settings.workers)
            with fleet_lock:
                proc = fleet.procs[index]
                pids = group_pids(proc.pid) if proc is not None else frozenset()
                fleet.kill(index)
                fault("kill", pids)
                result.kills += 1
                fleet.start(index)

    def freezer() -> None:
        assert settings.freeze_every is not None
        frng = random.Random(rng.random())
        while not stop.wait(frng.uniform(*settings.freeze_every)):
            index = frng.randrange(settings.workers)
            with fleet_lock:
                proc = fleet.procs[index]
                if proc is None or proc.poll() is not None:
                    continue
                pgid = proc.pid
                pids = group_pids(pgid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGSTOP)
            fault("freeze", pids)
            result.freezes += 1
            stop.wait(frng.uniform(*settings.freeze_for))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)

    def restarter() -> None:
        do_restart = restart or (lambda mode: restart_postgres())
        if settings.restart_every is None:
            if stop.wait(settings.restart_postgres_after or 0):
                return
            fault("restart")  # from its start: sessions are cut as it begins
            do_restart(settings.restart_modes[0])
            result.recoveries["postgres_restarts"] += 1
            return
        turn = 0
        while not stop.wait(settings.restart_every):
            mode = settings.restart_modes[turn % len(settings.restart_modes)]
            turn += 1
            fault("restart")  # from its start: sessions are cut as it begins
            try:
                do_restart(mode)
            except Exception as exc:  # judged at the end, with the run's outcome
                errors.append(f"restart ({mode}) failed: {exc}")
                continue
            result.recoveries[f"postgres_restarts_{mode}"] += 1

    def reaper() -> None:
        with app.app_context():
            while not stop.wait(settings.reap_every):
                try:
                    report = reap(state)
                except Exception as exc:  # keep reaping; judged at the end
                    result.reaper_errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                for case in ("expired_llm", "stalled_tools", "dropped_tools",
                             "stuck_tool_phase", "stuck_queued", "orphan_shells"):
                    result.recoveries[case] += len(getattr(report, case))
                result.recoveries["expired_jobs"] += report.expired_jobs

    started = time.monotonic()
    loop_ids: list[int] = []
    threads = [threading.Thread(target=reaper, daemon=True)]
    if settings.kill_workers:
        threads.append(threading.Thread(target=killer, daemon=True))
    if settings.restart_postgres_after is not None or settings.restart_every is not None:
        threads.append(threading.Thread(target=restarter, daemon=True))
    if settings.freeze_every is not None:
        threads.append(threading.Thread(target=freezer, daemon=True))
    try:
        fleet.start_all()
        with app.app_context():
            from .support_app import ChaosAgent

            for i in range(settings.loops):
                loop_ids.append(ChaosAgent.start(message=f"chaos loop {i}").id)
            for thread in threads:
                thread.start()
            session = state.db.session
            from flask_solidloop.models import Loop

            watch = ProgressWatch(settings.stall_timeout)
            while True:
                try:
                    session.expire_all()
                    statuses = Counter(session.query(Loop.status).filter(
                        Loop.id.in_(loop_ids)).all())
                    session.rollback()
                    with psycopg.connect(libpq_url(database_url), autocommit=True,
                                         connect_timeout=5) as conn:
                        watch.update(progress_marker(conn, loop_ids))
                except Exception:
                    session.rollback()
                    time.sleep(0.5)
                    continue
                done = sum(n for (s,), n in statuses.items() if s in ("completed", "failed"))
                if progress:
                    progress(f"{done}/{len(loop_ids)} finished, {result.kills} kills")
                if done == len(loop_ids):
                    break
                if watch.stalled:
                    errors.append(f"no progress for {watch.silent_for:.0f}s with {done}/"
                                  f"{len(loop_ids)} loops finished")
                    break
                time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=60)
        for proc in fleet.procs:  # nothing stays frozen
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
        fleet.stop_all()
        state.stop_renewer()
    result.wall_time = time.monotonic() - started
    result.llm_requests = len(emulator.requests) - requests_before
    result.problems.extend(errors)
    restarts = settings.restart_postgres_after is not None or settings.restart_every is not None
    if not restarts and result.reaper_errors:
        # With the database up throughout, a failing reaper pass is a bug.
        result.problems.append(f"reaper failed {len(result.reaper_errors)} time(s), e.g. "
                               f"{result.reaper_errors[0]}")
    with app.app_context():
        verify(settings, state, loop_ids, database_url, result)
    state.broker.close()
    return result


def verify(settings: ChaosSettings, state: Any, loop_ids: list[int], database_url: str,
           result: ChaosResult) -> None:
    problems = result.problems
    with psycopg.connect(libpq_url(database_url), autocommit=True) as pg:
        ids = list(loop_ids)
        for status, count in pg.execute(
                "SELECT status, count(*) FROM solidloop_loops WHERE id = ANY(%s) GROUP BY 1",
                (ids,)).fetchall():
            result.statuses[status] = count
        # The contract every chaos run checks, ours and a user's (the loop-scoped
        # checks: completion, one answer per call, no shell left, no live or dead job
        # of these loops); the checks below add what this harness knows.
        problems.extend(verify_contract(database_url, ids))

        expected_calls = settings.turns * settings.tools_per_turn
        per_loop = pg.execute(
            "SELECT l.id, "
            " (SELECT count(*) FROM solidloop_tool_calls t WHERE t.loop_id = l.id), "
            " (SELECT count(*) FROM solidloop_messages m WHERE m.loop_id = l.id "
            "   AND m.role = 'assistant' AND NOT m.is_hidden), "
            " (SELECT count(*) FROM solidloop_messages m WHERE m.loop_id = l.id "
            "   AND m.role = 'tool') "
            "FROM solidloop_loops l WHERE l.id = ANY(%s)", (ids,)).fetchall()
        for loop_id, calls, assistants, tools in per_loop:
            result.tool_calls += calls
            result.assistant_turns += assistants
            if calls != expected_calls:
                problems.append(f"loop {loop_id}: {calls} tool calls, expected {expected_calls}")
            if assistants != settings.turns + 1:
                problems.append(f"loop {loop_id}: {assistants} visible assistant turns, "
                                f"expected {settings.turns + 1} (duplicate or missing turn)")
            if tools != calls:
                problems.append(f"loop {loop_id}: {tools} tool messages for {calls} calls")

        failed_calls = pg.execute(
            "SELECT id, result FROM solidloop_tool_calls WHERE loop_id = ANY(%s) "
            "AND is_success IS NOT TRUE", (ids,)).fetchall()
        if failed_calls:
            problems.append(f"tool calls not successful: {failed_calls[:5]}")

        # Jobs of no loop of this run (host, maintenance): none left live or dead.
        others = "(loop_id IS NULL OR NOT loop_id = ANY(%s))"
        jobs = dict(pg.execute(f"SELECT state, count(*) FROM solidloop_jobs WHERE {others} "
                               "GROUP BY 1", (ids,)).fetchall())
        if jobs.get("queued") or jobs.get("running"):
            problems.append(f"other jobs left live after every loop finished: {jobs}")
        if jobs.get("dead"):
            dead = pg.execute("SELECT actor_name, last_error FROM solidloop_jobs "
                              f"WHERE state = 'dead' AND {others} LIMIT 3", (ids,)).fetchall()
            problems.append(f"{jobs['dead']} other job(s) dead-lettered, e.g. {dead}")

        effects = pg.execute("SELECT idempotency_key, loop_id, n FROM chaos_effects").fetchall()
        result.effects = len(effects)
        result.duplicate_causes = classify_duplicates(
            [(key, pid, at) for key, pid, at in pg.execute(
                "SELECT idempotency_key, pid, extract(epoch FROM created_at)::float8 "
                "FROM chaos_effects").fetchall()], result.faults)
        calls = {f"solidloop:tool_call:{cid}": (loop_id, args.get("n") if args else None)
                 for cid, loop_id, args in pg.execute(
                     "SELECT id, loop_id, arguments FROM solidloop_tool_calls "
                     "WHERE loop_id = ANY(%s)", (ids,)).fetchall()}
        per_key = Counter(key for key, _, _ in effects)
        result.duplicate_effects = sum(n - 1 for n in per_key.values() if n > 1)
        for key, loop_id, n in effects:
            if calls.get(key) != (loop_id, n):
                problems.append(f"side effect with a foreign or missing key: {key} "
                                f"(loop {loop_id}, n={n})")
                break
        missing = set(calls) - set(per_key)
        if missing:
            problems.append(f"{len(missing)} tool call(s) answered without their side effect")
