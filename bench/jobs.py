"""RQ-style jobs on our queue, side by side with RQ 2.x on Redis: latency and drain.

Run it from the project root with the project's virtualenv (``pip install -e
'.[bench]'`` brings rq and redis)::

    python bench/jobs.py                        # 200 samples, 2000-job backlog
    python bench/jobs.py --samples 100 --backlog 1000 --threads 4

Both sides run the same kind of job, an RQ-style call of a module-level
function recorded by import path, enqueued with each library's
``q.enqueue(f, i)`` (ours commits the job row and its NOTIFY on the broker's
pool; RQ writes to Redis). The job body notes ``time.time()`` when it starts.

1. enqueue-to-start latency: one job at a time, samples spaced 5-10 ms apart
   so each is a cold wake-up; the clock starts just before ``q.enqueue`` and
   stops when the job body starts.
2. drain rate: a backlog of K jobs is enqueued first, then the worker starts;
   the rate is (K - 1) / (last start - first start), so process start-up is
   not counted for either side.

Ours: one in-process ``dramatiq.Worker`` on the app's Postgres broker, with T
threads (default 4) and with 1 thread. RQ: ``rq worker`` (its default Worker,
which forks a work horse per job) and ``rq worker -w rq.SimpleWorker`` (no
fork), each one process on the local Redis. Postgres uses the database
``solidloop_bench_jobs`` (created if missing); Redis uses db 0 with keys under
``solidloop-bench-rq``, deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_jobs"
REDIS_URL = "redis://127.0.0.1:6379/0"
RQ_QUEUE = "solidloop-bench-rq"
STARTS_KEY = "solidloop-bench-rq:starts"

#: Job start times, by sample number (ours run in this process).
STARTS: dict[int, float] = {}


def pg_mark(i: int) -> None:
    STARTS[i] = time.time()


def rq_mark(i: int) -> None:
    from rq import get_current_job

    job = get_current_job()
    assert job is not None
    job.connection.hset(STARTS_KEY, str(i), repr(time.time()))


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * pct / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def drain_rate(starts: list[float]) -> float:
    return (len(starts) - 1) / (max(starts) - min(starts)) if len(starts) > 1 else 0.0


# -- ours ----------------------------------------------------------------------------

def make_app(url: str) -> Any:
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_solidloop import SolidLoop

    app = Flask("bench_jobs")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy(app)
    solidloop = SolidLoop(app, db=db)
    return app, solidloop.queue("bench")


def run_ours(url: str, samples: int, backlog: int, threads: int,
             module: Any) -> dict[str, float]:
    import dramatiq

    from flask_solidloop.state import get_state

    app, queue = make_app(url)
    broker = get_state(app).broker
    broker.flush("bench")
    result: dict[str, float] = {}
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.start()
    try:
        latencies = []
        for i in range(samples + 10):
            time.sleep(random.uniform(0.005, 0.010))
            started = time.time()
            queue.enqueue(module.pg_mark, i, result_ttl=0)
            deadline = time.monotonic() + 10
            while i not in module.STARTS and time.monotonic() < deadline:
                time.sleep(0.0002)
            if i >= 10 and i in module.STARTS:  # the first ten warm up
                latencies.append((module.STARTS[i] - started) * 1000)
        result["p50"], result["p99"] = percentile(latencies, 50), percentile(latencies, 99)
    finally:
        worker.stop()
    module.STARTS.clear()
    base = 1_000_000
    for i in range(backlog):
        queue.enqueue(module.pg_mark, base + i, result_ttl=0)
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while len(module.STARTS) < backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        result["drain"] = drain_rate(list(module.STARTS.values()))
    finally:
        worker.stop()
        module.STARTS.clear()
        broker.close()
    return result


# -- RQ --------------------------------------------------------------------------------

def run_rq(samples: int, backlog: int, worker_class: str | None) -> dict[str, float]:
    from redis import Redis
    from rq import Queue

    redis = Redis.from_url(REDIS_URL)
    queue = Queue(RQ_QUEUE, connection=redis)
    queue.empty()
    redis.delete(STARTS_KEY)
    cmd = [str(Path(sys.executable).with_name("rq")), "worker", RQ_QUEUE, "--url", REDIS_URL,
           "--quiet"]
    if worker_class:
        cmd += ["--worker-class", worker_class]
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result: dict[str, float] = {}

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(2.0)  # let the worker import and reach its BLPOP
        return proc

    proc = start()
    try:
        latencies = []
        for i in range(samples + 10):
            time.sleep(random.uniform(0.005, 0.010))
            started = time.time()
            queue.enqueue("jobs.rq_mark", i, result_ttl=0)
            deadline = time.monotonic() + 10
            value = None
            while value is None and time.monotonic() < deadline:
                value = redis.hget(STARTS_KEY, str(i))
                if value is None:
                    time.sleep(0.0002)
            if i >= 10 and value is not None:
                latencies.append((float(value) - started) * 1000)
        result["p50"], result["p99"] = percentile(latencies, 50), percentile(latencies, 99)
    finally:
        proc.terminate()
        proc.wait()
    redis.delete(STARTS_KEY)
    with redis.pipeline() as pipe:
        for i in range(backlog):
            queue.enqueue("jobs.rq_mark", 1_000_000 + i, result_ttl=0, pipeline=pipe)
        pipe.execute()
    proc = start()
    try:
        deadline = time.monotonic() + 300
        while redis.hlen(STARTS_KEY) < backlog and time.monotonic() < deadline:
            time.sleep(0.05)
        result["drain"] = drain_rate([float(v) for v in redis.hvals(STARTS_KEY)])
    finally:
        proc.terminate()
        proc.wait()
        queue.empty()
        redis.delete(STARTS_KEY)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("SOLIDLOOP_BENCH_URL", DEFAULT_URL))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    # Each phase starts a fresh dramatiq.Worker on the same broker; dramatiq warns
    # that its worker middleware is added twice, which is harmless here.
    logging.getLogger("dramatiq.broker.PostgresBroker").setLevel(logging.ERROR)
    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    ensure_database(args.url)
    upgrade(args.url)
    # Jobs are recorded by import path, and this file runs as __main__: import it
    # under its module name, so ours and RQ's workers resolve "jobs:..." alike.
    sys.path.insert(0, str(HERE))
    import jobs as module  # type: ignore[import-not-found]

    rows = [
        (f"ours, 1 process x {args.threads} threads",
         run_ours(args.url, args.samples, args.backlog, args.threads, module)),
        ("ours, 1 process x 1 thread", run_ours(args.url, args.samples, args.backlog, 1, module)),
        ("RQ Worker (forks per job)", run_rq(args.samples, args.backlog, None)),
        ("RQ SimpleWorker (no fork)", run_rq(args.samples, args.backlog, "rq.SimpleWorker")),
    ]
    import rq

    print(f"\nRQ-style jobs: {args.samples} latency samples, {args.backlog}-job backlog "
          f"(rq {rq.__version__}, same machine, same run)\n")
    print(f"{'':<34}{'p50 ms':>9}{'p99 ms':>9}{'drain jobs/s':>14}")
    for name, r in rows:
        print(f"{name:<34}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['drain']:>14.0f}")
    ours, rq_fork, rq_simple = rows[0][1], rows[2][1], rows[3][1]
    print()
    for label, other in (("RQ Worker", rq_fork), ("RQ SimpleWorker", rq_simple)):
        print(f"ours ({args.threads} threads) vs {label}: latency p50 "
              f"{other['p50'] / ours['p50']:.2f}x lower, drain "
              f"{ours['drain'] / other['drain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
