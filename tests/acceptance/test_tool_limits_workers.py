"""Hung tools under a real worker (docs/decisions/0018-no-fault-ends-a-loop.md,
item 2): twenty calls of a tool that never returns, in a row, on a worker
with two threads. Each call is answered with a timeout error, the worker's
threads keep serving, and past SOLIDLOOP_TOOL_QUARANTINE_LIMIT abandoned
threads the worker processes are restarted by dramatiq, which reclaims them;
a new loop then completes."""

from __future__ import annotations

import json
import sys

import pytest
from sqlalchemy import select

from flask_solidloop.models import Job, ToolCall

from ..support.support_app import Assistant, SlowAgent
from .test_e2e_workers import kill_group, spawn_workers, wait_for

pytestmark = pytest.mark.e2e

HUNG = 20


def answer(body):
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"content": "done"}
    if "hang" in (last.get("content") or ""):
        return {"tool_calls": [{"name": "hang_forever", "arguments": {}}]}
    return {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}


def test_twenty_hung_calls_in_a_row_leave_the_worker_serving(
        app, session, llm, monkeypatch, tmp_path, effects):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({
        "SOLIDLOOP_TOOL_QUARANTINE_LIMIT": 4, "SOLIDLOOP_LIVENESS_TTL": 10.0}))
    llm.script(lambda body: True, answer)
    log = tmp_path / "worker.log"
    worker = spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker",
                            "--processes", "1", "--threads", "2"], log=log)
    try:
        hung = [SlowAgent.start(message=f"hang {n}").id for n in range(HUNG)]
        statuses = wait_for(session, hung, timeout=240, proc=worker, log=log)
        assert set(statuses.values()) == {"completed"}, log.read_text()[-3000:]
        calls = session.scalars(select(ToolCall).where(ToolCall.loop_id.in_(hung))).all()
        assert len(calls) == HUNG
        assert {c.error_kind for c in calls} == {"timeout"}, log.read_text()[-3000:]
        assert all(c.lapsed_runs == 0 for c in calls)  # answered in time: no takeover
        durations = sorted(c.duration_ms for c in calls)
        print(f"\n[hung tools] {HUNG} calls of a 1 s timeout answered after "
              f"{durations[0] / 1000:.2f}-{durations[-1] / 1000:.2f} s (median "
              f"{durations[HUNG // 2] / 1000:.2f} s)")
        # Each call ran its tool once: a timeout is an answer, never a re-run.
        for call in calls:
            assert len(effects(call.idempotency_key, "hang")) == 1
        # Past the limit the worker processes were restarted, and each restart
        # reclaimed the abandoned threads (more than one process ran the tool).
        text = log.read_text()
        assert "asking dramatiq to restart its worker processes" in text, text[-3000:]
        pids = {pid for call in calls for pid in effects(call.idempotency_key, "hang")}
        assert len(pids) >= 2, pids
        # The worker still serves.
        fresh = Assistant.start(message="still serving?").id
        assert wait_for(session, [fresh], timeout=60, proc=worker,
                        log=log) == {fresh: "completed"}
        assert session.scalar(select(Job).where(Job.state == "dead")) is None
    finally:
        kill_group(worker)
