"""Waiting costs nothing: workers and PostgreSQL with 10,000 loops waiting for
an approval, against the same with none, in one run; and how long an approval
takes to start its tool, against a plain host job's dispatch.

Run it from the project root with the project's virtualenv::

    python bench/approvals.py                        # 10,000 waiting loops, 30 s windows
    python bench/approvals.py --waiting 1000 --window 10 --approve 100

What it does, on a database of its own (``solidloop_bench_approvals``, fresh):

1. Starts ``dramatiq flask_solidloop.worker --processes 2 --threads 4`` on
   bench/approvals_app.py (one agent whose one tool needs an approval) and the
   LLM emulator in this process; a warm-up loop goes through its approval to
   completion.
2. **none waiting**: a window of ``--window`` seconds with nothing to do: the
   worker processes' CPU (user+system, from /proc), the CPU of the server
   backends connected to the database, and its transactions per second
   (``pg_stat_database.xact_commit``). The workers' own reaper, janitor,
   heartbeats and broker run as they always do.
3. Starts ``--waiting`` loops (1,000 per commit); each one's first turn asks
   for the gated tool, so the loop ends up ``waiting``. Once all wait, the
   tables are vacuumed and analysed and **N waiting** gets the same window.
   Each window starts 11 s after the work before it (PostgreSQL 15 flushes
   an idle backend's statistics up to 10 s late), with this process's own
   connections closed.
4. **approve → tool start**: ``--approve`` of the waiting loops are approved
   one at a time, 50 ms apart, each in its own commit; the tool reports the
   moment it started, and the latency is that moment minus the moment
   ``approve()`` was called (its commit included; one clock: one machine).
   Baseline: as many plain host jobs (``solidloop.queue("bench").enqueue``),
   sent the same way, from the call to ``enqueue()`` (its commit included)
   to the job's start. Both run with the N loops still waiting.

5. **none after**: every remaining call is approved, every loop completes,
   the tables are vacuumed, and a third window runs: the same tables as with
   N waiting, with nothing waiting. Comparing N waiting with it isolates what
   waiting costs from what a bigger history costs.

It prints each window's figures (Postgres CPU counts client backends;
autovacuum runs are counted apart), the ratio N waiting / none after, and
PASS/MISS: worker CPU, Postgres CPU and transactions/s with N waiting within
1.2x of none after, or within an absolute floor of the idle noise (0.5% of a
core; 1 transaction/s).
Figures are noisy on a shared 2-core machine: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from turns import percentile, proc_cpu, sql, tree  # noqa: E402

DATABASE = "solidloop_bench_approvals"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
CPU_FLOOR = 0.5  # percent of one core
TPS_FLOOR = 1.0
RATIO = 1.2


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def start_workers() -> subprocess.Popen:
    env = dict(os.environ, FLASK_APP="approvals_app:create_app()",
               PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT)]))
    log_path = os.environ.get("SOLIDLOOP_BENCH_WORKER_LOG")
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                             "--processes", "2", "--threads", "4"], cwd=BENCH, env=env,
                            stdout=out, stderr=out, start_new_session=True)


def backends(database: str) -> dict[int, float]:
    """CPU seconds of each client backend connected to ``database`` (autovacuum
    workers are counted apart: vacuuming follows past writes, not waiting)."""
    return {pid: proc_cpu(pid) for (pid,) in sql(
        f"SELECT pid FROM pg_stat_activity WHERE datname = '{database}' "
        "AND backend_type = 'client backend'")}


def autovacuum_runs() -> int:
    (count,), = sql("SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) "
                    "FROM pg_stat_user_tables", DATABASE)
    return int(count)


def xacts() -> int:
    (count,), = sql(f"SELECT xact_commit + xact_rollback FROM pg_stat_database "
                    f"WHERE datname = '{DATABASE}'")
    return int(count)


#: PostgreSQL 15 flushes an idle backend's statistics up to 10 s late: a
#: window starts this long after the work before it, so none of that work's
#: transactions land in it.
SETTLE_SECONDS = 11.0


def window(app, module, workers: subprocess.Popen, seconds: float) -> dict[str, float]:
    """Worker CPU %, Postgres backend CPU % and transactions/s over ``seconds``."""
    with app.app_context():
        module.db.engine.dispose()  # this process's connections exit (and flush)
    time.sleep(SETTLE_SECONDS)
    cpu0 = sum(proc_cpu(p) for p in tree(workers.pid))
    pg0, x0, v0, t0 = backends(DATABASE), xacts(), autovacuum_runs(), time.monotonic()
    time.sleep(seconds)
    cpu1 = sum(proc_cpu(p) for p in tree(workers.pid))
    pg1 = backends(DATABASE)
    time.sleep(1.0)
    x1, v1, t1 = xacts(), autovacuum_runs(), time.monotonic() - 1.0
    wall = t1 - t0
    # Our own reads (backends, xacts, autovacuum_runs) are transactions too:
    # take them out.
    return {"worker CPU %": 100 * (cpu1 - cpu0) / wall,
            "Postgres CPU %": 100 * sum(c - pg0.get(p, 0.0) for p, c in pg1.items()) / wall,
            "transactions/s": max(0, x1 - x0 - 5) / wall,
            "autovacuum runs": float(v1 - v0)}


def count(status: str) -> int:
    (n,), = sql(f"SELECT count(*) FROM solidloop_loops WHERE status = '{status}'", DATABASE)
    return int(n)


def wait_until(check, what: str, timeout: float, workers: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if workers.poll() is not None:
            raise SystemExit(f"the workers exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def start_waiting(app, module, n: int, workers: subprocess.Popen) -> None:
    with app.app_context():
        for first in range(0, n, 1000):
            for k in range(first, min(n, first + 1000)):
                module.Approvals.start(message=f"wait {k}", commit=False)
            module.db.session.commit()
    started = time.monotonic()
    wait_until(lambda: count("waiting") >= n, f"{n} loops to wait", 3600, workers)
    log(f"{n} loops waiting ({time.monotonic() - started:.0f} s of LLM turns)")


def approve_latencies(app, module, k: int, workers: subprocess.Popen) -> list[float]:
    from sqlalchemy import func, select

    from flask_solidloop.models import ToolCall

    with app.app_context():
        session = module.db.session
        calls = session.scalars(select(ToolCall).where(
            ToolCall.waits_for == "approval", ToolCall.decision.is_(None))
            .order_by(ToolCall.id).limit(k)).all()
        pairs = [(c.id, c.loop_id) for c in calls]
        session.rollback()
        called: dict[int, float] = {}
        for call_id, loop_id in pairs:
            called[call_id] = time.time()
            module.Approvals(loop_id).approve(call_id, by="bench")
            time.sleep(0.05)
        ids = list(called)

        def all_started() -> bool:
            done = session.scalar(select(func.count()).select_from(ToolCall).where(
                ToolCall.id.in_(ids), ToolCall.executed_at.is_not(None)))
            session.rollback()
            return done == len(ids)

        wait_until(all_started, "the approved tools to run", 600, workers)
        rows = session.execute(select(ToolCall.id, ToolCall.result).where(
            ToolCall.id.in_(ids))).all()
        session.rollback()
    return [1000 * (float(r.result["content"][0]["text"].split()[1]) - called[r.id])
            for r in rows]


def approve_all(app, module) -> None:
    """Approve every call that still waits (the window after compares with them gone)."""
    from sqlalchemy import select

    from flask_solidloop.models import ToolCall

    with app.app_context():
        session = module.db.session
        pairs = session.execute(select(ToolCall.id, ToolCall.loop_id).where(
            ToolCall.waits_for == "approval", ToolCall.decision.is_(None))).all()
        session.rollback()
        for call_id, loop_id in pairs:
            module.Approvals(loop_id).approve(call_id, by="bench")


def probe_latencies(app, module, k: int, workers: subprocess.Popen) -> list[float]:
    sql("CREATE TABLE IF NOT EXISTS bench_probe (sent float8, started float8)", DATABASE)
    sql("TRUNCATE bench_probe", DATABASE)
    with app.app_context():
        for _ in range(k):
            module.probes.enqueue(module.probe, time.time())
            time.sleep(0.05)

    def all_started() -> bool:
        (n,), = sql("SELECT count(*) FROM bench_probe", DATABASE)
        return int(n) >= k

    wait_until(all_started, "the host jobs to run", 600, workers)
    return [1000 * (started - sent)
            for sent, started in sql("SELECT sent, started FROM bench_probe", DATABASE)]


def exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM as SystemExit, so the workers are stopped."""
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--approve", type=int, default=200)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)

    from flask_solidloop.migrations import upgrade
    from flask_solidloop.testing import LLMEmulator

    sql(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    sql(f"CREATE DATABASE {DATABASE}")
    upgrade(URL)
    emulator = LLMEmulator().start()

    def reply(body: dict) -> dict:
        if any(m.get("role") == "tool" for m in body["messages"]):
            return {"content": "done"}
        return {"content": "", "tool_calls": [{"name": "act", "arguments": {"n": 1}}]}

    emulator.script(lambda body: True, reply)
    os.environ.update(SOLIDLOOP_BENCH_DATABASE_URL=URL, SOLIDLOOP_BENCH_LLM_URL=emulator.base_url,
                      SOLIDLOOP_BENCH_API_KEY="sk-bench")
    import approvals_app as module

    app = module.create_app()
    workers = start_workers()
    try:
        log("warm-up")
        start_waiting(app, module, 4, workers)
        approve_latencies(app, module, 4, workers)
        wait_until(lambda: count("completed") >= 4, "the warm-up loops to complete", 120,
                   workers)
        log(f"window: none waiting ({args.window:g} s)")
        none = window(app, module, workers, args.window)
        start_waiting(app, module, args.waiting, workers)
        sql("VACUUM ANALYZE", DATABASE)
        log(f"window: {args.waiting} waiting ({args.window:g} s)")
        waiting = window(app, module, workers, args.window)
        log(f"approving {args.approve}, 50 ms apart")
        approved = approve_latencies(app, module, args.approve, workers)
        log(f"sending {args.approve} host jobs, 50 ms apart")
        probed = probe_latencies(app, module, args.approve, workers)
        log("approving the rest; waiting for every loop to complete")
        approve_all(app, module)
        wait_until(lambda: count("completed") >= args.waiting + 4, "every loop to complete",
                   3600, workers)
        sql("VACUUM ANALYZE", DATABASE)
        log(f"window: none waiting again, {args.waiting} more loops done ({args.window:g} s)")
        after = window(app, module, workers, args.window)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(workers.pid, signal.SIGTERM)
        try:
            workers.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(workers.pid, signal.SIGKILL)
        emulator.stop()
    report(args, none, waiting, after, approved, probed)


def report(args, none, waiting, after, approved, probed) -> None:
    print(f"\nbench/approvals.py: {args.waiting} waiting loops, {args.window:g} s windows, "
          f"{os.cpu_count()} cores\n")
    print("none before: an empty history; waiting: the loops wait; none after: the same "
          "loops approved and completed\n(the same tables, nothing waiting). The ratio is "
          "waiting / none after.\n")
    print(f"{'':20} {'none before':>12} {f'{args.waiting} waiting':>14} {'none after':>12} "
          f"{'ratio':>8}")
    for key in none:
        value, base = waiting[key], after[key]
        ratio = f"{value / base:.2f}x" if base else "n/a"
        print(f"{key:20} {none[key]:12.2f} {value:14.2f} {base:12.2f} {ratio:>8}")
    print(f"\n{'latency (ms)':24} {'p50':>8} {'p99':>8} {'n':>6}")
    for label, values in (("approve -> tool start", approved),
                          ("host job -> job start", probed)):
        print(f"{label:24} {percentile(values, 0.5):8.1f} {percentile(values, 0.99):8.1f} "
              f"{len(values):6}")
    if probed:
        print(f"{'ratio (p50)':24} {percentile(approved, 0.5) / percentile(probed, 0.5):7.2f}x")
    print()
    for key, floor in (("worker CPU %", CPU_FLOOR), ("Postgres CPU %", CPU_FLOOR),
                       ("transactions/s", TPS_FLOOR)):
        base, value = after[key], waiting[key]
        ok = value <= RATIO * base or value - base <= floor
        print(f"  {key} with {args.waiting} waiting <= {RATIO}x none after (or +{floor:g}): "
              f"{'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
