"""The Anthropic Messages dialect: pure render / parse / stream tests (no DB, no network)."""

from __future__ import annotations

import copy
import json
import time

import pytest

from flask_solidloop.errors import ProviderResponseError
from flask_solidloop.llm.anthropic import (
    DEFAULT_MAX_TOKENS,
    AnthropicAggregator,
    AnthropicDialect,
)
from flask_solidloop.llm.dialect import RenderOptions, SSEEvent
from flask_solidloop.llm.types import ChatMessage, ProviderSettings, ToolCallRequest, Usage

SETTINGS = ProviderSettings(dialect="anthropic", base_url="https://api.anthropic.com",
                            model="claude-test")
DIALECT = AnthropicDialect()
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}]

THINKING = {"type": "thinking", "thinking": "The user wants Paris weather.\nCall the tool.",
            "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIw"}
TEXT = {"type": "text", "text": "Let me check the weather in Paris (\u00e9t\u00e9)."}
TOOL_USE = {"type": "tool_use", "id": "toolu_01A", "name": "get_weather",
            "input": {"city": "Paris", "units": {"temp": "C"}}}
BLOCKS = [THINKING, REDACTED, TEXT, TOOL_USE]
USAGE = {"input_tokens": 50, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 100,
         "output_tokens": 87}


def body(content=None, stop_reason="tool_use", usage=None):
    return {
        "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-test",
        "content": copy.deepcopy(BLOCKS if content is None else content),
        "stop_reason": stop_reason, "stop_sequence": None,
        "usage": dict(USAGE if usage is None else usage),
    }


def render(messages, tools=(), **kwargs):
    return DIALECT.render(SETTINGS, messages, list(tools), RenderOptions(**kwargs))


# -- render ------------------------------------------------------------------


def test_two_turn_tool_conversation_payload_shape():
    messages = [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="system", content="Use metric units."),
        ChatMessage(role="user", content="Weather in Paris and Rome?"),
        ChatMessage(role="assistant", content="Checking.", tool_calls=[
            ToolCallRequest("toolu_1", "get_weather", '{"city": "Paris"}'),
            ToolCallRequest("toolu_2", "get_weather", "not json"),
        ]),
        ChatMessage(role="tool", content="18C sunny", tool_call_id="toolu_1"),
        ChatMessage(role="tool", content="bad arguments", tool_call_id="toolu_2", is_error=True),
        ChatMessage(role="user", content="And tomorrow?"),
    ]
    request = render(messages, TOOLS, max_tokens=512)
    assert request.path == "/v1/messages"
    assert request.headers == {"anthropic-version": "2023-06-01"}
    assert request.params == {}
    assert request.payload == {
        "model": "claude-test",
        "max_tokens": 512,
        "system": "You are terse.\n\nUse metric units.",
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"_invalid_arguments": "not json"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "bad arguments",
                 "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        "tools": [{"name": "get_weather", "description": "Weather for a city",
                   "input_schema": TOOLS[0]["inputSchema"]}],
    }
    assert "stream" not in request.payload
    assert render(messages, stream=True).payload["stream"] is True


def test_tool_input_edge_cases_and_consecutive_users_merge():
    messages = [
        ChatMessage(role="user", content="one"),
        ChatMessage(role="user", content="two"),
        ChatMessage(role="assistant", tool_calls=[
            ToolCallRequest("a", "t", ""), ToolCallRequest("b", "t", "[1, 2]")]),
        ChatMessage(role="tool", content="", tool_call_id="a"),  # no output: content omitted
        ChatMessage(role="tool", content="ok", tool_call_id="b"),
        ChatMessage(role="assistant", content=None),  # empty: Anthropic rejects it, dropped
    ]
    wire = render(messages).payload["messages"]
    assert wire == [
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "t", "input": {}},
            {"type": "tool_use", "id": "b", "name": "t", "input": {"_invalid_arguments": "[1, 2]"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a"},
            {"type": "tool_result", "tool_use_id": "b", "content": "ok"},
        ]},
    ]
    with pytest.raises(ValueError, match="role 'developer'"):
        render([ChatMessage(role="developer", content="x")])


def test_version_setting_auth_and_llm_params():
    class WithVersion:
        model = "claude-test"
        anthropic_version = "2099-01-01"

    request = DIALECT.render(WithVersion(), [ChatMessage(role="user", content="hi")], [],
                             RenderOptions(llm_params={"temperature": 0.2, "max_tokens": 99,
                                                       "metadata": {"user_id": "u1"}}))
    assert request.headers == {"anthropic-version": "2099-01-01"}
    assert request.payload["temperature"] == 0.2
    assert request.payload["max_tokens"] == 99  # llm_params win, merged last
    assert request.payload["metadata"] == {"user_id": "u1"}
    assert DIALECT.auth_headers(SETTINGS, "sk-ant-1") == {"x-api-key": "sk-ant-1"}
    assert DIALECT.auth_headers(SETTINGS, None) == {}
    assert DIALECT.retry_after_from_body({"error": {"type": "rate_limit_error"}}) is None
    assert DIALECT.name == "anthropic"


def test_max_tokens_default_and_thinking_budget():
    hi = [ChatMessage(role="user", content="hi")]
    payload = render(hi).payload
    assert payload["max_tokens"] == DEFAULT_MAX_TOKENS == 4096
    assert "thinking" not in payload

    low = render(hi, reasoning_effort="low").payload
    assert low["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert low["max_tokens"] == 4096  # already above the budget

    medium = render(hi, reasoning_effort="medium").payload
    assert medium["thinking"]["budget_tokens"] == 4096
    assert medium["max_tokens"] == 4096 + 1024  # raised: must exceed the budget

    high = render(hi, reasoning_effort="high", max_tokens=2000).payload
    assert high["thinking"]["budget_tokens"] == 16384
    assert high["max_tokens"] == 16384 + 1024

    roomy = render(hi, reasoning_effort="high", max_tokens=32000).payload
    assert roomy["max_tokens"] == 32000

    with pytest.raises(ValueError, match="'low', 'medium', 'high'"):
        render(hi, reasoning_effort="minimal")


# -- reasoning round trip ------------------------------------------------------


def assistant_from(turn) -> ChatMessage:
    """What the loop stores and gives back next turn."""
    return ChatMessage(role="assistant", content=turn.content, tool_calls=turn.tool_calls,
                       reasoning=turn.reasoning, meta=json.loads(json.dumps(turn.provider_meta)))


def test_thinking_blocks_round_trip_byte_for_byte():
    original = body()
    original_blocks = copy.deepcopy(original["content"])
    turn = DIALECT.parse(original)
    history = [
        ChatMessage(role="user", content="Weather in Paris?"),
        assistant_from(turn),
        ChatMessage(role="tool", content="18C", tool_call_id="toolu_01A"),
    ]
    for strategies in (None, ["anthropic_signed"], ["anthropic_signed", "xml"]):
        payload = render(history, TOOLS, reasoning_strategies=strategies).payload
        sent = payload["messages"][1]
        assert sent["role"] == "assistant"
        assert json.dumps(sent["content"]) == json.dumps(original_blocks)
        assert payload["messages"][2] == {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "18C"}]}
    # The payload is a copy: editing it does not touch the stored history.
    payload["messages"][1]["content"][0]["thinking"] = "edited"
    assert history[1].meta["anthropic_blocks"][0]["thinking"] == THINKING["thinking"]


def test_xml_fallback_without_blocks_and_empty_strategies():
    message = ChatMessage(role="assistant", content="Answer.", reasoning="Because.",
                          tool_calls=[ToolCallRequest("toolu_9", "t", '{"a": 1}')])
    history = [ChatMessage(role="user", content="q"), message]

    welded = render(history, reasoning_strategies=["anthropic_signed", "xml"]).payload
    assert welded["messages"][1]["content"] == [
        {"type": "text", "text": "<think>Because.</think>Answer."},
        {"type": "tool_use", "id": "toolu_9", "name": "t", "input": {"a": 1}},
    ]
    default = render(history).payload  # signed cannot apply, no xml: reasoning dropped
    assert default["messages"][1]["content"][0] == {"type": "text", "text": "Answer."}

    # [] sends no reasoning even when signed blocks are stored.
    signed = assistant_from(DIALECT.parse(body()))
    bare = render([history[0], signed], reasoning_strategies=[]).payload
    assert bare["messages"][1]["content"] == [TEXT, TOOL_USE]
    assert "think" not in json.dumps(bare)


def test_xml_bang_welds_beside_signed_blocks_without_touching_thinking():
    signed = assistant_from(DIALECT.parse(body()))
    payload = render([ChatMessage(role="user", content="q"), signed],
                     reasoning_strategies=["anthropic_signed", "xml!"]).payload
    sent = payload["messages"][1]["content"]
    assert json.dumps(sent[:2]) == json.dumps([THINKING, REDACTED])
    assert sent[2] == {"type": "text", "text": f"<think>{THINKING['thinking']}</think>"
                       + TEXT["text"]}
    assert sent[3] == TOOL_USE

    no_text = assistant_from(DIALECT.parse(body(content=[THINKING, TOOL_USE])))
    sent = render([ChatMessage(role="user", content="q"), no_text],
                  reasoning_strategies=["anthropic_signed", "xml!"]).payload["messages"][1]
    assert sent["content"] == [
        THINKING, {"type": "text", "text": f"<think>{THINKING['thinking']}</think>"}, TOOL_USE]


def test_xml_bang_welds_when_blocks_lack_thinking():
    # Blocks without thinking: the signed strategy does not apply; fields are rebuilt.
    turn = DIALECT.parse(body(content=[TEXT], stop_reason="end_turn"))
    message = assistant_from(turn)
    message.reasoning = "hidden"
    payload = render([ChatMessage(role="user", content="q"), message],
                     reasoning_strategies=["anthropic_signed", "xml!"]).payload
    assert payload["messages"][1]["content"] == [
        {"type": "text", "text": "<think>hidden</think>" + TEXT["text"]}]


# -- parse -------------------------------------------------------------------


def test_parse_response():
    turn = DIALECT.parse(body())
    assert turn.content == TEXT["text"]
    assert turn.reasoning == THINKING["thinking"]
    assert turn.finish_reason == "tool_calls"
    assert turn.tool_calls == [ToolCallRequest(
        "toolu_01A", "get_weather", json.dumps(TOOL_USE["input"]))]
    assert json.loads(turn.tool_calls[0].arguments_raw) == TOOL_USE["input"]
    assert turn.provider_meta == {"anthropic_blocks": BLOCKS}
    assert turn.raw["id"] == "msg_01"

    only_redacted = DIALECT.parse(body(content=[REDACTED, TEXT], stop_reason="end_turn"))
    assert only_redacted.reasoning is None
    assert only_redacted.tool_calls == []
    no_text = DIALECT.parse(body(content=[TOOL_USE]))
    assert no_text.content is None


def test_usage_normalization():
    assert DIALECT.parse(body()).usage == Usage(input_tokens=170, cached_input_tokens=100,
                                                output_tokens=87, reasoning_tokens=0)
    plain = DIALECT.parse(body(usage={"input_tokens": 12, "output_tokens": 3,
                                      "cache_read_input_tokens": None}))
    assert plain.usage == Usage(input_tokens=12, cached_input_tokens=0, output_tokens=3)
    missing = body()
    del missing["usage"]
    assert DIALECT.parse(missing).usage is None


@pytest.mark.parametrize(("stop", "finish"), [
    ("end_turn", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"),
    ("stop_sequence", "stop"), ("pause_turn", "pause_turn"), ("refusal", "refusal"),
    ("model_context_window_exceeded", "length"),
])
def test_stop_reason_mapping(stop, finish):
    assert DIALECT.parse(body(stop_reason=stop)).finish_reason == finish


def test_bad_bodies():
    with pytest.raises(ProviderResponseError, match="unknown stop_reason 'exploded'"):
        DIALECT.parse(body(stop_reason="exploded"))
    with pytest.raises(ProviderResponseError, match="overloaded_error: Overloaded"):
        DIALECT.parse({"type": "error",
                       "error": {"type": "overloaded_error", "message": "Overloaded"}})
    with pytest.raises(ProviderResponseError, match="no content list"):
        DIALECT.parse({"type": "message", "stop_reason": "end_turn"})
    with pytest.raises(ProviderResponseError, match="JSON object"):
        DIALECT.parse(["nope"])


# -- streaming ---------------------------------------------------------------


def sse(kind, **data):
    return SSEEvent(event=kind, data=json.dumps({"type": kind, **data}))


def stream_events():
    start = body(content=[], stop_reason=None,
                 usage={"input_tokens": 50, "cache_creation_input_tokens": 20,
                        "cache_read_input_tokens": 100, "output_tokens": 1})
    return [
        sse("message_start", message=start),
        sse("content_block_start", index=0,
            content_block={"type": "thinking", "thinking": "", "signature": ""}),
        sse("content_block_delta", index=0,
            delta={"type": "thinking_delta", "thinking": "The user wants Paris weather.\n"}),
        sse("ping"),
        sse("content_block_delta", index=0,
            delta={"type": "thinking_delta", "thinking": "Call the tool."}),
        sse("content_block_delta", index=0,
            delta={"type": "signature_delta", "signature": THINKING["signature"]}),
        sse("content_block_stop", index=0),
        sse("content_block_start", index=1, content_block=REDACTED),
        sse("content_block_stop", index=1),
        sse("content_block_start", index=2, content_block={"type": "text", "text": ""}),
        sse("content_block_delta", index=2,
            delta={"type": "text_delta", "text": "Let me check the weather "}),
        sse("content_block_delta", index=2,
            delta={"type": "text_delta", "text": "in Paris (\u00e9t\u00e9)."}),
        sse("content_block_stop", index=2),
        sse("content_block_start", index=3, content_block={
            "type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {}}),
        sse("content_block_delta", index=3, delta={"type": "input_json_delta", "partial_json": ""}),
        sse("content_block_delta", index=3,
            delta={"type": "input_json_delta", "partial_json": '{"city": "Paris", "un'}),
        sse("content_block_delta", index=3,
            delta={"type": "input_json_delta", "partial_json": 'its": {"temp": "C"}}'}),
        sse("content_block_stop", index=3),
        sse("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None},
            usage={"output_tokens": 40}),
        sse("message_delta", delta={}, usage={"output_tokens": 87}),
        sse("message_stop"),
    ]


def test_stream_equals_non_streaming_parse():
    aggregator = DIALECT.aggregator()
    assert isinstance(aggregator, AnthropicAggregator)
    deltas = []
    for event in stream_events():
        assert not aggregator.finished
        delta = aggregator.feed(event)
        if delta:
            deltas.append((delta.content, delta.reasoning))
    assert aggregator.finished
    assert deltas == [
        ("", "The user wants Paris weather.\n"), ("", "Call the tool."),
        ("Let me check the weather ", ""), ("in Paris (\u00e9t\u00e9).", ""),
    ]
    streamed = aggregator.result()
    expected = DIALECT.parse(body())
    assert streamed == expected
    assert json.dumps(streamed.provider_meta["anthropic_blocks"]) == json.dumps(BLOCKS)
    assert streamed.usage == Usage(input_tokens=170, cached_input_tokens=100, output_tokens=87)


def test_stream_error_event():
    aggregator = AnthropicAggregator()
    aggregator.feed(stream_events()[0])
    with pytest.raises(ProviderResponseError, match="overloaded_error: Overloaded") as info:
        aggregator.feed(sse("error", error={"type": "overloaded_error", "message": "Overloaded"}))
    assert info.value.error_type == "overloaded_error"


def test_stream_without_message_stop_is_an_error():
    aggregator = AnthropicAggregator()
    for event in stream_events()[:-1]:
        aggregator.feed(event)
    assert not aggregator.finished
    with pytest.raises(ProviderResponseError, match="without message_stop"):
        aggregator.result()


def test_stream_malformed_data():
    aggregator = AnthropicAggregator()
    with pytest.raises(ProviderResponseError, match="unparseable"):
        aggregator.feed(SSEEvent(event="message_start", data='{"type": "message_st'))

    broken_json = AnthropicAggregator()
    events = stream_events()
    for event in events[:14]:  # up to the tool_use content_block_start
        broken_json.feed(event)
    broken_json.feed(sse("content_block_delta", index=3,
                         delta={"type": "input_json_delta", "partial_json": '{"city": '}))
    broken_json.feed(sse("content_block_stop", index=3))
    for event in events[-3:]:  # message_delta x2, message_stop
        broken_json.feed(event)
    # broken tool JSON is not a failed turn: the call keeps the raw text (the loop
    # turns it into a tool error the model can correct); the block goes back as {}
    turn = broken_json.result()
    assert turn.tool_calls[0].arguments_raw == '{"city": '
    assert turn.provider_meta["anthropic_blocks"][3]["input"] == {}

    orphan = AnthropicAggregator()
    orphan.feed(events[0])
    with pytest.raises(ProviderResponseError, match="unstarted block 5"):
        orphan.feed(sse("content_block_delta", index=5,
                        delta={"type": "text_delta", "text": "x"}))


def test_stream_ignores_unknown_events_and_blank_data():
    aggregator = AnthropicAggregator()
    events = stream_events()
    events.insert(3, sse("future_event", payload=1))
    events.insert(4, SSEEvent(data=""))
    for event in events:
        aggregator.feed(event)
    assert aggregator.result() == DIALECT.parse(body())


# -- aggregation cost ------------------------------------------------------------


def piece(i: int) -> str:
    """A ~40-character delta, the size of a few streamed words."""
    return f"{i % 10} lorem ipsum dolor sit amet, consec "


def _delta_events(count: int) -> list:
    start = body(content=[], stop_reason=None, usage={"input_tokens": 1, "output_tokens": 1})
    return [
        sse("message_start", message=start),
        sse("content_block_start", index=0,
            content_block={"type": "thinking", "thinking": "", "signature": ""}),
        *(sse("content_block_delta", index=0,
              delta={"type": "thinking_delta", "thinking": piece(i)}) for i in range(1000)),
        sse("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "s"}),
        sse("content_block_stop", index=0),
        sse("content_block_start", index=1, content_block={"type": "text", "text": ""}),
        *(sse("content_block_delta", index=1, delta={"type": "text_delta", "text": piece(i)})
          for i in range(count)),
        # no content_block_stop for the text block: result() closes it
        sse("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 9}),
        sse("message_stop"),
    ]


def _aggregate(events: list) -> tuple[object, float]:
    aggregator = AnthropicAggregator()
    began = time.perf_counter()
    for event in events:
        aggregator.feed(event)
    turn = aggregator.result()
    return turn, time.perf_counter() - began


def _ratio_timing(aggregate, small_input, big_input):
    """(result of the big run, best small time, best big time): runs interleaved, the
    garbage collector held off, so a load spike or a collection hits one sample, not
    the figure."""
    import gc

    smalls, bigs, turn = [], [], None
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            smalls.append(aggregate(small_input)[1])
            turn, took = aggregate(big_input)
            bigs.append(took)
    finally:
        gc.enable()
    return turn, min(smalls), min(bigs)


def test_many_small_deltas_aggregate_in_linear_time():
    # Appending every delta to the block's string copied the whole text each time:
    # quadratic, about 20 s here. Pieces are now joined once per block. A ratio,
    # not a wall-clock limit: 10x the deltas must cost well under 100x (quadratic)
    # the time (25x leaves room for load; quadratic is 100x), measured interleaved.
    small, count = 5_000, 50_000
    small_events, events = _delta_events(small), _delta_events(count)
    turn, small_time, elapsed = _ratio_timing(_aggregate, small_events, events)
    text = "".join(piece(i) for i in range(count))
    thought = "".join(piece(i) for i in range(1000))
    assert (turn.content, turn.reasoning) == (text, thought)
    assert turn.provider_meta["anthropic_blocks"] == [
        {"type": "thinking", "thinking": thought, "signature": "s"},
        {"type": "text", "text": text}]
    assert elapsed < 25 * small_time, (
        f"{count} deltas took {elapsed:.3f}s, {elapsed / small_time:.0f}x the {small_time:.3f}s "
        f"of {small} (linear would be about 10x)")


def test_deltas_into_a_block_that_started_without_text_and_empty_deltas():
    # A block whose start omits "text"/"thinking" still gets the key once a delta
    # (even an empty one) arrives, exactly as concatenation did.
    start = body(content=[], stop_reason=None, usage={"input_tokens": 1, "output_tokens": 1})
    aggregator = AnthropicAggregator()
    for event in [
        sse("message_start", message=start),
        sse("content_block_start", index=0, content_block={"type": "thinking"}),
        sse("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": ""}),
        sse("content_block_stop", index=0),
        sse("content_block_start", index=1, content_block={"type": "text", "text": "Hi"}),
        sse("content_block_delta", index=1, delta={"type": "text_delta", "text": ", you"}),
        sse("content_block_stop", index=1),
        sse("message_delta", delta={"stop_reason": "end_turn"}),
        sse("message_stop"),
    ]:
        aggregator.feed(event)
    turn = aggregator.result()
    assert turn.provider_meta["anthropic_blocks"] == [
        {"type": "thinking", "thinking": ""}, {"type": "text", "text": "Hi, you"}]
    assert turn.content == "Hi, you" and aggregator.result() == turn  # result() repeatable
