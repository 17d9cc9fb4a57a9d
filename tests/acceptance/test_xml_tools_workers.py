"""Issue 16 under real ``dramatiq`` worker subprocesses: loops whose model writes its
tool calls as text complete, streaming and not, with one tool message per call, and
the tool-prompted agent completes against a server that rejects the ``tools`` field."""

from __future__ import annotations

import sys

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message, ToolCall

from ..integration.test_xml_tools import CORRECTED, MALFORMED, TWO_CALLS, answered
from ..support.support_app import (
    XmlPromptedAgent,
    XmlPromptedStreamingAgent,
    XmlToolsAgent,
    XmlToolsStreamingAgent,
)
from .test_e2e_workers import kill_group, spawn_workers, wait_for

pytestmark = pytest.mark.e2e


def reply(body: dict) -> dict:
    """One script for every loop, chosen by what the conversation asks."""
    first_user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if "malformed" in first_user:
        return {"content": [MALFORMED, CORRECTED, "3, done"][min(turns, 2)]}
    return {"content": "42, done" if answered(body) else TWO_CALLS}


def test_text_tool_calls_complete_under_real_workers(app, session, llm, tmp_path):
    llm.script(lambda body: True, reply)
    log = tmp_path / "workers.log"
    proc = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                          "--processes", "1", "--threads", "4"], log=log)
    try:
        native = {agent.start(message=f"{kind} please").id: (agent, kind)
                  for agent in (XmlToolsAgent, XmlToolsStreamingAgent)
                  for kind in ("parallel", "malformed")}
        # Native-tools agents first, while the server takes tools ...
        wait_for(session, list(native), timeout=60, proc=proc, log=log)
        # ... then a server whose chat format has no tools: prompting carries them.
        llm.tool_support = "reject"
        prompted = {agent.start(message="parallel please").id: (agent, "parallel")
                    for agent in (XmlPromptedAgent, XmlPromptedStreamingAgent)}
        wait_for(session, list(prompted), timeout=60, proc=proc, log=log)
    finally:
        llm.tool_support = "native"
        kill_group(proc)
    for loop_id, (agent, kind) in {**native, **prompted}.items():
        loop = session.get(Loop, loop_id)
        assert loop.status == "completed", (agent.agent_name, kind, loop.error_message)
        calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
        answers = list(session.scalars(select(Message).where(
            Message.loop_id == loop_id, Message.role == "tool")))
        # One tool message per call, exactly once.
        assert sorted(m.tool_call_id for m in answers) == sorted(c.id for c in calls)
        assert len({c.call_id for c in calls}) == len(calls)
        if kind == "parallel":
            assert [c.is_success for c in calls] == [True, True]
        else:
            assert sorted(c.is_success for c in calls) == [False, True]
