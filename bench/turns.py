"""The per-turn price of durability: our agent loop against DBOS Transact's, same run.

Run it from the project root with the project's virtualenv (DBOS is in the
``bench`` extra: ``pip install -e '.[bench]'``)::

    python bench/turns.py                      # 200 loops x 5 LLM turns, 3 reps, ~3 min
    python bench/turns.py --loops 50 --reps 1
    python bench/turns.py --against HEAD~3 --no-dbos   # A/B: this tree against HEAD~3
    python bench/turns.py --cluster-port 5446          # on a throwaway cluster of its own
    python bench/turns.py --wire-log summary           # ours with SOLIDLOOP_WIRE_LOG = "summary"
    python bench/turns.py --metrics --no-dbos --cluster-port 5446   # metrics on against off
    python bench/turns.py --tracing --no-dbos          # tracing on against tracing off

The workload: ``--loops`` loops of ``--turns`` LLM turns against the LLM
emulator (instant answers, in this process), with one no-op tool call in
each gap between two LLM turns, 8 turns running at once:

* **ours**: `dramatiq flask_solidloop.worker --processes 2 --threads 4` on
  bench/turns_app.py (an in-process toolset), loops started in one commit;
* **ours@<short hash>** (with ``--against REV``): the same, on REV's code;
* **ours+metrics** (with ``--metrics``): ours with SOLIDLOOP_METRICS on (port
  19191, or SOLIDLOOP_BENCH_METRICS_PORT), its endpoint scraped once a second
  through each measured run as Prometheus would; the table adds "metrics ÷
  ours" and a PASS/MISS for turns/s at least 0.97x ours';
* **DBOS**: bench/turns_dbos.py in a process of its own, the loop as a
  workflow whose LLM calls and tool calls are steps, from a queue with
  concurrency 8 (queue poll 0.1 s); ``--no-dbos`` leaves it out.

Each system gets its own database. The systems are interleaved, in an order
rotated each rep (ours, DBOS, then DBOS, ours; with REV: ours, REV, DBOS, then
REV, DBOS, ours, ...) for ``--reps`` reps; the table shows the median with
min-max, and every figure of ours as a ratio to DBOS (and to REV):

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

Tracing (``--tracing``): ours runs with the OpenTelemetry SDK installed in
its workers and in the harness that starts the loops (a BatchSpanProcessor
over an exporter that drops what it is given: the cost of making the spans,
not of shipping them), against **untraced**, the same tree without an SDK,
interleaved like ``--against``'s builds; the check: turns/s >= 0.95x
untraced's.

Targets (issue 10): turns/s >= 1.5x DBOS; worker CPU/turn <= 0.7x and
Postgres CPU/turn <= 1x; durable commits/turn <= 4 and WAL/turn <= DBOS;
one loop alone gap p50 <= 10 ms; completion p50 <= DBOS's. Printed with
PASS/MISS (without DBOS, only the two that do not compare with it).
Figures are noisy on a shared 2-core machine: compare ratios.

The A/B (``--against REV``, any git revision: a hash, ``HEAD~3``, a tag):
REV is checked out as a detached git worktree in a temporary directory,
removed at the end (also on Ctrl-C, SIGTERM or an error), and runs as
``ours@<short hash>`` exactly as ours runs (every figure above, the one loop
alone and the WAL figures included), in a database of its own
(``solidloop_bench_turns_against``, fresh each rep). Its workers import
flask_solidloop and turns_app from the worktree: it is their working
directory and comes first on their PYTHONPATH (its bench/, then its root),
ahead of the virtualenv's editable install of this tree. Each worker process
also imports bench/turns_probe.py (copied to a directory last on that path,
so it shadows nothing), which reports the file of every flask_solidloop
module and of turns_app it has loaded; the run stops if one is not in the
worktree, and prints flask_solidloop's file once. The harness (starting the
loops, waiting for them, reading their results) runs this tree's code for
both builds, so REV's workers must take the loops this tree starts (the
warm-up stops the run if they do not). REV's database is built by this
tree's migrations when REV's flask_solidloop/migrations/versions/ is the same
as this tree's; otherwise by REV's own, run from the worktree in a subprocess,
and the run says so. A/B lines, PASS/MISS: turns/s >= 0.9x REV's, worker
CPU/turn and Postgres CPU/turn <= 1.1x REV's (no more than 10% worse).
An A/A (``--against HEAD`` on a clean tree) shows how far apart two equal
builds land at the sizes used; small sizes are smoke checks only.

The server: by default the PostgreSQL on 127.0.0.1:5432. Its WAL figures
(bytes, commits, by table) are server-wide, so any other load on it lands in
them. ``--cluster-port PORT`` runs everything on a throwaway cluster instead:
initdb'ed (as the postgres user when run as root) in a temporary directory,
started on 127.0.0.1:PORT with initdb's defaults (fsync, full-page writes,
checkpoints every 5 min or 1 GB of WAL, as the shared server has) and
``shared_buffers`` 128MB, a ``CHECKPOINT`` before each measured run (so no run
pays another's full-page images), and stopped and removed at the end, on
Ctrl-C, SIGTERM or an error too. Its WAL is this run's alone.
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
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

OURS_DB = "solidloop_bench_turns"
#: --tracing: the build without an SDK that ours (traced) is compared with.
UNTRACED = "untraced"
#: --tracing: the most tracing may cost in turns/s.
TRACING_TOLERANCE = 0.05
AGAINST_DB = "solidloop_bench_turns_against"
DBOS_DB = "solidloop_bench_turns_dbos"
#: The server every system runs on (--cluster-port moves it to a throwaway cluster).
PG_PORT = 5432
PG_BIN = Path("/usr/lib/postgresql/15/bin")
CLK_TCK = os.sysconf("SC_CLK_TCK")
WORKER_PROCESSES = 2
#: --against: how much worse than REV's a figure may be and still PASS.
AB_TOLERANCE = 0.10
#: --metrics: the build with SOLIDLOOP_METRICS on, its database and its endpoint's port.
METRICS_BUILD = "ours+metrics"
METRICS_DB = "solidloop_bench_turns_metrics"
METRICS_PORT = int(os.environ.get("SOLIDLOOP_BENCH_METRICS_PORT", "19191"))
#: --metrics: how much of ours' turns/s metrics may cost and still PASS.
METRICS_TOLERANCE = 0.03


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
    #: The file the workers imported flask_solidloop from (checked builds only).
    imports: str | None = None
    #: --wal-by-table: each table's rows inserted, updated, HOT-updated during the run.
    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: --statements: the top statements' lines.
    statements: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Build:
    """One build of our system as the harness runs it: its label, its database,
    the tree its workers import flask_solidloop and turns_app from, whether
    that tree's own migrations build its schema, and the directory holding the
    import probe (bench/turns_probe.py) and its report, for a checked build."""

    name: str
    database: str
    tree: Path = ROOT
    own_migrations: bool = False
    probe: Path | None = None
    #: SOLIDLOOP_WIRE_LOG for this build's workers (--wire-log; None: the default).
    wire_log: str | None = None
    #: --metrics: the port of this build's workers' metrics endpoint (SOLIDLOOP_METRICS
    #: on, its directory a fresh one); None: metrics off.
    metrics_port: int | None = None
    #: --tracing: the OpenTelemetry SDK in this build's workers and loop starter.
    tracing: bool = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{PG_PORT}/{self.database}"

    @property
    def imports_log(self) -> Path | None:
        return None if self.probe is None else self.probe / "imports.jsonl"

    def python_env(self) -> dict[str, str]:
        """The environment of a process that imports from ``tree``: its bench/
        and root first on PYTHONPATH (the probe's directory last); this tree's
        build with ``--wire-log``'s SOLIDLOOP_WIRE_LOG."""
        paths = [self.tree / "bench", self.tree, *([self.probe] if self.probe else [])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)))
        env.pop("SOLIDLOOP_BENCH_WIRE_LOG", None)
        env.pop("SOLIDLOOP_BENCH_TRACING", None)
        if self.wire_log:
            env["SOLIDLOOP_BENCH_WIRE_LOG"] = self.wire_log
        env.pop("SOLIDLOOP_BENCH_METRICS_PORT", None)
        if self.metrics_port is not None:
            env["SOLIDLOOP_BENCH_METRICS_PORT"] = str(self.metrics_port)
        if self.tracing:
            env["SOLIDLOOP_BENCH_TRACING"] = "1"
        if self.imports_log is not None:
            env["SOLIDLOOP_BENCH_IMPORTS"] = str(self.imports_log)
        return env


# -- the server ----------------------------------------------------------------------------


def pg_url(database: str = "postgres") -> str:
    return f"postgresql://postgres@127.0.0.1:{PG_PORT}/{database}"


class Cluster:
    """--cluster-port: a PostgreSQL cluster of this run's own, initdb'ed in a
    temporary directory as the postgres user, removed by :meth:`stop`."""

    def __init__(self, port: int, statements: bool = False, max_connections: int = 100) -> None:
        self.port = port
        self.statements = statements
        self.max_connections = max_connections
        self.data = Path(tempfile.mkdtemp(prefix="solidloop-turns-pg-"))

    def _as_postgres(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(prefix + list(cmd), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"turns.py: --cluster-port {self.port}: {Path(cmd[0]).name} "
                             f"failed: {(done.stderr or done.stdout).strip()[-500:]}")

    def start(self) -> Cluster:
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust",
                          "-U", "postgres")
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.data / "log"), "-w",
            "-o", f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 "
                  f"-c max_connections={self.max_connections} -c shared_buffers=128MB"
                  + (" -c shared_preload_libraries=pg_stat_statements"
                     if self.statements else ""), "start")
        return self

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast",
                                  "-w", "stop")
        finally:
            shutil.rmtree(self.data, ignore_errors=True)


#: Set by main() with --cluster-port: measured runs begin with a CHECKPOINT.
_OWN_CLUSTER = False


def settle(database: str | None = None) -> None:
    """Before a measured run on a cluster of our own: a CHECKPOINT, so the run
    does not pay for full-page images of pages an earlier run dirtied (and
    with --statements, pg_stat_statements emptied)."""
    if _OWN_CLUSTER:
        sql("CHECKPOINT")
    if _STATEMENTS and database is not None:
        sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements", database)
        sql("SELECT pg_stat_statements_reset()", database)


#: Set by main() with --statements: pg_stat_statements on the throwaway cluster.
_STATEMENTS = False


def top_statements(database: str, turns: int, limit: int = 40) -> list[str]:
    """--statements: the statements of ``database`` by WAL bytes, as lines of
    calls, WAL bytes and execution ms per turn (the harness's own included)."""
    rows = sql("SELECT s.calls, s.wal_bytes, s.total_exec_time, "
               "regexp_replace(s.query, '\\s+', ' ', 'g') FROM pg_stat_statements s "
               f"JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{database}' "
               "ORDER BY s.wal_bytes DESC, s.total_exec_time DESC", database)
    total_wal = sum(int(r[1]) for r in rows) / turns
    total_ms = sum(r[2] for r in rows) / turns
    lines = [f"  {'calls':>6} {'WAL B':>7} {'exec ms':>7}   per turn "
             f"(all statements: {total_wal:.0f} B, {total_ms:.2f} ms)"]
    for calls, wal, ms, query in rows[:limit]:
        lines.append(f"  {calls / turns:6.2f} {int(wal) / turns:7.0f} {ms / turns:7.3f}   "
                     f"{query[:150]}")
    return lines


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

    with psycopg.connect(pg_url(database), autocommit=True) as conn:
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


def row_writes(database: str) -> dict[str, tuple[int, int, int]]:
    """Each table's inserted, updated and HOT-updated rows so far (pg_stat_user_tables)."""
    return {name: (int(ins), int(upd), int(hot)) for name, ins, upd, hot in sql(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables",
        database)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the emulator's script: the same loop shape for every system --------------------------


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


# -- the systems -------------------------------------------------------------------------------


def fresh_database(name: str) -> None:
    sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    sql(f"CREATE DATABASE {name}")


def inside(path: str | None, root: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(root.resolve())


def migrate(build: Build) -> None:
    """Build ``build``'s schema: with this tree's migrations, in this process; or,
    for a build with migrations of its own, with its tree's, in a subprocess
    that imports from that tree (checked)."""
    if not build.own_migrations:
        from flask_solidloop.migrations import upgrade

        upgrade(build.url)
        return
    code = ("import sys, flask_solidloop.migrations as m; m.upgrade(sys.argv[1]); "
            "print(m.__file__)")
    done = subprocess.run([sys.executable, "-c", code, build.url], cwd=build.tree,
                          env=build.python_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{build.name}: its own migrations failed:\n{done.stderr[-3000:]}")
    origin = (done.stdout.strip().splitlines() or [None])[-1]
    if not inside(origin, build.tree):
        raise SystemExit(f"{build.name}: its migrations ran from {origin}, not {build.tree}")


def start_workers(build: Build) -> subprocess.Popen:
    """``dramatiq flask_solidloop.worker`` on turns_app, importing from ``build.tree``.
    It is also their working directory: ``-m`` and dramatiq's ``--path .`` put
    that first on sys.path. A checked build's workers also import the probe."""
    env = dict(build.python_env(), FLASK_APP="turns_app:create_app()")
    probe = []
    if build.imports_log is not None:
        build.imports_log.write_text("")
        probe = ["turns_probe"]
    # SOLIDLOOP_BENCH_WORKER_LOG=<file>: keep the workers' log (to look into a slow run).
    log_path = os.environ.get("SOLIDLOOP_BENCH_WORKER_LOG")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", *probe,
             "--processes", str(WORKER_PROCESSES), "--threads", "4"],
            cwd=build.tree, env=env, stdout=log, stderr=log, start_new_session=True)
    finally:
        if log_path:
            log.close()


def checked_imports(build: Build, workers: subprocess.Popen) -> str:
    """Wait for each worker process's probe report, and stop the run if one
    imported a flask_solidloop module or turns_app from outside ``build.tree``
    (the old workers would run the new code). Returns flask_solidloop's file."""
    assert build.imports_log is not None
    deadline = time.monotonic() + 60
    while True:
        text = build.imports_log.read_text()
        reports = [json.loads(line) for line in text.splitlines(keepends=True)
                   if line.endswith("\n")]
        if len(reports) >= WORKER_PROCESSES:
            break
        if time.monotonic() > deadline or workers.poll() is not None:
            raise SystemExit(f"{build.name}: {len(reports)} of {WORKER_PROCESSES} worker "
                             "processes reported their imports (bench/turns_probe.py; "
                             "SOLIDLOOP_BENCH_WORKER_LOG=<file> keeps the workers' log)")
        time.sleep(0.05)
    for report in reports:
        modules = report["modules"]
        for name in ("flask_solidloop", "turns_app"):
            if name not in modules:
                raise SystemExit(f"{build.name}: worker {report['pid']} has not imported "
                                 f"{name}: cannot tell where its code comes from")
        stray = {name: path for name, path in modules.items() if not inside(path, build.tree)}
        if stray:
            name = next((n for n in ("flask_solidloop", "turns_app") if n in stray),
                        next(iter(stray)))
            path = stray[name]
            raise SystemExit(f"{build.name}: worker {report['pid']} imported {name} from "
                             f"{path}, not from {build.tree} ({len(stray)} of its modules "
                             "came from elsewhere): the old workers would run the new code")
    return str(reports[0]["modules"]["flask_solidloop"])


#: A process that starts loops with a build's own code (a REV whose schema this
#: tree's statements do not fit): it reads "<prefix> <count>" lines and answers
#: each with the new loops' ids as one JSON line, so a start costs the measured
#: run a pipe's round trip, not a Python start-up.
_STARTER = """
import json, sys
import turns_app
app = turns_app.create_app()
with app.app_context():
    print("ready", flush=True)
    for line in sys.stdin:
        prefix, count = line.rsplit(" ", 1)
        ids = turns_app.Turns.start_many([f"{prefix} {n}" for n in range(int(count))])
        print(json.dumps(ids), flush=True)
"""


class Starter:
    """Starts loops with ``build``'s own code: in this process for this tree, in
    a :data:`_STARTER` process for a build with migrations of its own."""

    def __init__(self, build: Build, turns_app: Any) -> None:
        self.turns_app = turns_app
        self.proc: subprocess.Popen[str] | None = None
        if build.own_migrations:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _STARTER], cwd=build.tree, env=build.python_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"{build.name}: its loop starter did not start")

    def start(self, prefix: str, count: int) -> list[int]:
        if self.proc is None:
            return list(self.turns_app.Turns.start_many(
                [f"{prefix} {n}" for n in range(count)]))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{prefix} {count}\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Scraper:
    """--metrics: scrape the workers' endpoint once a second, as Prometheus would,
    for the length of a measured run (a failed scrape stops the bench)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.done = threading.Event()
        self.scrapes = 0
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import urllib.request

        # The server is a process dramatiq's master forks once its workers are
        # up; it loads the app, which takes seconds (a minute on a loaded machine).
        deadline = time.monotonic() + 180
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
                self.scrapes += 1
            except Exception as exc:
                if self.scrapes or time.monotonic() > deadline:
                    self.error = exc
                    return
                self.done.wait(0.2)
                continue
            self.done.wait(1.0)

    def wait_ready(self) -> None:
        while not self.scrapes and self.error is None and self.thread.is_alive():
            time.sleep(0.1)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        if self.error is not None:
            raise SystemExit(f"turns.py --metrics: scraping {self.url} failed: {self.error}")


def run_ours(build: Build, script: Script, loops: int, prefix: str) -> Run:
    from sqlalchemy import func, select

    from flask_solidloop.models import Loop

    fresh_database(build.database)
    migrate(build)
    os.environ["SOLIDLOOP_BENCH_DATABASE_URL"] = build.url
    import turns_app

    app = turns_app.create_app()
    workers = start_workers(build)
    starter = Starter(build, turns_app)
    run = Run(build.name)
    # A traced build's loops start traced, as a traced host's would (their run's
    # context stored, their first jobs carrying it).
    turns_app.set_tracing(build.tracing)
    try:
        with app.app_context():
            session = turns_app.db.session
            # Warm up (imports, connections, first claims) with loops of their own,
            # so the measured run sees both worker processes ready.
            # Loops are started with the build's own code (Starter): a REV's
            # schema may lack columns this tree's statements write.
            warm = starter.start("warm", 4)
            deadline = time.monotonic() + 120
            while session.scalar(select(func.count()).select_from(Loop).where(
                    Loop.id.in_(warm), Loop.status != "completed")):
                session.rollback()
                if time.monotonic() > deadline or workers.poll() is not None:
                    if build.imports_log is not None and workers.poll() is None:
                        checked_imports(build, workers)  # workers on the wrong code?
                    raise SystemExit(f"{build.name}: the warm-up loops did not complete"
                                     " (SOLIDLOOP_BENCH_WORKER_LOG=<file> keeps the"
                                     " workers' log)")
                time.sleep(0.05)
            session.rollback()
            # After the warm-up, as the run without a probe: the same sequence.
            if build.imports_log is not None:
                run.imports = checked_imports(build, workers)
            # --metrics: its server up (it loads the app) before the clock starts.
            scraper = Scraper(build.metrics_port) if build.metrics_port else None
            if scraper is not None:
                scraper.wait_ready()
            script.reset()
            settle(build.database)
            cpu0 = sum(proc_cpu(p) for p in tree(workers.pid))
            pg0 = backends(build.database)
            rows0 = row_writes(build.database)
            xacts0, lsn0 = server_counters(build.database)
            started = time.monotonic()
            ids = starter.start(prefix, loops)
            wait_for_loops(ids, build.database)
            run.wall = time.monotonic() - started
            if scraper is not None:
                scraper.stop()
            run.worker_cpu = sum(proc_cpu(p) for p in tree(workers.pid)) - cpu0
            pg1 = backends(build.database)
            run.pg_cpu = sum(cpu - pg0.get(pid, 0.0) for pid, cpu in pg1.items())
            time.sleep(1.5)  # let the server flush its statistics
            xacts1, lsn1 = server_counters(build.database)
            run.rows = {name: tuple(a - b for a, b in zip(now, rows0.get(name, (0, 0, 0)),
                                                          strict=True))  # type: ignore[misc]
                        for name, now in row_writes(build.database).items()}
            run.xacts, run.wal = xacts1 - xacts0, wal_bytes(lsn0, lsn1)
            run.commits = wal_commits(lsn0, lsn1)
            run.wal_range = (lsn0, lsn1, build.database)
            rows = session.execute(select(Loop.step_count, Loop.status, Loop.created_at,
                                          Loop.finished_at).where(Loop.id.in_(ids))).all()
            failed = [r for r in rows if r.status != "completed"]
            if failed:
                raise SystemExit(f"{build.name}: {len(failed)} loops did not complete")
            run.turns = sum(r.step_count for r in rows)
            if _STATEMENTS:
                run.statements = top_statements(build.database, max(run.turns, 1))
            (epoch,), = session.execute(select(func.min(Loop.created_at)).where(
                Loop.id.in_(ids))).all()
            run.completion = [(r.finished_at - epoch).total_seconds() for r in rows]
            session.remove()
    finally:
        turns_app.set_tracing(False)
        starter.close()
        try:
            os.killpg(workers.pid, 15)
            workers.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(workers.pid, 9)
    run.gaps = script.gaps(prefix + " ")
    return run


def wait_for_loops(ids: list[int], database: str) -> None:
    """Wait until every loop has finished, as the DBOS side waits for its
    handles: one at a time, in order, each with a primary-key read (on an
    autocommit connection, every 20 ms while it runs). The harness's own
    reads land in the measured server CPU of both systems, so they are kept
    as cheap as DBOS's ``get_result`` polls."""
    import psycopg

    with psycopg.connect(pg_url(database), autocommit=True) as conn:
        for loop_id in ids:
            while conn.execute(
                    "SELECT status NOT IN ('completed', 'failed', 'paused') "
                    "FROM solidloop_loops WHERE id = %s", (loop_id,)).fetchone()[0]:
                time.sleep(0.02)


def run_dbos(emulator, script: Script, loops: int, prefix: str) -> Run:
    fresh_database(DBOS_DB)
    settle(DBOS_DB)
    script.reset()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "turns_dbos.py"), "--url", pg_url(DBOS_DB),
         "--llm", emulator.base_url, "--loops", str(loops), "--prefix", prefix],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # DBOS creates its schema at launch and warms up: measure the server from the
    # first measured workflow on.
    deadline = time.monotonic() + 120
    while not script.requests(prefix + " ") and time.monotonic() < deadline \
            and proc.poll() is None:
        time.sleep(0.005)
    pg0 = backends(DBOS_DB)
    rows0 = row_writes(DBOS_DB)
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
    run.rows = {name: tuple(a - b for a, b in zip(now, rows0.get(name, (0, 0, 0)),
                                                  strict=True))  # type: ignore[misc]
                for name, now in row_writes(DBOS_DB).items()}
    run.xacts, run.wal = xacts1 - xacts0, wal_bytes(lsn0, lsn1)
    run.commits = wal_commits(lsn0, lsn1)
    run.wal_range = (lsn0, lsn1, DBOS_DB)
    run.turns = script.requests(prefix + " ")
    run.gaps = script.gaps(prefix + " ")
    if _STATEMENTS:
        run.statements = top_statements(DBOS_DB, max(run.turns, 1))
    return run


_last_backends: dict[int, float] = {}


def watch_backends(database: str, stop: threading.Event) -> None:
    """Keep the latest CPU reading of each backend of ``database`` (they vanish
    when the DBOS process exits)."""
    while not stop.is_set():
        with contextlib.suppress(Exception):
            _last_backends.update(backends(database))
        stop.wait(0.2)



def run_dbos_watched(emulator, script: Script, loops: int, prefix: str) -> Run:
    """run_dbos with the CPU of its database's backends watched while it runs."""
    stop = threading.Event()
    watcher = threading.Thread(target=watch_backends, args=(DBOS_DB, stop), daemon=True)
    watcher.start()
    try:
        return run_dbos(emulator, script, loops, prefix)
    finally:
        stop.set()
        watcher.join()
        _last_backends.clear()


# -- --against REV: an older commit of ours as a third system -----------------------------------


class Commit(NamedTuple):
    rev: str
    full: str
    short: str
    subject: str


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def resolve(rev: str) -> Commit:
    """``rev`` as a commit of this repository; exits with one line if it is none."""
    found = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise SystemExit(f"turns.py: --against {rev}: not a commit of the repository at {ROOT};"
                         " give a hash, a tag or HEAD~N (see `git log --oneline`)")
    full = found.stdout.strip()
    return Commit(rev, full, git("rev-parse", "--short", full).stdout.strip(),
                  git("log", "-1", "--format=%s", full).stdout.strip())


@contextlib.contextmanager
def checkout(commit: Commit) -> Iterator[Path]:
    """``commit`` as a detached git worktree (``src/`` of a temporary directory
    that also holds the import probe), all removed on the way out, on Ctrl-C,
    SIGTERM or an error too."""
    scratch = Path(tempfile.mkdtemp(prefix="solidloop-turns-against-"))
    source = scratch / "src"
    try:
        added = git("worktree", "add", "--detach", "--quiet", str(source), commit.full)
        if added.returncode != 0:
            raise SystemExit(f"turns.py: --against {commit.rev}: git worktree add failed: "
                             f"{added.stderr.strip()}")
        yield source
    finally:
        removed = git("worktree", "remove", "--force", str(source)).returncode == 0
        shutil.rmtree(scratch, ignore_errors=True)
        if not removed and str(source) in git("worktree", "list", "--porcelain").stdout:
            git("worktree", "prune")


def same_migrations(source: Path) -> bool:
    """Whether ``source``'s flask_solidloop/migrations/versions/ holds the same
    scripts, byte for byte, as this tree's."""
    def scripts(root: Path) -> dict[str, bytes]:
        versions = root / "flask_solidloop" / "migrations" / "versions"
        return {path.name: path.read_bytes() for path in versions.glob("*.py")}

    return scripts(source) == scripts(ROOT)


def against_build(commit: Commit, source: Path) -> Build:
    """The build of ``commit``, checked out at ``source``: database AGAINST_DB,
    the import probe beside the worktree, its own migrations if they differ."""
    needed = ("bench/turns_app.py", "flask_solidloop/worker.py")
    missing = [path for path in needed if not (source / path).is_file()]
    if missing:
        raise SystemExit(f"turns.py: --against {commit.rev}: {commit.short} has no "
                         f"{' or '.join(missing)}; pick a later commit "
                         "(`git log --oneline -- bench/turns_app.py`)")
    probe = source.parent / "probe"
    probe.mkdir()
    shutil.copy2(BENCH / "turns_probe.py", probe / "turns_probe.py")
    return Build(f"ours@{commit.short}", AGAINST_DB, source,
                 own_migrations=not same_migrations(source), probe=probe)


def describe(commit: Commit, build: Build) -> list[str]:
    """What ``--against`` runs, in a line or two (printed before the runs and with the table)."""
    given = "" if commit.full.startswith(commit.rev) else f" ({commit.rev})"
    lines = [f"{build.name}{given}: {commit.subject}"]
    if build.own_migrations:
        lines.append(f"{build.name}: its flask_solidloop/migrations/versions/ differs from this "
                     "tree's, so its database is built by its own migrations (a subprocess in "
                     "its worktree); this tree's harness still starts and reads its loops")
    return lines


# -- the runs ------------------------------------------------------------------------------------


@dataclass
class Measured:
    #: Each system's figures, one dict a rep.
    figures: dict[str, list[dict[str, float | None]]]
    #: Each system's one-loop-alone turn gaps, all reps.
    alone: dict[str, list[float]]
    #: --wal-by-table: each system's WAL by table (last rep), and its turns.
    wal_tables: dict[str, tuple[collections.Counter[str], int]] = field(default_factory=dict)
    #: --wal-by-table: each system's rows written by table (last rep).
    row_tables: dict[str, dict[str, tuple[int, int, int]]] = field(default_factory=dict)
    #: --statements: each system's top statements (last rep).
    statements: dict[str, list[str]] = field(default_factory=dict)


def rotated(systems: list[str], rep: int) -> list[str]:
    """The run order of rep ``rep``: each rep starts one system later, so no
    system always runs first or last."""
    shift = rep % len(systems)
    return systems[shift:] + systems[:shift]


def measure(args: argparse.Namespace, systems: list[str], builds: dict[str, Build],
            emulator, script: Script) -> Measured:
    """Every system's runs, interleaved: per rep, each system's measured run
    and its one-loop-alone run, in the rep's order."""
    measured = Measured({s: [] for s in systems}, {s: [] for s in systems})
    for rep in range(args.reps):
        for system in rotated(systems, rep):
            build = builds.get(system)
            if build is None:
                many = run_dbos_watched(emulator, script, args.loops, f"r{rep}")
            else:
                many = run_ours(build, script, args.loops, f"r{rep}")
            if args.wal_by_table and many.wal_range is not None:
                # Before the one-loop run drops the database.
                measured.wal_tables[system] = (wal_by_table(*many.wal_range), max(many.turns, 1))
                measured.row_tables[system] = many.rows
            if many.statements:
                measured.statements[system] = many.statements
            if build is None:
                one = run_dbos(emulator, script, 1, f"alone{rep}")
            else:
                one = run_ours(build, script, 1, f"alone{rep}")
            measured.figures[system].append(figures(many))
            measured.alone[system].extend(one.gaps)
            if many.imports and rep == 0:
                print(f"{system}: its workers import flask_solidloop from {many.imports}",
                      flush=True)
            print(f"rep {rep + 1} {system}: {many.turns} turns in {many.wall:.1f} s",
                  flush=True)
    return measured


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


def cell(values: list[float | None]) -> tuple[float | None, str]:
    """The median of a figure over the reps, and its text with the min-max."""
    present = [v for v in values if v is not None]
    if not present:
        return None, "n/a"
    mid = statistics.median(present)
    spread = f" ({min(present):.1f}-{max(present):.1f})" if len(present) > 1 else ""
    return mid, f"{mid:.1f}{spread}"


def ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:.2f}x" if ours is not None and base else "n/a"


def print_table(args: argparse.Namespace, measured: Measured,
                against: str | None) -> dict[str, dict[str, float | None]]:
    """The table: each system's medians (DBOS, REV, ours), then ours' ratios to
    REV and to DBOS; returns the medians, the one-loop-alone gaps included."""
    shown = [s for s in ("dbos", against, "ours", METRICS_BUILD) if s in measured.figures]
    headers = {"dbos": "DBOS 3.4", "ours": "ours (tracing)" if args.tracing else "ours",
               METRICS_BUILD: METRICS_BUILD, **({against: against} if against else {})}
    #: (header, numerator, denominator) of each ratio column.
    ratios = [(f"ours ÷ {against}", "ours", against)] if against else []
    if "dbos" in shown:
        ratios.append(("ours ÷ DBOS" if against else "ratio", "ours", "dbos"))
    if METRICS_BUILD in shown:
        ratios.append(("metrics ÷ ours", METRICS_BUILD, "ours"))
    widths = [max(7, len(header)) for header, _, _ in ratios]

    def line(label: str, cells: list[str], ratio_texts: list[str]) -> str:
        return (f"{label:38}" + "".join(f" {text:>20}" for text in cells)
                + "".join(f" {text:>{w}}" for text, w in zip(ratio_texts, widths, strict=True)))

    print(f"\n{args.loops} loops x {args.turns} LLM turns, a no-op tool call in each gap, "
          f"8 concurrent turns; median (min-max) of {args.reps} reps")
    print(line("metric", [headers[s] for s in shown], [header for header, _, _ in ratios]))
    medians: dict[str, dict[str, float | None]] = {s: {} for s in shown}
    for metric in measured.figures["ours"][0]:
        texts = []
        for system in shown:
            mid, text = cell([r[metric] for r in measured.figures[system]])
            medians[system][metric] = mid
            texts.append(text)
        print(line(metric, texts, [ratio(medians[top][metric], medians[base][metric])
                                   for _, top, base in ratios]))
    for system in shown:
        medians[system]["alone p50"] = percentile(measured.alone[system], 0.5)
        medians[system]["alone p99"] = percentile(measured.alone[system], 0.99)
    for label in ("alone p50", "alone p99"):
        print(line(f"one loop alone: turn gap {label.split()[1]} ms",
                   [f"{medians[s][label]:.1f}" for s in shown],
                   [ratio(medians[top][label], medians[base][label])
                    for _, top, base in ratios]))
    return medians


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def targets(o: dict, d: dict | None) -> list[tuple[str, bool | None]]:
    """Issue 10's targets for ours (``o``) against DBOS (``d``); without DBOS,
    the two that do not compare with it."""
    commits = o["durable commits / turn"]
    commits_ok = None if commits is None else commits <= 4
    alone_ok = o["alone p50"] <= 10
    if d is None:
        return [("durable commits/turn <= 4", commits_ok),
                ("one loop alone gap p50 <= 10 ms", alone_ok)]
    return [
        ("turns/s >= 1.5x DBOS", o["LLM turns/s"] >= 1.5 * d["LLM turns/s"]),
        ("worker CPU/turn <= 0.7x DBOS",
         o["worker CPU ms / turn"] <= 0.7 * d["worker CPU ms / turn"]),
        ("Postgres CPU/turn <= DBOS", o["Postgres CPU ms / turn"] <= d["Postgres CPU ms / turn"]),
        ("durable commits/turn <= 4", commits_ok),
        ("WAL/turn <= DBOS", o["WAL bytes / turn"] <= d["WAL bytes / turn"]),
        ("one loop alone gap p50 <= 10 ms", alone_ok),
        ("completion p50 <= DBOS", o["loop completion p50 s"] <= d["loop completion p50 s"]),
    ]


def ab_checks(o: dict, old: dict, name: str) -> list[tuple[str, bool | None, str]]:
    """The A/B of ``--against``: ours' turns/s, worker CPU/turn and Postgres
    CPU/turn each no more than AB_TOLERANCE worse than REV's (``old``)."""
    checks = []
    for label, metric, higher_is_better in (("turns/s", "LLM turns/s", True),
                                            ("worker CPU/turn", "worker CPU ms / turn", False),
                                            ("Postgres CPU/turn", "Postgres CPU ms / turn", False)):
        bound = 1 - AB_TOLERANCE if higher_is_better else 1 + AB_TOLERANCE
        ours, base = o[metric], old[metric]
        ok = None
        if ours is not None and base:
            ok = ours >= bound * base if higher_is_better else ours <= bound * base
        sign = ">=" if higher_is_better else "<="
        checks.append((f"A/B: {label} {sign} {bound:.1f}x {name}", ok, ratio(ours, base)))
    return checks


def print_checks(medians: dict[str, dict[str, float | None]], against: str | None) -> None:
    rows = [(label, ok, "") for label, ok in targets(medians["ours"], medians.get("dbos"))]
    if METRICS_BUILD in medians:
        on, off = medians[METRICS_BUILD]["LLM turns/s"], medians["ours"]["LLM turns/s"]
        rows.append((f"metrics on: turns/s >= {1 - METRICS_TOLERANCE:.2f}x off",
                     None if not on or not off else on >= (1 - METRICS_TOLERANCE) * off,
                     f" ({ratio(on, off)})"))
    if against == UNTRACED:
        ours, base = medians["ours"]["LLM turns/s"], medians[against]["LLM turns/s"]
        ok = None if ours is None or not base else ours >= (1 - TRACING_TOLERANCE) * base
        rows.append((f"tracing: turns/s >= {1 - TRACING_TOLERANCE:.2f}x {UNTRACED}", ok,
                     f" ({ratio(ours, base)})"))
    elif against:
        rows += [(label, ok, f" ({r})") for label, ok, r in
                 ab_checks(medians["ours"], medians[against], against)]
    width = max(40, *(len(label) for label, _, _ in rows))
    print()
    for label, ok, note in rows:
        print(f"  {label:{width}} {verdict(ok)}{note}")


def print_wal_tables(wal_tables: dict[str, tuple[collections.Counter[str], int]],
                     row_tables: dict[str, dict[str, tuple[int, int, int]]]) -> None:
    for system, (tables, turns) in sorted(wal_tables.items()):
        print(f"\nWAL bytes / turn by table, {system} (last rep, "
              f"{sum(tables.values()) / turns:.0f} in all), and rows inserted, updated "
              "(HOT) / turn:")
        rows = row_tables.get(system, {})
        for table, size in tables.most_common():
            if size / turns >= 1:
                ins, upd, hot = rows.get(table, (0, 0, 0))
                written = (f"  ins {ins / turns:4.2f}  upd {upd / turns:4.2f} "
                           f"({hot / turns:4.2f})" if ins or upd else "")
                print(f"  {size / turns:8.0f}  {table:34}{written}")


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--alone-turns", type=int, default=20,
                        help="LLM turns of the one-loop-alone run (default 20)")
    parser.add_argument("--wal-by-table", action="store_true",
                        help="also print each system's WAL per turn by table (last rep)")
    parser.add_argument("--against", metavar="REV",
                        help="A/B: also run git revision REV (a hash, HEAD~3, a tag) as "
                             "ours@<short hash>, from a temporary worktree")
    parser.add_argument("--cluster-port", type=int, metavar="PORT",
                        help="run on a throwaway PostgreSQL cluster initdb'ed on PORT (its WAL "
                             "is this run's alone), removed at the end")
    parser.add_argument("--wire-log", choices=("full", "summary"),
                        help="SOLIDLOOP_WIRE_LOG for this tree's workers (default: the "
                             "setting's default); --against REV runs with its own default")
    parser.add_argument("--statements", action="store_true",
                        help="with --cluster-port: print each system's statements per turn by "
                             "WAL (pg_stat_statements, last rep)")
    parser.add_argument("--metrics", action="store_true",
                        help=f"also run ours with SOLIDLOOP_METRICS on as {METRICS_BUILD!r} "
                             "(its workers' endpoint scraped once a second during the run)")
    parser.add_argument("--tracing", action="store_true",
                        help="ours with the OpenTelemetry SDK (spans made, then dropped), "
                             "against the same tree untraced")
    parser.add_argument("--no-dbos", action="store_true",
                        help="leave DBOS out (a quicker A/B; needs --against, --metrics or "
                             "--tracing)")
    args = parser.parse_args()
    if args.statements and args.cluster_port is None:
        parser.error("--statements needs --cluster-port (it loads pg_stat_statements)")
    if args.no_dbos and not (args.against or args.metrics or args.tracing):
        parser.error("--no-dbos needs --against, --metrics or --tracing: without DBOS ours "
                     "has nothing to compare with")
    if args.tracing and args.against:
        parser.error("--tracing compares ours with itself untraced: leave --against out")
    return args


def exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM as SystemExit, so the workers and the REV worktree are cleaned up."""
    raise SystemExit(128 + signum)


def main() -> None:
    global PG_PORT, _OWN_CLUSTER, _STATEMENTS
    args = parse_args()
    commit = resolve(args.against) if args.against else None
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with contextlib.ExitStack() as stack:
        if args.cluster_port is not None:
            cluster = Cluster(args.cluster_port, args.statements)
            stack.callback(cluster.stop)
            cluster.start()
            PG_PORT, _OWN_CLUSTER, _STATEMENTS = args.cluster_port, True, args.statements
            print(f"on a throwaway cluster at 127.0.0.1:{PG_PORT} ({cluster.data})", flush=True)
        builds = {"ours": Build("ours", OURS_DB, wire_log=args.wire_log,
                                tracing=args.tracing)}
        if args.metrics:
            builds[METRICS_BUILD] = Build(METRICS_BUILD, METRICS_DB, wire_log=args.wire_log,
                                          metrics_port=METRICS_PORT)
        against = None
        if args.tracing:
            against = Build(UNTRACED, OURS_DB + "_untraced", wire_log=args.wire_log)
            builds[UNTRACED] = against
        if commit is not None:
            against = against_build(commit, stack.enter_context(checkout(commit)))
            builds[against.name] = against
            print("\n".join(describe(commit, against)), flush=True)
        systems = [*builds, *([] if args.no_dbos else ["dbos"])]

        from flask_solidloop.testing import LLMEmulator

        script = Script(args.turns, args.alone_turns)
        emulator = LLMEmulator().start()
        stack.callback(emulator.stop)
        emulator.script(lambda body: True, script.reply)
        os.environ["SOLIDLOOP_BENCH_LLM_URL"] = emulator.base_url
        os.environ["SOLIDLOOP_BENCH_API_KEY"] = "sk-bench"
        measured = measure(args, systems, builds, emulator, script)

    medians = print_table(args, measured, against and against.name)
    print_checks(medians, against and against.name)
    if commit is not None and against is not None:
        print("\n" + "\n".join(describe(commit, against)))
    print_wal_tables(measured.wal_tables, measured.row_tables)
    for system, lines in sorted(measured.statements.items()):
        print(f"\nStatements by WAL, {system} (last rep):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
