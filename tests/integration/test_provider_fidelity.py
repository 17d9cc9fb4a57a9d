"""Issue 11: what real servers and the official SDKs accept, end to end against the
strict emulator (tests/conftest.py starts it with ``strict=True``).

* the dialect loops, 3 dialects x stream / non-stream, with parallel tool calls,
  reasoning, a tool-calling turn without text and a nested-model tool schema; every
  request body the dialects sent is validated against the SDK's request types;
* the request shapes llama-cpp-python's server rejects, replayed (compiling the
  server takes many minutes, so CI does not run it);
* refusals, streams without usage, an empty 200 stream, Gemini CONTINUATION.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from sqlalchemy import select

from flask_solidloop import Agent, Toolset
from flask_solidloop.models import Event, ToolCall
from flask_solidloop.render import format_loop, format_message

from ..support.rows import loop_of as finished
from ..support.rows import visible
from ..support.sdk_contract import check_anthropic, check_gemini, check_openai
from ..support.support_app import calc, solidloop

CASES = [(d, s) for d in ("openai", "anthropic", "gemini") for s in (False, True)]
CHECKS = {"openai": check_openai, "anthropic": check_anthropic, "gemini": check_gemini}

shapes = Toolset("shapes")


class Point(BaseModel):
    x: int
    y: int
    label: str | None = None


class Segment(BaseModel):
    start: Point
    end: Point


@shapes.tool
def length(segment: Segment, points: list[Point]) -> str:
    """Manhattan length of a segment (nested models: $defs / $ref in the schema)."""
    return str(abs(segment.end.x - segment.start.x) + abs(segment.end.y - segment.start.y)
               + len(points))


def make_agent(name, dialect, streaming, base_url, **extra):
    class FidelityAgent(Agent):
        system_prompt = "You measure and add."
        mcps = [{"name": "calc", "toolset": calc}, {"name": "shapes", "toolset": shapes}]

    FidelityAgent.llm = {"dialect": dialect, "base_url": base_url, "model": "test-model",
                         "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}
    FidelityAgent.streaming = streaming
    for key, value in extra.items():
        setattr(FidelityAgent, key, value)
    return solidloop.agent(name)(FidelityAgent)


@pytest.mark.parametrize(("dialect", "streaming"), CASES)
def test_dialect_loop_with_parallel_calls_reasoning_and_nested_schema(
        app, session, llm, drain, dialect, streaming):
    agent = make_agent(f"fidelity_{dialect}_{'stream' if streaming else 'plain'}", dialect,
                       streaming, llm.base_url,
                       reasoning_effort=None if dialect == "openai" else "low")
    segment = {"start": {"x": 0, "y": 0}, "end": {"x": 3, "y": 4, "label": "B"}}
    # No text beside the calls: the turn that goes back has empty content (defect 1).
    llm.script("measure", {"reasoning_content": "Two tools at once.", "tool_calls": [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "length", "arguments": {"segment": segment, "points": [{"x": 1, "y": 1}]}},
    ]})
    llm.script(lambda req: "8" in str(req) and "5" in str(req), {"content": "5 and 8."})
    loop = agent.start(message="Please add 2 and 3 and measure the segment")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant", "tool", "tool",
                                         "assistant"]
    assert history[2].reasoning == "Two tools at once."
    assert history[-1].content == "5 and 8."
    calls = session.scalars(select(ToolCall).order_by(ToolCall.position)).all()
    assert [(c.name, c.is_success) for c in calls] == [("add", True), ("length", True)]
    assert calls[1].arguments["segment"]["end"]["label"] == "B"

    chat = [r for r in llm.requests if r.method == "POST"][-2:]
    for request in chat:  # every body validates against the SDK's request type
        CHECKS[dialect](request.json)
    second = chat[-1].json
    if dialect == "openai":
        assistant = second["messages"][2]
        assert assistant["content"] == "" and len(assistant["tool_calls"]) == 2
        assert "reasoning_content" not in assistant  # defect 2: no undocumented field
    elif dialect == "gemini":
        declaration = next(d for d in second["tools"][0]["functionDeclarations"]
                           if d["name"] == "length")
        params = str(declaration["parameters"])
        assert "$defs" not in params and "$ref" not in params
        point = declaration["parameters"]["properties"]["segment"]["properties"]["start"]
        assert point["properties"]["x"] == {"type": "integer"}
    else:
        assert second["messages"][1]["content"][0]["type"] == "thinking"


@pytest.mark.parametrize("streaming", [False, True])
def test_llama_cpp_python_rejected_shapes_replayed(llm, streaming):
    """The shapes llama-cpp-python's server refuses (HTTP 500 from its pydantic
    validation), against the strict emulator: null content beside tool_calls and a
    missing content; the empty string it accepts."""
    import httpx

    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]

    def body(assistant):
        return {"model": "m", "stream": streaming, "messages": [
            {"role": "user", "content": "add 2 and 3"}, assistant,
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]}

    llm.reset()
    llm.script("5", {"content": "It is 5."})
    with httpx.Client(base_url=llm.base_url) as client:
        for rejected in ({"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "assistant", "tool_calls": calls}):
            answer = client.post("/v1/chat/completions", json=body(rejected))
            assert answer.status_code == 500
            assert "Input should be a valid string" in answer.text
        undocumented = {"role": "assistant", "content": "", "tool_calls": calls,
                        "reasoning_content": "hm"}
        assert client.post("/v1/chat/completions", json=body(undocumented)).status_code == 400
        accepted = client.post("/v1/chat/completions",
                               json=body({"role": "assistant", "content": "", "tool_calls": calls}))
        assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize(("dialect", "streaming"), [("openai", False), ("openai", True),
                                                    ("anthropic", False), ("anthropic", True)])
def test_a_refusal_is_the_turns_outcome_and_status_shows_it(
        app, session, llm, drain, dialect, streaming):
    agent = make_agent(f"refuse_{dialect}_{streaming}", dialect, streaming, llm.base_url)
    llm.script("weapon", {"content": None, "refusal": "I can't help with that."})
    loop = agent.start(message="build a weapon")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    answer = visible(session, loop.id)[-1]
    assert answer.finish_reason == "refusal"
    assert answer.meta["refusal"] == "I can't help with that."
    # Shown where the answer would be (OpenAI leaves content empty), flagged.
    assert answer.content == "I can't help with that."
    assert "outcome: refusal" in format_loop(row) and "I can't help" in format_loop(row)
    shown = format_message(answer, {})
    assert shown.startswith(f"[{answer.id}] assistant (refusal)\n    I can't help with that.")
    assert shown.count("I can't help with that.") == 1


@pytest.mark.parametrize(("dialect", "streaming"), [("openai", True), ("openai", False),
                                                    ("anthropic", True), ("gemini", True)])
def test_a_turn_without_usage_is_usage_unknown_not_zero(
        app, session, llm, drain, dialect, streaming):
    agent = make_agent(f"nousage_{dialect}_{streaming}", dialect, streaming, llm.base_url)
    llm.fault_next("no_usage")  # llama-cpp-python ignores stream_options.include_usage
    llm.script("hi", {"content": "hello"})
    loop = agent.start(message="hi")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    answer = visible(session, loop.id)[-1]
    assert answer.usage is None and answer.meta["usage_missing"] is True
    assert answer.meta["metrics"]["usage_missing"] is True
    assert answer.meta["usage_estimate"]["input_tokens"] > 0
    assert "usage unknown for 1 of 1 turn(s)" in format_loop(row)
    assert "usage unknown" in format_message(answer, {})


def test_an_empty_200_stream_fails_once_and_says_why(app, session, llm, drain):
    agent = make_agent("overflow_stream", "openai", True, llm.base_url)
    llm.fault_next("context_overflow", times=3)
    loop = agent.start(message="a very long prompt")
    drain()
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "empty stream" in row.error_message
    assert "context window" in row.error_message and "streaming = False" in row.error_message
    event = session.scalars(select(Event).where(Event.kind == "llm_request")).one()
    assert len(event.payload["attempts"]) == 1  # not retried with the same payload


@pytest.mark.parametrize("streaming", [False, True])
def test_gemini_continuation_is_sent_again_with_its_token(app, session, llm, drain, streaming):
    agent = make_agent(f"continued_{streaming}", "gemini", streaming, llm.base_url)
    llm.script("story", {"content": "Once upon ", "finish_reason": "CONTINUATION",
                         "continuation_token": "dG9rZW4tMQ=="}, times=1)
    llm.script(lambda req: req.get("continuationToken") == "dG9rZW4tMQ==",
               {"content": "a time."})
    loop = agent.start(message="tell a story")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    answer = visible(session, loop.id)[-1]
    assert answer.content == "Once upon a time." and answer.finish_reason == "stop"
    assert answer.meta["metrics"]["continuations"] == 1
    assert "gemini_continuation_token" not in answer.meta
    sent = [r.json for r in llm.requests if r.method == "POST"][-2:]
    assert "continuationToken" not in sent[0] and sent[1]["continuationToken"] == "dG9rZW4tMQ=="
    assert sent[1]["contents"] == sent[0]["contents"]
    for body in sent:
        check_gemini(body)
