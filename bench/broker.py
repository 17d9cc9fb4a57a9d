"""Benchmark our PostgresBroker against dramatiq's RedisBroker: wake-up latency and drain rate.

Run it from the project root with the project's virtualenv::

    python bench/broker.py                      # defaults: 300 samples, 5000-job backlog
    python bench/broker.py --samples 100 --backlog 2000 --threads 4 --skip-redis

It measures, for each broker in the same run:

1. commit-to-actor-start latency: one message at a time, N sequential samples
   spaced 5-10 ms apart so every sample is a cold wake-up (LISTEN/NOTIFY for
   Postgres, the consumer's poll for Redis), never a backlog. For Postgres the
   message is written with ``broker.enqueue(message, connection=conn)`` inside
   a psycopg transaction; the clock starts just before ``conn.commit()``. For
   Redis the clock starts just before ``actor.send()``. It stops when the actor
   body starts (``time.perf_counter()`` in the same process).
2. backlog drain rate: K no-op jobs are enqueued first, then ONE in-process
   ``dramatiq.Worker(broker, worker_threads=T)`` is started, and jobs/s is
   measured until the last job has been acknowledged (an ``after_ack``
   middleware counts acks for both brokers).

Postgres uses a dedicated database (``solidloop_bench``; created if missing,
its solidloop tables dropped and re-created by the migrations). Redis uses the
key namespace ``solidloop-bench``, flushed before and after. If Redis is not
reachable, the Redis column is skipped with a note.
"""

from __future__ import annotations

import argparse
import logging
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from flask_solidloop.database import ensure_database
from flask_solidloop.migrations import upgrade
from flask_solidloop.queue.broker import PostgresBroker, libpq_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_NAMESPACE = "solidloop-bench"
QUEUE = "bench"
WARMUP_SAMPLES = 10

# The targets from our issue: a cold wake-up within 5 ms at the median, and at
# least 1000 jobs/s drained by one worker process.
TARGET_P50_MS = 5.0
TARGET_DRAIN = 1000.0


# -- results -------------------------------------------------------------------


@dataclass
class Latency:
    samples_ms: list[float] = field(default_factory=list)
    commit_ms: list[float] = field(default_factory=list)  # postgres only: conn.commit() itself
    lost: int = 0

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)


@dataclass
class Drain:
    jobs: int
    acked: int
    seconds: float
    enqueue_seconds: float
    timed_out: bool = False
    note: str = ""

    @property
    def rate(self) -> float:
        return self.acked / self.seconds if self.seconds > 0 else float("nan")


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil(n * pct / 100), at least 1
    return ordered[int(rank) - 1]


# -- shared plumbing -----------------------------------------------------------


class AckCounter(dramatiq.Middleware):
    """Counts acknowledged messages; sets ``done`` once ``target`` is reached."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.target = -1
        self.done = threading.Event()
        self.last_ack = 0.0

    def reset(self, target: int) -> None:
        with self.lock:
            self.count = 0
            self.target = target
            self.done.clear()

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.count += 1
            self.last_ack = time.perf_counter()
            if self.count == self.target:
                self.done.set()


@dataclass
class Harness:
    """One broker with the benchmark's two actors bound to it explicitly."""

    broker: dramatiq.Broker
    probe: dramatiq.Actor
    noop: dramatiq.Actor
    started: queue.Queue[tuple[int, float]]
    acks: AckCounter


def make_harness(broker: dramatiq.Broker) -> Harness:
    started: queue.Queue[tuple[int, float]] = queue.Queue()

    def latency_probe(seq: int) -> None:
        started.put((seq, time.perf_counter()))

    def noop() -> None:
        return None

    # Actors bind to the broker passed here, never to dramatiq's global broker.
    probe = dramatiq.Actor(latency_probe, broker=broker, actor_name="bench_latency_probe",
                           queue_name=QUEUE, priority=0, options={})
    noop_actor = dramatiq.Actor(noop, broker=broker, actor_name="bench_noop",
                                queue_name=QUEUE, priority=0, options={})
    acks = AckCounter()
    broker.add_middleware(acks)
    return Harness(broker, probe, noop_actor, started, acks)


def start_worker(broker: dramatiq.Broker, threads: int) -> dramatiq.Worker:
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.start()
    return worker


def stop_worker(worker: dramatiq.Worker) -> None:
    worker.stop(timeout=10_000)


def measure_latency(
    harness: Harness,
    samples: int,
    threads: int,
    send: Callable[[int], tuple[float, float | None]],
) -> Latency:
    """``send(seq)`` enqueues one probe and returns (t_start, commit duration or None)."""
    result = Latency()
    worker = start_worker(harness.broker, threads)
    try:
        time.sleep(0.2)  # let the consumer connect (and LISTEN) before the first sample
        for seq in range(-WARMUP_SAMPLES, samples):
            t0, commit_s = send(seq)
            while True:
                try:
                    got, t_actor = harness.started.get(timeout=5.0)
                except queue.Empty:
                    result.lost += 1
                    break
                if got == seq:
                    if seq >= 0:
                        result.samples_ms.append((t_actor - t0) * 1000)
                        if commit_s is not None:
                            result.commit_ms.append(commit_s * 1000)
                    break
            # Spaced out so the consumer is idle again: each sample is a cold wake-up.
            time.sleep(random.uniform(0.005, 0.010))
    finally:
        stop_worker(worker)
    return result


def measure_drain(
    harness: Harness,
    jobs: int,
    threads: int,
    enqueue_backlog: Callable[[int], None],
    timeout: float,
) -> Drain:
    t_enqueue = time.perf_counter()
    enqueue_backlog(jobs)
    enqueue_seconds = time.perf_counter() - t_enqueue
    harness.acks.reset(jobs)
    t0 = time.perf_counter()
    worker = start_worker(harness.broker, threads)
    try:
        finished = harness.acks.done.wait(timeout)
        with harness.acks.lock:
            acked = harness.acks.count
            t_end = harness.acks.last_ack if finished else time.perf_counter()
    finally:
        stop_worker(worker)
    return Drain(jobs=jobs, acked=acked, seconds=t_end - t0,
                 enqueue_seconds=enqueue_seconds, timed_out=not finished)


# -- postgres --------------------------------------------------------------------


def reset_postgres(url: str) -> str:
    """Create the bench database if needed, drop our tables, migrate. Returns server info."""
    ensure_database(url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        tables = [row[0] for row in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename LIKE 'solidloop\\_%'"
        )]
        for table in tables:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(
                sql.Identifier(table)))
        version = conn.execute("SHOW server_version").fetchone()[0]
        sync = conn.execute("SHOW synchronous_commit").fetchone()[0]
    upgrade(url)
    return f"PostgreSQL {version}, synchronous_commit={sync}"


def truncate_jobs(url: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("TRUNCATE solidloop_jobs RESTART IDENTITY")


def job_states(url: str) -> dict[str, int]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return dict(conn.execute(
            "SELECT state, count(*) FROM solidloop_jobs GROUP BY state").fetchall())


def bench_postgres(args: argparse.Namespace) -> tuple[Latency, Drain, str]:
    info = reset_postgres(args.url)

    # Latency: one transaction per sample, enqueue on the caller's connection, commit.
    truncate_jobs(args.url)
    broker = PostgresBroker(args.url, job_lease=60, poll_interval=1.0)
    harness = make_harness(broker)
    sender = psycopg.connect(libpq_url(args.url))
    try:
        def send(seq: int) -> tuple[float, float]:
            broker.enqueue(harness.probe.message(seq), connection=sender)
            t0 = time.perf_counter()
            sender.commit()
            return t0, time.perf_counter() - t0

        latency = measure_latency(harness, args.samples, args.threads, send)
    finally:
        sender.close()
        broker.close()

    # Drain: the whole backlog in one transaction, pipelined, before the worker starts.
    truncate_jobs(args.url)
    broker = PostgresBroker(args.url, job_lease=60, poll_interval=1.0)
    harness = make_harness(broker)
    try:
        def enqueue_backlog(jobs: int) -> None:
            with psycopg.connect(libpq_url(args.url)) as conn:
                with conn.pipeline():
                    for _ in range(jobs):
                        broker.enqueue(harness.noop.message(), connection=conn)
                conn.commit()

        drain = measure_drain(harness, args.backlog, args.threads, enqueue_backlog,
                              args.drain_timeout)
    finally:
        broker.close()
    states = job_states(args.url)
    drain.note = "rows by state after drain: " + ", ".join(
        f"{state}={count}" for state, count in sorted(states.items()))
    truncate_jobs(args.url)
    return latency, drain, info


# -- redis -----------------------------------------------------------------------


def redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=5.0)


def flush_redis_namespace(client: Any) -> None:
    keys = list(client.scan_iter(match=REDIS_NAMESPACE + "*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])


def redis_unavailable(url: str) -> str | None:
    """None if Redis answers at ``url``, else why not."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is not installed"
    try:
        client = redis_client(url)
        client.ping()
        client.close()
    except Exception as exc:
        return f"cannot reach Redis at {url}: {str(exc).rstrip('.')}"
    return None


def bench_redis(args: argparse.Namespace) -> tuple[Latency, Drain, str]:
    from dramatiq.brokers.redis import RedisBroker

    client = redis_client(args.redis_url)
    info = "Redis " + str(client.info("server").get("redis_version", "?"))
    flush_redis_namespace(client)
    try:
        broker = RedisBroker(url=args.redis_url, namespace=REDIS_NAMESPACE)
        harness = make_harness(broker)

        def send(seq: int) -> tuple[float, None]:
            t0 = time.perf_counter()
            harness.probe.send(seq)
            return t0, None

        latency = measure_latency(harness, args.samples, args.threads, send)
        broker.close()
        flush_redis_namespace(client)

        broker = RedisBroker(url=args.redis_url, namespace=REDIS_NAMESPACE)
        harness = make_harness(broker)

        def enqueue_backlog(jobs: int) -> None:
            for _ in range(jobs):
                harness.noop.send()

        drain = measure_drain(harness, args.backlog, args.threads, enqueue_backlog,
                              args.drain_timeout)
        broker.close()
    finally:
        flush_redis_namespace(client)
        client.close()
    return latency, drain, info


# -- report ----------------------------------------------------------------------


def fmt(value: float | None, digits: int) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs or ours != ours or theirs != theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(
    args: argparse.Namespace,
    pg: tuple[Latency, Drain, str],
    rd: tuple[Latency, Drain, str] | None,
    redis_note: str | None,
) -> None:
    pg_lat, pg_drain, pg_info = pg
    rd_lat, rd_drain = (rd[0], rd[1]) if rd else (None, None)

    print()
    print(f"worker: one in-process dramatiq.Worker(broker, worker_threads={args.threads}) "
          f"per broker and phase (queue prefetch {args.threads * 2}, dramatiq defaults)")
    print(f"latency: {args.samples} sequential samples (+{WARMUP_SAMPLES} warm-up), "
          f"5-10 ms apart; drain: backlog of {args.backlog} no-op jobs")
    print(f"postgres: {pg_info}; PostgresBroker(job_lease=60, poll_interval=1.0)")
    if rd:
        print(f"redis: {rd[2]}; RedisBroker(namespace={REDIS_NAMESPACE!r})")
    else:
        print(f"redis: skipped ({redis_note})")
    print()

    header = f"{'':24}{'postgres':>10}{'redis':>10}{'ratio':>10}   {'target':<17}{'':4}"
    print(header)
    rows = [
        ("latency p50 (ms)", pg_lat.p50, rd_lat.p50 if rd_lat else None, 2,
         f"<= {TARGET_P50_MS:g} ms", verdict(pg_lat.p50 <= TARGET_P50_MS)),
        ("latency p99 (ms)", pg_lat.p99, rd_lat.p99 if rd_lat else None, 2, "", ""),
        ("drain (jobs/s)", pg_drain.rate, rd_drain.rate if rd_drain else None, 0,
         f">= {TARGET_DRAIN:g} jobs/s",
         verdict(pg_drain.rate >= TARGET_DRAIN and not pg_drain.timed_out)),
    ]
    for label, ours, theirs, digits, target, mark in rows:
        print(f"{label:<24}{fmt(ours, digits):>10}{fmt(theirs, digits):>10}"
              f"{ratio(ours, theirs):>10}   {target:<17}{mark:4}")
    print()

    print("details:")
    print(f"  postgres commit itself (conn.commit, included above): "
          f"p50 {fmt(percentile(pg_lat.commit_ms, 50), 2)} ms, "
          f"p99 {fmt(percentile(pg_lat.commit_ms, 99), 2)} ms")
    for name, lat, drain in (("postgres", pg_lat, pg_drain), ("redis", rd_lat, rd_drain)):
        if lat is None or drain is None:
            continue
        spread = (f"min {fmt(min(lat.samples_ms, default=None), 2)} / "
                  f"mean {fmt(statistics.fmean(lat.samples_ms) if lat.samples_ms else None, 2)}"
                  f" / max {fmt(max(lat.samples_ms, default=None), 2)} ms")
        lost = f", {lat.lost} samples lost (>5 s)" if lat.lost else ""
        print(f"  {name} latency: {spread}{lost}")
        status = " TIMED OUT" if drain.timed_out else ""
        print(f"  {name} drain: {drain.acked}/{drain.jobs} acked in {drain.seconds:.2f} s"
              f"{status} (backlog enqueued in {drain.enqueue_seconds:.2f} s)"
              + (f"; {drain.note}" if drain.note else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--samples", type=int, default=300, help="latency samples (300)")
    parser.add_argument("--backlog", type=int, default=5000, help="jobs in the drain backlog")
    parser.add_argument("--threads", type=int, default=4, help="worker threads (4)")
    parser.add_argument("--skip-redis", action="store_true", help="benchmark Postgres only")
    parser.add_argument("--url", default=DEFAULT_URL, help="Postgres URL of the bench database")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis URL")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="give up on a drain after this many seconds (60)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    redis_note = "--skip-redis" if args.skip_redis else redis_unavailable(args.redis_url)
    if redis_note and not args.skip_redis:
        print(f"note: {redis_note}; skipping the redis column", file=sys.stderr)

    t_start = time.perf_counter()
    print("postgres: measuring ...", file=sys.stderr)
    pg = bench_postgres(args)
    rd = None
    if not redis_note:
        print("redis: measuring ...", file=sys.stderr)
        try:
            rd = bench_redis(args)
        except Exception as exc:  # Redis went away mid-run: report Postgres anyway
            redis_note = f"redis run failed: {exc}"
            print(f"note: {redis_note}; skipping the redis column", file=sys.stderr)
    report(args, pg, rd, redis_note)
    print(f"\n(total run {time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
