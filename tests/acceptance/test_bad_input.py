"""Bad input is made storable or answered, never a failed loop (real workers, real HTTP).

Each case ran into PostgreSQL's limits after wave 1 and failed the whole loop:
a NUL or a lone surrogate in model output (streamed or not) or in a tool's
output, tool arguments nested deeper than Python parses, and a tool result
block holding a value JSON cannot. Here each ends in a completed loop, with
the tool's side effect recorded once and its result kept.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from flask_solidloop.models import Event, Loop, Message, ToolCall

from ..support.support_app import OddAgent, OddStreamingAgent
from .test_e2e_workers import kill_group, spawn_workers, wait_for

pytestmark = pytest.mark.e2e

UNSTORABLE = "a\x00b \ud800 c"
WORKER = ["-m", "dramatiq", "flask_solidloop.worker", "--processes", "1", "--threads", "2"]


@pytest.fixture
def worker(tmp_path):
    import sys

    log = tmp_path / "worker.log"
    proc = spawn_workers([sys.executable, *WORKER], log=log)
    yield proc, log
    kill_group(proc)


def finish(session, loop_id, worker) -> Loop:
    proc, log = worker
    statuses = wait_for(session, [loop_id], timeout=60, proc=proc, log=log)
    loop = session.get(Loop, loop_id)
    assert statuses[loop_id] == "completed", loop.error_message
    return loop


def visible(session, loop_id, role):
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == role, Message.is_hidden.is_(False))
        .order_by(Message.id)))


@pytest.mark.parametrize("agent", [OddAgent, OddStreamingAgent], ids=["plain", "streaming"])
def test_nul_and_lone_surrogates_in_model_output_are_replaced(app, session, llm, worker, agent):
    llm.script("odd text", {"content": f"answer {UNSTORABLE}",
                            "reasoning_content": f"thinking {UNSTORABLE}"})
    loop = finish(session, agent.start(message="odd text").id, worker)
    (answer,) = visible(session, loop.id, "assistant")
    assert answer.content == "answer a\ufffdb \ufffd c"
    assert "content" in answer.meta["sanitized"]


def test_unstorable_tool_output_is_kept_and_answered(app, session, llm, worker, effects):
    llm.script("odd tool", {"tool_calls": [{"name": "unstorable", "arguments": {}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "got it"})
    loop = finish(session, OddAgent.start(message="odd tool").id, worker)
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    assert len(effects(call.idempotency_key, "odd")) == 1  # ran once, result not lost
    assert call.result["content"][0]["text"] == "before\ufffdafter \ufffd end"
    assert call.meta["sanitized"] == ["result"]
    (answer,) = visible(session, loop.id, "tool")
    assert answer.content == "before\ufffdafter \ufffd end"
    assert llm.requests[1].json["messages"][-1]["content"] == "before\ufffdafter \ufffd end"


def test_arguments_nested_too_deep_are_a_correctable_tool_error(app, session, llm, worker):
    deep = '{"value": ' + "[" * 5000 + "]" * 5000 + "}"
    llm.script("deep", {"tool_calls": [{"name": "nested", "arguments": deep}]})
    llm.script(lambda body: "not a JSON object" in str(body["messages"][-1].get("content")),
               {"tool_calls": [{"name": "nested", "arguments": {"value": {"ok": 1}}}]})
    llm.script(lambda body: body["messages"][-1].get("content") == "took it", "done")
    loop = finish(session, OddAgent.start(message="deep").id, worker)
    first, second = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)
                                    .order_by(ToolCall.id)).all()
    assert first.arguments is None and first.is_success is False
    assert second.is_success is True
    assert [m.content for m in visible(session, loop.id, "assistant")][-1] == "done"


def test_a_result_json_cannot_hold_is_stored_as_text(app, session, llm, worker, effects):
    llm.script("odd block", {"tool_calls": [{"name": "odd_block", "arguments": {}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "fine"})
    loop = finish(session, OddAgent.start(message="odd block").id, worker)
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    assert len(effects(call.idempotency_key, "odd")) == 1
    assert call.meta == {"unserializable": True}
    assert call.result["content"][0] == {"type": "text", "text": "made at noon",
                                         "at": "2026-12-01 12:00:00"}
    assert visible(session, loop.id, "tool")[0].content == "made at noon"
    _, log = worker
    assert "its result held values JSON cannot" in log.read_text()


def test_a_large_result_is_kept_whole_once_and_excerpted_in_the_wire_log(
        app, session, llm, worker):
    size = 3_000_000
    llm.script("big", {"tool_calls": [{"name": "big", "arguments": {"chars": size}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "big"})
    loop = finish(session, OddAgent.start(message="big").id, worker)
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    assert len(call.result["content"][0]["text"]) == size  # the full result, on the call
    event = session.scalars(select(Event).where(Event.tool_call_id == call.id)).one()
    kept = event.payload["result"]
    assert kept["truncated"] is True and kept["size"] > size
    assert len(kept["excerpt"]) == 65536 and len(kept["sha256"]) == 64
    assert len(json.dumps(event.payload)) < 100_000
