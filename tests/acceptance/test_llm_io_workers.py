"""Async LLM I/O (SOLIDLOOP_LLM_IO = "async") with real ``flask solidloop
worker`` processes, PostgreSQL and the LLM emulator streaming slowly.

* A process with two worker threads holds many more streaming calls in
  flight than it has threads, and every loop completes with its tool call
  recorded once.
* A worker process SIGKILLed while dozens of its calls stream: a new worker
  finishes every loop (the reaper takes over the dead process's leases); no
  loop is left running.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from flask_solidloop.loops import sql
from flask_solidloop.models import Loop, Message, ToolCall

from ..support.support_app import StreamingAssistant
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

WORDS = " ".join(f"w{i:03d}" for i in range(60))
FIRST = "Let me add. " + WORDS
FINAL = "The sum is 5. " + WORDS
APP_CONFIG = {"SOLIDLOOP_LLM_IO": "async", "SOLIDLOOP_LIVENESS_TTL": 6,
              "SOLIDLOOP_LEASE_MARGIN": 1, "SOLIDLOOP_REAPER_INTERVAL": 1,
              # the loops' own requests: above the emulator's, below the cluster's
              "SQLALCHEMY_ENGINE_OPTIONS": {"pool_pre_ping": True, "pool_size": 6,
                                            "max_overflow": 4}}
THREADS = 2


def script_answers(llm, pause: float, streams: int) -> None:
    """Two streamed answers per loop (a tool call between them), the first
    ``streams`` of them trickled ``pause`` seconds a piece."""
    llm.fault_next("slow_stream", seconds=pause, times=streams)
    llm.script(lambda body: body["messages"][-1]["role"] == "user",
               {"content": FIRST, "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": FINAL})


def start_worker(tmp_path: Path, name: str):
    return spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker", "--processes",
                          "1", "--threads", str(THREADS)], log=tmp_path / name)


def in_flight(session) -> int:
    """Requests on record and not answered yet, of running loops."""
    count = session.scalar(text(
        "SELECT count(*) FROM solidloop_events e JOIN solidloop_loops l ON l.id = e.loop_id "
        f"WHERE e.kind = 'llm_request' AND {sql.request_pending('e')} AND l.status = 'running'"))
    session.rollback()
    return int(count or 0)


def wait_in_flight(session, count: int, *, timeout: float, logs: list[Path]) -> int:
    deadline = time.monotonic() + timeout
    peak = 0
    while time.monotonic() < deadline:
        peak = max(peak, in_flight(session))
        if peak >= count:
            return peak
        time.sleep(0.05)
    pytest.fail(f"only {peak} requests in flight at once after {timeout}s\n{tails(logs)}")


def tails(logs: list[Path]) -> str:
    return "\n".join(f"== {log}\n{log.read_text()[-4000:]}" for log in logs if log.exists())


def wait_done(session, loop_ids: list[int], *, timeout: float, logs: list[Path],
              procs: list[Any]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        session.expire_all()
        statuses = {lid: session.get(Loop, lid).status for lid in loop_ids}
        session.rollback()
        if all(s in ("completed", "failed", "paused", "stopped") for s in statuses.values()):
            return
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"the worker exited ({proc.returncode})\n{tails(logs)}")
        if time.monotonic() > deadline:
            left = {k: v for k, v in statuses.items() if v != "completed"}
            pytest.fail(f"loops not finished after {timeout}s: {left}\n{tails(logs)}")
        time.sleep(0.2)


def assert_completed_once(session, loop_ids: list[int]) -> None:
    session.expire_all()
    for loop_id in loop_ids:
        loop = session.get(Loop, loop_id)
        assert loop.status == "completed", (loop_id, loop.status, loop.error_message)
        calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
        assert len(calls) == 1 and calls[0].is_success
        answers = list(session.scalars(select(Message).where(
            Message.loop_id == loop_id, Message.role == "assistant",
            Message.is_hidden.is_(False)).order_by(Message.id)))
        assert [m.content for m in answers] == [FIRST, FINAL]
    session.rollback()


@pytest.mark.timeout(300)
def test_a_process_holds_more_streaming_calls_than_threads(app, session, llm, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    loops = 16
    script_answers(llm, 0.04, streams=loops * 2)
    worker = start_worker(tmp_path, "worker.log")
    logs = [tmp_path / "worker.log"]
    try:
        loop_ids = [StreamingAssistant.start(message="Please add 2 and 3").id
                    for _ in range(loops)]
        # Two threads, so thread mode never has more than two in flight.
        wait_in_flight(session, THREADS * 3, timeout=120, logs=logs)
        wait_done(session, loop_ids, timeout=180, logs=logs, procs=[worker])
        assert_completed_once(session, loop_ids)
        log = (tmp_path / "worker.log").read_text()
        assert "LLM I/O: async" in log
        assert "Traceback" not in log, log[-4000:]
    finally:
        kill_group(worker)


@pytest.mark.timeout(400)
def test_every_loop_completes_after_a_worker_is_killed_mid_stream(app, session, llm, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    loops = 30
    # Slow enough that the kill finds most first answers mid-stream.
    script_answers(llm, 0.05, streams=loops * 3)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = start_worker(tmp_path, "first.log")
    second = None
    try:
        loop_ids = [StreamingAssistant.start(message="Please add 2 and 3").id
                    for _ in range(loops)]
        wait_in_flight(session, 12, timeout=120, logs=logs)
        # Partial text was flushed by the commit threads: a stream was mid-way.
        streamed = session.scalar(text(
            "SELECT count(*) FROM solidloop_stream_events WHERE kind = 'text_delta'"))
        session.rollback()
        kill_group(first, signal.SIGKILL)
        second = start_worker(tmp_path, "second.log")
        wait_done(session, loop_ids, timeout=300, logs=logs, procs=[second])
        assert_completed_once(session, loop_ids)
        running = session.scalar(select(Loop.id).where(Loop.status == "running"))
        session.rollback()
        assert running is None
        # Some of the killed process's requests were cut: their turns ran again.
        requests = session.scalar(text(
            "SELECT count(*) FROM solidloop_events WHERE kind = 'llm_request'"))
        session.rollback()
        assert requests > loops * 2, (requests, streamed)
    finally:
        kill_group(first, signal.SIGKILL)
        if second is not None:
            kill_group(second)


@pytest.mark.timeout(300)
def test_a_pause_cuts_a_silent_stream_at_once(app, session, llm, tmp_path, monkeypatch):
    """The emulator's pieces come 15 s apart, past the agent's 10-s read
    timeout: a thread would only notice the pause at that timeout (and fail
    the request); the I/O loop's watcher cancels the exchange within a second
    of the pause, and the turn stops as a pause stops it."""
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    llm.fault_next("slow_stream", seconds=15.0, times=1)
    llm.script(lambda body: True, {"content": WORDS})
    log = tmp_path / "worker.log"
    worker = start_worker(tmp_path, "worker.log")
    try:
        loop = StreamingAssistant.start(message="Please talk slowly")
        wait_in_flight(session, 1, timeout=120, logs=[log])
        assert StreamingAssistant(loop).pause()
        deadline = time.monotonic() + 120
        while "the turn stopped: the loop was paused or stopped" not in log.read_text():
            assert "ReadTimeout" not in log.read_text(), log.read_text()[-4000:]
            if time.monotonic() > deadline:
                pytest.fail(f"the turn never stopped\n{tails([log])}")
            time.sleep(0.1)
        session.expire_all()
        assert session.get(Loop, loop.id).status == "paused"
        session.rollback()
        assert "ReadTimeout" not in log.read_text()
    finally:
        kill_group(worker)


@pytest.mark.timeout(300)
def test_a_watched_loop_streams_its_text_through_the_commit_threads(app, session, llm,
                                                                    tmp_path, monkeypatch):
    """Deltas arrive on the I/O loop, which never writes: each due flush is
    handed to a commit thread. A watcher (``events()``) gets the answers in
    deltas that add up to each stored message, before the message completes."""
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    script_answers(llm, 0.05, streams=4)
    log = tmp_path / "worker.log"
    worker = start_worker(tmp_path, "worker.log")
    try:
        loop = StreamingAssistant.start(message="Please add 2 and 3")
        ext = app.extensions["solidloop"].extension
        events = [json.loads(json.dumps(e.as_dict(), default=str))
                  for e in ext.events(loop.id, timeout=180, app=app)]
        assert events and events[-1]["kind"] == "completed", (events[-5:], tails([log]))
        streamed: dict[int, str] = {}
        completed: dict[int, str] = {}
        for event in events:
            if event["kind"] == "text_delta":
                assert event["message_id"] not in completed, "a delta after its message"
                text = streamed.setdefault(event["message_id"], "")
                assert event["offset"] == len(text)
                streamed[event["message_id"]] = text + event["text"]
            elif event["kind"] == "message_completed" and event.get("role") != "tool":
                completed[event["message_id"]] = event["text"]
        assert_completed_once(session, [loop.id])
        # Both answers streamed in pieces, and the pieces are the answers.
        assert sorted(streamed.values()) == sorted([FIRST, FINAL])
        deltas = sum(1 for e in events if e["kind"] == "text_delta")
        assert deltas > 2
        for message_id, text in streamed.items():
            assert completed[message_id] == text
        assert "Traceback" not in log.read_text()
    finally:
        kill_group(worker)
