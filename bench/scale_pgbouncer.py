"""PgBouncer in transaction mode in front of a worker fleet, against the same fleet direct.

One run, two phases on the same PostgreSQL (a throwaway cluster on port 5442,
``max_connections = 300``, so the fleet never exhausts the shared server),
each with its own fleet of ``--processes`` (8) dramatiq worker processes x
``--threads`` (4), the LLM emulator in this process:

- ``direct``: the app's engine (``SQLALCHEMY_DATABASE_URI``) straight to
  PostgreSQL, preparing on (psycopg's default);
- ``pgbouncer``: the documented deployment of docs/guides/pgbouncer.md: the
  engine through PgBouncer (Debian's, ``pool_mode = transaction``,
  ``default_pool_size = --pool-size``) with ``prepare_threshold = None``,
  ``SOLIDLOOP_DATABASE_URL`` direct. The loops are started from this
  process through the same engine, as a web process would.

Per phase:

- wake-up latency: ``--samples`` loops started one at a time on an idle
  fleet; from just before ``Agent.start()`` (its transaction included) to the
  moment the model server receives the loop's first request: the enqueue's
  commit, the NOTIFY, the listener, the claim, the hand-off to a thread and
  the turn's own claim transaction, i.e. commit-to-actor-start plus the
  turn's first write;
- ``--loops`` (500) loops started at once (in every round), each two LLM turns around two
  parallel tool calls: all must complete; wall time, LLM turns/s, and the
  turn gap (a loop's first model request to its second: the tool phase and
  its commits);
- prepared-statement errors in the workers' logs (``InvalidSqlStatementName``,
  ``DuplicatePreparedStatement``, ``ProtocolViolation``, "prepared statement"),
  failed loops, and the peak of PostgreSQL backends (pg_stat_activity).

``--rounds`` (2) runs both phases that many times in alternating order
(direct then PgBouncer, then PgBouncer then direct, ...), each with a fleet
of its own, after an unreported warm-up load; the wake-up samples are split
across the rounds and pooled. Targets (PASS/MISS): every loop completes,
wake-up p50 through PgBouncer <= 2x direct, 0 prepared-statement errors.
Exit status 1 on a MISS.

    .venv/bin/python bench/scale_pgbouncer.py                 # about 6 min
    .venv/bin/python bench/scale_pgbouncer.py --quick         # about 2 min
    .venv/bin/python bench/scale_pgbouncer.py --loops 100 --samples 20 --processes 4
    .venv/bin/python bench/scale_pgbouncer.py --url postgresql+psycopg://postgres@127.0.0.1:5432/mine

``--url`` runs on an existing server's database instead of a throwaway
cluster (created and migrated if missing; mind its ``max_connections``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATABASE = "solidloop_bench_pgbouncer"
PREPARED_ERRORS = re.compile(r"InvalidSqlStatementName|DuplicatePreparedStatement|"
                             r"ProtocolViolation|prepared statement", re.IGNORECASE)
ENDED = ("completed", "failed", "paused", "stopped")


@dataclass
class Phase:
    name: str
    wake_ms: list[float] = field(default_factory=list)
    start_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    #: Per round: wall time of the load, loops completed.
    walls: list[float] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    failed: int = 0
    prepared_errors: int = 0
    tracebacks: int = 0
    peak_backends: int = 0
    pooler_xacts: int = 0
    peak_server_conns: int = 0


class Recorder:
    """The emulator's reply function: it answers and notes when each loop's
    requests arrived (this process's clock, the one Agent.start() is timed on)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived: dict[str, list[float]] = {}
        self.changed = threading.Condition(self.lock)

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        now = time.perf_counter()
        messages = body.get("messages", [])
        tag = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
        with self.lock:
            self.arrived.setdefault(tag, []).append(now)
            self.changed.notify_all()
        if tag.startswith("wake") or (messages and messages[-1].get("role") == "tool"):
            return {"content": "done"}
        return {"content": "adding", "tool_calls": [
            {"name": "add", "arguments": {"a": 20, "b": 22}},
            {"name": "lookup", "arguments": {"key": "abc"}}]}

    def wait_first(self, tag: str, timeout: float) -> float | None:
        with self.lock:
            self.changed.wait_for(lambda: tag in self.arrived, timeout)
            times = self.arrived.get(tag)
            return times[0] if times else None


def free_or_other(port: int) -> int:
    """``port`` if nothing listens on it on 127.0.0.1, else a free one."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return port
        except OSError:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[str]:
    """The direct URL of the bench database: on a throwaway cluster, or --url."""
    from flask_solidloop.testing.plugin import prepare_database

    if args.url:
        from flask_solidloop.database import ensure_database

        ensure_database(args.url)
        prepare_database(args.url)
        yield args.url
        return
    from tests.support.pg_cluster import ThrowawayCluster, available

    if not available():
        raise SystemExit("bench: cannot initdb a throwaway cluster here (no PostgreSQL server "
                         "programs, or no postgres user to run them as); pass --url")
    cluster = ThrowawayCluster(port=args.port, max_connections=300)
    try:
        cluster.start()
        url = cluster.url(DATABASE)
        from flask_solidloop.database import ensure_database

        ensure_database(url)
        prepare_database(url)
        yield url
    finally:
        cluster.stop()


class Sampler(threading.Thread):
    """Peaks of PostgreSQL client backends, and of PgBouncer's server
    connections in use (``sv_active``), sampled every 0.5 s."""

    def __init__(self, direct: str, bouncer: Any, name: str) -> None:
        super().__init__(daemon=True)
        self.direct, self.bouncer, self.dbname = direct, bouncer, name
        self.stop = threading.Event()
        self.peak_backends = 0
        self.peak_servers = 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.direct, autocommit=True) as conn:
            while not self.stop.wait(0.5):
                (n,) = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                    "backend_type = 'client backend'").fetchone() or (0,)
                self.peak_backends = max(self.peak_backends, int(n))
                servers = sum(int(r["sv_active"]) for r in self.bouncer.show("POOLS")
                              if r["database"] == self.dbname)
                self.peak_servers = max(self.peak_servers, servers)


def spawn_fleet(args: argparse.Namespace, config: dict[str, Any], llm_url: str,
                log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update({
        "FLASK_APP": "tests.support.support_app:create_app()",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "SOLIDLOOP_TEST_APP_CONFIG": json.dumps(config),
        "SOLIDLOOP_TEST_DATABASE_URL": config["SOLIDLOOP_DATABASE_URL"],
        "SOLIDLOOP_TEST_LLM_URL": llm_url,
        "SOLIDLOOP_TEST_API_KEY": "sk-bench",
    })
    handle = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes",
         str(args.processes), "--threads", str(args.threads)],
        cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def stop_fleet(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], log: Path, processes: int) -> None:
    deadline = time.monotonic() + 180
    while log.read_text(errors="replace").count("Worker process is ready") < processes:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench: the fleet did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def ended(direct: str, loop_ids: list[int]) -> tuple[int, int]:
    """(loops ended, loops failed) among ``loop_ids``."""
    import psycopg

    with psycopg.connect(direct, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = ANY(%s)), "
            "count(*) FILTER (WHERE status = 'failed') FROM solidloop_loops "
            "WHERE id = ANY(%s)", (list(ENDED), loop_ids)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def run_phase(args: argparse.Namespace, phase: Phase, *, direct: str, app_url: str,
              bouncer: Any, pooled: bool, recorder: Recorder, llm_url: str,
              logs: Path, loops: int | None = None, samples: int | None = None,
              round_: int = 0) -> None:
    """One phase of one round, its figures added to ``phase``: ``pooled`` says
    whether ``app_url`` goes through ``bouncer``."""
    from flask_solidloop.urls import libpq_url
    from tests.support.support_app import Assistant, create_app

    loops = args.loops if loops is None else loops
    samples = -(-args.samples // args.rounds) if samples is None else samples
    key = f"{phase.name} r{round_}"
    engine_options: dict[str, Any] = {"pool_pre_ping": True, "pool_size": args.threads + 1,
                                      "max_overflow": 0}
    if pooled:
        engine_options["connect_args"] = {"prepare_threshold": None}
    config = {"SQLALCHEMY_DATABASE_URI": app_url, "SOLIDLOOP_DATABASE_URL": direct,
              "SQLALCHEMY_ENGINE_OPTIONS": engine_options}
    log = logs / f"{phase.name}-{round_}.log"
    proc = spawn_fleet(args, config, llm_url, log)
    app = create_app(**config)
    sampler = Sampler(libpq_url(direct), bouncer, DATABASE_NAME[0])
    xacts = lambda: sum(int(r["total_xact_count"]) for r in bouncer.show("STATS")  # noqa: E731
                        if r["database"] == DATABASE_NAME[0])
    try:
        wait_ready(proc, log, args.processes)
        sampler.start()
        before = xacts()
        with app.app_context():
            session = app.extensions["sqlalchemy"].session
            for i in range(samples):
                tag = f"wake {key} {i}"
                t0 = time.perf_counter()
                loop_id = Assistant.start(message=tag).id
                phase.start_ms.append((time.perf_counter() - t0) * 1000)
                session.remove()
                first = recorder.wait_first(tag, 60)
                if first is None:
                    raise SystemExit(f"bench: no model request for {tag!r}:\n"
                                     f"{log.read_text()[-3000:]}")
                phase.wake_ms.append((first - t0) * 1000)
                while ended(libpq_url(direct), [loop_id])[0] < 1:
                    time.sleep(0.02)
                time.sleep(0.05)  # an idle fleet: each sample is a cold wake-up
            t0 = time.perf_counter()
            loop_ids = []
            for i in range(loops):
                loop_ids.append(Assistant.start(message=f"load {key} {i}").id)
                session.remove()
            deadline = time.monotonic() + args.timeout
            while True:
                done, failed = ended(libpq_url(direct), loop_ids)
                if done == len(loop_ids) or time.monotonic() > deadline or proc.poll() is not None:
                    break
                time.sleep(0.2)
            phase.walls.append(time.perf_counter() - t0)
            phase.completed.append(done - failed)
            phase.failed += failed
        with recorder.lock:
            for i in range(loops):
                times = recorder.arrived.get(f"load {key} {i}", [])
                if len(times) >= 2:
                    phase.gaps_ms.append((times[1] - times[0]) * 1000)
        phase.pooler_xacts += xacts() - before
    finally:
        sampler.stop.set()
        stop_fleet(proc)
        with app.app_context():
            app.extensions["solidloop"].stop_renewer()
            app.extensions["solidloop"].broker.close()
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
    sampler.join(5)
    phase.peak_backends = max(phase.peak_backends, sampler.peak_backends)
    phase.peak_server_conns = max(phase.peak_server_conns, sampler.peak_servers)
    text = log.read_text(errors="replace")
    phase.prepared_errors += len(PREPARED_ERRORS.findall(text))
    phase.tracebacks += text.count("Traceback (most recent call last)")


#: The bench database's name, set once the URL is known (for PgBouncer's SHOW output).
DATABASE_NAME = [DATABASE]


def report(args: argparse.Namespace, phases: dict[str, Phase]) -> bool:
    d, p = phases["direct"], phases["pgbouncer"]

    def ms(v: float) -> str:
        return f"{v:.1f}"

    def each(values: list[int]) -> str:
        return ",".join(str(v) for v in values)

    rows = [
        ("wake-up p50 (start -> first model request), ms", ms(statistics.median(d.wake_ms)),
         ms(statistics.median(p.wake_ms))),
        ("wake-up p90, ms", ms(percentile(d.wake_ms, 0.9)), ms(percentile(p.wake_ms, 0.9))),
        ("of which Agent.start() (the web side's commit), p50, ms",
         ms(statistics.median(d.start_ms)), ms(statistics.median(p.start_ms))),
        (f"{args.loops} loops: completed, each round", each(d.completed), each(p.completed)),
        (f"{args.loops} loops: failed, all rounds", str(d.failed), str(p.failed)),
        (f"{args.loops} loops: wall time, median, s", f"{statistics.median(d.walls):.1f}",
         f"{statistics.median(p.walls):.1f}"),
        ("LLM turns/s, median", f"{2 * args.loops / statistics.median(d.walls):.1f}",
         f"{2 * args.loops / statistics.median(p.walls):.1f}"),
        ("turn gap p50 (first -> second model request), ms",
         ms(statistics.median(d.gaps_ms)) if d.gaps_ms else "-",
         ms(statistics.median(p.gaps_ms)) if p.gaps_ms else "-"),
        ("prepared-statement errors in worker logs", str(d.prepared_errors),
         str(p.prepared_errors)),
        ("tracebacks in worker logs", str(d.tracebacks), str(p.tracebacks)),
        ("peak PostgreSQL client backends", str(d.peak_backends), str(p.peak_backends)),
        ("peak PgBouncer server connections in use", str(d.peak_server_conns),
         str(p.peak_server_conns)),
        ("transactions carried by PgBouncer", str(d.pooler_xacts), str(p.pooler_xacts)),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':<{width}} | {'direct':>9} | {'pgbouncer':>9}")
    print(f"{'-' * width}-|-{'-' * 9}-|-{'-' * 9}")
    for label, a, b in rows:
        print(f"{label:<{width}} | {a:>9} | {b:>9}")
    ratio = statistics.median(p.wake_ms) / statistics.median(d.wake_ms)
    targets = [
        (f"all {args.loops} loops complete through PgBouncer",
         f"{min(p.completed)}/{args.loops}", min(p.completed) == args.loops),
        ("wake-up p50 through PgBouncer <= 2x direct", f"{ratio:.2f}x", ratio <= 2.0),
        ("prepared-statement errors == 0", str(p.prepared_errors), p.prepared_errors == 0),
    ]
    print()
    for label, value, ok in targets:
        print(f"{label:<48} {value:>10}  {'PASS' if ok else 'MISS'}")
    return all(ok for _, _, ok in targets)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--loops", type=int, default=500)
    parser.add_argument("--samples", type=int, default=40, help="wake-up samples per phase")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--pool-size", type=int, default=20,
                        help="PgBouncer's default_pool_size (server connections)")
    parser.add_argument("--port", type=int, default=5442,
                        help="the throwaway cluster's port (a free one if it is taken)")
    parser.add_argument("--bouncer-port", type=int, default=6432,
                        help="PgBouncer's port (a free one if it is taken)")
    parser.add_argument("--quick", action="store_true",
                        help="100 loops, 20 samples, 4 processes, 1 round: about 2 minutes")
    parser.add_argument("--url", default=None, help="an existing database instead of a "
                        "throwaway cluster")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of both phases, in alternating order (ABBA...); the "
                        "wake-up samples are split across them, each runs the whole load")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the loads of one phase may take")
    args = parser.parse_args(argv)
    if args.quick:
        args.loops, args.samples, args.processes, args.rounds = 100, 20, 4, 1
    args.port, args.bouncer_port = free_or_other(args.port), free_or_other(args.bouncer_port)

    import tempfile

    from flask_solidloop.testing.llm_emulator import LLMEmulator
    from tests.support import pgbouncer as pgb

    if not pgb.available():
        print(f"bench: {pgb.PGBOUNCER} is missing (apt-get install pgbouncer)", file=sys.stderr)
        return 2
    recorder = Recorder()
    logs = Path(tempfile.mkdtemp(prefix="solidloop-bench-pgbouncer-"))
    with database(args) as direct, LLMEmulator() as llm:
        from sqlalchemy.engine import make_url

        parsed = make_url(direct)
        DATABASE_NAME[0] = str(parsed.database)
        llm.script(lambda body: True, recorder)
        with pgb.pgbouncer(upstream_port=parsed.port or 5432, pool_mode="transaction",
                           port=args.bouncer_port, pool_size=args.pool_size) as bouncer:
            pooled = bouncer.url(DATABASE_NAME[0])
            print(f"bench: {args.processes} worker processes x {args.threads} threads, "
                  f"{args.loops} loops and {args.samples} wake-up samples per phase; "
                  f"PgBouncer {pooled.split('@')[1]} (transaction mode, pool {args.pool_size})"
                  f" in front of {direct.split('@')[1]}; worker logs in {logs}",
                  file=sys.stderr)
            # A fresh cluster's tables have no statistics, and the first fleet
            # plans (and, direct, prepares) against that: whichever phase ran
            # first was 4-15x slower in trials. A warm-up load, then ANALYZE.
            started = time.perf_counter()
            run_phase(args, Phase("warm-up"), direct=direct, app_url=direct, bouncer=bouncer,
                      pooled=False, recorder=recorder, llm_url=llm.base_url, logs=logs,
                      loops=min(args.loops, 100), samples=3)
            import psycopg

            from flask_solidloop.urls import libpq_url

            with psycopg.connect(libpq_url(direct), autocommit=True) as conn:
                conn.execute("ANALYZE")
            print(f"bench: warm-up done in {time.perf_counter() - started:.0f}s",
                  file=sys.stderr)
            phases = {"direct": Phase("direct"), "pgbouncer": Phase("pgbouncer")}
            for round_ in range(args.rounds):
                # ABBA...: the noise of a shared machine hits both alike.
                order = [("direct", direct), ("pgbouncer", pooled)]
                if round_ % 2:
                    order.reverse()
                for name, app_url in order:
                    started = time.perf_counter()
                    run_phase(args, phases[name], direct=direct, app_url=app_url,
                              bouncer=bouncer, pooled=app_url == pooled, recorder=recorder,
                              llm_url=llm.base_url, logs=logs, round_=round_)
                    print(f"bench: round {round_ + 1}, {name} done in "
                          f"{time.perf_counter() - started:.0f}s", file=sys.stderr)
    return 0 if report(args, phases) else 1


if __name__ == "__main__":
    sys.exit(main())
