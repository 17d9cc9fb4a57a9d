"""The openai_responses dialect (decision 0044) against the strict emulator, through
real loops: a tool round trip streaming and not with parallel calls, reasoning items
carried back verbatim, previous_response_id chaining, usage with cached and reasoning
tokens, refusals, structured output and a rate-limited retry. Every request body is
validated against the ``openai`` SDK's ResponseCreateParams types, and the emulator's
answers against the SDK's response and event models."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Event, ToolCall

from ..support.rows import loop_of as finished
from ..support.rows import visible
from ..support.sdk_contract import check_openai_responses
from ..support.support_app import calc, solidloop

pytest.importorskip("openai")

from openai.types.responses import Response, ResponseStreamEvent

USAGE = {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 48},
         "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 12}}


def make_agent(name, streaming, base_url, **extra):
    class ResponsesAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]

    ResponsesAgent.llm = {"dialect": "openai_responses", "base_url": base_url,
                          "model": "test-model", "api_key_env": "SOLIDLOOP_TEST_API_KEY",
                          "read_timeout": 10, **extra.pop("llm", {})}
    ResponsesAgent.streaming = streaming
    for key, value in extra.items():
        setattr(ResponsesAgent, key, value)
    return solidloop.agent(name)(ResponsesAgent)


def sent(llm, count):
    return [r for r in llm.requests if r.method == "POST"][-count:]


@pytest.mark.parametrize("streaming", [False, True])
def test_tool_round_trip_with_parallel_calls_reasoning_and_usage(
        app, session, llm, drain, streaming):
    agent = make_agent(f"responses_{'stream' if streaming else 'plain'}", streaming,
                       llm.base_url)
    llm.script("add 2 and 3", {"reasoning_content": "Two sums at once.", "usage": USAGE,
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}},
                                              {"name": "add", "arguments": {"a": 4, "b": 4}}]})
    llm.script(lambda req: "8" in str(req["input"][-1]), {"content": "5 and 8."})
    loop = agent.start(message="Please add 2 and 3, and 4 and 4")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant", "tool", "tool",
                                         "assistant"]
    assert history[-1].content == "5 and 8."
    assert history[2].reasoning == "Two sums at once."
    calls = session.scalars(select(ToolCall).order_by(ToolCall.position)).all()
    assert [(c.arguments, c.is_success) for c in calls] == [({"a": 2, "b": 3}, True),
                                                            ({"a": 4, "b": 4}, True)]
    # Usage in the project's fields: cached and reasoning tokens kept apart.
    assert history[2].usage["input_tokens"] == 120
    assert history[2].usage["cached_input_tokens"] == 48
    assert history[2].usage["output_tokens"] == 30
    assert history[2].usage["reasoning_tokens"] == 12
    if streaming:
        assert history[2].meta["metrics"]["ttft_ms"] >= 0

    first, second = sent(llm, 2)
    for request in (first, second):
        assert request.path == "/v1/responses"
        assert request.headers["authorization"] == "Bearer sk-test-secret-123"
        check_openai_responses(request.json)
    body = second.json
    assert body["stream"] is streaming and body["store"] is False
    assert body["include"] == ["reasoning.encrypted_content"]
    assert "previous_response_id" not in body
    kinds = [(i["type"], i.get("role")) for i in body["input"]]
    assert kinds == [("message", "system"), ("message", "user"), ("reasoning", None),
                     ("function_call", None), ("function_call", None),
                     ("function_call_output", None), ("function_call_output", None)]
    # The reasoning item goes back verbatim: the emulator issued this encrypted_content.
    issued = history[2].meta["responses_items"][0]
    assert body["input"][2] == issued
    assert issued["encrypted_content"] in llm.responses.issued
    assert history[-1].meta["reasoning_carried"]["messages"] == 1
    call_items, outputs = body["input"][3:5], body["input"][5:]
    assert [json.loads(c["arguments"]) for c in call_items] == [{"a": 2, "b": 3},
                                                                {"a": 4, "b": 4}]
    assert [o["call_id"] for o in outputs] == [c["call_id"] for c in call_items]
    assert [o["output"] for o in outputs] == ["5", "8"]
    assert "id" not in call_items[0]  # item ids mean nothing to a server that stores none
    tool = body["tools"][0]
    assert (tool["type"], tool["name"], tool["strict"]) == ("function", "add", False)
    assert tool["parameters"]["required"] == ["a", "b"]


def test_reasoning_items_are_left_out_under_an_empty_strategy(app, session, llm, drain):
    agent = make_agent("responses_no_reasoning", False, llm.base_url,
                       reasoning_strategies=[])
    llm.script("add 2 and 3", {"reasoning_content": "Hm.",
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "5."})
    loop = agent.start(message="Please add 2 and 3")
    drain()
    assert finished(session, loop.id).status == "completed"
    body = sent(llm, 1)[0].json
    assert [i["type"] for i in body["input"]] == ["message", "message", "function_call",
                                                  "function_call_output"]


@pytest.mark.parametrize("streaming", [False, True])
def test_previous_response_id_sends_only_the_new_items(app, session, llm, drain, streaming):
    agent = make_agent(f"responses_chain_{streaming}", streaming, llm.base_url,
                       llm={"previous_response_id": True})
    llm.script("add 2 and 3", {"reasoning_content": "Sum.",
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "The sum is 5."})
    loop = agent.start(message="Please add 2 and 3")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    history = visible(session, loop.id)
    first, second = sent(llm, 2)
    for request in (first, second):
        check_openai_responses(request.json)
    assert first.json["store"] is True and "previous_response_id" not in first.json
    assert "include" not in first.json
    body = second.json
    assert body["store"] is True
    assert body["previous_response_id"] == history[2].meta["responses_id"]
    assert body["previous_response_id"] in llm.responses.stored
    # Only what came after that response: the tool's output (its call is on the server).
    assert [(i["type"], i["output"]) for i in body["input"]] == [("function_call_output", "5")]
    # The reasoning stayed on the server: this request carried none of it.
    assert history[-1].meta["reasoning_carried"]["messages"] == 0


def test_the_strict_emulator_refuses_what_the_api_refuses(llm):
    llm.reset()
    llm.script("hi", {"reasoning_content": "think",
                      "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})

    def post(client, **body):
        return client.post("/v1/responses", json={"model": "m", **body})

    with httpx.Client(base_url=llm.base_url) as client:
        answer = post(client, input=[{"role": "user", "content": "hi"}], store=False,
                      include=["reasoning.encrypted_content"])
        assert answer.status_code == 200, answer.text
        issued, call_item = answer.json()["output"]
        Response.model_validate(answer.json())
        assert issued["type"] == "reasoning" and issued["encrypted_content"]
        assert call_item["type"] == "function_call"
        user = {"role": "user", "content": "hi"}
        output = {"type": "function_call_output", "call_id": call_item["call_id"],
                  "output": "3"}
        cases = [
            ({"input": [user], "bogus": 1}, "Unknown parameter: 'bogus'"),
            ({"input": [user, {"type": "function_call_output", "call_id": "call_x",
                               "output": "5"}]},
             "No tool call found for function call output with call_id call_x"),
            ({"input": [user, {**issued, "encrypted_content": "forged"}, user], "store": False},
             "could not be verified"),
            ({"input": [user, issued, user], "store": False},
             f"Item '{issued['id']}' of type 'reasoning' was provided without its required "
             "following item"),
            ({"input": [user, call_item, output]},
             f"Item '{call_item['id']}' of type 'function_call' was provided without its "
             f"required 'reasoning' item: '{issued['id']}'"),
            ({"input": [user], "previous_response_id": "resp_unknown"},
             "Previous response with id 'resp_unknown' not found"),
            ({"input": [{"type": "message", "role": "user", "content": "hi", "name": "x"}]},
             "Unknown parameter: 'input[0].name'"),
        ]
        for body, message in cases:
            refused = post(client, **body)
            assert refused.status_code == 400, (body, refused.text)
            assert message in refused.json()["error"]["message"]
        unknown = post(client, input=[user, {**issued, "encrypted_content": None}, call_item,
                                      output], store=False)
        assert unknown.status_code == 404
        assert "Items are not persisted when `store` is set to false" in unknown.text
        accepted = post(client, input=[user, issued, call_item, output], store=False)
        assert accepted.status_code == 200, accepted.text


def test_the_emulators_stream_fits_the_sdks_event_models(llm):
    llm.reset()
    llm.script("hi", {"content": "hello there", "reasoning_content": "think",
                      "tool_calls": [{"name": "add", "arguments": {"a": 1}}]})
    adapter: TypeAdapter = TypeAdapter(ResponseStreamEvent)
    with httpx.Client(base_url=llm.base_url) as client:
        answer = client.post("/v1/responses", json={
            "model": "m", "stream": True, "input": "hi",
            "include": ["reasoning.encrypted_content"]})
    assert answer.status_code == 200
    events = [json.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: ")]
    kinds = [adapter.validate_python(event).type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds
    assert "response.reasoning_summary_text.delta" in kinds
    Response.model_validate(events[-1]["response"])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_refusal_is_the_turns_outcome(app, session, llm, drain, streaming):
    agent = make_agent(f"responses_refuse_{streaming}", streaming, llm.base_url)
    llm.script("weapon", {"content": None, "refusal": "I can't help with that."})
    loop = agent.start(message="build a weapon")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    answer = visible(session, loop.id)[-1]
    assert answer.finish_reason == "refusal"
    assert answer.meta["refusal"] == "I can't help with that."


class Sum(BaseModel):
    total: int
    note: str | None = None


@pytest.mark.parametrize("streaming", [False, True])
def test_structured_output_asks_through_text_format(app, session, llm, drain, streaming):
    agent = make_agent(f"responses_output_{streaming}", streaming, llm.base_url,
                       output_type=Sum, mcps=[])
    llm.script("sum", {"output": {"total": 5, "note": None}})
    loop = agent.start(message="sum 2 and 3")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    assert row.output == {"total": 5, "note": None}
    body = sent(llm, 1)[0].json
    check_openai_responses(body)
    fmt = body["text"]["format"]
    assert (fmt["type"], fmt["name"], fmt["strict"]) == ("json_schema", "final_answer", True)
    assert fmt["schema"]["required"] == ["total", "note"]
    assert fmt["schema"]["additionalProperties"] is False


def test_a_rate_limited_request_is_retried_as_on_the_chat_dialect(app, session, llm, drain):
    agent = make_agent("responses_429", False, llm.base_url)
    llm.fault_next("status", status=429, retry_after=0)
    llm.script("hi", {"content": "hello"})
    loop = agent.start(message="hi")
    drain()
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    event = session.scalars(select(Event).where(Event.kind == "llm_request")).one()
    statuses = [a.get("status") for a in event.payload["attempts"]]
    assert statuses[0] == 429 and len(statuses) == 2
