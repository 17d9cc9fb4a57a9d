"""The chaos suite, longer: 300+ loops while workers are SIGKILLed at random.

Runs tests/support/chaos.py's harness (real ``dramatiq`` worker processes, the LLM
emulator on 127.0.0.1, a reaper thread with short leases) against a database of
its own, then verifies the durability contract and prints what happened: loops,
turns, kills, recoveries by case, duplicate side effects, wall time. As a
baseline it first runs a short calm round (no kills) with the same settings, so
the cost of the chaos shows as a ratio.

    python bench/chaos.py                      # 300 loops, 3 workers, a kill every 1-3 s
    python bench/chaos.py --loops 1000 --workers 4 --kill-min 0.5 --kill-max 1.5
    python bench/chaos.py --restart-postgres-after 5   # also restart PostgreSQL once
    python bench/chaos.py --loops 1000 --throwaway-cluster --freeze-every 10 20 \
        --freeze-for 5 40 --restart-every 120         # kills, freezes, restarts

``--throwaway-cluster`` runs on a PostgreSQL cluster of its own
(tests/support/pg_cluster.py: ``initdb`` in a temporary directory, a free
port), which ``--restart-every`` restarts fast and immediately in turn; without
it, restarts hit the local cluster. The table says what each duplicate side
effect followed: the kill or freeze of the process that ran it first, a
restart, or nothing (``other``: a defect), and how many LLM requests were
sent beyond the loops' turns.

Exit status 1 when the contract was broken (any problem is listed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_chaos"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=300)
    parser.add_argument("--turns", type=int, default=3, help="tool turns per loop")
    parser.add_argument("--tools-per-turn", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3, help="independent worker fleets")
    parser.add_argument("--threads", type=int, default=4, help="threads per worker")
    parser.add_argument("--kill-min", type=float, default=1.0)
    parser.add_argument("--kill-max", type=float, default=3.0)
    parser.add_argument("--llm-latency", type=float, default=0.4, help="max seconds per reply")
    parser.add_argument("--restart-postgres-after", type=float, default=None)
    parser.add_argument("--restart-every", type=float, default=None,
                        help="restart PostgreSQL every N s, fast and immediate in turn")
    parser.add_argument("--freeze-every", type=float, nargs=2, default=None,
                        metavar=("MIN", "MAX"), help="SIGSTOP a random worker this often")
    parser.add_argument("--freeze-for", type=float, nargs=2, default=(5.0, 40.0),
                        metavar=("MIN", "MAX"), help="... for this long, then SIGCONT")
    parser.add_argument("--throwaway-cluster", action="store_true",
                        help="run on a PostgreSQL cluster of its own (restarts hit it only)")
    parser.add_argument("--baseline-loops", type=int, default=50,
                        help="loops in the calm baseline round (0 skips it)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stall-timeout", type=float, default=120,
                        help="fail when nothing progressed for this many seconds")
    parser.add_argument("--url", default=os.environ.get("SOLIDLOOP_BENCH_CHAOS_URL", DEFAULT_URL))
    args = parser.parse_args()

    cluster = None
    if args.throwaway_cluster:
        from tests.support.pg_cluster import ThrowawayCluster

        cluster = ThrowawayCluster().start()
        args.url = cluster.url("solidloop_bench_chaos")
    os.environ["SOLIDLOOP_TEST_DATABASE_URL"] = args.url
    import psycopg

    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade
    from flask_solidloop.queue.broker import libpq_url
    from flask_solidloop.testing import LLMEmulator
    from tests.support.chaos import ChaosSettings, run_chaos
    from tests.support.support_app import LLM_URL_ENV, create_app

    ensure_database(args.url)
    upgrade(args.url)
    emulator = LLMEmulator().start()
    os.environ[LLM_URL_ENV] = emulator.base_url
    os.environ["SOLIDLOOP_TEST_API_KEY"] = "sk-bench"

    def reset() -> None:
        with psycopg.connect(libpq_url(args.url), autocommit=True) as conn:
            conn.execute("TRUNCATE solidloop_events, solidloop_tool_calls, solidloop_messages, "
                         "solidloop_loops, solidloop_jobs RESTART IDENTITY CASCADE")

    def settings(loops: int, chaos: bool) -> ChaosSettings:
        return ChaosSettings(
            loops=loops, turns=args.turns, tools_per_turn=args.tools_per_turn,
            workers=args.workers, threads=args.threads, kill_min=args.kill_min,
            kill_max=args.kill_max, llm_latency=args.llm_latency, seed=args.seed,
            stall_timeout=args.stall_timeout, kill_workers=chaos,
            restart_postgres_after=args.restart_postgres_after if chaos else None,
            restart_every=args.restart_every if chaos else None,
            freeze_every=tuple(args.freeze_every) if chaos and args.freeze_every else None,
            freeze_for=tuple(args.freeze_for))

    last = [0.0]

    def progress(line: str) -> None:
        if time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            print(f"  ... {line}", flush=True)

    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="solidloop-chaos-") as logs:
            if args.baseline_loops:
                reset()
                print(f"calm baseline: {args.baseline_loops} loops, no kills", flush=True)
                results["calm"] = run_chaos(settings(args.baseline_loops, False),
                                            database_url=args.url, emulator=emulator,
                                            log_dir=Path(logs), make_app=create_app,
                                            progress=progress)
            reset()
            print(f"chaos: {args.loops} loops, {args.workers} workers x {args.threads} threads, "
                  f"a kill every {args.kill_min}-{args.kill_max} s, freezes "
                  f"{args.freeze_every}, restarts every {args.restart_every} s "
                  f"({'a throwaway cluster' if cluster else 'the local cluster'})", flush=True)
            results["chaos"] = run_chaos(settings(args.loops, True), database_url=args.url,
                                         emulator=emulator, log_dir=Path(logs),
                                         make_app=create_app, progress=progress,
                                         restart=cluster.restart if cluster else None)
    finally:
        emulator.stop()
        if cluster is not None:
            cluster.stop()

    chaos = results["chaos"]
    print()
    print(chaos.table())
    expected_requests = chaos.loops * (args.turns + 1)
    extra = chaos.llm_requests - expected_requests
    print(f"\nduplicate side effects: {chaos.duplicate_effects} of {chaos.effects} "
          f"({100 * chaos.duplicate_effects / max(chaos.effects, 1):.2f}%); LLM requests "
          f"beyond the loops' turns: {extra} of {chaos.llm_requests} "
          f"({100 * extra / max(chaos.llm_requests, 1):.2f}%)")
    calm = results.get("calm")
    if calm is not None:
        calm_rate = calm.loops / calm.wall_time
        chaos_rate = chaos.loops / chaos.wall_time
        print(f"\nthroughput (loops/s)            calm {calm_rate:6.2f}   chaos {chaos_rate:6.2f}"
              f"   ratio {chaos_rate / calm_rate:.2f}x")
        print(f"calm round: {calm.loops} loops, reaper recoveries "
              f"{sum(calm.recoveries.values())} {dict(calm.recoveries)}")
        if calm.problems:
            print(f"calm round problems: {calm.problems}")
    if chaos.problems:
        print("\nPROBLEMS:")
        for problem in chaos.problems:
            print(f"  - {problem}")
        return 1
    print("\ncontract held: every loop completed, every call answered exactly once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
