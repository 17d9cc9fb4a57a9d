"""One worker process, many concurrent streaming loops: async LLM I/O against
thread mode, in the same run (docs/decisions/0027-llm-io.md).

Run it from the project root with the project's virtualenv::

    python bench/scale_inflight.py                    # 1000 loops, both modes
    python bench/scale_inflight.py --quick            # 200 loops, 64 threads against 8
    python bench/scale_inflight.py --url postgresql+psycopg://postgres@127.0.0.1:5441/mine

What runs. ``--loops`` loops of one streaming agent (one LLM turn each, no
tools) are started, then ONE ``flask solidloop worker --processes 1`` runs
them all, once per mode:

* **async**: ``SOLIDLOOP_LLM_IO="async"``, ``--async-threads`` dramatiq
  threads (default 16), ``SOLIDLOOP_LLM_IO_MAX_INFLIGHT`` = the loops;
* **threads**: today's mode, ``--threads`` dramatiq threads (default 256).

The LLM emulator (flask_solidloop.testing.llm_emulator, in a process of its
own) answers each turn with ``--seconds`` x ``--tps`` pieces of 8 characters
(a token's worth), ``1/tps`` seconds apart: about 5 s at 40 tokens/s.

Figures, per mode, sampled every 0.25 s: peak in-flight calls (requests on
record, not answered, of running loops), peak RSS of the worker process
(dramatiq's worker child, its master not counted), peak PostgreSQL
connections of the bench database (this sampler's own excluded), turns/s
(the loops over the span from the first request to the last loop's end,
database clock), and the worker process's CPU (user + system) per turn.
Every loop must complete, or the run fails. The table ends with the ratio
async / threads.

Database: by default a throwaway cluster (``initdb`` as postgres) on
``--port`` (5441) with ``max_connections=300``, removed at the end; or
``--url`` names a server of your own (one database per mode is created on it
as ``<name>_async`` / ``<name>_threads``). ``main(argv)`` runs it and returns
the figures (bench/scale.py calls it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from flask import Flask  # noqa: E402
from flask_sqlalchemy import SQLAlchemy  # noqa: E402

from flask_solidloop import Agent, SolidLoop  # noqa: E402
from flask_solidloop.urls import libpq_url  # noqa: E402

# -- the app the worker runs (FLASK_APP='scale_inflight:create_app()') -----------------

db = SQLAlchemy()
solidloop = SolidLoop()


@solidloop.agent("scale_stream")
class ScaleStream(Agent):
    system_prompt = "You answer at length."
    streaming = True

    def llm(self) -> dict:
        return {"base_url": os.environ["SCALE_LLM_URL"], "model": "bench",
                "api_key_env": "SCALE_API_KEY", "read_timeout": 120}


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SCALE_DATABASE_URL"]
    pool = int(os.environ.get("SCALE_POOL", "16"))
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": pool, "max_overflow": pool,
                                               "pool_timeout": 120}
    app.config.update(json.loads(os.environ.get("SCALE_CONFIG", "{}")))
    db.init_app(app)
    solidloop.init_app(app, db=db)
    return app


# -- the emulator, in a process of its own ----------------------------------------------

def serve_emulator(tps: float, seconds: float) -> None:
    from flask_solidloop.testing.llm_emulator import LLMEmulator

    llm = LLMEmulator().start()
    pieces = max(1, int(tps * seconds))
    answer = "".join(f"w{i:06d} " for i in range(pieces))[:pieces * 8]
    llm.fault_next("slow_stream", seconds=1.0 / tps, times=10**7)
    llm.script(lambda body: True, {"content": answer})
    print(llm.base_url, flush=True)
    while True:
        time.sleep(3600)


def start_emulator(tps: float, seconds: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-emulator", "--tps", str(tps),
                             "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        raise RuntimeError(f"the emulator did not start: {url!r}")
    return proc, url


# -- the throwaway cluster -----------------------------------------------------------------

@contextlib.contextmanager
def cluster(port: int) -> Any:
    from tests.support import pg_cluster

    if not pg_cluster.available():
        raise SystemExit("no initdb/pg_ctl here: pass --url to a server of your own")

    class Cluster(pg_cluster.ThrowawayCluster):
        def __init__(self) -> None:
            super().__init__()
            self.port = port

        def start_server(self) -> None:
            self._pg_ctl("start", "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 "
                         f"-c unix_socket_directories={self.root} -c max_connections=300 "
                         "-c shared_buffers=256MB -c synchronous_commit=off")

    made = Cluster()
    try:
        yield made.start()
    finally:
        made.stop()


def fresh_database(url: str) -> None:
    from sqlalchemy.engine import make_url

    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    name = make_url(url).database
    admin = libpq_url(str(make_url(url).set(database="postgres")))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    ensure_database(url)
    upgrade(url)


# -- one mode -------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(c) for c in handle.read().split()]
    return found


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children(current)
    return out


def rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def worker_pids(master: int) -> list[int]:
    """dramatiq's worker processes: the master's descendants but the master."""
    return [pid for pid in tree(master) if pid != master]


def run_mode(mode: str, url: str, llm_url: str, args: argparse.Namespace) -> dict[str, Any]:
    fresh_database(url)
    threads = args.async_threads if mode == "async" else args.threads
    config = {"SOLIDLOOP_LLM_IO": mode, "SOLIDLOOP_LLM_IO_MAX_INFLIGHT": max(args.loops, 1),
              "SOLIDLOOP_STREAM_MAX_HZ": 20.0}
    env = dict(os.environ, SCALE_DATABASE_URL=url, SCALE_LLM_URL=llm_url,
               SCALE_API_KEY="sk-bench", SCALE_CONFIG=json.dumps(config),
               SCALE_POOL=str(args.pool), FLASK_APP="scale_inflight:create_app()",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    app = create_app_for(url, llm_url)
    with app.app_context():
        loop_ids = [ScaleStream.start(message=f"Answer #{i} at length").id
                    for i in range(args.loops)]
        db.session.remove()
    log = Path(tempfile.gettempdir()) / f"scale_inflight_{mode}.log"
    with open(log, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "flask", "solidloop", "worker",
                                 "--processes", "1", "--threads", str(threads)],
                                cwd=ROOT / "bench", env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    figures: dict[str, Any] = {"mode": mode, "threads": threads, "loops": args.loops}
    peak_inflight = peak_rss = peak_conns = 0
    cpu_at: dict[int, float] = {}
    deadline = time.monotonic() + args.timeout
    try:
        with psycopg.connect(libpq_url(url), autocommit=True) as pg:
            while True:
                pids = worker_pids(proc.pid)
                for pid in pids:
                    cpu_at[pid] = max(cpu_at.get(pid, 0.0), cpu_seconds(pid))
                peak_rss = max(peak_rss, sum(rss_kb(pid) for pid in pids))
                inflight, conns, done, running = pg.execute(
                    "SELECT (SELECT count(*) FROM solidloop_events e JOIN solidloop_loops l "
                    "ON l.id = e.loop_id WHERE e.kind = 'llm_request' AND e.duration_ms IS NULL "
                    # Answered requests keep a NULL duration: their answer is a
                    # row of its own (migration 0027).
                    "AND NOT EXISTS (SELECT 1 FROM solidloop_llm_answers a "
                    "WHERE a.event_id = e.id) AND l.status = 'running'), "
                    "(SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()), "
                    "(SELECT count(*) FROM solidloop_loops WHERE status IN "
                    "('completed', 'failed', 'paused', 'stopped')), "
                    "(SELECT count(*) FROM solidloop_loops WHERE status = 'running')"
                ).fetchone()
                peak_inflight, peak_conns = max(peak_inflight, inflight), max(peak_conns, conns)
                if done >= len(loop_ids):
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"the {mode} worker exited: {log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: {done} of {len(loop_ids)} loops done after "
                                       f"{args.timeout}s ({running} running); log: {log}")
                time.sleep(0.25)
            statuses = dict(pg.execute("SELECT status, count(*) FROM solidloop_loops "
                                       "GROUP BY status").fetchall())
            span = pg.execute(
                "SELECT extract(epoch FROM (SELECT max(finished_at) FROM solidloop_loops) - "
                "(SELECT min(created_at) FROM solidloop_events WHERE kind = 'llm_request'))"
            ).fetchone()[0]
            turns = pg.execute("SELECT count(*) FROM solidloop_events "
                               "WHERE kind = 'llm_request'").fetchone()[0]
        for pid in worker_pids(proc.pid):
            cpu_at[pid] = max(cpu_at.get(pid, 0.0), cpu_seconds(pid))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(Exception):
            proc.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    if statuses.get("completed", 0) != len(loop_ids):
        raise RuntimeError(f"{mode}: not every loop completed: {statuses}; log: {log}")
    figures.update(peak_inflight=peak_inflight, peak_rss_mb=round(peak_rss / 1024, 1),
                   peak_pg_connections=peak_conns, turns=turns,
                   turns_per_s=round(turns / float(span), 2) if span else None,
                   cpu_ms_per_turn=round(sum(cpu_at.values()) * 1000 / max(turns, 1), 2),
                   seconds=round(float(span or 0), 1), statuses=statuses)
    return figures


def create_app_for(url: str, llm_url: str) -> Flask:
    """The app this process starts the loops with (a small pool)."""
    os.environ.update(SCALE_DATABASE_URL=url, SCALE_LLM_URL=llm_url, SCALE_POOL="4",
                      SCALE_CONFIG="{}")
    return create_app()


# -- the report -------------------------------------------------------------------------------

ROWS = [("peak in-flight calls", "peak_inflight"), ("worker RSS, peak (MB)", "peak_rss_mb"),
        ("PostgreSQL connections, peak", "peak_pg_connections"),
        ("turns/s", "turns_per_s"), ("worker CPU per turn (ms)", "cpu_ms_per_turn"),
        ("span, first request to last end (s)", "seconds")]


def table(results: dict[str, dict[str, Any]]) -> str:
    modes = list(results)
    head = " | ".join(f"{m} ({results[m]['threads']} threads)" for m in modes)
    lines = [f"| | {head} |" + (" async / threads |" if len(modes) == 2 else ""),
             "|---|" + "---|" * len(modes) + ("---|" if len(modes) == 2 else "")]
    for label, key in ROWS:
        cells = [str(results[m][key]) for m in modes]
        ratio = ""
        if len(modes) == 2:
            a, t = results["async"][key], results["threads"][key]
            ratio = f" {a / t:.2f} |" if a and t else " |"
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=256, help="thread mode's threads")
    parser.add_argument("--async-threads", type=int, default=16)
    parser.add_argument("--tps", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of a turn")
    parser.add_argument("--pool", type=int, default=16,
                        help="the worker's SQLAlchemy pool_size (and max_overflow)")
    parser.add_argument("--modes", default="async,threads")
    parser.add_argument("--url", default=None,
                        help="a database URL of your own (default: a throwaway cluster)")
    parser.add_argument("--port", type=int, default=5441, help="the throwaway cluster's port")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true",
                        help="200 loops of 3-s turns, 64 threads against 8: about 3 minutes")
    parser.add_argument("--serve-emulator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.loops, args.threads, args.async_threads, args.seconds = 200, 64, 8, 3.0
    if args.serve_emulator:
        serve_emulator(args.tps, args.seconds)
    emulator, llm_url = start_emulator(args.tps, args.seconds)
    results: dict[str, dict[str, Any]] = {}
    try:
        with contextlib.ExitStack() as stack:
            base = args.url or stack.enter_context(cluster(args.port)).url("scale_inflight")
            for mode in args.modes.split(","):
                print(f"{mode}: {args.loops} loops ...", flush=True)
                results[mode] = run_mode(mode, f"{base}_{mode}", llm_url, args)
                print(json.dumps(results[mode]), flush=True)
    finally:
        emulator.kill()
        emulator.wait()
    print(f"\nOne worker process, {args.loops} streaming loops (one turn of "
          f"{args.seconds:g} s at {args.tps:g} tokens/s each)\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
