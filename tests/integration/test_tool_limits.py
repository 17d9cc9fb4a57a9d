"""A tool's hard limits (docs/decisions/0018-no-fault-ends-a-loop.md, item 2): an
in-process tool that outruns its timeout is answered with a timeout error the
model sees and abandoned in a quarantined thread, so the worker keeps its
threads; a call whose lease keeps lapsing is not run for ever
(SOLIDLOOP_TOOL_MAX_ATTEMPTS). Real PostgreSQL, the real LLM emulator, the
worker's real tool-thread pool."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import select

from flask_solidloop import Agent, ToolDefinitionError, Toolset
from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Loop, Message, ToolCall
from flask_solidloop.pipeline import tool_threads

from ..support.support_app import llm_settings, solidloop
from .loop_states import tool_phase

limits = Toolset("limits")
#: Released at the end of each test, so no hung tool outlives it.
RELEASE = threading.Event()
RUNS: list[str] = []


@limits.tool(timeout=0.5)
def hang(label: str) -> str:
    """Hang, ignoring any attempt to stop it, until the test releases it."""
    RUNS.append(label)
    RELEASE.wait(60)
    return f"{label} returned at last"


@limits.tool
def quick(label: str) -> str:
    """Answer at once."""
    RUNS.append(label)
    return f"{label} done"


@solidloop.agent("limits")
class Limits(Agent):
    system_prompt = "You call tools."
    mcps = [{"name": "limits", "toolset": limits}]

    def llm(self) -> dict:
        return llm_settings()


@pytest.fixture(autouse=True)
def released():
    RELEASE.clear()
    RUNS.clear()
    yield
    RELEASE.set()
    pool = tool_threads.pool()
    deadline = time.monotonic() + 10
    while pool.quarantined and time.monotonic() < deadline:
        time.sleep(0.02)  # every abandoned tool returns, and leaves the quarantine


def answered_by_tools(body):
    return body["messages"][-1]["role"] == "tool"


def calls(*pairs):
    return {"tool_calls": [{"name": name, "arguments": {"label": label}}
                           for name, label in pairs]}


def answers(session, loop_id):
    session.expire_all()
    rows = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)
                           .order_by(ToolCall.position)).all()
    out = [(c.name, c.error_kind, (c.result or {}).get("content", [{}])[0].get("text"))
           for c in rows]
    session.rollback()
    return out


def test_a_hung_tool_is_answered_with_a_timeout_and_the_loop_goes_on(
        app, session, llm, drain, caplog):
    llm.script("stuck", calls(("hang", "h1"), ("quick", "q1")))
    llm.script(answered_by_tools, {"content": "the first tool timed out"})
    pool = tool_threads.pool()
    before = pool.quarantined
    loop = Limits.start(message="stuck")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    (hung, fine) = answers(session, loop.id)
    assert hung[:2] == ("hang", "timeout")
    assert hung[2].startswith("the tool 'hang' did not finish within its 0.5s timeout and "
                              "was abandoned")
    assert fine == ("quick", None, "q1 done")
    session.expire_all()
    timed_out = session.scalars(select(ToolCall).where(ToolCall.name == "hang")).one()
    assert timed_out.duration_ms >= 490  # it was given its whole timeout
    session.rollback()
    # The model saw the timeout: its next request carries the error as the answer.
    tool_messages = [m for m in llm.requests[-1].json["messages"] if m["role"] == "tool"]
    assert "did not finish within its 0.5s timeout" in tool_messages[0]["content"]
    # Its thread is quarantined, not lost: it leaves once the tool returns.
    assert pool.quarantined == before + 1
    assert "it is abandoned in a quarantined thread" in caplog.text
    RELEASE.set()
    deadline = time.monotonic() + 5
    while pool.quarantined > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.quarantined == before
    # Its late result changed nothing.
    assert answers(session, loop.id)[0][1] == "timeout"


def test_twenty_hung_calls_in_a_row_leave_the_worker_serving(app, session, llm, drain,
                                                             monkeypatch):
    pool = tool_threads.pool()
    limit_hits: list[int] = []
    monkeypatch.setattr(pool, "quarantine_limit", pool.quarantined + 8)
    monkeypatch.setattr(pool, "_limit_reported", False)
    monkeypatch.setattr(pool, "on_limit", limit_hits.append)
    llm.script("twenty", calls(*[("hang", f"h{i}") for i in range(20)]))
    llm.script(answered_by_tools, {"content": "all twenty timed out"})
    hung = Limits.start(message="twenty")
    drain()
    assert [kind for _, kind, _ in answers(session, hung.id)] == ["timeout"] * 20
    assert limit_hits == [pool.quarantine_limit]  # the restart was asked for, once
    # The worker still serves: a new loop's tool runs at once.
    llm.script("fresh start", calls(("quick", "x")))
    fresh = Limits.start(message="fresh start")
    drain()
    session.expire_all()
    assert session.get(Loop, fresh.id).status == "completed"
    assert answers(session, fresh.id) == [("quick", None, "x done")]


def test_a_call_whose_lease_keeps_lapsing_stops_at_max_attempts(app, state, session, llm,
                                                                pg, drain):
    loop_id = tool_phase(app, session, llm)
    call = session.scalars(select(ToolCall)).one()
    session.rollback()
    # A lease the reaper minted lapsing before any worker claimed it ran
    # nothing: not counted.
    pg.execute("UPDATE solidloop_tool_calls SET lease_token = %s, lease_holder = NULL, "
               "leased_until = now() - interval '1 second' WHERE id = %s",
               (uuid.uuid4(), call.id))
    pg.execute("UPDATE solidloop_jobs SET state = 'done' WHERE state = 'queued'")
    assert reap(state).stalled_tools == [call.id]
    session.expire_all()
    assert session.get(ToolCall, call.id).lapsed_runs == 0
    session.rollback()
    for lapse in (1, 2, 3):
        # A worker claimed the call and died (or froze) before a result.
        pg.execute("UPDATE solidloop_tool_calls SET lease_token = %s, lease_holder = 'w:1', "
                   "leased_until = now() - interval '1 second' WHERE id = %s",
                   (uuid.uuid4(), call.id))
        pg.execute("UPDATE solidloop_jobs SET state = 'done' WHERE state = 'queued'")
        assert reap(state).stalled_tools == [call.id]
        session.expire_all()
        assert session.get(ToolCall, call.id).lapsed_runs == lapse
        session.rollback()
    from ..support.support_app import SIDE_EFFECTS

    SIDE_EFFECTS.clear()
    drain()  # the reaper's job: the fourth claim
    session.expire_all()
    answered = session.get(ToolCall, call.id)
    assert answered.error_kind == "attempts" and SIDE_EFFECTS == []  # not run again
    message = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert message.content.startswith(f"the tool {call.name!r} was started 3 times and each "
                                      "run ended without a result")
    assert "SOLIDLOOP_TOOL_MAX_ATTEMPTS=3" in message.content
    assert session.get(Loop, loop_id).status in ("queued", "running", "completed")


def test_a_call_under_the_cap_runs_after_a_lapse(app, state, session, llm, pg, drain):
    loop_id = tool_phase(app, session, llm)
    call = session.scalars(select(ToolCall)).one()
    session.rollback()
    pg.execute("UPDATE solidloop_tool_calls SET lease_token = %s, lapsed_runs = 1, "
               "lease_holder = 'w:1', leased_until = now() - interval '1 second' "
               "WHERE id = %s",
               (uuid.uuid4(), call.id))
    pg.execute("UPDATE solidloop_jobs SET state = 'done' WHERE state = 'queued'")
    assert reap(state).stalled_tools == [call.id]
    drain()
    session.expire_all()
    assert session.get(ToolCall, call.id).error_kind is None
    assert session.get(Loop, loop_id).status == "completed"


@pytest.mark.parametrize("value", [0, -1, True, "5"])
def test_a_bad_tool_timeout_is_refused(value):
    with pytest.raises(ToolDefinitionError, match="timeout= must be a number of seconds > 0"):
        Toolset("bad").tool(lambda: None, name="t", timeout=value)
