"""Benchmark a loop's event stream fanned out: many SSE clients on many
streaming loops, against real gunicorn and real workers.

Run it from the project root with the project's virtualenv::

    python bench/streaming_fanout.py --quick     # 10 loops x 4 clients, about a minute
    python bench/streaming_fanout.py             # 50 loops x 4 clients (200 SSE clients)
    python bench/streaming_fanout.py --url postgresql+psycopg://postgres@127.0.0.1:5432/mine

What runs. ``--loops`` streaming loops (tests/support/support_app.py's
``streaming_assistant``), each answering with ``--words`` numbered words
(``x07w012``: the loop and the word, so every word is unique) that the LLM
emulator (in this process) trickles at ``--tps`` pieces per second (one piece
is 8 characters, a token's worth). ``--per-loop`` SSE clients per loop
(tests/support/sse_client.py, in ``--client-processes`` processes of their
own) read ``/loops/<id>/events`` (``solidloop.sse_response``) from gunicorn
(``-k gthread``, ``--web-processes`` processes with ``--web-threads``
threads) serving tests/support/stream_app.py; ``flask solidloop worker``
processes run the turns. The loops are created first, the clients connect,
then every loop is resumed at once.

Two phases, in the same run, each with fresh web and worker processes:

* **deltas**: ``SOLIDLOOP_STREAM_MAX_HZ`` = ``--max-hz`` (20): the clients get
  ``text_delta`` events as the words arrive;
* **off** (the baseline): ``SOLIDLOOP_STREAM_MAX_HZ=0``: no deltas, the
  clients get each message when it completes.

Figures, per phase:

* connections the web processes held, sampled from ``pg_stat_activity``
  every 0.25 s: the LISTEN ones (application_name ``solidloop-live``) and the
  pooled ones (the web's URL carries application_name ``fanout-web``), peak;
  the target is one LISTEN per web process and at most the pool's size
  (5 + 10 overflow, SQLAlchemy's default) pooled;
* NOTIFYs per streamed turn (a separate LISTEN connection of this process on
  ``solidloop_live`` counts those of the run's loops) against the deltas and
  the events written per turn (rows of ``solidloop_stream_events``);
* the delay from a word's token to the client: the emulator's send time of
  the piece that completes a numbered word, to the arrival at a client of the
  event that completes it there (``time.time()`` on both sides, one machine),
  p50 / p99 over every word and client;
* WAL bytes (``pg_current_wal_lsn()``, the whole server's: other databases'
  writes count too on a shared server) and commits (``pg_stat_database`` of
  the bench's database) per turn, from the resume to the last client's end.

It prints the figures side by side and the ratios deltas / off. Nothing is
asserted of wall-clock times. Database: ``--url`` (default
``solidloop_bench_fanout``), migrated and emptied at each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

from flask_solidloop.testing import _local_server  # noqa: E402
from flask_solidloop.urls import libpq_url  # noqa: E402

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_fanout"
WEB_APP_NAME = "fanout-web"
LISTEN_APP_NAME = "solidloop-live"
WORD = re.compile(r"x\d+w\d{3}")

# -- the emulator's send times ----------------------------------------------------------

#: One list per streamed response: (time.time(), piece) for every piece written.
SENT: list[list[tuple[float, bytes]]] = []
_sent_lock = threading.Lock()
_trickle = _local_server._trickle


def _recording_trickle(response: Any, sock: Any) -> Any:
    record: list[tuple[float, bytes]] = []
    with _sent_lock:
        SENT.append(record)
    for piece in _trickle(response, sock):
        if piece:
            record.append((time.time(), piece))
        yield piece


_local_server._trickle = _recording_trickle  # type: ignore[assignment]


def words_sent() -> dict[str, float]:
    """Each word's send time: when the piece completing it was written."""
    out: dict[str, float] = {}
    for record in SENT:
        text = ""
        for at, piece in record:
            for line in piece.decode("utf-8", "replace").splitlines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices:
                    text += (choices[0].get("delta") or {}).get("content") or ""
            _complete_words(text, at, out)
    return out


def _complete_words(text: str, at: float, into: dict[str, float]) -> None:
    # a word has exactly three digits after its "w": any match is a whole word
    for match in WORD.finditer(text):
        into.setdefault(match.group(), at)


def answer(loop_index: int, words: int) -> str:
    return " ".join(f"x{loop_index}w{i:03d}" for i in range(words))


# -- the client processes ---------------------------------------------------------------


def run_clients(args: argparse.Namespace) -> None:
    """A client process: ``--per-loop`` readers of each loop, until all end."""
    from tests.support.sse_client import SSEReader

    loops = [int(x) for x in args.client_loops.split(",")]
    readers = [SSEReader(f"{args.client_base}/loops/{loop}/events", read_timeout=60)
               for loop in loops for _ in range(args.per_loop)]
    deadline = time.monotonic() + args.timeout
    threads = [threading.Thread(target=r.run, kwargs={"deadline": deadline}, daemon=True)
               for r in readers]
    for thread in threads:
        thread.start()
    while any(r.connections == 0 for r in readers) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("ready", flush=True)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    out = []
    for reader in readers:
        events = []
        for event in reader.events:
            data = event.json()
            events.append([event.id, event.event, data.get("message_id"), data.get("text"),
                           event.received])
        out.append({"url": reader.url, "end": reader.end, "connections": reader.connections,
                    "breaks": len(reader.breaks), "events": events})
    Path(args.client_out).write_text(json.dumps(out))


# -- processes --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(cmd: list[str], env: dict[str, str], log: Path, **kw: Any) -> subprocess.Popen:
    handle = open(log, "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=kw.get("stdout", handle),
                            stderr=subprocess.STDOUT if "stdout" not in kw else handle,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def with_app_name(url: str, name: str) -> str:
    return url + ("&" if "?" in url else "?") + f"application_name={name}"


# -- samplers ---------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Peak connections by application_name in the bench's database."""

    def __init__(self, conninfo: str, database: str) -> None:
        super().__init__(daemon=True)
        self.conninfo, self.database = conninfo, database
        self.peak: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not self.done.is_set():
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid() GROUP BY 1",
                    (self.database,)).fetchall()
                for name, count in rows:
                    self.peak[name] = max(self.peak.get(name, 0), int(count))
                self.done.wait(0.25)


class NotifyCounter(threading.Thread):
    """NOTIFYs on solidloop_live for the given loops, and those carrying an event."""

    def __init__(self, conninfo: str) -> None:
        super().__init__(daemon=True)
        self.conninfo = conninfo
        self.loops: set[int] = set()
        self.count = 0
        self.inline = 0
        self.done = threading.Event()
        self.listening = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("LISTEN solidloop_live")
            self.listening.set()
            while not self.done.is_set():
                for note in conn.notifies(timeout=0.5, stop_after=1000):
                    head, _, body = note.payload.partition("\n")
                    loop = head.split(":")[0]
                    if loop.isdigit() and int(loop) in self.loops:
                        self.count += 1
                        self.inline += bool(body)


def db_counters(conninfo: str, database: str) -> tuple[int, int]:
    """(WAL position in bytes, commits of the database)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        lsn = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')").fetchone()
        commits = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                               (database,)).fetchone()
    assert lsn is not None and commits is not None
    return int(lsn[0]), int(commits[0])


# -- one phase --------------------------------------------------------------------------


def phase(args: argparse.Namespace, url: str, max_hz: float, emulator: Any,
          workdir: Path) -> dict[str, Any]:
    from flask_solidloop.loops import control
    from flask_solidloop.testing.plugin import truncate_all
    from tests.support.support_app import StreamingAssistant, create_app

    truncate_all(url)
    SENT.clear()
    emulator.reset()
    emulator.fault_next("slow_stream", seconds=1.0 / args.tps, times=args.loops * 3)
    emulator.script(lambda body: "fanout" in str(body["messages"][-1].get("content")),
                    lambda body: {"content": answer(
                        int(str(body["messages"][-1]["content"]).split()[-1]), args.words)})
    config = {"SOLIDLOOP_STREAM_MAX_HZ": max_hz,
              "SQLALCHEMY_ENGINE_OPTIONS": {"pool_pre_ping": True}}
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "SOLIDLOOP_TEST_LLM_URL": emulator.base_url,
                "SOLIDLOOP_TEST_API_KEY": "sk-bench",
                "SOLIDLOOP_TEST_APP_CONFIG": json.dumps(config)})
    worker_env = dict(env, SOLIDLOOP_TEST_DATABASE_URL=url,
                      FLASK_APP="tests.support.support_app:create_app()",
                      SOLIDLOOP_TEST_APP_CONFIG=json.dumps(dict(config, SQLALCHEMY_ENGINE_OPTIONS={
                          "pool_pre_ping": True, "pool_size": args.worker_threads + 2})))
    web_env = dict(env, SOLIDLOOP_TEST_DATABASE_URL=with_app_name(url, WEB_APP_NAME))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tag = "deltas" if max_hz else "off"
    web = spawn([sys.executable, "-m", "gunicorn", "-k", "gthread",
                 "-w", str(args.web_processes), "--threads", str(args.web_threads),
                 "-b", f"127.0.0.1:{port}", "--timeout", "60",
                 "tests.support.stream_app:create_app()"], web_env, workdir / f"web-{tag}.log")
    workers = spawn([sys.executable, "-m", "flask", "solidloop", "worker", "--processes",
                     str(args.worker_processes), "--threads", str(args.worker_threads)],
                    worker_env, workdir / f"workers-{tag}.log")
    clients: list[subprocess.Popen] = []
    app = create_app()
    conninfo = libpq_url(url)
    database = url.rsplit("/", 1)[1].split("?")[0]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/ping", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or web.poll() is not None:
                    raise RuntimeError("gunicorn did not start: see " + str(workdir)) from None
                time.sleep(0.2)
        with app.app_context():
            loop_ids = [StreamingAssistant.create(message=f"fanout {i}").id
                        for i in range(args.loops)]
            app.extensions["sqlalchemy"].session.remove()
        counter = NotifyCounter(conninfo)
        counter.loops = set(loop_ids)
        counter.start()
        counter.listening.wait(10)
        share = -(-len(loop_ids) // args.client_processes)
        for n in range(args.client_processes):
            mine = loop_ids[n * share:(n + 1) * share]
            if not mine:
                continue
            clients.append(subprocess.Popen(
                [sys.executable, __file__, "--client-base", base, "--client-loops",
                 ",".join(map(str, mine)), "--client-out", str(workdir / f"clients-{tag}-{n}.json"),
                 "--per-loop", str(args.per_loop), "--timeout", str(args.timeout)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        for proc in clients:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a client process did not get ready")
        time.sleep(1.0)  # every stream marked its loop watched
        sampler = Sampler(conninfo, database)
        sampler.start()
        wal0, commits0 = db_counters(conninfo, database)
        started = time.monotonic()
        with app.app_context():
            state = app.extensions["solidloop"]
            for loop_id in loop_ids:
                control.resume(state, loop_id, from_="init")
            app.extensions["sqlalchemy"].session.remove()
        for proc in clients:
            proc.wait(timeout=args.timeout + 30)
        elapsed = time.monotonic() - started
        time.sleep(1.5)  # backends report their commits to the statistics
        wal1, commits1 = db_counters(conninfo, database)
        sampler.done.set()
        counter.done.set()
        sampler.join(5)
        counter.join(5)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            turns, deltas, rows, completed = conn.execute(
                "SELECT (SELECT count(*) FROM solidloop_messages WHERE role = 'assistant' "
                "AND status = 'completed' AND loop_id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_stream_events WHERE kind = 'text_delta' "
                "AND loop_id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_stream_events WHERE loop_id = ANY(%(ids)s)), "
                "(SELECT count(*) FROM solidloop_loops WHERE status = 'completed' "
                "AND id = ANY(%(ids)s))", {"ids": loop_ids}).fetchone() or (0, 0, 0, 0)
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
        stop(workers)
        stop(web)
        with app.app_context():
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
        app.extensions["solidloop"].stop_renewer()
        app.extensions["solidloop"].broker.close()
    results = []
    for n in range(args.client_processes):
        path = workdir / f"clients-{tag}-{n}.json"
        if path.exists():
            results.extend(json.loads(path.read_text()))
    sent = words_sent()
    delays: list[float] = []
    whole = 0
    for client in results:
        loop_index = int(client["url"].split("/")[-2])
        texts: dict[int, str] = {}
        final = ""
        for _id, kind, message_id, text, received in client["events"]:
            if kind == "text_delta":
                before = texts.get(message_id, "")
                now = before + (text or "")
                texts[message_id] = now
                done: dict[str, float] = {}
                _complete_words(before, 0.0, done)
                for word in WORD.findall(now):
                    if word not in done and word in sent:
                        done[word] = received
                        delays.append(received - sent[word])
            elif kind == "message_completed" and text and WORD.search(text):
                final = text
        expected = answer(loop_ids.index(loop_index), args.words)
        whole += final == expected and client["end"] == "completed"
    delays.sort()
    return {"phase": tag, "max_hz": max_hz, "clients": len(results), "whole": whole,
            "loops_completed": completed, "turns": turns, "deltas": deltas, "rows": rows,
            "notifies": counter.count, "notifies_inline": counter.inline,
            "listen_peak": sampler.peak.get(LISTEN_APP_NAME, 0),
            "pool_peak": sampler.peak.get(WEB_APP_NAME, 0),
            "others_peak": sum(v for k, v in sampler.peak.items()
                               if k not in (LISTEN_APP_NAME, WEB_APP_NAME)),
            "wal": wal1 - wal0, "commits": commits1 - commits0, "elapsed": elapsed,
            "reconnects": sum(c["connections"] - 1 for c in results),
            "p50": _pct(delays, 0.5), "p99": _pct(delays, 0.99), "delays": len(delays)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--quick", action="store_true",
                        help="10 loops, 60 words, one worker process: about a minute")
    parser.add_argument("--loops", type=int, default=50)
    parser.add_argument("--per-loop", type=int, default=4)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--tps", type=float, default=40.0)
    parser.add_argument("--max-hz", type=float, default=20.0)
    parser.add_argument("--web-processes", type=int, default=2)
    parser.add_argument("--web-threads", type=int, default=128)
    parser.add_argument("--worker-processes", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=25)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    # the client processes' own arguments
    parser.add_argument("--client-base", help=argparse.SUPPRESS)
    parser.add_argument("--client-loops", help=argparse.SUPPRESS)
    parser.add_argument("--client-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_base:
        run_clients(args)
        return
    if args.quick:
        args.loops, args.words, args.worker_processes, args.worker_threads = 10, 60, 1, 10
        args.client_processes = 1
    from flask_solidloop.testing.llm_emulator import LLMEmulator
    from flask_solidloop.testing.plugin import prepare_database

    prepare_database(args.url)
    os.environ["SOLIDLOOP_TEST_DATABASE_URL"] = args.url  # this process's app
    os.environ.pop("SOLIDLOOP_TEST_APP_CONFIG", None)
    emulator = LLMEmulator(strict=True).start()
    figures = []
    try:
        with tempfile.TemporaryDirectory(prefix="solidloop-fanout-") as tmp:
            for max_hz in (args.max_hz, 0.0):
                figures.append(phase(args, args.url, max_hz, emulator, Path(tmp)))
                print(f"phase {figures[-1]['phase']}: done in {figures[-1]['elapsed']:.1f} s",
                      flush=True)
    finally:
        emulator.stop()
    report(args, figures)


def report(args: argparse.Namespace, figures: list[dict[str, Any]]) -> None:
    on, off = figures

    def per_turn(f: dict[str, Any], key: str) -> float:
        return f[key] / f["turns"] if f["turns"] else float("nan")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    print(f"\n{args.loops} loops x {args.per_loop} clients = {args.loops * args.per_loop} SSE "
          f"clients; {args.words} words at {args.tps:g} pieces/s; gunicorn gthread "
          f"{args.web_processes} x {args.web_threads} threads; workers "
          f"{args.worker_processes} x {args.worker_threads} threads\n")
    rows = [
        ("clients with the whole answer and `end`", "whole", "clients"),
        ("loops completed", "loops_completed", None),
        ("run, resume to last client's end (s)", "elapsed", None),
        ("client reconnects", "reconnects", None),
        ("web LISTEN connections, peak", "listen_peak", None),
        ("web pooled connections, peak", "pool_peak", None),
        ("other connections (workers), peak", "others_peak", None),
    ]
    print(f"| figure | deltas (MAX_HZ={on['max_hz']:g}) | off (MAX_HZ=0) | deltas / off |")
    print("|---|---|---|---|")
    def cell(f: dict[str, Any], key: str, of: str | None) -> str:
        value = f[key]
        if isinstance(value, float):
            return f"{value:.1f}"
        return f"{value}/{f[of]}" if of else str(value)

    for label, key, of in rows:
        print(f"| {label} | {cell(on, key, of)} | {cell(off, key, of)} | |")
    for label, key in (("text_delta events per turn", "deltas"),
                       ("stream events per turn", "rows"),
                       ("NOTIFYs per turn", "notifies"),
                       ("NOTIFYs carrying the event, per turn", "notifies_inline"),
                       ("commits per turn", "commits")):
        a, b = per_turn(on, key), per_turn(off, key)
        print(f"| {label} | {a:.1f} | {b:.1f} | {ratio(a, b)} |")
    a, b = per_turn(on, "wal") / 1024, per_turn(off, "wal") / 1024
    print(f"| WAL per turn (KiB, whole server) | {a:.1f} | {b:.1f} | {ratio(a, b)} |")
    print(f"| token -> client delay p50 (ms) | {ms(on['p50'])} | {ms(off['p50'])} | |")
    print(f"| token -> client delay p99 (ms) | {ms(on['p99'])} | {ms(off['p99'])} | |")
    print(f"| words timed | {on['delays']} | {off['delays']} | |")
    print(f"\nturns: {on['turns']} / {off['turns']}; NOTIFYs per delta (deltas phase): "
          f"{on['notifies'] / on['deltas']:.2f}" if on["deltas"] else "")
    listens = max(on["listen_peak"], off["listen_peak"])
    pooled, pool_cap = max(on["pool_peak"], off["pool_peak"]), 15 * args.web_processes
    print(f"target: one LISTEN per web process ({args.web_processes}): {listens} "
          f"{'PASS' if listens <= args.web_processes else 'MISS'}; pooled <= {pool_cap} "
          f"(5 + 10 overflow per process): {pooled} {'PASS' if pooled <= pool_cap else 'MISS'}")


if __name__ == "__main__":
    main()
