"""The openai_responses dialect without a server (decision 0044): responses and stream
events built with the ``openai`` SDK's own models, dumped as the API sends them and
parsed; the items a history renders to, in order; the settings it validates."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")

from openai.types import responses as rt

from flask_solidloop.errors import (
    AgentDefinitionError,
    ProviderAnswerError,
    ProviderResponseError,
)
from flask_solidloop.llm.dialect import RenderOptions, SSEEvent
from flask_solidloop.llm.openai_responses import OpenAIResponsesDialect
from flask_solidloop.llm.types import ChatMessage, ProviderSettings, ToolCallRequest

from ..support.sdk_contract import check_openai_responses

REASONING = {"type": "reasoning", "id": "rs_1", "encrypted_content": "gAAAA-opaque",
             "summary": [{"type": "summary_text", "text": "Add first."}]}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add",
        "arguments": '{"a": 2, "b": 3}', "status": "completed"}
USAGE = {"input_tokens": 100, "output_tokens": 40, "total_tokens": 140,
         "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 25}}


def sdk_response(output, **extra):
    model = rt.Response.model_validate({
        "id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-5",
        "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "status": "completed", "usage": USAGE, **extra})
    return model.model_dump(mode="json", exclude_none=True)


def settings(**extra):
    return ProviderSettings.from_dict({"dialect": "openai_responses",
                                       "base_url": "https://api.openai.com", "model": "gpt-5",
                                       **extra}, agent="a")


def test_an_sdk_response_with_reasoning_and_a_call_parses():
    turn = OpenAIResponsesDialect().parse(sdk_response([REASONING, CALL]))
    assert [(c.call_id, c.name, c.arguments_raw) for c in turn.tool_calls] == [
        ("call_1", "add", '{"a": 2, "b": 3}')]
    assert turn.finish_reason == "tool_calls" and turn.reasoning == "Add first."
    assert (turn.usage.input_tokens, turn.usage.cached_input_tokens, turn.usage.output_tokens,
            turn.usage.reasoning_tokens) == (100, 64, 40, 25)
    items = turn.provider_meta["responses_items"]
    assert items[0]["encrypted_content"] == "gAAAA-opaque"
    assert items[1] == {"type": "function_call", "call_id": "call_1"}
    assert turn.provider_meta["responses_id"] == "resp_1"


def test_a_refusal_part_is_the_refusal():
    body = sdk_response([{"type": "message", "id": "msg_1", "role": "assistant",
                          "status": "completed",
                          "content": [{"type": "refusal", "refusal": "I can't."}]}])
    turn = OpenAIResponsesDialect().parse(body)
    assert (turn.refusal, turn.finish_reason, turn.content) == ("I can't.", "refusal", None)


def test_incomplete_failed_and_unknown_statuses():
    dialect = OpenAIResponsesDialect()
    cut = sdk_response([], status="incomplete",
                       incomplete_details={"reason": "max_output_tokens"})
    assert dialect.parse(cut).finish_reason == "length"
    with pytest.raises(ProviderResponseError, match="server_error"):
        dialect.parse(sdk_response([], status="failed",
                                   error={"code": "server_error", "message": "boom"}))
    with pytest.raises(ProviderAnswerError, match="in_progress"):
        dialect.parse(sdk_response([], status="in_progress"))


def events_for(output):
    """A stream as the API sends it, every event an SDK event model."""
    final = sdk_response(output)
    raw = [{"type": "response.created", "sequence_number": 0,
            "response": {**final, "status": "in_progress", "output": []}}]
    for index, item in enumerate(output):
        raw.append({"type": "response.output_item.added", "output_index": index,
                    "sequence_number": len(raw), "item": {**item, "arguments": ""}
                    if item["type"] == "function_call" else {**item, "summary": []}})
        if item["type"] == "function_call":
            for piece in (item["arguments"][:5], item["arguments"][5:]):
                raw.append({"type": "response.function_call_arguments.delta",
                            "item_id": item["id"], "output_index": index, "delta": piece,
                            "sequence_number": len(raw)})
        else:
            raw.append({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                        "output_index": index, "summary_index": 0, "delta": "Add first.",
                        "sequence_number": len(raw)})
        raw.append({"type": "response.output_item.done", "output_index": index, "item": item,
                    "sequence_number": len(raw)})
    raw.append({"type": "response.completed", "response": final, "sequence_number": len(raw)})
    from pydantic import TypeAdapter

    adapter: TypeAdapter = TypeAdapter(rt.ResponseStreamEvent)
    return [SSEEvent(data=json.dumps(adapter.validate_python(e).model_dump(
        mode="json", exclude_none=True)), event=e["type"]) for e in raw]


def test_a_stream_gives_the_same_turn_and_its_deltas():
    aggregator = OpenAIResponsesDialect().aggregator()
    deltas = [aggregator.feed(event) for event in events_for([REASONING, CALL])]
    assert [d.reasoning for d in deltas if d] == ["Add first."]
    assert aggregator.finished
    turn = aggregator.result()
    assert [(c.call_id, c.arguments_raw) for c in turn.tool_calls] == [
        ("call_1", '{"a": 2, "b": 3}')]
    assert turn.usage.cached_input_tokens == 64
    assert turn.provider_meta["responses_items"][0]["encrypted_content"] == "gAAAA-opaque"


def test_a_stream_without_its_final_event_or_with_an_error_fails():
    events = events_for([CALL])
    aggregator = OpenAIResponsesDialect().aggregator()
    for event in events[:-1]:
        aggregator.feed(event)
    with pytest.raises(ProviderResponseError, match=r"without response\.completed"):
        aggregator.result()
    error = SSEEvent(data=json.dumps({"type": "error", "code": "server_error",
                                      "message": "overloaded", "sequence_number": 3}),
                     event="error")
    with pytest.raises(ProviderResponseError, match="overloaded"):
        OpenAIResponsesDialect().aggregator().feed(error)


def test_interleaved_reasoning_goes_back_in_its_order_and_xml_welds():
    second = {**REASONING, "id": "rs_2", "encrypted_content": "gAAAA-two"}
    turn = OpenAIResponsesDialect().parse(sdk_response(
        [REASONING, CALL, second, {**CALL, "id": "fc_2", "call_id": "call_2"}]))
    history = [
        ChatMessage("user", "add"),
        ChatMessage("assistant", None, [ToolCallRequest("call_1", "add", "{}"),
                                        ToolCallRequest("call_2", "add", "{}")],
                    reasoning=turn.reasoning, meta=turn.provider_meta),
        ChatMessage("tool", "5", tool_call_id="call_1"),
        ChatMessage("tool", "6", tool_call_id="call_2"),
    ]
    body = OpenAIResponsesDialect().render(settings(), history, []).payload
    check_openai_responses(body)
    assert [(i["type"], i.get("id") or i.get("call_id")) for i in body["input"][1:]] == [
        ("reasoning", "rs_1"), ("function_call", "call_1"), ("reasoning", "rs_2"),
        ("function_call", "call_2"), ("function_call_output", "call_1"),
        ("function_call_output", "call_2")]
    welded = OpenAIResponsesDialect().render(
        settings(), history, [], RenderOptions(reasoning_strategies=["xml"])).payload
    assert [i["type"] for i in welded["input"]][:2] == ["message", "message"]
    assert welded["input"][1]["content"].startswith("<think>Add first.")


def test_chaining_without_an_earlier_response_sends_everything():
    body = OpenAIResponsesDialect().render(
        settings(previous_response_id=True), [ChatMessage("user", "hi")], []).payload
    assert body["store"] is True and "previous_response_id" not in body
    assert body["input"] == [{"type": "message", "role": "user", "content": "hi"}]


def test_previous_response_id_is_a_bool_of_this_dialect_only():
    with pytest.raises(AgentDefinitionError, match="True or False"):
        settings(previous_response_id="yes")
    with pytest.raises(AgentDefinitionError, match="dialect='openai_responses'"):
        ProviderSettings.from_dict({"base_url": "https://x", "model": "m",
                                    "previous_response_id": True}, agent="a")


def test_a_reasoning_item_that_led_to_nothing_is_not_sent_back():
    # Cut off while reasoning: the API refuses a reasoning item with no following item.
    turn = OpenAIResponsesDialect().parse(sdk_response(
        [REASONING], status="incomplete", incomplete_details={"reason": "max_output_tokens"}))
    assert turn.finish_reason == "length" and turn.provider_meta["responses_items"]
    history = [ChatMessage("user", "add"),
               ChatMessage("assistant", None, reasoning=turn.reasoning, meta=turn.provider_meta),
               ChatMessage("user", "go on")]
    body = OpenAIResponsesDialect().render(settings(), history, []).payload
    assert [i["type"] for i in body["input"]] == ["message", "message"]
