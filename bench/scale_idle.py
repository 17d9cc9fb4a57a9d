"""What an idle worker fleet costs PostgreSQL, at 4 and at 32 processes, before and after.

Run it from the project root with the project's virtualenv::

    python bench/scale_idle.py --against e4c78a4            # 4 and 32 processes, 30-s windows
    python bench/scale_idle.py --against e4c78a4 --quick    # 4 and 8 processes, 15-s windows

For each build (``ours@REV``, a git worktree of ``--against``, and this
tree) and each fleet size, on a PostgreSQL cluster of its own (initdb'ed on
``--cluster-port``, ``max_connections`` 1000 so the old build's fleet fits):

1. a fresh database, migrated by the build's own migrations;
2. ``dramatiq flask_solidloop.worker --processes N --threads 4`` on
   bench/turns_app.py, importing from the build's tree, nothing enqueued;
3. once every process has registered its heartbeat, 5 s to settle, then a
   window of ``--window`` seconds: transactions committed and rolled back in
   the database (``pg_stat_database``), connections to it
   (``pg_stat_activity``, the most seen at one-second samples), and reaper
   passes (``solidloop_maintenance_runs``, the ``reap`` row's pass count).

Targets (decision 0029): at most 2 transactions/s per idle process, flat
from 4 to 32 processes, and one reaper pass per interval for the fleet.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import turns

REAPER_INTERVAL = 2.0  # SOLIDLOOP_REAPER_INTERVAL's default, which turns_app keeps


@dataclass
class Idle:
    build: str
    processes: int
    window: float
    transactions: int
    connections: int
    reaper_passes: int

    def row(self) -> str:
        per_second = self.transactions / self.window
        return (f"| {self.build} | {self.processes} | {per_second:.1f} | "
                f"{per_second / self.processes:.2f} | {self.connections} | "
                f"{self.connections / self.processes:.2f} | "
                f"{self.reaper_passes / (self.window / REAPER_INTERVAL):.2f} |")


def counters(database: str) -> int:
    (done,), = turns.sql("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                         f"WHERE datname = '{database}'")
    return int(done)


def reap_passes(database: str) -> int:
    rows = turns.sql("SELECT passes FROM solidloop_maintenance_runs WHERE task = 'reap'",
                     database)
    return int(rows[0][0]) if rows else 0


def connections(database: str) -> int:
    (count,), = turns.sql("SELECT count(*) FROM pg_stat_activity "
                          f"WHERE datname = '{database}'")
    return int(count)


def measure(build: turns.Build, processes: int, window: float) -> Idle:
    turns.fresh_database(build.database)
    turns.migrate(build)
    env = dict(build.python_env(), FLASK_APP="turns_app:create_app()",
               SOLIDLOOP_BENCH_DATABASE_URL=build.url,
               SOLIDLOOP_BENCH_LLM_URL="http://127.0.0.1:9/unused")
    log = Path(tempfile.gettempdir()) / f"scale_idle-{build.database}-{processes}.log"
    with open(log, "wb") as out:
        workers = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes",
             str(processes), "--threads", "4"], cwd=build.tree, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120 + 10 * processes
        while True:
            (registered,), = turns.sql("SELECT count(*) FROM solidloop_workers WHERE "
                                       "stopped_at IS NULL", build.database)
            if registered >= processes:
                break
            if workers.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"scale_idle.py: {build.name}: {registered} of {processes} "
                                 f"worker processes registered (their log: {log})")
            time.sleep(0.5)
        time.sleep(5.0)
        start_tx, start_passes = counters(build.database), reap_passes(build.database)
        most = 0
        end = time.monotonic() + window
        while time.monotonic() < end:
            most = max(most, connections(build.database))
            time.sleep(1.0)
        time.sleep(1.0)  # backends report their counters at most once a second
        transactions = counters(build.database) - start_tx - 3  # our own three reads
        return Idle(build.name, processes, window, transactions, most,
                    reap_passes(build.database) - start_passes)
    finally:
        _stop(workers)


def _stop(workers: subprocess.Popen) -> None:
    import os
    import signal

    try:
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(workers.pid, signal.SIGKILL)
        workers.wait()
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--quick", action="store_true", help="4 and 8 processes, 15-s windows")
    parser.add_argument("--sizes", help="comma-separated fleet sizes (default 4,32)")
    parser.add_argument("--window", type=float, help="seconds measured (default 30)")
    parser.add_argument("--cluster-port", type=int, default=5447)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in (args.sizes or ("4,8" if args.quick else "4,32")).split(",")]
    window = args.window or (15.0 if args.quick else 30.0)
    turns.PG_PORT = args.cluster_port
    cluster = turns.Cluster(args.cluster_port, max_connections=1000).start()
    results: list[Idle] = []
    try:
        commit = turns.resolve(args.against)
        with turns.checkout(commit) as source:
            before = turns.against_build(commit, source)
            after = turns.Build("ours", turns.OURS_DB)
            print("\n".join(turns.describe(commit, before)), flush=True)
            for processes in sizes:
                for build in (before, after):
                    result = measure(build, processes, window)
                    print(result.row(), flush=True)
                    results.append(result)
    finally:
        cluster.stop()
    print(f"\nIdle worker processes of 4 threads, {window:.0f}-s window; reaper interval "
          f"{REAPER_INTERVAL:g} s")
    print("| build | processes | transactions/s | per process | connections | per process "
          "| reaper passes per interval |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(result.row())
    ours = [r for r in results if r.build == "ours"]
    flat = all(r.transactions / window / r.processes <= 2.0 for r in ours)
    one_pass = all(r.reaper_passes / (window / REAPER_INTERVAL) <= 1.1 for r in ours)
    print(f"\nTarget (<= 2 tx/s per process, one pass per interval): "
          f"{'PASS' if flat and one_pass else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
