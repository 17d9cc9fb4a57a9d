"""Starting many loops: Agent.start one by one against Agent.start_many, in one run.

Run it from the project root with the project's virtualenv::

    python bench/start_many.py                     # 10,000 loops each way
    python bench/start_many.py --loops 2000 --batch 500

What it does, on a database of its own (``solidloop_bench_start_many``, fresh
for each way, so neither starts on the other's rows):

1. **one by one**: ``--loops`` calls of ``Agent.start(message=...)``, each its
   own transaction (the loop, its two messages, its first job and NOTIFY).
2. **start_many**: the same number of loops through ``Agent.start_many`` in
   batches of ``--batch`` (default: all in one call), each batch one
   transaction: three statements and one NOTIFY.
3. **start_many, batches of 1,000**: the same, in commits of 1,000 (what a
   host that starts loops as rows arrive might do).

No worker runs: this measures the start itself (what the caller waits for),
not the turns. Each way reports loops per second and its ratio against one by
one, and the target: 10,000 loops through start_many in under 10 s on this
machine, quiet. Figures are noisy on a shared 2-core machine: compare ratios
from one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from turns import sql  # noqa: E402

DATABASE = "solidloop_bench_start_many"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
TARGET_SECONDS = 10.0
TARGET_LOOPS = 10_000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fresh_app():
    """A new database and the app on it (bench/approvals_app.py's agent)."""
    from flask_solidloop.migrations import upgrade

    sql(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    sql(f"CREATE DATABASE {DATABASE}")
    upgrade(URL)
    import approvals_app as module

    return module, module.create_app()


def count_loops(module) -> int:
    from sqlalchemy import text

    return int(module.db.session.execute(text("SELECT count(*) FROM solidloop_loops")
                                         ).scalar_one())


def one_by_one(n: int) -> float:
    module, app = fresh_app()
    with app.app_context():
        started = time.perf_counter()
        for i in range(n):
            module.Approvals.start(message=f"task {i}")
        elapsed = time.perf_counter() - started
        assert count_loops(module) == n
        module.db.session.remove()
        module.db.engine.dispose()
    return elapsed


def many(n: int, batch: int) -> float:
    module, app = fresh_app()
    with app.app_context():
        messages = [f"task {i}" for i in range(n)]
        started = time.perf_counter()
        for offset in range(0, n, batch):
            module.Approvals.start_many(messages[offset:offset + batch])
        elapsed = time.perf_counter() - started
        assert count_loops(module) == n
        module.db.session.remove()
        module.db.engine.dispose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=TARGET_LOOPS)
    parser.add_argument("--batch", type=int, default=0,
                        help="loops per start_many call (default: all in one)")
    args = parser.parse_args()
    os.environ.update(SOLIDLOOP_BENCH_DATABASE_URL=URL,
                      SOLIDLOOP_BENCH_LLM_URL="http://127.0.0.1:9",
                      SOLIDLOOP_BENCH_API_KEY="sk-bench")
    n = args.loops
    batch = args.batch or n
    log(f"one by one: {n} loops")
    single = one_by_one(n)
    log(f"start_many: {n} loops, batches of {batch}")
    bulk = many(n, batch)
    log(f"start_many: {n} loops, batches of 1000")
    thousands = many(n, 1000)
    sql(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")

    rows = [("one by one (Agent.start)", single),
            (f"start_many, batches of {batch}", bulk),
            ("start_many, batches of 1000", thousands)]
    print(f"\n{n} loops started, no worker running\n")
    print(f"| {'way':<34} | {'seconds':>8} | {'loops/s':>9} | {'vs one by one':>13} |")
    print(f"|{'-' * 36}|{'-' * 9}:|{'-' * 10}:|{'-' * 14}:|")
    for name, seconds in rows:
        print(f"| {name:<34} | {seconds:8.2f} | {n / seconds:9.0f} | "
              f"{single / seconds:12.1f}x |")
    if n >= TARGET_LOOPS:
        scaled = bulk * TARGET_LOOPS / n
        verdict = "PASS" if scaled < TARGET_SECONDS else "MISS"
        print(f"\ntarget: {TARGET_LOOPS} loops through start_many in under "
              f"{TARGET_SECONDS:g} s: {bulk:.2f} s for {n}: {verdict}")


if __name__ == "__main__":
    main()
