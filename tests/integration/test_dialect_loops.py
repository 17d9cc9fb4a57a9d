"""Each dialect, streaming and not: a two-turn tool loop against the emulator, with
the exact request payload shape asserted on the wire."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Event, Loop, Message, ToolCall

from ..support.support_app import calc, solidloop

CASES = [(d, s) for d in ("openai", "openai_responses", "anthropic", "gemini")
         for s in (False, True)]


def make_agent(name: str, dialect: str, streaming: bool, base_url: str) -> type[Agent]:
    class DialectAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]
        llm = {"dialect": dialect, "base_url": base_url, "model": "test-model",
               "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}

    DialectAgent.streaming = streaming
    return solidloop.agent(name)(DialectAgent)


@pytest.mark.parametrize(("dialect", "streaming"), CASES)
def test_two_turn_tool_loop(app, session, llm, drain, dialect, streaming):
    agent = make_agent(f"{dialect}_{'stream' if streaming else 'plain'}", dialect, streaming,
                       llm.base_url)
    llm.script("add 2 and 3", {"content": "Adding.",
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "The sum is 5."})
    loop = agent.start(message="Please add 2 and 3")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "completed", row.error_message
    history = list(session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.is_hidden.is_(False)).order_by(Message.id)))
    assert [m.role for m in history] == ["system", "user", "assistant", "tool", "assistant"]
    assert history[-1].content == "The sum is 5."
    call = session.scalars(select(ToolCall)).one()
    assert (call.name, call.arguments, call.is_success) == ("add", {"a": 2, "b": 3}, True)
    assert history[2].usage and history[2].usage["output_tokens"] > 0
    assert "metrics" in history[2].meta and "reasoning_carried" in history[2].meta
    if streaming:
        assert history[2].meta["metrics"]["ttft_ms"] >= 0
        wire = session.scalars(select(Event).where(Event.kind == "llm_request")).first()
        assert "stream_summary" in wire.payload["response"]["body"]

    first, second = llm.requests[-2], llm.requests[-1]
    assert_shape(dialect, streaming, first, second)


def assert_shape(dialect, streaming, first, second):
    body = second.json
    if dialect == "openai":
        assert second.path == "/v1/chat/completions"
        assert second.headers["authorization"] == "Bearer sk-test-secret-123"
        assert body["model"] == "test-model" and body["stream"] is streaming
        if streaming:
            assert body["stream_options"] == {"include_usage": True}
        assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
        call = body["messages"][2]["tool_calls"][0]
        assert call["type"] == "function"
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
        assert body["messages"][3] == {"role": "tool", "content": "5",
                                       "tool_call_id": call["id"]}
        assert body["tools"][0]["type"] == "function"
        assert body["tools"][0]["function"]["name"] == "add"
        assert body["tools"][0]["function"]["parameters"]["required"] == ["a", "b"]
    elif dialect == "openai_responses":
        assert second.path == "/v1/responses"
        assert second.headers["authorization"] == "Bearer sk-test-secret-123"
        assert body["model"] == "test-model" and body["stream"] is streaming
        assert body["store"] is False
        items = body["input"]
        assert [(i["type"], i.get("role")) for i in items] == [
            ("message", "system"), ("message", "user"), ("message", "assistant"),
            ("function_call", None), ("function_call_output", None)]
        assert items[2]["content"] == "Adding."
        call = items[3]
        assert (call["name"], call["arguments"]) == ("add", '{"a": 2, "b": 3}')
        assert items[4] == {"type": "function_call_output", "call_id": call["call_id"],
                            "output": "5"}
        assert body["tools"][0]["type"] == "function" and body["tools"][0]["name"] == "add"
        assert body["tools"][0]["parameters"]["required"] == ["a", "b"]
    elif dialect == "anthropic":
        assert second.path == "/v1/messages"
        assert second.headers["x-api-key"] == "sk-test-secret-123"
        assert second.headers["anthropic-version"] == "2023-06-01"
        assert body["system"] == "You add numbers."
        assert body["max_tokens"] == 4096
        assert body.get("stream", False) is streaming
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        blocks = body["messages"][1]["content"]
        tool_use = next(b for b in blocks if b["type"] == "tool_use")
        assert (tool_use["name"], tool_use["input"]) == ("add", {"a": 2, "b": 3})
        result = body["messages"][2]["content"][0]
        assert result["type"] == "tool_result" and result["tool_use_id"] == tool_use["id"]
        assert result["content"] == "5"
        assert body["tools"][0]["name"] == "add" and "input_schema" in body["tools"][0]
    else:
        action = "streamGenerateContent" if streaming else "generateContent"
        assert second.path == f"/v1beta/models/test-model:{action}"
        if streaming:
            assert "alt=sse" in second.query
        assert second.headers["x-goog-api-key"] == "sk-test-secret-123"
        assert body["systemInstruction"] == {"parts": [{"text": "You add numbers."}]}
        assert [c["role"] for c in body["contents"]] == ["user", "model", "user"]
        model_parts = body["contents"][1]["parts"]
        function_call = next(p["functionCall"] for p in model_parts if "functionCall" in p)
        assert function_call["name"] == "add" and function_call["args"] == {"a": 2, "b": 3}
        response = body["contents"][2]["parts"][0]["functionResponse"]
        assert response["name"] == "add" and response["response"] == {"result": "5"}
        declaration = body["tools"][0]["functionDeclarations"][0]
        assert declaration["name"] == "add" and "parameters" in declaration
