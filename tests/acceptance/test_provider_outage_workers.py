"""A provider that goes away under real workers: ten loops ride out the outage
and complete once it is back, and meanwhile no worker thread waits for it
(a host job runs at once). The provider is the LLM emulator on a fixed port,
stopped and started again (a real HTTP server on 127.0.0.1: connections are
refused while it is down, as for any provider restart)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
from sqlalchemy import func, select, text

from flask_solidloop.models import Job, Loop
from flask_solidloop.testing import LLMEmulator

from ..support.support_app import LLM_URL_ENV, Assistant, notifications, notify_staff
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

#: How long the provider stays down (SOLIDLOOP_TEST_OUTAGE_SECONDS; the
#: deferrals back off 5, 10, 20, 40 s, so a 60 s outage takes about 95 s).
OUTAGE = float(os.environ.get("SOLIDLOOP_TEST_OUTAGE_SECONDS", "30"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(body):
    if body["messages"][-1]["role"] == "tool":
        return {"content": "done"}
    return {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}


def assert_no_thread_waits(session, effects, label: str) -> None:
    """While the provider is out, no worker thread waits for it: a host job
    runs at once, and no LLM turn job stays running."""
    notifications.enqueue(notify_staff, label)
    deadline = time.monotonic() + 10
    while not effects(f"notify:{label}", "notify"):
        assert time.monotonic() < deadline, "a host job could not get a thread"
        time.sleep(0.05)
    longest = session.scalar(text(
        "SELECT coalesce(max(extract(epoch FROM now() - started_at)), 0) "
        "FROM solidloop_jobs WHERE state = 'running' AND actor_name = 'solidloop.llm_turn'"))
    session.rollback()
    assert longest < 5, longest


def test_ten_loops_ride_out_a_provider_outage_with_no_thread_waiting(
        app, session, monkeypatch, tmp_path, effects):
    port = free_port()
    monkeypatch.setenv(LLM_URL_ENV, f"http://127.0.0.1:{port}")
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({"SOLIDLOOP_LIVENESS_TTL": 10.0}))
    provider = LLMEmulator(port=port).start()
    provider.script(lambda body: True, answer)
    log = tmp_path / "worker.log"
    worker = spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker",
                            "--processes", "1", "--threads", "2"], log=log)
    try:
        loops = [Assistant.start(message=f"outage {n}").id for n in range(10)]
        # Mid-run: some loops have finished a turn or two, the rest are on the way.
        deadline = time.monotonic() + 30
        while session.scalar(select(func.count()).select_from(Loop).where(
                Loop.id.in_(loops), Loop.step_count >= 1)) < 3:
            session.rollback()
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        session.rollback()
        provider.stop()
        down_at = time.monotonic()
        # Every unfinished loop meets the outage and is deferred.
        deadline = time.monotonic() + 30
        while True:
            session.expire_all()
            rows = session.execute(select(Loop.status, Loop.provider_wait_since).where(
                Loop.id.in_(loops))).all()
            session.rollback()
            if all(s == "completed" or since is not None for s, since in rows):
                break
            assert time.monotonic() < deadline, (rows, log.read_text()[-3000:])
            time.sleep(0.1)
        waiting = sum(1 for s, _ in rows if s != "completed")
        assert waiting >= 1
        # While it waits, no worker thread is held: a host job runs at once,
        # and no turn job stays running.
        assert_no_thread_waits(session, effects, "outage")
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
        provider = LLMEmulator(port=port).start()
        provider.script(lambda body: True, answer)
        deadline = time.monotonic() + 120
        while True:
            session.expire_all()
            statuses = [s for (s,) in session.execute(select(Loop.status).where(
                Loop.id.in_(loops)))]
            session.rollback()
            if all(s in ("completed", "failed", "paused") for s in statuses):
                break
            assert time.monotonic() < deadline, (statuses, log.read_text()[-3000:])
            time.sleep(0.2)
        assert statuses == ["completed"] * 10
        assert session.scalar(select(func.count()).select_from(Loop).where(
            Loop.id.in_(loops), Loop.provider_wait_since.is_not(None))) == 0
        assert session.scalar(select(func.count()).select_from(Job).where(
            Job.state == "dead")) == 0
    finally:
        kill_group(worker)
        provider.stop()
