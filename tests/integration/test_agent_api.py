"""The decorator-based agent API: registration, options, start/pause/resume/stop."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import RESUMABLE_STATUSES, Agent, AgentDefinitionError, Toolset
from flask_solidloop.models import Job, Loop, Message, ToolCall

from ..support.support_app import Assistant, solidloop


def test_unknown_llm_setting_and_v1_base_url_are_rejected(app):
    class BadLlm(Agent):
        llm = {"base_url": "https://api.openai.com/v1", "model": "m"}

    solidloop.agent("bad_llm")(BadLlm)
    with pytest.raises(AgentDefinitionError, match="ends in /v1"):
        BadLlm.start(message="x")

    class UnknownKey(Agent):
        llm = {"base_url": "https://x.test", "model": "m", "temprature": 1}

    solidloop.agent("unknown_key")(UnknownKey)
    with pytest.raises(AgentDefinitionError, match="temprature"):
        UnknownKey.start(message="x")


def test_mcps_entries_need_a_name_and_one_kind(app):
    ts = Toolset("things")

    class NoName(Agent):
        llm = {"base_url": "http://127.0.0.1:9", "model": "m"}
        mcps = [{"toolset": ts}]

    solidloop.agent("no_name")(NoName)
    with pytest.raises(AgentDefinitionError, match="needs a name"):
        NoName.start(message="x")


def test_collision_appearing_after_start_fails_the_loop_naming_both(app, session, llm, drain):
    """A deploy can change toolsets under loops already in flight."""
    emulator_url = llm.base_url
    one, two = Toolset("one"), Toolset("two")

    @one.tool
    def ping() -> str:
        return "one"

    class Collide(Agent):
        llm = {"base_url": emulator_url, "model": "m"}
        mcps = [{"name": "a", "toolset": one}, {"name": "b", "toolset": two}]

    solidloop.agent("collide")(Collide)
    loop = Collide.start(message="x")

    @two.tool(name="ping")
    def ping_two() -> str:
        return "two"

    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "failed"
    assert "'ping'" in loop.error_message and "'a'" in loop.error_message
    assert "'b'" in loop.error_message and "prefix" in loop.error_message


def test_prefix_advertises_prefixed_names(app, session, llm, drain):
    emulator_url = llm.base_url
    ts = Toolset("pfx")

    @ts.tool
    def hello(name: str) -> str:
        return f"hello {name}"

    class Prefixed(Agent):
        llm = {"base_url": emulator_url, "model": "m"}
        mcps = [{"name": "greeter", "toolset": ts, "prefix": "greet"}]

    solidloop.agent("prefixed")(Prefixed)
    llm.script("greet", {"tool_calls": [{"name": "greet__hello", "arguments": {"name": "Ann"}}]})
    llm.script("hello Ann", {"content": "done"})
    loop = Prefixed.start(message="greet Ann")
    drain()
    assert llm.requests[0].json["tools"][0]["function"]["name"] == "greet__hello"
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert (call.server_name, call.tool_name) == ("greeter", "hello")


def test_unregistered_agent_fails_the_loop_once_and_is_not_retried(app, session, drain):
    loop = Assistant.start(message="hi")
    loop.agent_name = "renamed_agent"
    session.commit()
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "failed"
    assert "renamed_agent" in loop.error_message and "assistant" in loop.error_message
    assert [j.state for j in session.scalars(select(Job))] == ["done"]


def test_resume_rejects_statuses_that_can_never_resume(app):
    loop = Assistant.start(message="hi")
    for status in ("running", "queued"):
        with pytest.raises(ValueError, match="can never be resumed"):
            Assistant(loop).resume(from_=(status,))
    assert set(RESUMABLE_STATUSES) == {"init", "paused", "failed", "completed"}


def test_pause_resume_and_stop(app, session, llm, drain):
    llm.script("hi", {"content": "hello"})
    loop = Assistant.start(message="hi")
    agent = Assistant(loop)
    assert agent.pause() is True
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert agent.pause() is False  # not live any more
    drain()  # the old generation's job is a no-op
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert agent.resume(from_=("failed",)) is False
    assert agent.resume(from_=("paused", "failed")) is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    # narrowing from_ leaves finished runs alone
    assert agent.resume(from_=("paused", "failed")) is False
    # resuming a completed loop with a new message continues the conversation
    llm.script("again", {"content": "hello again"})
    assert agent.resume(message="again") is True
    drain()
    session.expire_all()
    contents = [m.content for m in session.scalars(
        select(Message).where(Message.loop_id == loop.id).order_by(Message.id))]
    assert contents[-2:] == ["again", "hello again"]
    assert agent.stop(reason="enough") is False  # completed is terminal
    llm.script("more", {"content": "x"})
    agent.resume(message="more")
    assert agent.stop(reason="enough") is True
    session.expire_all()
    stopped = session.get(Loop, loop.id)
    assert (stopped.status, stopped.error_message) == ("failed", "enough")


def test_resume_in_tool_phase_revokes_leases_and_reenqueues_tools(app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("tools", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})
    loop = Assistant.start(message="tools")
    run(app, queues=("solidloop_llm",))
    call = session.scalars(select(ToolCall)).one()
    # A dead worker's lease: it stopped being renewed, so it has lapsed. (A live
    # lease is left to its worker: see test_resume_leaves_a_running_tool_to_its_worker.)
    call.lease_token = __import__("uuid").uuid4()
    call.leased_until = __import__("datetime").datetime(2000, 1, 1, tzinfo=__import__(
        "datetime").timezone.utc)
    session.commit()
    Assistant(loop).pause()
    assert Assistant(loop).resume(from_=("paused",)) is True
    session.expire_all()
    call = session.get(ToolCall, call.id)
    assert call.lease_token is None and call.leased_until is None
    assert session.get(Loop, loop.id).status == "running"
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert len(list(session.scalars(select(Message).where(Message.role == "tool")))) == 1


def test_start_can_join_the_callers_transaction(app, session):
    loop = Assistant.start(message="atomic", commit=False)
    loop_id = loop.id
    session.rollback()
    assert session.get(Loop, loop_id) is None
    assert list(session.scalars(select(Job))) == []


def test_create_leaves_an_init_loop_that_resume_starts(app, session, llm, drain):
    llm.script("later", {"content": "now"})
    loop = Assistant.create(message="later")
    assert loop.status == "init"
    assert list(session.scalars(select(Job))) == []
    assert drain() == 0
    assert Assistant(loop).resume(from_=("init",)) is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


def test_limits_apply_per_run_so_resume_gets_a_fresh_budget(app, session, llm, drain):
    class OneStep(Assistant):
        max_steps = 1

    solidloop.agent("one_step")(OneStep)
    llm.script("again", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]})
    loop = OneStep.start(message="again and again")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert session.get(Loop, loop.id).step_count == 1
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "finally"})
    assert OneStep(loop).resume(from_=("paused",)) is True
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "completed", loop.error_message
    assert loop.step_count == 2


def test_resume_with_a_message_answers_pending_tool_calls_first(app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("pending", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("changed my mind", {"content": "ok, new plan"})
    loop = Assistant.start(message="pending work")
    run(app, queues=("solidloop_llm",))
    Assistant(loop).pause()
    assert Assistant(loop).resume(message="changed my mind") is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    roles = [m.role for m in session.scalars(
        select(Message).where(Message.loop_id == loop.id, Message.is_hidden.is_(False))
        .order_by(Message.id))]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant"]
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False and call.error_kind == "cancelled"
    sent = llm.requests[-1].json["messages"]
    assert [m["role"] for m in sent[-3:]] == ["assistant", "tool", "user"]
    assert "was not run" in sent[-2]["content"]


def test_agent_without_llm_is_rejected_at_start(app):
    class NoLlm(Agent):
        pass

    solidloop.agent("no_llm")(NoLlm)
    with pytest.raises(AgentDefinitionError, match="declares no llm settings"):
        NoLlm.start(message="x")


def test_tool_collisions_are_rejected_at_start(app):
    one, two = Toolset("c_one"), Toolset("c_two")

    @one.tool(name="same")
    def first() -> str:
        return "1"

    @two.tool(name="same")
    def second() -> str:
        return "2"

    class Clash(Agent):
        llm = {"base_url": "http://127.0.0.1:9", "model": "m"}
        mcps = [{"name": "x", "toolset": one}, {"name": "y", "toolset": two}]

    solidloop.agent("clash")(Clash)
    with pytest.raises(AgentDefinitionError, match="offered by both 'x' and 'y'"):
        Clash.start(message="x")


def test_resume_with_a_message_keeps_the_result_of_a_call_that_already_ran(
        app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("ran", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]})
    llm.script("new topic", {"content": "ok"})
    loop = Assistant.start(message="ran already")
    run(app, queues=("solidloop_llm",))
    call = session.scalars(select(ToolCall)).one()
    # the tool ran and checkpointed; its answer was never written (worker died)
    call.executed_at = __import__("datetime").datetime.now(__import__("datetime").UTC)
    call.is_success = True
    call.result = {"content": [{"type": "text", "text": "4"}], "isError": False}
    session.commit()
    Assistant(loop).pause()
    assert Assistant(loop).resume(message="new topic") is True
    drain()
    session.expire_all()
    answer = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert answer.content == "4"
    assert session.get(Loop, loop.id).status == "completed"
