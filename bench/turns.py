"""The per-turn price of durability: our agent loop against DBOS Transact's, same run.

Run it from the project root with the project's virtualenv (DBOS is in the
``bench`` extra: ``pip install -e '.[bench]'``)::

    python bench/turns.py                      # 200 loops x 5 LLM turns, 3 reps, ~3 min
    python bench/turns.py --loops 50 --reps 1

The workload: ``--loops`` loops of ``--turns`` LLM turns against the LLM
emulator (instant answers, in this process), with one no-op tool call in
each gap between two LLM turns, 8 turns running at once:

* **ours**: `dramatiq flask_solidloop.worker --processes 2 --threads 4` on
  bench/turns_app.py (an in-process toolset), loops started in one commit;
* **DBOS**: bench/turns_dbos.py in a process of its own, the loop as a
  workflow whose LLM calls and tool calls are steps, from a queue with
  concurrency 8 (queue poll 0.1 s).

Each system gets its own database. The systems are interleaved (ours, DBOS,
then DBOS, ours, ...) for ``--reps`` reps; the table shows the median with
min-max, and every figure as a ratio to DBOS:

* LLM turns/s: turns / wall time from the start of all loops to the last end;
* worker CPU ms per turn: the worker processes' user+system CPU (ours: the
  dramatiq master and its two workers; DBOS: its process);
* Postgres CPU ms per turn: user+system CPU of the server backends connected
  to that system's database (from /proc, before and after);
* transactions per turn (``pg_stat_database.xact_commit``, read-only ones
  included) and durable commits per turn (COMMIT records in the WAL written
  during the run, from ``pg_waldump``; server-wide, so other load on the
  server counts too), WAL bytes per turn (server-wide LSN difference);
* the turn gap (one LLM request of a loop to its next; the answer is
  instant, so this is the loop's own machinery: claim, tool call, commits,
  queueing) p50, with 200 loops queued; and for one loop alone, p50/p99
  (a loop of ``--alone-turns`` LLM turns per rep, so the percentiles rest on
  some dozens of gaps);
* loop completion time p50/p99: from the start of all loops to each end.

Targets (issue 10): turns/s >= 1.5x DBOS; worker CPU/turn <= 0.7x and
Postgres CPU/turn <= 1x; durable commits/turn <= 4 and WAL/turn <= DBOS;
one loop alone gap p50 <= 10 ms; completion p50 <= DBOS's. Printed with
PASS/MISS. Figures are noisy on a shared 2-core machine: compare ratios.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

OURS_DB = "solidloop_bench_turns"
DBOS_DB = "solidloop_bench_turns_dbos"
PG = "postgresql://postgres@127.0.0.1:5432"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    system: str
    turns: int = 0
    wall: float = 0.0
    worker_cpu: float = 0.0
    pg_cpu: float = 0.0
    xacts: int = 0
    commits: int | None = None
    wal: int = 0
    #: The WAL the measured run wrote: its start and end LSNs, and its database.
    wal_range: tuple[str, str, str] | None = None
    gaps: list[float] = field(default_factory=list)
    completion: list[float] = field(default_factory=list)


# -- measuring -------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children[int(parts[1])].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def sql(query: str, database: str = "postgres") -> list[tuple]:
    import psycopg

    with psycopg.connect(f"{PG}/{database}", autocommit=True) as conn:
        cursor = conn.execute(query)
        return cursor.fetchall() if cursor.description else []


def backends(database: str) -> dict[int, float]:
    return {pid: proc_cpu(pid) for (pid,) in sql(
        f"SELECT pid FROM pg_stat_activity WHERE datname = '{database}'")}


def server_counters(database: str) -> tuple[int, str]:
    (xacts,), = sql(f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{database}'")
    (lsn,), = sql("SELECT pg_current_wal_lsn()::text")
    return int(xacts), str(lsn)


def wal_bytes(start: str, end: str) -> int:
    (diff,), = sql(f"SELECT pg_wal_lsn_diff('{end}', '{start}')::bigint")
    return int(diff)


def wal_commits(start: str, end: str) -> int | None:
    """COMMIT records between two LSNs, read with pg_waldump (None if it cannot)."""
    binary = shutil.which("pg_waldump") or "/usr/lib/postgresql/15/bin/pg_waldump"
    (data_dir,), = sql("SHOW data_directory")
    try:
        out = subprocess.run([binary, "--start", start, "--end", end, "-r", "Transaction",
                              "-p", f"{data_dir}/pg_wal"], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.splitlines() if "COMMIT" in line) if out else None


_WAL_SIZE = re.compile(r"len \(rec/tot\):\s*\d+/\s*(\d+),")
_WAL_RELATION = re.compile(r"rel \d+/(\d+)/(\d+)")


def wal_by_table(start: str, end: str, database: str) -> collections.Counter[str]:
    """The WAL bytes between two LSNs per table of ``database`` (a table's
    indexes and TOAST counted with it); records of no relation of it (commits,
    other databases) under ``(other)``. Read with pg_waldump: run it before
    the server recycles those segments."""
    binary = shutil.which("pg_waldump") or "/usr/lib/postgresql/15/bin/pg_waldump"
    (data_dir,), = sql("SHOW data_directory")
    (db_oid,), = sql(f"SELECT oid FROM pg_database WHERE datname = '{database}'")
    owners = {str(node): table for node, table in sql(
        "SELECT c.relfilenode, coalesce(t.relname, o.relname, ot.relname, c.relname) "
        "FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid "
        "LEFT JOIN pg_class t ON t.oid = i.indrelid "
        "LEFT JOIN pg_class o ON o.reltoastrelid = c.oid "
        "LEFT JOIN pg_class ot ON ot.reltoastrelid = t.oid "
        "WHERE c.relfilenode <> 0", database)}
    out = subprocess.run([binary, "--start", start, "--end", end, "-p", f"{data_dir}/pg_wal"],
                         capture_output=True, text=True, timeout=300).stdout
    totals: collections.Counter[str] = collections.Counter()
    for line in out.splitlines():
        size = _WAL_SIZE.search(line)
        if size is None:
            continue
        relation = _WAL_RELATION.search(line)
        table = "(other)"
        if relation is not None and relation.group(1) == str(db_oid):
            table = owners.get(relation.group(2), "(other)")
        totals[table] += int(size.group(1))
    return totals


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the emulator's script: the same loop shape for both systems ------------------------


class Script:
    """Answers with a noop tool call until the loop has had ``turns`` LLM turns
    (``alone_turns`` for a loop labelled ``alone...``), and records when each
    loop's requests arrived."""

    def __init__(self, turns: int, alone_turns: int | None = None) -> None:
        self.turns = turns
        self.alone_turns = alone_turns or turns
        self.arrivals: dict[str, list[float]] = collections.defaultdict(list)
        self.lock = threading.Lock()

    def reply(self, request: dict) -> dict:
        messages = request["messages"]
        label = next(m["content"] for m in messages if m.get("role") == "user")
        with self.lock:
            self.arrivals[label].append(time.monotonic())
        done = sum(1 for m in messages if m.get("role") == "tool")
        turns = self.alone_turns if label.startswith("alone") else self.turns
        if done + 1 >= turns:
            return {"content": "done"}
        return {"content": "", "tool_calls": [{"name": "noop", "arguments": {"n": done}}]}

    def gaps(self, prefix: str = "") -> list[float]:
        """Milliseconds between consecutive requests of each loop labelled ``prefix...``."""
        with self.lock:
            return [(b - a) * 1000 for label, times in self.arrivals.items()
                    if label.startswith(prefix)
                    for a, b in itertools.pairwise(times)]

    def requests(self, prefix: str) -> int:
        with self.lock:
            return sum(len(t) for label, t in self.arrivals.items() if label.startswith(prefix))

    def reset(self) -> None:
        with self.lock:
            self.arrivals.clear()


# -- the two systems -------------------------------------------------------------------------


def fresh_database(name: str) -> None:
    sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    sql(f"CREATE DATABASE {name}")


def run_ours(emulator, script: Script, loops: int, prefix: str) -> Run:
    from sqlalchemy import func, select

    from flask_solidloop.migrations import upgrade
    from flask_solidloop.models import Loop

    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{OURS_DB}"
    fresh_database(OURS_DB)
    upgrade(url)
    os.environ["SOLIDLOOP_BENCH_DATABASE_URL"] = url
    import turns_app

    app = turns_app.create_app()
    env = dict(os.environ, FLASK_APP="turns_app:create_app()",
               PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT)]))
    # SOLIDLOOP_BENCH_WORKER_LOG=<file>: keep the workers' log (to look into a slow run).
    log_path = os.environ.get("SOLIDLOOP_BENCH_WORKER_LOG")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    workers = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "2",
         "--threads", "4"], cwd=ROOT, env=env, stdout=log, stderr=log,
        start_new_session=True)
    run = Run("ours")
    try:
        with app.app_context():
            session = turns_app.db.session
            # Warm up (imports, connections, first claims) with loops of their own,
            # so the measured run sees both worker processes ready.
            warm = [turns_app.Turns.start(message=f"warm {n}").id for n in range(4)]
            deadline = time.monotonic() + 120
            while session.scalar(select(func.count()).select_from(Loop).where(
                    Loop.id.in_(warm), Loop.status != "completed")):
                session.rollback()
                if time.monotonic() > deadline or workers.poll() is not None:
                    raise SystemExit("ours: the warm-up loops did not complete")
                time.sleep(0.05)
            session.rollback()
            script.reset()
            cpu0 = sum(proc_cpu(p) for p in tree(workers.pid))
            pg0 = backends(OURS_DB)
            xacts0, lsn0 = server_counters(OURS_DB)
            started = time.monotonic()
            ids = [turns_app.Turns.start(message=f"{prefix} {n}", commit=False).id
                   for n in range(loops)]
            session.commit()
            wait_for_loops(ids)
            run.wall = time.monotonic() - started
            run.worker_cpu = sum(proc_cpu(p) for p in tree(workers.pid)) - cpu0
            pg1 = backends(OURS_DB)
            run.pg_cpu = sum(cpu - pg0.get(pid, 0.0) for pid, cpu in pg1.items())
            time.sleep(1.5)  # let the server flush its statistics
            xacts1, lsn1 = server_counters(OURS_DB)
            run.xacts, run.wal = xacts1 - xacts0, wal_bytes(lsn0, lsn1)
            run.commits = wal_commits(lsn0, lsn1)
            run.wal_range = (lsn0, lsn1, OURS_DB)
            rows = session.execute(select(Loop.step_count, Loop.status, Loop.created_at,
                                          Loop.finished_at).where(Loop.id.in_(ids))).all()
            failed = [r for r in rows if r.status != "completed"]
            if failed:
                raise SystemExit(f"ours: {len(failed)} loops did not complete")
            run.turns = sum(r.step_count for r in rows)
            (epoch,), = session.execute(select(func.min(Loop.created_at)).where(
                Loop.id.in_(ids))).all()
            run.completion = [(r.finished_at - epoch).total_seconds() for r in rows]
            session.remove()
    finally:
        try:
            os.killpg(workers.pid, 15)
            workers.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(workers.pid, 9)
    run.gaps = script.gaps(prefix + " ")
    return run


def wait_for_loops(ids: list[int]) -> None:
    """Wait until every loop has finished, as the DBOS side waits for its
    handles: one at a time, in order, each with a primary-key read (on an
    autocommit connection, every 20 ms while it runs). The harness's own
    reads land in the measured server CPU of both systems, so they are kept
    as cheap as DBOS's ``get_result`` polls."""
    import psycopg

    with psycopg.connect(f"{PG}/{OURS_DB}", autocommit=True) as conn:
        for loop_id in ids:
            while conn.execute(
                    "SELECT status NOT IN ('completed', 'failed', 'paused') "
                    "FROM solidloop_loops WHERE id = %s", (loop_id,)).fetchone()[0]:
                time.sleep(0.02)


def run_dbos(emulator, script: Script, loops: int, prefix: str) -> Run:
    fresh_database(DBOS_DB)
    script.reset()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "turns_dbos.py"), "--url", f"{PG}/{DBOS_DB}",
         "--llm", emulator.base_url, "--loops", str(loops), "--prefix", prefix],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # DBOS creates its schema at launch and warms up: measure the server from the
    # first measured workflow on.
    deadline = time.monotonic() + 120
    while not script.requests(prefix + " ") and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.005)
    pg0 = backends(DBOS_DB)
    xacts0, lsn0 = server_counters(DBOS_DB)
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"DBOS run failed:\n{err[-3000:]}")
    data = json.loads(out.strip().splitlines()[-1])
    run = Run("dbos", wall=data["wall"], worker_cpu=data["cpu"],
              completion=data["completion"])
    # The DBOS process has exited: its backends' CPU was read while it ran.
    run.pg_cpu = sum(cpu - pg0.get(pid, 0.0) for pid, cpu in _last_backends.items())
    time.sleep(1.5)
    xacts1, lsn1 = server_counters(DBOS_DB)
    run.xacts, run.wal = xacts1 - xacts0, wal_bytes(lsn0, lsn1)
    run.commits = wal_commits(lsn0, lsn1)
    run.wal_range = (lsn0, lsn1, DBOS_DB)
    run.turns = script.requests(prefix + " ")
    run.gaps = script.gaps(prefix + " ")
    return run


_last_backends: dict[int, float] = {}


def watch_backends(database: str, stop: threading.Event) -> None:
    """Keep the latest CPU reading of each backend of ``database`` (they vanish
    when the DBOS process exits)."""
    while not stop.is_set():
        with contextlib.suppress(Exception):
            _last_backends.update(backends(database))
        stop.wait(0.2)


# -- report ------------------------------------------------------------------------------------


def figures(run: Run) -> dict[str, float | None]:
    turns = max(run.turns, 1)
    return {
        "LLM turns/s": run.turns / run.wall,
        "worker CPU ms / turn": run.worker_cpu * 1000 / turns,
        "Postgres CPU ms / turn": run.pg_cpu * 1000 / turns,
        "transactions / turn": run.xacts / turns,
        "durable commits / turn": None if run.commits is None else run.commits / turns,
        "WAL bytes / turn": run.wal / turns,
        "turn gap p50 ms (all loops queued)": percentile(run.gaps, 0.5),
        "loop completion p50 s": percentile(run.completion, 0.5),
        "loop completion p99 s": percentile(run.completion, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--alone-turns", type=int, default=20,
                        help="LLM turns of the one-loop-alone run (default 20)")
    parser.add_argument("--wal-by-table", action="store_true",
                        help="also print each system's WAL per turn by table (last rep)")
    args = parser.parse_args()

    from flask_solidloop.testing import LLMEmulator

    script = Script(args.turns, args.alone_turns)
    emulator = LLMEmulator().start()
    emulator.script(lambda body: True, script.reply)
    os.environ["SOLIDLOOP_BENCH_LLM_URL"] = emulator.base_url
    os.environ["SOLIDLOOP_BENCH_API_KEY"] = "sk-bench"
    results: dict[str, list[dict]] = {"ours": [], "dbos": []}
    wal_tables: dict[str, tuple[collections.Counter[str], int]] = {}

    def tally(system: str, run: Run) -> None:
        if args.wal_by_table and run.wal_range is not None:
            wal_tables[system] = (wal_by_table(*run.wal_range), max(run.turns, 1))
    alone: dict[str, list[float]] = {"ours": [], "dbos": []}
    try:
        for rep in range(args.reps):
            order = ("ours", "dbos") if rep % 2 == 0 else ("dbos", "ours")
            for system in order:
                if system == "ours":
                    many = run_ours(emulator, script, args.loops, f"r{rep}")
                    tally(system, many)  # before the next run drops its database
                    one = run_ours(emulator, script, 1, f"alone{rep}")
                else:
                    stop = threading.Event()
                    watcher = threading.Thread(target=watch_backends, args=(DBOS_DB, stop),
                                               daemon=True)
                    watcher.start()
                    try:
                        many = run_dbos(emulator, script, args.loops, f"r{rep}")
                    finally:
                        stop.set()
                        watcher.join()
                        _last_backends.clear()
                    tally(system, many)
                    one = run_dbos(emulator, script, 1, f"alone{rep}")
                results[system].append(figures(many))
                alone[system].extend(one.gaps)
                print(f"rep {rep + 1} {system}: {many.turns} turns in {many.wall:.1f} s",
                      flush=True)
    finally:
        emulator.stop()

    def cell(values: list[float | None]) -> tuple[float | None, str]:
        present = [v for v in values if v is not None]
        if not present:
            return None, "n/a"
        mid = statistics.median(present)
        spread = f" ({min(present):.1f}-{max(present):.1f})" if len(present) > 1 else ""
        return mid, f"{mid:.1f}{spread}"

    print(f"\n{args.loops} loops x {args.turns} LLM turns, a no-op tool call in each gap, "
          f"8 concurrent turns; median (min-max) of {args.reps} reps")
    print(f"{'metric':38} {'DBOS 3.4':>20} {'ours':>20} {'ratio':>7}")
    medians: dict[str, dict[str, float | None]] = {"ours": {}, "dbos": {}}
    for metric in results["ours"][0]:
        row = []
        for system in ("dbos", "ours"):
            mid, text = cell([r[metric] for r in results[system]])
            medians[system][metric] = mid
            row.append(text)
        ours, dbos = medians["ours"][metric], medians["dbos"][metric]
        ratio = f"{ours / dbos:.2f}x" if ours is not None and dbos else "n/a"
        print(f"{metric:38} {row[0]:>20} {row[1]:>20} {ratio:>7}")
    for system in ("dbos", "ours"):
        gaps = alone[system]
        medians[system]["alone p50"] = percentile(gaps, 0.5)
        medians[system]["alone p99"] = percentile(gaps, 0.99)
    for label in ("alone p50", "alone p99"):
        ours, dbos = medians["ours"][label], medians["dbos"][label]
        print(f"{'one loop alone: turn gap ' + label.split()[1] + ' ms':38} "
              f"{dbos:>20.1f} {ours:>20.1f} {ours / dbos:>6.2f}x")

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "MISS")

    o, d = medians["ours"], medians["dbos"]
    commits = o["durable commits / turn"]
    checks = [
        ("turns/s >= 1.5x DBOS", o["LLM turns/s"] >= 1.5 * d["LLM turns/s"]),
        ("worker CPU/turn <= 0.7x DBOS",
         o["worker CPU ms / turn"] <= 0.7 * d["worker CPU ms / turn"]),
        ("Postgres CPU/turn <= DBOS", o["Postgres CPU ms / turn"] <= d["Postgres CPU ms / turn"]),
        ("durable commits/turn <= 4", None if commits is None else commits <= 4),
        ("WAL/turn <= DBOS", o["WAL bytes / turn"] <= d["WAL bytes / turn"]),
        ("one loop alone gap p50 <= 10 ms", o["alone p50"] <= 10),
        ("completion p50 <= DBOS", o["loop completion p50 s"] <= d["loop completion p50 s"]),
    ]
    print()
    for label, ok in checks:
        print(f"  {label:40} {verdict(ok)}")
    for system, (tables, turns) in sorted(wal_tables.items()):
        print(f"\nWAL bytes / turn by table, {system} (last rep, "
              f"{sum(tables.values()) / turns:.0f} in all):")
        for table, size in tables.most_common():
            if size / turns >= 1:
                print(f"  {size / turns:8.0f}  {table}")


if __name__ == "__main__":
    main()
