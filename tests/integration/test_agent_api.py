"""The decorator-based agent API: registration, options, start/pause/resume/stop."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import Agent, AgentDefinitionError, Toolset
from flask_solidloop.models import Job, Loop, ToolCall

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


def test_start_can_join_the_callers_transaction(app, session):
    loop = Assistant.start(message="atomic", commit=False)
    loop_id = loop.id
    session.rollback()
    assert session.get(Loop, loop_id) is None
    assert list(session.scalars(select(Job))) == []


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


