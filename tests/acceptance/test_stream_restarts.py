"""A loop's SSE stream (``solidloop.sse_response``) across restarts: a real
gunicorn (gthread) serving tests/support/stream_app.py, real ``flask solidloop
worker`` processes, the LLM emulator trickling long answers of numbered words
(so a gap or a duplicate shows), and an SSE client that resumes with
``Last-Event-ID`` (tests/support/sse_client.py).

* the web process is SIGKILLed mid-answer and a new one started on its port;
* the database (a throwaway cluster of its own) is restarted mid-answer.

Either way the client ends with every event once, in id order, each message's
deltas adding up to its stored text, and ``events()`` read afterwards gives
exactly what the client saw.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from flask_solidloop.models import Message

from ..support.sse_client import SSEReader
from ..support.support_app import DATABASE_URL_ENV, StreamingAssistant
from .test_admin_browser import free_port, wait_http
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

#: Numbered words: 1200 characters, about 150 pieces of the emulator's stream.
WORDS = " ".join(f"w{i:03d}" for i in range(240))
#: Short stream lives and heartbeats: the client also reconnects on its own.
APP_CONFIG = {"SOLIDLOOP_STREAM_SECONDS": 4.0, "SOLIDLOOP_STREAM_HEARTBEAT": 1.0,
              "SOLIDLOOP_LIVENESS_TTL": 6, "SOLIDLOOP_LEASE_MARGIN": 1}
FIRST = "Let me add. " + WORDS
FINAL = "The sum is 5. " + WORDS


def script_answers(llm, pause: float) -> None:
    """Two streamed answers (one with a tool call between them), each
    trickled ``pause`` seconds a piece; spare faults for a retried turn."""
    llm.fault_next("slow_stream", seconds=pause, times=6)
    llm.script(lambda body: body["messages"][-1]["role"] == "user",
               {"content": FIRST, "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": FINAL})


class Web:
    """gunicorn -k gthread serving tests.support.stream_app on a fixed port."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "gunicorn.log"
        self.proc: Any = None

    def start(self) -> None:
        self.proc = spawn_workers([sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "1",
                                   "--threads", "8", "-b", f"127.0.0.1:{self.port}",
                                   "--timeout", "30", "tests.support.stream_app:create_app()"],
                                  log=self.log)
        wait_http(self.base + "/ping", self.proc, self.log, timeout=60)

    def kill(self) -> None:
        kill_group(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)


def start_worker(tmp_path: Path):
    return spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker", "--processes",
                          "1", "--threads", "2"], log=tmp_path / "worker.log")


def read_in_thread(reader: SSEReader) -> threading.Thread:
    thread = threading.Thread(target=reader.run, kwargs={"deadline": time.monotonic() + 240},
                              daemon=True)
    thread.start()
    return thread


def wait_deltas(reader: SSEReader, count: int, *, timeout: float, logs: list[Path]) -> int:
    """Wait until the client has seen ``count`` text deltas; the number of
    events it had then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = list(reader.events)
        if sum(1 for e in seen if e.event == "text_delta") >= count:
            return len(seen)
        time.sleep(0.02)
    tails = "\n".join(f"== {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    pytest.fail(f"only {[e.event for e in reader.events]} after {timeout}s\n{tails}")


def finish(reader: SSEReader, thread: threading.Thread, logs: list[Path]) -> None:
    thread.join(timeout=240)
    if thread.is_alive() or reader.end is None:
        reader.stop()
        tails = "\n".join(f"== {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        pytest.fail(f"the stream did not end: {reader.breaks[-5:]}\n"
                    f"{[e.event for e in reader.events][-20:]}\n{tails}")


def check_stream(app, session, loop_id: int, reader: SSEReader, cut: int) -> dict[int, str]:
    """What every test asserts of a finished stream; the streamed text of each
    message the client kept."""
    payloads = [event.json() for event in reader.events]
    ids = [int(event.id or 0) for event in reader.events]
    assert len(ids) == len(set(ids)), "a duplicate event id"
    assert ids == sorted(ids), "ids out of order"
    assert [p["id"] for p in payloads] == [e.id for e in reader.events]
    assert [p["kind"] for p in payloads] == [e.event for e in reader.events]
    assert payloads[-1]["kind"] == "completed" and reader.end == "completed"

    discarded = {p["message_id"] for p in payloads if p["kind"] == "message_discarded"}
    streamed: dict[int, str] = {}
    for p in payloads:
        if p["kind"] == "text_delta":
            text = streamed.setdefault(p["message_id"], "")
            assert p["offset"] == len(text), "a gap or an overlap in a message's deltas"
            streamed[p["message_id"]] = text + p["text"]
    kept = {mid: text for mid, text in streamed.items() if mid not in discarded}
    print(f"\nstream: {len(payloads)} events, {reader.connections} connections, "
          f"discarded {sorted(discarded)}, breaks {reader.breaks}")

    session.expire_all()
    replies = list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "assistant",
        Message.status == "completed").order_by(Message.id)))
    session.rollback()
    assert [m.content for m in replies] == [FIRST, FINAL]
    assert sorted(kept) == [m.id for m in replies], (sorted(kept), discarded)
    for message in replies:
        assert kept[message.id] == message.content
        done = [p for p in payloads if p["kind"] == "message_completed"
                and p["message_id"] == message.id]
        assert len(done) == 1 and done[0]["text"] == message.content

    # the cut fell mid-answer: the message streaming then went on (or was
    # discarded and streamed anew) after it
    before = {p["message_id"] for p in payloads[:cut] if p["kind"] == "text_delta"}
    after = [p for p in payloads[cut:] if p["kind"] == "text_delta"]
    assert before and after
    assert any(p["message_id"] in before for p in after) or before <= discarded

    # events() read afterwards: exactly what the client saw, from the start
    # and from an id in the middle
    ext = app.extensions["solidloop"].extension
    replay = [json.loads(json.dumps(e.as_dict(), default=str))
              for e in ext.events(loop_id, timeout=30, app=app)]
    assert replay == payloads
    middle = payloads[cut]["id"]
    tail = [json.loads(json.dumps(e.as_dict(), default=str))
            for e in ext.events(loop_id, after=middle, timeout=30, app=app)]
    assert tail == payloads[cut + 1:]
    return kept


@pytest.mark.timeout(400)
def test_the_stream_resumes_across_a_killed_web_process(app, session, llm, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    script_answers(llm, 0.03)
    web, worker = Web(tmp_path), None
    logs = [web.log, tmp_path / "worker.log"]
    try:
        web.start()
        worker = start_worker(tmp_path)
        loop = StreamingAssistant.start(message="Please add 2 and 3")
        reader = SSEReader(f"{web.base}/loops/{loop.id}/events")
        thread = read_in_thread(reader)
        cut = wait_deltas(reader, 5, timeout=90, logs=logs)
        web.kill()  # SIGKILL mid-answer: the client's connection breaks
        breaks = len(reader.breaks)
        web.start()  # a new web process on the same port
        finish(reader, thread, logs)
        assert len(reader.breaks) > breaks or reader.breaks, "the kill broke no connection"
        assert reader.connections >= 2
        check_stream(app, session, loop.id, reader, cut)
    finally:
        if worker is not None:
            kill_group(worker)
        web.stop()


@pytest.mark.timeout(600)
def test_the_stream_resumes_across_a_database_restart(llm, tmp_path, monkeypatch):
    """On a throwaway cluster (never the shared one), stopped (fast) while the
    first answer streams, left down for longer than a stream lives, started."""
    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    from ..support import pg_cluster
    from ..support.support_app import create_app

    if not pg_cluster.available():
        pytest.skip("no PostgreSQL server programs to run a throwaway cluster")
    llm.reset()
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    script_answers(llm, 0.03)
    with pg_cluster.throwaway_cluster() as cluster:
        url = cluster.url("solidloop_stream_restart")
        ensure_database(url)
        upgrade(url)
        monkeypatch.setenv(DATABASE_URL_ENV, url)
        app = create_app()
        web, worker = Web(tmp_path), None
        logs = [web.log, tmp_path / "worker.log", cluster.log]
        try:
            with app.app_context():
                session = app.extensions["sqlalchemy"].session
                web.start()
                worker = start_worker(tmp_path)
                loop_id = StreamingAssistant.start(message="Please add 2 and 3").id
                session.remove()  # no connection of ours held across the restart
                reader = SSEReader(f"{web.base}/loops/{loop_id}/events")
                thread = read_in_thread(reader)
                cut = wait_deltas(reader, 5, timeout=90, logs=logs)
                # a fast stop, down for longer than a stream lives, and a start
                cluster.stop_server()
                time.sleep(APP_CONFIG["SOLIDLOOP_STREAM_SECONDS"] + 1.0)
                cluster.start_server()
                finish(reader, thread, logs)
                # the web process lived on: each of its streams waited the
                # database out or ended cleanly, and a reconnect that found it
                # down was asked to come back (200, a retry and no event)
                assert reader.breaks == [], f"{reader.breaks}\n{web.log.read_text()[-4000:]}"
                check_stream(app, session, loop_id, reader, cut)
                session.remove()
        finally:
            if worker is not None:
                kill_group(worker)
            web.stop()
            with app.app_context():
                for engine in app.extensions["sqlalchemy"].engines.values():
                    engine.dispose()
            app.extensions["solidloop"].stop_renewer()
            app.extensions["solidloop"].broker.close()
