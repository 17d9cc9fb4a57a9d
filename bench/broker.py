"""Benchmark our PostgresBroker against its floor and its peers: wake-up latency and drain rate.

Run it from the project root with the project's virtualenv (procrastinate and
redis are in the ``bench`` extra: ``pip install -e '.[bench]'``)::

    python bench/broker.py                      # 300 samples, 5000-job backlog, 3 rounds
    python bench/broker.py --samples 150 --backlog 2000 --rounds 2 --skip-redis

Four columns, measured in the same run:

* **postgres**: our ``PostgresBroker`` under one in-process
  ``dramatiq.Worker(broker, worker_threads=T)``.
* **raw floor**: bare psycopg, no queue library. Latency: one connection runs
  ``INSERT`` (into a scratch table) + ``pg_notify`` in one statement inside a
  transaction, and another connection blocked in ``LISTEN`` wakes up. Drain:
  one autocommit connection takes the backlog in batches of ``2 * T`` rows
  with ``DELETE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING``
  (one statement and one commit per batch, no worker, no ack): the cheapest
  way SQL can hand out a backlog, a ceiling rather than a peer.
* **procrastinate**: procrastinate 3.x (a maintained PostgreSQL job queue)
  with ``PsycopgConnector``, its own worker (``App.run_worker_async``, the
  code behind ``procrastinate worker``) run in this process on an event-loop
  thread of its own, ``concurrency=T``, async no-op tasks (its fastest
  kind). Jobs are deferred with ``task.configure(connection=conn)`` inside a
  psycopg transaction, like ours. It has a database of its own.
* **redis**: dramatiq's stock ``RedisBroker`` (skipped if Redis is not reachable).

Each system is measured the same way:

1. commit-to-start latency: one job at a time, N sequential samples spaced
   5-10 ms apart so every sample is a cold wake-up, never a backlog. The job
   is written inside a psycopg transaction; the clock starts just before
   ``conn.commit()`` (Redis: just before ``actor.send()``) and stops when the
   actor/task body starts (raw floor: when the LISTENing connection receives
   the notification), ``time.perf_counter()`` in this process.
2. backlog drain rate: K no-op jobs are committed first, then one worker is
   started and jobs/s is measured up to the last acknowledged job (dramatiq:
   an ``after_ack`` middleware; procrastinate: its worker run with
   ``wait=False`` returns once the queue is empty and every job is finished).

The phases are interleaved to spread noise evenly: ``--rounds`` rounds, each
running every system's latency phase (a 1/rounds share of the samples) and
then every system's drain, in an order rotated each round. Latency
percentiles pool the samples of all rounds; drains show the median of the
rounds with min-max.

Databases: ours in ``--url`` (``solidloop_*`` tables dropped and migrated at
the start) and the raw floor's scratch table ``bench_raw_floor`` next to
them; procrastinate's in ``--procrastinate-url`` (dropped, re-created, its
schema applied). Redis uses the key namespace ``--redis-namespace``, flushed
before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from dramatiq.message import Message
from psycopg import sql
from psycopg.types.json import Jsonb
from sqlalchemy.engine import make_url

from flask_solidloop.database import ensure_database
from flask_solidloop.migrations import upgrade
from flask_solidloop.queue.broker import PostgresBroker, libpq_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench"
DEFAULT_PROCRASTINATE_URL = "postgresql://postgres@127.0.0.1:5432/solidloop_bench_procrastinate"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_REDIS_NAMESPACE = "solidloop-bench"
QUEUE = "bench"
WARMUP_SAMPLES = 10
RAW_TABLE = "bench_raw_floor"
RAW_CHANNEL = "bench_raw_floor"

# Targets: a cold wake-up within 5 ms at the median and at least 1000 jobs/s
# drained by one worker process (the broker's first issue); and, from issue 10,
# a median within 1.2x of the raw floor and a drain at least 2x procrastinate's.
TARGET_P50_MS = 5.0
TARGET_DRAIN = 1000.0
TARGET_FLOOR_RATIO = 1.2
TARGET_PROCRASTINATE_RATIO = 2.0

SYSTEMS = ("postgres", "raw", "procrastinate", "redis", "pg-async")
TITLES = {"postgres": "postgres", "raw": "raw floor", "procrastinate": "procrastinate",
          "redis": "redis", "pg-async": "pg async claim"}


# -- results -------------------------------------------------------------------


@dataclass
class Latency:
    samples_ms: list[float] = field(default_factory=list)
    commit_ms: list[float] = field(default_factory=list)  # conn.commit() itself, where timed
    lost: int = 0
    #: Our broker only: each sample cut into stages (ms), see Ours.latency.
    stages: dict[str, list[float]] = field(default_factory=dict)

    def extend(self, other: Latency) -> None:
        self.samples_ms += other.samples_ms
        self.commit_ms += other.commit_ms
        self.lost += other.lost
        for stage, values in other.stages.items():
            self.stages.setdefault(stage, []).extend(values)

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


def sample_latency(
    samples: int,
    send: Callable[[int], tuple[float, float | None]],
    started: queue.Queue[tuple[int, float]],
    on_sample: Callable[[Latency, float, float | None, float], None] | None = None,
) -> Latency:
    """``send(seq)`` writes one probe and returns (t_start, commit duration or None);
    whatever runs the probe puts ``(seq, time.perf_counter())`` on ``started``.
    ``on_sample(result, t0, commit_s, t_started)`` sees every kept sample."""
    result = Latency()
    for seq in range(-WARMUP_SAMPLES, samples):
        t0, commit_s = send(seq)
        while True:
            try:
                got, t_start = started.get(timeout=5.0)
            except queue.Empty:
                result.lost += 1
                break
            if got == seq:
                if seq >= 0:
                    result.samples_ms.append((t_start - t0) * 1000)
                    if commit_s is not None:
                        result.commit_ms.append(commit_s * 1000)
                    if on_sample is not None:
                        on_sample(result, t0, commit_s, t_start)
                break
        # Spaced out so the consumer is idle again: each sample is a cold wake-up.
        time.sleep(random.uniform(0.005, 0.010))
    return result


def sample_message() -> str:
    """A no-op dramatiq message as JSON: the raw floor's rows carry the same bytes."""
    message = Message(queue_name=QUEUE, actor_name="bench_noop", args=(), kwargs={},
                      options={})
    return json.dumps(message.asdict())


def database_named(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def recreate_database(url: str) -> None:
    """Drop (with FORCE) and create the database of ``url``."""
    parsed = make_url(url)
    admin = libpq_url(database_named(url, "postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(parsed.database)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(parsed.database)))


# -- dramatiq brokers (ours and Redis) --------------------------------------------


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


@contextlib.contextmanager
def running_worker(broker: dramatiq.Broker, threads: int) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(timeout=10_000)


def dramatiq_latency(
    harness: Harness, samples: int, threads: int,
    send: Callable[[int], tuple[float, float | None]],
    on_sample: Callable[[Latency, float, float | None, float], None] | None = None,
) -> Latency:
    with running_worker(harness.broker, threads):
        time.sleep(0.2)  # let the consumer connect (and LISTEN) before the first sample
        return sample_latency(samples, send, harness.started, on_sample)


def dramatiq_drain(harness: Harness, jobs: int, threads: int,
                   enqueue_backlog: Callable[[int], None], timeout: float) -> Drain:
    t_enqueue = time.perf_counter()
    enqueue_backlog(jobs)
    enqueue_seconds = time.perf_counter() - t_enqueue
    harness.acks.reset(jobs)
    t0 = time.perf_counter()
    with running_worker(harness.broker, threads):
        finished = harness.acks.done.wait(timeout)
        with harness.acks.lock:
            acked = harness.acks.count
            t_end = harness.acks.last_ack if finished else time.perf_counter()
    return Drain(jobs=jobs, acked=acked, seconds=t_end - t0,
                 enqueue_seconds=enqueue_seconds, timed_out=not finished)


class Ours:
    """Our PostgresBroker.

    ``async_claims`` (the "pg async claim" column, ``--async-claims``) is an
    experiment, not a setting of the broker: the broker's pool (where the
    consumers claim and ack) runs ``synchronous_commit = off``, so a claim's
    commit does not wait for its WAL flush. It shows what the claim's fsync costs in the wake-up
    path.
    """

    def __init__(self, args: argparse.Namespace, *, async_claims: bool = False) -> None:
        self.args = args
        self.async_claims = async_claims
        self.info = ""

    def setup(self) -> None:
        if self.async_claims:  # the plain column's setup has migrated the database
            self.info = ("the same broker and database; its pool's connections (claims, acks) run "
                         "synchronous_commit = off (an experiment, not a broker setting)")
            return
        url = self.args.url
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
        self.info = (f"PostgreSQL {version}, synchronous_commit={sync}; "
                     "PostgresBroker(job_lease=60, poll_interval=1.0)")

    def _sql(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(libpq_url(self.args.url), autocommit=True) as conn:
            cur = conn.execute(query)
            return cur.fetchall() if cur.description else []

    def _broker(self, claims: list[tuple[float, float]] | None = None) -> PostgresBroker:
        """A fresh broker on an empty table. Its consumers record (start, end)
        of every claim that returned rows in ``claims``."""
        self._sql("TRUNCATE solidloop_jobs RESTART IDENTITY")
        broker = PostgresBroker(self.args.url, job_lease=60, poll_interval=1.0)
        if self.async_claims:
            # Claims (and acks) go through the broker's pool: make its connections
            # commit asynchronously before the first one is opened.
            from psycopg_pool import ConnectionPool

            broker._pool = ConnectionPool(
                broker.conninfo, min_size=1, max_size=4, open=True,
                kwargs={"autocommit": True, "options": "-c synchronous_commit=off"},
                name="solidloop-broker")
        consume = broker.consume

        def instrumented(queue_name: str, prefetch: int = 1, timeout: int = 30000) -> Any:
            consumer: Any = consume(queue_name, prefetch, timeout)
            if claims is not None:
                look = consumer._look

                def timed_look() -> bool:
                    t0 = time.perf_counter()
                    got = look()
                    if got:
                        claims.append((t0, time.perf_counter()))
                    return got

                consumer._look = timed_look
            return consumer

        broker.consume = instrumented  # type: ignore[method-assign]
        return broker

    def latency(self, samples: int) -> Latency:
        claims: list[tuple[float, float]] = []
        broker = self._broker(claims)
        harness = make_harness(broker)
        sender = psycopg.connect(libpq_url(self.args.url))

        def on_sample(result: Latency, t0: float, commit_s: float | None, t_actor: float) -> None:
            # The claim that took this sample's job: the last one between the
            # commit's start and the actor's start (samples are sequential).
            mine = [c for c in claims if t0 <= c[0] and c[1] <= t_actor]
            claims.clear()
            if not mine or commit_s is None:
                return
            c0, c1 = mine[-1]
            for stage, ms in (("commit", commit_s), ("commit -> claim", c0 - (t0 + commit_s)),
                              ("claim", c1 - c0), ("claim -> actor", t_actor - c1)):
                result.stages.setdefault(stage, []).append(ms * 1000)

        try:
            def send(seq: int) -> tuple[float, float]:
                broker.enqueue(harness.probe.message(seq), connection=sender)
                t0 = time.perf_counter()
                sender.commit()
                return t0, time.perf_counter() - t0

            return dramatiq_latency(harness, samples, self.args.threads, send, on_sample)
        finally:
            sender.close()
            broker.close()

    def drain(self, jobs: int) -> Drain:
        broker = self._broker()
        harness = make_harness(broker)
        try:
            def enqueue_backlog(jobs: int) -> None:
                # The whole backlog in one transaction, pipelined, before the worker starts.
                with psycopg.connect(libpq_url(self.args.url)) as conn:
                    with conn.pipeline():
                        for _ in range(jobs):
                            broker.enqueue(harness.noop.message(), connection=conn)
                    conn.commit()

            drain = dramatiq_drain(harness, jobs, self.args.threads, enqueue_backlog,
                                   self.args.drain_timeout)
        finally:
            broker.close()
        states = self._sql("SELECT state, count(*) FROM solidloop_jobs GROUP BY state")
        drain.note = "rows by state after drain: " + ", ".join(
            f"{state}={count}" for state, count in sorted(states))
        return drain

    def teardown(self) -> None:
        if not self.async_claims:
            self._sql("TRUNCATE solidloop_jobs RESTART IDENTITY")


class Redis:
    """dramatiq's stock RedisBroker."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.info = ""

    @staticmethod
    def unavailable(url: str) -> str | None:
        """None if Redis answers at ``url``, else why not."""
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis package is not installed"
        try:
            client = Redis._client(url)
            client.ping()
            client.close()
        except Exception as exc:
            return f"cannot reach Redis at {url}: {str(exc).rstrip('.')}"
        return None

    @staticmethod
    def _client(url: str) -> Any:
        import redis

        return redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=5.0)

    def _flush(self) -> None:
        client = self._client(self.args.redis_url)
        try:
            keys = list(client.scan_iter(match=self.args.redis_namespace + "*", count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start:start + 500])
        finally:
            client.close()

    def setup(self) -> None:
        client = self._client(self.args.redis_url)
        try:
            self.info = (f"Redis {client.info('server').get('redis_version', '?')}; "
                         f"RedisBroker(namespace={self.args.redis_namespace!r})")
        finally:
            client.close()
        self._flush()

    def _broker(self) -> dramatiq.Broker:
        from dramatiq.brokers.redis import RedisBroker

        self._flush()
        return RedisBroker(url=self.args.redis_url, namespace=self.args.redis_namespace)

    def latency(self, samples: int) -> Latency:
        broker = self._broker()
        harness = make_harness(broker)
        try:
            def send(seq: int) -> tuple[float, None]:
                t0 = time.perf_counter()
                harness.probe.send(seq)
                return t0, None

            return dramatiq_latency(harness, samples, self.args.threads, send)
        finally:
            broker.close()

    def drain(self, jobs: int) -> Drain:
        broker = self._broker()
        harness = make_harness(broker)
        try:
            def enqueue_backlog(jobs: int) -> None:
                for _ in range(jobs):
                    harness.noop.send()

            return dramatiq_drain(harness, jobs, self.args.threads, enqueue_backlog,
                                  self.args.drain_timeout)
        finally:
            broker.close()

    def teardown(self) -> None:
        self._flush()


# -- the raw floor: psycopg alone ---------------------------------------------------

RAW_INSERT_AND_NOTIFY = (
    f"WITH job AS (INSERT INTO {RAW_TABLE} (payload) VALUES (%(payload)s) RETURNING id) "
    f"SELECT pg_notify('{RAW_CHANNEL}', %(seq)s) FROM job"
)
RAW_BACKLOG = (
    f"INSERT INTO {RAW_TABLE} (payload) SELECT %(payload)s::jsonb FROM generate_series(1, %(n)s)"
)
RAW_TAKE = (
    f"DELETE FROM {RAW_TABLE} WHERE id IN (SELECT id FROM {RAW_TABLE} ORDER BY id "
    "LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id, payload"
)


class RawFloor:
    """What PostgreSQL and psycopg cost with no queue library at all."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.conninfo = libpq_url(args.url)
        self.info = ""

    def _sql(self, query: str, params: Any = None) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute(query, params)

    def setup(self) -> None:
        self._sql(f"DROP TABLE IF EXISTS {RAW_TABLE}")
        self._sql(f"CREATE TABLE {RAW_TABLE} (id bigserial PRIMARY KEY, payload jsonb NOT NULL, "
                  "created_at timestamptz NOT NULL DEFAULT now())")
        self.info = (f"table {RAW_TABLE} in the postgres database; latency: INSERT + pg_notify "
                     f"in one statement, commit, a LISTENing connection wakes; drain: "
                     f"DELETE ... SKIP LOCKED ... RETURNING, {2 * self.args.threads} rows "
                     "per statement, one connection")

    def latency(self, samples: int) -> Latency:
        self._sql(f"TRUNCATE {RAW_TABLE} RESTART IDENTITY")
        started: queue.Queue[tuple[int, float]] = queue.Queue()
        ready = threading.Event()
        stop = threading.Event()

        def listen() -> None:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                conn.execute(f"LISTEN {RAW_CHANNEL}")
                ready.set()
                while not stop.is_set():
                    for note in conn.notifies(timeout=0.5):
                        started.put((int(note.payload), time.perf_counter()))

        listener = threading.Thread(target=listen, name="raw-floor-listener", daemon=True)
        listener.start()
        if not ready.wait(10):
            raise RuntimeError("the raw floor's LISTEN connection did not come up")
        payload = Jsonb(json.loads(sample_message()))
        sender = psycopg.connect(self.conninfo)
        try:
            def send(seq: int) -> tuple[float, float]:
                sender.execute(RAW_INSERT_AND_NOTIFY, {"payload": payload, "seq": str(seq)})
                t0 = time.perf_counter()
                sender.commit()
                return t0, time.perf_counter() - t0

            return sample_latency(samples, send, started)
        finally:
            stop.set()
            sender.close()
            listener.join(5)

    def drain(self, jobs: int) -> Drain:
        self._sql(f"TRUNCATE {RAW_TABLE} RESTART IDENTITY")
        t_enqueue = time.perf_counter()
        self._sql(RAW_BACKLOG, {"payload": sample_message(), "n": jobs})
        enqueue_seconds = time.perf_counter() - t_enqueue
        batch = 2 * self.args.threads
        taken = 0
        t0 = time.perf_counter()
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            deadline = t0 + self.args.drain_timeout
            while time.perf_counter() < deadline:
                rows = conn.execute(RAW_TAKE, (batch,)).fetchall()
                if not rows:
                    break
                taken += len(rows)
        t_end = time.perf_counter()
        return Drain(jobs=jobs, acked=taken, seconds=t_end - t0, enqueue_seconds=enqueue_seconds,
                     timed_out=taken < jobs,
                     note=f"{math.ceil(jobs / batch)} statements of up to {batch} rows")

    def teardown(self) -> None:
        self._sql(f"DROP TABLE IF EXISTS {RAW_TABLE}")


# -- procrastinate 3.x ---------------------------------------------------------------


class Procrastinate:
    """procrastinate with its psycopg connector and its own worker, in this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.conninfo = libpq_url(args.procrastinate_url)
        self.info = ""
        self.started: queue.Queue[tuple[int, float]] = queue.Queue()
        self.ran = 0

    def setup(self) -> None:
        import procrastinate

        recreate_database(self.args.procrastinate_url)
        schema_app = procrastinate.App(
            connector=procrastinate.SyncPsycopgConnector(conninfo=self.conninfo))
        with schema_app.open():
            schema_app.schema_manager.apply_schema()
        version = getattr(procrastinate, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("procrastinate")
        database = make_url(self.args.procrastinate_url).database
        self.info = (f"procrastinate {version}; PsycopgConnector, worker in-process "
                     f"(run_worker_async, concurrency={self.args.threads}, listen_notify=True, "
                     f"delete_jobs=never as by default), async no-op tasks; database {database}")

        started = self.started

        async def probe(seq: int) -> None:
            started.put((seq, time.perf_counter()))

        async def noop() -> None:
            self.ran += 1

        # The worker's app (async connector) runs the tasks; the deferring app
        # (sync connector, as a web process would use) only needs their names.
        self.app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(conninfo=self.conninfo))
        self.defer_app = procrastinate.App(
            connector=procrastinate.SyncPsycopgConnector(conninfo=self.conninfo))
        for app in (self.app, self.defer_app):
            app.task(name="bench_probe", queue=QUEUE)(probe)
            app.task(name="bench_noop", queue=QUEUE)(noop)
        self.defer_app.open()

    def _truncate(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs, procrastinate_events, "
                         "procrastinate_periodic_defers, procrastinate_workers "
                         "RESTART IDENTITY CASCADE")

    @contextlib.contextmanager
    def _worker(self, *, wait: bool) -> Iterator[dict[str, Any]]:
        """The worker on an event loop thread; yields a dict that gets 'ended'
        (perf_counter when run_worker_async returned) and 'error'."""
        state: dict[str, Any] = {"ended": None, "error": None}
        ready = threading.Event()
        loop_box: dict[str, Any] = {}

        async def main() -> None:
            async with self.app.open_async():
                loop_box["loop"] = asyncio.get_running_loop()
                loop_box["task"] = asyncio.current_task()
                state["t0"] = time.perf_counter()
                ready.set()
                try:
                    await self.app.run_worker_async(
                        queues=[QUEUE], concurrency=self.args.threads, wait=wait,
                        install_signal_handlers=False, listen_notify=True,
                        name="bench")
                    state["ended"] = time.perf_counter()
                except asyncio.CancelledError:
                    pass

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by the caller
                state["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=run, name="procrastinate-worker", daemon=True)
        thread.start()
        ready.wait(30)
        try:
            yield state
        finally:
            loop, task = loop_box.get("loop"), loop_box.get("task")
            if thread.is_alive() and loop is not None and task is not None and wait:
                loop.call_soon_threadsafe(task.cancel)
            thread.join(self.args.drain_timeout)
            if state["error"] is not None:
                raise RuntimeError(f"procrastinate worker failed: {state['error']!r}")

    def latency(self, samples: int) -> Latency:
        self._truncate()
        probe = self.defer_app.tasks["bench_probe"]
        sender = psycopg.connect(self.conninfo)
        try:
            with self._worker(wait=True):
                time.sleep(0.2)  # let it register and LISTEN before the first sample

                def send(seq: int) -> tuple[float, float]:
                    probe.configure(connection=sender).defer(seq=seq)
                    t0 = time.perf_counter()
                    sender.commit()
                    return t0, time.perf_counter() - t0

                return sample_latency(samples, send, self.started)
        finally:
            sender.close()

    def drain(self, jobs: int) -> Drain:
        self._truncate()
        noop = self.defer_app.tasks["bench_noop"]
        t_enqueue = time.perf_counter()
        with psycopg.connect(self.conninfo) as conn:
            noop.configure(connection=conn).batch_defer(*({} for _ in range(jobs)))
            conn.commit()
        enqueue_seconds = time.perf_counter() - t_enqueue
        self.ran = 0
        with self._worker(wait=False) as state:
            pass  # wait=False: the worker returns once the queue is empty and jobs finished
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            statuses = dict(conn.execute(
                "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY 1").fetchall())
        done = statuses.get("succeeded", 0)
        ended = state["ended"]
        seconds = (ended if ended is not None else time.perf_counter()) - state["t0"]
        return Drain(jobs=jobs, acked=done, seconds=seconds, enqueue_seconds=enqueue_seconds,
                     timed_out=ended is None or done < jobs,
                     note="jobs by status after drain: " + ", ".join(
                         f"{status}={count}" for status, count in sorted(statuses.items())))

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.defer_app.close()
        with contextlib.suppress(Exception):
            self._truncate()


# -- report ----------------------------------------------------------------------


def fmt(value: float | None, digits: int) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if not ours or not theirs or ours != ours or theirs != theirs:
        return None
    return ours / theirs


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def drain_summary(drains: list[Drain]) -> tuple[float | None, float | None, float | None]:
    rates = [d.rate for d in drains if d.rate == d.rate]
    if not rates:
        return None, None, None
    return statistics.median(rates), min(rates), max(rates)


def report(args: argparse.Namespace, systems: dict[str, Any], lat: dict[str, Latency],
           drains: dict[str, list[Drain]], skipped: dict[str, str]) -> None:
    names = [name for name in SYSTEMS if name in systems]
    print()
    print(f"worker: one in-process worker per system and phase, {args.threads} threads "
          f"(dramatiq prefetch {args.threads * 2}; procrastinate concurrency {args.threads})")
    print(f"latency: {args.samples} sequential samples per system (+{WARMUP_SAMPLES} warm-up "
          f"per phase), 5-10 ms apart; drain: backlog of {args.backlog} no-op jobs; "
          f"{args.rounds} interleaved rounds")
    for name in SYSTEMS:
        if name in systems:
            print(f"{TITLES[name]}: {systems[name].info}")
        elif name in skipped:
            print(f"{TITLES[name]}: skipped ({skipped[name]})")
    print()

    width = 15
    print(f"{'':22}" + "".join(f"{TITLES[n]:>{width}}" for n in names))
    medians = {n: drain_summary(drains[n]) for n in names}
    rows: list[tuple[str, Callable[[str], str]]] = [
        ("latency p50 (ms)", lambda n: fmt(lat[n].p50, 2)),
        ("latency p99 (ms)", lambda n: fmt(lat[n].p99, 2)),
        ("drain (jobs/s)", lambda n: fmt(medians[n][0], 0)),
        ("  min-max", lambda n: f"{fmt(medians[n][1], 0)}-{fmt(medians[n][2], 0)}"),
    ]
    for label, cell in rows:
        print(f"{label:<22}" + "".join(f"{cell(n):>{width}}" for n in names))
    print()

    pg_p50 = lat["postgres"].p50
    pg_drain = medians["postgres"][0]
    pg_ok = not any(d.timed_out for d in drains["postgres"])
    print("targets:")
    targets: list[tuple[str, str, bool | None]] = [
        (f"postgres latency p50 <= {TARGET_P50_MS:g} ms", f"{fmt(pg_p50, 2)} ms",
         pg_p50 <= TARGET_P50_MS),
        (f"postgres drain >= {TARGET_DRAIN:g} jobs/s", f"{fmt(pg_drain, 0)} jobs/s",
         pg_drain is not None and pg_drain >= TARGET_DRAIN and pg_ok),
    ]
    if "raw" in lat:
        floor_ratio = ratio(pg_p50, lat["raw"].p50)
        targets.append((f"postgres p50 <= {TARGET_FLOOR_RATIO:g}x raw floor p50",
                        f"{fmt(floor_ratio, 2)}x ({fmt(pg_p50, 2)} / {fmt(lat['raw'].p50, 2)})",
                        None if floor_ratio is None else floor_ratio <= TARGET_FLOOR_RATIO))
    if "procrastinate" in medians:
        proc_drain = medians["procrastinate"][0]
        proc_ratio = ratio(pg_drain, proc_drain)
        targets.append((f"postgres drain >= {TARGET_PROCRASTINATE_RATIO:g}x procrastinate",
                        f"{fmt(proc_ratio, 2)}x ({fmt(pg_drain, 0)} / {fmt(proc_drain, 0)})",
                        None if proc_ratio is None else
                        proc_ratio >= TARGET_PROCRASTINATE_RATIO and pg_ok))
    for label, value, ok in targets:
        mark = "-" if ok is None else verdict(ok)
        print(f"  {label:<42}{value:<28}{mark}")
    print()

    print("ratios (postgres / other):")
    for name in names:
        if name == "postgres":
            continue
        print(f"  vs {TITLES[name]:<14} latency p50 {fmt(ratio(pg_p50, lat[name].p50), 2)}x, "
              f"p99 {fmt(ratio(lat['postgres'].p99, lat[name].p99), 2)}x, "
              f"drain {fmt(ratio(pg_drain, medians[name][0]), 2)}x")
    print()

    print("details:")
    for name in names:
        latency = lat[name]
        if latency.commit_ms:
            print(f"  {TITLES[name]} commit itself (included above): "
                  f"p50 {fmt(percentile(latency.commit_ms, 50), 2)} ms, "
                  f"p99 {fmt(percentile(latency.commit_ms, 99), 2)} ms")
        spread = (f"min {fmt(min(latency.samples_ms, default=None), 2)} / mean "
                  f"{fmt(statistics.fmean(latency.samples_ms) if latency.samples_ms else None, 2)}"
                  f" / max {fmt(max(latency.samples_ms, default=None), 2)} ms")
        lost = f", {latency.lost} samples lost (>5 s)" if latency.lost else ""
        print(f"  {TITLES[name]} latency: {spread}{lost}")
        if latency.stages:
            print(f"  {TITLES[name]} latency by stage, p50 (ms): " + ", ".join(
                f"{stage} {fmt(percentile(values, 50), 2)}"
                for stage, values in latency.stages.items()))
        for i, drain in enumerate(drains[name], 1):
            status = " TIMED OUT" if drain.timed_out else ""
            print(f"  {TITLES[name]} drain {i}: {drain.acked}/{drain.jobs} in "
                  f"{drain.seconds:.2f} s = {fmt(drain.rate, 0)}/s{status} "
                  f"(backlog written in {drain.enqueue_seconds:.2f} s)"
                  + (f"; {drain.note}" if drain.note else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--samples", type=int, default=300,
                        help="latency samples per system, over all rounds (300)")
    parser.add_argument("--backlog", type=int, default=5000, help="jobs in each drain backlog")
    parser.add_argument("--threads", type=int, default=4, help="worker threads (4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--skip-redis", action="store_true", help="no Redis column")
    parser.add_argument("--skip-procrastinate", action="store_true",
                        help="no procrastinate column")
    parser.add_argument("--url", default=DEFAULT_URL, help="Postgres URL of the bench database")
    parser.add_argument("--procrastinate-url", default=DEFAULT_PROCRASTINATE_URL,
                        help="database for procrastinate (dropped and re-created)")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis URL")
    parser.add_argument("--redis-namespace", default=DEFAULT_REDIS_NAMESPACE,
                        help="Redis key namespace (flushed)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="give up on a drain after this many seconds (60)")
    parser.add_argument("--async-claims", action="store_true",
                        help="add the 'pg async claim' column: our broker with its claims "
                             "committed with synchronous_commit=off (an experiment)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    skipped: dict[str, str] = {}
    candidates: dict[str, Any] = {"postgres": Ours(args), "raw": RawFloor(args)}
    if args.skip_procrastinate:
        skipped["procrastinate"] = "--skip-procrastinate"
    else:
        try:
            import procrastinate  # noqa: F401
            candidates["procrastinate"] = Procrastinate(args)
        except ImportError:
            skipped["procrastinate"] = "the procrastinate package is not installed (bench extra)"
    redis_note = "--skip-redis" if args.skip_redis else Redis.unavailable(args.redis_url)
    if redis_note:
        skipped["redis"] = redis_note
    else:
        candidates["redis"] = Redis(args)
    if args.async_claims:
        candidates["pg-async"] = Ours(args, async_claims=True)
    for name, why in skipped.items():
        if not why.startswith("--"):
            print(f"note: {why}; skipping the {name} column", file=sys.stderr)

    t_start = time.perf_counter()
    systems: dict[str, Any] = {}
    for name, system in candidates.items():
        system.setup()
        systems[name] = system
    lat = {name: Latency() for name in systems}
    drains: dict[str, list[Drain]] = {name: [] for name in systems}
    per_round = math.ceil(args.samples / args.rounds)
    order = list(systems)
    try:
        for rnd in range(args.rounds):
            shift = rnd % len(order)
            rotated = order[shift:] + order[:shift]
            samples = min(per_round, args.samples - rnd * per_round)
            for name in rotated:
                print(f"round {rnd + 1}/{args.rounds}: {name} latency ...", file=sys.stderr)
                lat[name].extend(systems[name].latency(samples))
            for name in rotated:
                print(f"round {rnd + 1}/{args.rounds}: {name} drain ...", file=sys.stderr)
                drains[name].append(systems[name].drain(args.backlog))
    finally:
        for system in systems.values():
            system.teardown()
    report(args, systems, lat, drains, skipped)
    print(f"\n(total run {time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
