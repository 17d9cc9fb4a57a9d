"""Dropped database connections inside real worker processes, on the inline
path: a loop's steps run one after another on one thread (each commit adopts
the next step), and a connection dropped under one of them costs the loop
nothing (docs/decisions/0018-no-fault-ends-a-loop.md). The worker processes
drop the connection themselves (tests/support/db_faults.py, armed by
SOLIDLOOP_TEST_DROP_PATTERN) under the first statement that matches."""

from __future__ import annotations

import json
import sys
import time

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message, ToolCall

from ..support.support_app import DROP_AFTER_ENV, DROP_PATTERN_ENV, SIDE_EFFECTS, Assistant
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

#: Where, and how many matches to let through first.
POINTS = {
    "a delivered turn's end": (r"^WITH fenced AS \(UPDATE solidloop_loops", 0),
    "an adopted tool's outcome": (r"^WITH locked AS \(SELECT l.status", 0),
    "an adopted turn's end": (r"^WITH fenced AS \(UPDATE solidloop_loops", 1),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_connection_dropped_on_the_inline_path_costs_the_loop_nothing(
        app, session, llm, tmp_path, monkeypatch, effects, point):
    pattern, after = POINTS[point]
    monkeypatch.setenv(DROP_PATTERN_ENV, pattern)
    monkeypatch.setenv(DROP_AFTER_ENV, str(after))
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(
        {"SOLIDLOOP_LIVENESS_TTL": 4.0, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
         "SOLIDLOOP_LEASE_MARGIN": 1}))
    llm.script("three sums", {"tool_calls": [
        {"name": "add", "arguments": {"a": n, "b": n}} for n in (1, 2, 3)]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "done"})
    log = tmp_path / "worker.log"
    worker = spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker",
                            "--processes", "1", "--threads", "2"], log=log)
    try:
        loop = Assistant.start(message="three sums please")
        deadline = time.monotonic() + 90
        while True:
            session.expire_all()
            status = session.get(Loop, loop.id).status
            session.rollback()
            if status in ("completed", "failed", "paused"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"loop still {status}:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
    finally:
        kill_group(worker)
    text = log.read_text()
    assert "db_faults: dropped the connection" in text, text[-3000:]
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "completed", (row.error_message, text[-3000:])
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)))
    answers = [m.tool_call_id for m in session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.role == "tool"))]
    assert sorted(answers) == sorted(c.id for c in calls) and len(calls) == 3
    assert SIDE_EFFECTS == []  # the tools ran in the worker, not here
    # Retried in place, on the same thread: no lease had to lapse, nothing was
    # healed, and no LLM request was sent twice.
    assert "trying again in" in text and "reaper healed" not in text, text[-3000:]
    assert len([r for r in llm.requests if r.method == "POST"]) == 2
