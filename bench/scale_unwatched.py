"""Many streaming loops nobody watches: what their partial text costs PostgreSQL.

Run it from the project root with the project's virtualenv::

    python bench/scale_unwatched.py --quick     # 60 loops, about 2 minutes
    python bench/scale_unwatched.py             # 500 loops, 50 of them watched

What runs. ``--loops`` loops of tests/support/support_app.py's
``streaming_assistant`` run at once: each makes three streamed LLM turns and
two tool calls (``add``), every answer ``--words`` numbered words that the LLM
emulator (in this process) trickles at ``--tps`` pieces per second (a piece is
8 characters, a token's worth: 200 words at 40/s is a turn of about 5 s).
``flask solidloop worker`` processes (``--worker-processes`` x
``--worker-threads``, enough threads for every loop's call at once) run them
against a throwaway PostgreSQL cluster this script initdbs on ``--port``
(``max_connections`` 400), so nothing else on the machine's server counts.

Phases, in the same run, each with fresh worker processes and an emptied
database:

* **off**: partial text off (``SOLIDLOOP_STREAM_MAX_HZ = 0`` and a slow pace
  longer than any turn): the baseline, each answer written once, at its end;
* **unwatched**: the defaults (deltas at 20 Hz for watched loops, a flush
  every ``SOLIDLOOP_STREAM_UPDATE_INTERVAL`` = 10 s for the others): nobody
  watches;
* **2 s pace**: the same with ``SOLIDLOOP_STREAM_UPDATE_INTERVAL = 2`` (the
  default before watcher arrivals were heard), for reference;
* **50 watched** (``--watched``): the defaults, with that many of the loops
  followed by an SSE client each (``solidloop.sse_response`` under gunicorn,
  the clients of bench/streaming_fanout.py) from before they start. Each
  client's stream is checked: every answer's deltas add up to its stored text,
  ids only grow, and the stream ends with ``completed`` (no gap).

Figures per phase: PostgreSQL CPU per LLM turn (user+system time of the
cluster's processes from /proc, all of them: backends, WAL writer,
checkpointer), transactions per LLM turn (``xact_commit`` + ``xact_rollback``
of the database), NOTIFYs per turn (a LISTEN connection of this process on
``solidloop_live``), stream events per turn, turns per second, and the ratio to
**off**. The target: **unwatched** within 20% of **off** in PostgreSQL CPU and
transactions per turn. Nothing is asserted of wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg  # noqa: E402
import streaming_fanout as fanout  # noqa: E402

PG_BIN = Path("/usr/lib/postgresql/15/bin")
DATABASE = "solidloop_scale_unwatched"


# -- a throwaway cluster ----------------------------------------------------------------


class Cluster:
    """A PostgreSQL cluster of this run's own, initdb'ed as the postgres user."""

    def __init__(self, port: int, max_connections: int = 400) -> None:
        self.port = port
        self.data = Path(tempfile.mkdtemp(prefix="solidloop-scale-pg-"))
        self.max_connections = max_connections

    def _as_postgres(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(prefix + list(cmd), check=True, stdout=subprocess.DEVNULL)

    def start(self) -> Cluster:
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust",
                          "-U", "postgres")
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.data / "log"), "-w",
            "-o", f"-p {self.port} -k /tmp -c max_connections={self.max_connections} "
                  "-c shared_buffers=256MB -c listen_addresses=127.0.0.1", "start")
        return self

    def stop(self) -> None:
        try:
            self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                              "-w", "stop")
        finally:
            shutil.rmtree(self.data, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def cpu_seconds(self) -> float:
        """User+system CPU of every process of the cluster so far (postmaster's
        children that exited are counted in its cumulative children time)."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        # utime, stime, cutime, cstime: the exited backends are in the last two.
        total = sum(int(f) for f in fields[11:15]) / ticks
        for child in cluster_children(pid):
            cfields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in cfields[11:13]) / ticks
        return total


def cluster_children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


# -- one phase --------------------------------------------------------------------------


def words(loop_index: int, turn: int, count: int) -> str:
    return " ".join(f"x{loop_index}t{turn}w{i:03d}" for i in range(count))


def script(emulator: Any, args: argparse.Namespace) -> None:
    """Three streamed answers per loop: two with a tool call, then the last."""
    emulator.reset()
    emulator.fault_next("slow_stream", seconds=1.0 / args.tps, times=args.loops * 3)

    def index(body: dict) -> int:
        first = next(m for m in body["messages"] if m["role"] == "user")
        return int(str(first["content"]).split()[-1])

    def turn(body: dict) -> int:
        return sum(1 for m in body["messages"] if m["role"] == "tool")

    def reply(body: dict) -> dict:
        n, t = index(body), turn(body)
        out: dict[str, Any] = {"content": words(n, t, args.words)}
        if t < 2:
            out["tool_calls"] = [{"name": "add", "arguments": {"a": n, "b": t}}]
        return out

    emulator.script(lambda body: "scale" in json.dumps(body["messages"][:2]), reply)


def phase(args: argparse.Namespace, cluster: Cluster, emulator: Any, tag: str,
          config: dict[str, Any], watched: int, workdir: Path) -> dict[str, Any]:
    from flask_solidloop.loops import control
    from flask_solidloop.testing.plugin import truncate_all
    from tests.support.support_app import StreamingAssistant, create_app

    url = cluster.url(DATABASE)
    truncate_all(url)
    script(emulator, args)
    config = {"SQLALCHEMY_ENGINE_OPTIONS": {"pool_pre_ping": True}, **config}
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "SOLIDLOOP_TEST_LLM_URL": emulator.base_url,
                "SOLIDLOOP_TEST_API_KEY": "sk-bench",
                "SOLIDLOOP_TEST_DATABASE_URL": url,
                "SOLIDLOOP_TEST_APP_CONFIG": json.dumps(config)})
    worker_env = dict(env, FLASK_APP="tests.support.support_app:create_app()",
                      SOLIDLOOP_TEST_APP_CONFIG=json.dumps(dict(config, SQLALCHEMY_ENGINE_OPTIONS={
                          "pool_pre_ping": True, "pool_size": args.worker_pool,
                          "max_overflow": args.worker_pool})))
    workers = fanout.spawn([sys.executable, "-m", "flask", "solidloop", "worker",
                            "--processes", str(args.worker_processes),
                            "--threads", str(args.worker_threads)],
                           worker_env, workdir / f"workers-{tag}.log")
    web: subprocess.Popen | None = None
    clients: list[subprocess.Popen] = []
    app = create_app()
    conninfo = fanout.libpq_url(url)
    try:
        with app.app_context():
            loop_ids = [StreamingAssistant.create(message=f"scale {i}").id
                        for i in range(args.loops)]
            app.extensions["sqlalchemy"].session.remove()
        followed = loop_ids[:watched]
        if followed:
            port = fanout.free_port()
            base = f"http://127.0.0.1:{port}"
            web = fanout.spawn([sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "2",
                                "--threads", str(max(8, watched)), "-b", f"127.0.0.1:{port}",
                                "--timeout", "60", "tests.support.stream_app:create_app()"],
                               env, workdir / f"web-{tag}.log")
            deadline = time.monotonic() + 60
            while True:
                try:
                    fanout.httpx.get(base + "/ping", timeout=1)
                    break
                except fanout.httpx.HTTPError:
                    if time.monotonic() > deadline or web.poll() is not None:
                        raise RuntimeError("gunicorn did not start: see " + str(workdir)) \
                            from None
                    time.sleep(0.2)
            clients.append(subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "streaming_fanout.py"), "--client-base",
                 base, "--client-loops", ",".join(map(str, followed)), "--client-out",
                 str(workdir / f"clients-{tag}.json"), "--per-loop", "1", "--timeout",
                 str(args.timeout)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
            assert clients[0].stdout is not None
            if clients[0].stdout.readline().strip() != "ready":
                raise RuntimeError("the client process did not get ready")
        wait_for_workers(conninfo, args.worker_processes, workers)
        time.sleep(1.0)  # idle; the streams marked their loops
        counter = fanout.NotifyCounter(conninfo)
        counter.loops = set(loop_ids)
        counter.start()
        counter.listening.wait(10)
        cpu0 = cluster.cpu_seconds()
        xacts0 = xacts(conninfo)
        started = time.monotonic()
        with app.app_context():
            state = app.extensions["solidloop"]
            for loop_id in loop_ids:
                control.resume(state, loop_id, from_="init")
            app.extensions["sqlalchemy"].session.remove()
        deadline = started + args.timeout
        with psycopg.connect(conninfo, autocommit=True) as conn:
            while time.monotonic() < deadline:
                done = conn.execute(
                    "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) "
                    "AND status IN ('completed', 'failed')", (loop_ids,)).fetchone()
                if done and done[0] == len(loop_ids):
                    break
                time.sleep(0.25)
        elapsed = time.monotonic() - started
        time.sleep(1.0)  # backends report their counters
        cpu1 = cluster.cpu_seconds()
        xacts1 = xacts(conninfo)
        counter.done.set()
        counter.join(5)
        for proc in clients:
            proc.wait(timeout=60)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            turns, rows, completed, failed = conn.execute(
                "SELECT (SELECT count(*) FROM solidloop_messages WHERE role = 'assistant' "
                "AND status = 'completed' AND loop_id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_stream_events WHERE loop_id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_loops WHERE status = 'completed' "
                "AND id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_loops WHERE status = 'failed' "
                "AND id = ANY(%(ids)s))", {"ids": loop_ids}).fetchone() or (0, 0, 0, 0)
            stored = {(loop, message): text for loop, message, text in conn.execute(
                "SELECT loop_id, id, content FROM solidloop_messages WHERE role = 'assistant' "
                "AND status = 'completed' AND loop_id = ANY(%s)", (followed,)).fetchall()}
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
        fanout.stop(workers)
        if web is not None:
            fanout.stop(web)
        with app.app_context():
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
        app.extensions["solidloop"].stop_renewer()
        app.extensions["solidloop"].broker.close()
    gaps = check_streams(workdir / f"clients-{tag}.json", stored) if followed else None
    return {"phase": tag, "loops": len(loop_ids), "completed": completed, "failed": failed,
            "turns": turns, "cpu": cpu1 - cpu0, "xacts": xacts1 - xacts0,
            "notifies": counter.count, "rows": rows, "elapsed": elapsed,
            "watched": len(followed), "gaps": gaps}


def wait_for_workers(conninfo: str, processes: int, workers: subprocess.Popen) -> None:
    """Until every worker process LISTENs (its consumers are up)."""
    deadline = time.monotonic() + 120
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                               "WHERE application_name = 'solidloop-listener'").fetchone()
            if row and row[0] >= processes:
                return
            if time.monotonic() > deadline or workers.poll() is not None:
                raise RuntimeError("the workers did not start")
            time.sleep(0.2)


def xacts(conninfo: str) -> int:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def check_streams(path: Path, stored: dict[tuple[int, int], str]) -> dict[str, int]:
    """Each watched loop's stream against its stored answers: streams whose
    deltas add up to every answer, whose ids only grow, that ended completed."""
    whole = ordered = ended = 0
    clients = json.loads(path.read_text()) if path.exists() else []
    for client in clients:
        loop_id = int(client["url"].split("/")[-2])
        texts: dict[int, str] = {}
        ids = [int(e[0]) for e in client["events"] if e[0] is not None]
        for _id, kind, message_id, text, _received in client["events"]:
            if kind == "text_delta":
                texts[message_id] = texts.get(message_id, "") + (text or "")
        answers = {m: t for (loop, m), t in stored.items() if loop == loop_id}
        whole += bool(answers) and all(texts.get(m) == t for m, t in answers.items())
        ordered += ids == sorted(set(ids))
        ended += client["end"] == "completed"
    return {"clients": len(clients), "whole": whole, "ordered": ordered, "ended": ended}


# -- the run ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="60 loops, 6 watched, 50 words: about two minutes")
    parser.add_argument("--loops", type=int, default=500)
    parser.add_argument("--watched", type=int, default=50)
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--tps", type=float, default=40.0)
    parser.add_argument("--worker-processes", type=int, default=4)
    parser.add_argument("--worker-threads", type=int, default=128)
    parser.add_argument("--worker-pool", type=int, default=16)
    parser.add_argument("--port", type=int, default=5445)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--phases", default="off,unwatched,2s,watched")
    args = parser.parse_args(argv)
    if args.quick:
        args.loops, args.watched, args.words = 60, 6, 50
        args.worker_processes, args.worker_threads = 2, 32
    from flask_solidloop.testing.llm_emulator import LLMEmulator
    from flask_solidloop.testing.plugin import prepare_database

    settings = {
        "off": ({"SOLIDLOOP_STREAM_MAX_HZ": 0, "SOLIDLOOP_STREAM_UPDATE_INTERVAL": 1e6}, 0),
        "unwatched": ({}, 0),
        "2s": ({"SOLIDLOOP_STREAM_UPDATE_INTERVAL": 2.0}, 0),
        "watched": ({}, args.watched),
    }
    cluster = Cluster(args.port).start()
    emulator = LLMEmulator(strict=True).start()
    figures = []
    try:
        url = cluster.url(DATABASE)
        prepare_database(url)
        os.environ["SOLIDLOOP_TEST_DATABASE_URL"] = url  # this process's app
        os.environ.pop("SOLIDLOOP_TEST_APP_CONFIG", None)
        with tempfile.TemporaryDirectory(prefix="solidloop-scale-") as tmp:
            for tag in args.phases.split(","):
                config, watched = settings[tag]
                figures.append(phase(args, cluster, emulator, tag, config, watched, Path(tmp)))
                f = figures[-1]
                print(f"phase {tag}: {f['completed']}/{f['loops']} completed in "
                      f"{f['elapsed']:.1f} s", flush=True)
    finally:
        emulator.stop()
        cluster.stop()
    report(args, figures)
    return figures


def report(args: argparse.Namespace, figures: list[dict[str, Any]]) -> None:
    base = next((f for f in figures if f["phase"] == "off"), figures[0])

    def per_turn(f: dict[str, Any], key: str) -> float:
        return f[key] / f["turns"] if f["turns"] else float("nan")

    print(f"\n{args.loops} streaming loops at once (3 LLM turns, 2 tool calls each; "
          f"{args.words} words at {args.tps:g} pieces/s per answer); workers "
          f"{args.worker_processes} x {args.worker_threads} threads\n")
    print("| figure | " + " | ".join(f["phase"] for f in figures) + " |")
    print("|---" * (len(figures) + 1) + "|")
    print("| loops completed | " + " | ".join(f"{f['completed']}/{f['loops']}"
                                             for f in figures) + " |")
    print("| LLM turns | " + " | ".join(str(f["turns"]) for f in figures) + " |")
    print("| turns/s | " + " | ".join(f"{f['turns'] / f['elapsed']:.1f}"
                                     for f in figures) + " |")
    for label, key, scale in (("PostgreSQL CPU ms per LLM turn", "cpu", 1000.0),
                              ("transactions per LLM turn", "xacts", 1.0),
                              ("NOTIFYs per LLM turn", "notifies", 1.0),
                              ("stream events per LLM turn", "rows", 1.0)):
        cells = []
        for f in figures:
            value = per_turn(f, key) * scale
            ref = per_turn(base, key) * scale
            ratio = f" ({value / ref:.2f}x)" if ref and f is not base else ""
            cells.append(f"{value:.2f}{ratio}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for f in figures:
        if f["gaps"] is not None:
            g = f["gaps"]
            print(f"\n{f['phase']}: {g['clients']} SSE clients; every answer whole: "
                  f"{g['whole']}; ids in order: {g['ordered']}; ended completed: {g['ended']}")
    unwatched = next((f for f in figures if f["phase"] == "unwatched"), None)
    if unwatched is not None and base is not unwatched:
        cpu = per_turn(unwatched, "cpu") / per_turn(base, "cpu")
        tx = per_turn(unwatched, "xacts") / per_turn(base, "xacts")
        verdict = "PASS" if cpu <= 1.2 and tx <= 1.2 else "MISS"
        print(f"\ntarget: unwatched within 20% of off: CPU {cpu:.2f}x, transactions "
              f"{tx:.2f}x: {verdict}")


if __name__ == "__main__":
    main()
