"""The Gemini dialect: request shape, response parsing, stream assembly. Pure, no I/O."""

from __future__ import annotations

import copy
import json
import re
import time

import pytest

from flask_solidloop.errors import ProviderAnswerError, ProviderResponseError
from flask_solidloop.llm.dialect import RenderOptions, SSEEvent
from flask_solidloop.llm.gemini import (
    UNSUPPORTED_SCHEMA_KEYS,
    GeminiAggregator,
    GeminiDialect,
    clean_schema,
)
from flask_solidloop.llm.types import ChatMessage, ProviderSettings, ToolCallRequest

SETTINGS = ProviderSettings(dialect="gemini", base_url="https://generativelanguage.googleapis.com",
                            model="gemini-2.5-flash")
DIALECT = GeminiDialect()

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "inputSchema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

SIGNED_PARTS = [
    {"text": "The user wants Paris weather.", "thought": True},
    {"text": "Let me check.", "thoughtSignature": "c2lnLXRleHQ="},
    {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
     "thoughtSignature": "c2lnLWNhbGw="},
    {"functionCall": {"name": "get_weather", "args": {"city": "Lyon"}}},
]


def signed_history() -> list[ChatMessage]:
    return [
        ChatMessage(role="user", content="Weather in Paris and Lyon?"),
        ChatMessage(
            role="assistant", content="Let me check.",
            reasoning="The user wants Paris weather.",
            tool_calls=[ToolCallRequest("call_0", "get_weather", '{"city": "Paris"}'),
                        ToolCallRequest("call_1", "get_weather", '{"city": "Lyon"}')],
            meta={"gemini_parts": copy.deepcopy(SIGNED_PARTS)},
        ),
        ChatMessage(role="tool", content="18C", tool_call_id="call_0"),
        ChatMessage(role="tool", content="no station", tool_call_id="call_1", is_error=True),
    ]


def events(*chunks: dict) -> list[SSEEvent]:
    return [SSEEvent(data=json.dumps(chunk)) for chunk in chunks]


def run_stream(*chunks: dict):
    aggregator = DIALECT.aggregator()
    deltas = [aggregator.feed(event) for event in events(*chunks)]
    return aggregator, deltas


# ------------------------------------------------------------------ render


def test_two_turn_tool_conversation_payload_is_exact():
    messages = [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None,
                    tool_calls=[ToolCallRequest("call_0", "get_weather", '{"city": "Paris"}')]),
        ChatMessage(role="tool", content="18C and sunny", tool_call_id="call_0"),
        ChatMessage(role="assistant", content="18C and sunny in Paris."),
        ChatMessage(role="user", content="And Lyon?"),
    ]
    request = DIALECT.render(SETTINGS, messages, [WEATHER_TOOL],
                             RenderOptions(stream=True, max_tokens=256))
    assert request.path == "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    assert request.params == {"alt": "sse"}
    assert request.headers == {}
    assert request.payload == {
        "systemInstruction": {"parts": [{"text": "You are terse."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "Weather in Paris?"}]},
            {"role": "model", "parts": [
                {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}},
            ]},
            {"role": "user", "parts": [
                {"functionResponse": {"name": "get_weather",
                                      "response": {"result": "18C and sunny"}}},
            ]},
            {"role": "model", "parts": [{"text": "18C and sunny in Paris."}]},
            {"role": "user", "parts": [{"text": "And Lyon?"}]},
        ],
        "tools": [{"functionDeclarations": [{
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]},
        }]}],
        "generationConfig": {"maxOutputTokens": 256},
    }


def test_non_streaming_path_has_no_params_and_model_prefix_is_dropped():
    settings = ProviderSettings(dialect="gemini", base_url="https://x", model="models/gemini-pro")
    request = DIALECT.render(settings, [ChatMessage(role="user", content="hi")], [])
    assert request.path == "/v1beta/models/gemini-pro:generateContent"
    assert request.params == {}
    assert request.payload == {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


@pytest.mark.parametrize(("url_model", "path"), [
    ("gemini-2.5-flash-001", "/v1beta/models/gemini-2.5-flash-001:generateContent"),
    ("models/gemini-2.5-flash-001", "/v1beta/models/gemini-2.5-flash-001:generateContent"),
    ("tunedModels/support-v2", "/v1beta/tunedModels/support-v2:generateContent"),
])
def test_url_model_names_the_model_in_the_path_and_model_stays_out_of_it(url_model, path):
    settings = ProviderSettings.from_dict(
        {"dialect": "gemini", "base_url": "https://x", "model": "priced-name",
         "url_model": url_model}, agent="a")
    request = DIALECT.render(settings, [ChatMessage(role="user", content="hi")], [])
    assert request.path == path
    assert "priced-name" not in json.dumps(request.payload)


@pytest.mark.parametrize(("data", "named"), [
    ({"dialect": "openai", "url_model": "gpt"}, r"url_model is read only when dialect='gemini'"),
    ({"dialect": "gemini", "url_model": "models/x:generateContent"}, r"without spaces"),
    ({"dialect": "gemini", "url_model": "/models/x"}, r"a leading '/'"),
    ({"dialect": "gemini", "url_model": ""}, r"url_model must be a model name"),
    ({"dialect": "gemini", "url_model": 7}, r"got 7"),
    ({"dialect": "gemini", "url_model": "a", "llm_model_name": "b"}, r"are one setting"),
])
def test_a_bad_url_model_is_refused_naming_the_fix(data, named):
    from flask_solidloop.errors import AgentDefinitionError

    with pytest.raises(AgentDefinitionError, match=named):
        ProviderSettings.from_dict({"base_url": "https://x", "model": "m", **data}, agent="a")


def test_llm_model_name_is_another_name_for_url_model():
    settings = ProviderSettings.from_dict(
        {"dialect": "gemini", "base_url": "https://x", "model": "priced-name",
         "llm_model_name": "tunedModels/support-v2"}, agent="a")
    request = DIALECT.render(settings, [ChatMessage(role="user", content="hi")], [])
    assert request.path == "/v1beta/tunedModels/support-v2:generateContent"


def test_consecutive_tool_results_become_one_user_turn_with_names_and_errors():
    messages = [
        ChatMessage(role="user", content="go"),
        ChatMessage(role="assistant", content=None, tool_calls=[
            ToolCallRequest("a", "search", '{"q": "x"}'),
            ToolCallRequest("b", "fetch", "{}"),
        ]),
        ChatMessage(role="tool", content="found", tool_call_id="a"),
        ChatMessage(role="tool", content="404", tool_call_id="b", is_error=True),
    ]
    contents = DIALECT.render(SETTINGS, messages, []).payload["contents"]
    assert contents[-1] == {"role": "user", "parts": [
        {"functionResponse": {"name": "search", "response": {"result": "found"}}},
        {"functionResponse": {"name": "fetch", "response": {"error": "404"}}},
    ]}
    assert contents[1]["parts"][1] == {"functionCall": {"name": "fetch", "args": {}}}


def test_tool_result_name_comes_from_the_nearest_assistant_with_that_call_id():
    messages = [
        ChatMessage(role="user", content="go"),
        ChatMessage(role="assistant", tool_calls=[ToolCallRequest("call_0", "first", "{}")]),
        ChatMessage(role="tool", content="1", tool_call_id="call_0"),
        ChatMessage(role="assistant", tool_calls=[ToolCallRequest("call_0", "second", "{}")]),
        ChatMessage(role="tool", content="2", tool_call_id="call_0"),
    ]
    contents = DIALECT.render(SETTINGS, messages, []).payload["contents"]
    assert contents[2]["parts"][0]["functionResponse"]["name"] == "first"
    assert contents[4]["parts"][0]["functionResponse"]["name"] == "second"


def test_orphan_tool_result_without_name_is_a_clear_error():
    messages = [ChatMessage(role="user", content="go"),
                ChatMessage(role="tool", content="x", tool_call_id="nope")]
    with pytest.raises(ValueError, match="nope"):
        DIALECT.render(SETTINGS, messages, [])


def test_wire_call_ids_are_echoed_in_function_response():
    parts = [{"functionCall": {"id": "fc-7", "name": "get_weather", "args": {"city": "Oslo"}}}]
    messages = [
        ChatMessage(role="user", content="Oslo?"),
        ChatMessage(role="assistant", meta={"gemini_parts": parts},
                    tool_calls=[ToolCallRequest("fc-7", "get_weather", '{"city": "Oslo"}')]),
        ChatMessage(role="tool", content="-3C", tool_call_id="fc-7"),
    ]
    contents = DIALECT.render(SETTINGS, messages, []).payload["contents"]
    assert contents[1]["parts"] == [
        {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}, "id": "fc-7"}}]
    assert contents[2]["parts"] == [{"functionResponse": {
        "name": "get_weather", "response": {"result": "-3C"}, "id": "fc-7"}}]


def test_schema_keys_gemini_rejects_are_stripped_recursively():
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Args",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "title": {"type": "string", "title": "Title", "default": "x"},
            "default": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "title": "Tag"},
                     "default": []},
            "nested": {"type": "object", "additionalProperties": {"type": "string"},
                       "properties": {"a": {"anyOf": [{"type": "string", "title": "A"},
                                                      {"type": "null"}]}}},
        },
        "required": ["title"],
        "enum_holder": {"enum": ["title", "default"]},
    }
    cleaned = clean_schema(schema)
    assert cleaned == {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "default": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "nested": {"type": "object",
                       "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
        },
        "required": ["title"],
    }  # enum_holder is no Schema keyword: dropped (google-genai's Schema forbids it)
    assert schema["title"] == "Args"  # the input is not modified
    dumped = json.dumps(cleaned)
    for key in ("$schema", "additionalProperties"):
        assert key not in dumped
    assert {"$schema", "additionalProperties", "title", "default"} <= UNSUPPORTED_SCHEMA_KEYS


def test_tool_without_parameters_omits_them():
    tools = [{"name": "now", "description": "", "inputSchema": {
        "type": "object", "properties": {}, "additionalProperties": False}},
        {"name": "ping"}]
    declarations = DIALECT.render(SETTINGS, [ChatMessage(role="user", content="t")],
                                  tools).payload["tools"][0]["functionDeclarations"]
    assert declarations == [{"name": "now", "description": ""},
                            {"name": "ping", "description": ""}]


def test_signed_parts_round_trip_unchanged_with_the_default_strategy():
    payload = DIALECT.render(SETTINGS, signed_history(), [WEATHER_TOOL]).payload
    model_turn = payload["contents"][1]
    assert model_turn["role"] == "model"
    assert json.dumps(model_turn["parts"]) == json.dumps(SIGNED_PARTS)
    # The signature stays on the SAME part as its functionCall / text.
    assert model_turn["parts"][2]["thoughtSignature"] == "c2lnLWNhbGw="
    assert "thoughtSignature" not in model_turn["parts"][3]
    assert payload["contents"][2] == {"role": "user", "parts": [
        {"functionResponse": {"name": "get_weather", "response": {"result": "18C"}}},
        {"functionResponse": {"name": "get_weather", "response": {"error": "no station"}}},
    ]}


def test_explicit_signed_strategy_with_xml_bang_adds_a_think_part_in_front():
    parts = DIALECT.render(SETTINGS, signed_history(), [],
                           RenderOptions(reasoning_strategies=["gemini_signed", "xml!"])
                           ).payload["contents"][1]["parts"]
    assert parts[0] == {"text": "<think>The user wants Paris weather.</think>"}
    assert json.dumps(parts[1:]) == json.dumps(SIGNED_PARTS)


def test_xml_fallback_when_the_message_has_no_signature():
    history = signed_history()
    history[1].meta = {"gemini_parts": [
        {k: v for k, v in p.items() if k != "thoughtSignature"} for p in SIGNED_PARTS]}
    parts = DIALECT.render(SETTINGS, history, [],
                           RenderOptions(reasoning_strategies=["gemini_signed", "xml"])
                           ).payload["contents"][1]["parts"]
    assert parts == [
        {"text": "<think>The user wants Paris weather.</think>Let me check."},
        {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}},
        {"functionCall": {"name": "get_weather", "args": {"city": "Lyon"}}},
    ]


def test_xml_strategy_without_native_welds_even_when_signed_parts_exist():
    parts = DIALECT.render(SETTINGS, signed_history(), [],
                           RenderOptions(reasoning_strategies=["xml"])
                           ).payload["contents"][1]["parts"]
    assert parts[0] == {"text": "<think>The user wants Paris weather.</think>Let me check."}
    assert "thoughtSignature" not in json.dumps(parts)


def test_empty_strategy_list_sends_no_reasoning():
    parts = DIALECT.render(SETTINGS, signed_history(), [], RenderOptions(reasoning_strategies=[])
                           ).payload["contents"][1]["parts"]
    assert parts == [
        {"text": "Let me check."},
        {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}},
        {"functionCall": {"name": "get_weather", "args": {"city": "Lyon"}}},
    ]
    dumped = json.dumps(parts)
    assert "thought" not in dumped and "<think>" not in dumped


def test_reasoning_effort_and_llm_params_deep_merged_last():
    request = DIALECT.render(SETTINGS, [ChatMessage(role="user", content="hi")], [], RenderOptions(
        reasoning_effort="medium", max_tokens=100,
        llm_params={"generationConfig": {"temperature": 0.2, "thinkingConfig": {
            "thinkingBudget": 2048}}, "safetySettings": []},
    ))
    assert request.payload["generationConfig"] == {
        "maxOutputTokens": 100, "temperature": 0.2,
        "thinkingConfig": {"thinkingBudget": 2048, "includeThoughts": True},
    }
    assert request.payload["safetySettings"] == []
    for effort, budget in (("low", 1024), ("high", 16384)):
        config = DIALECT.render(SETTINGS, [], [], RenderOptions(reasoning_effort=effort)
                                ).payload["generationConfig"]
        assert config == {"thinkingConfig": {"thinkingBudget": budget, "includeThoughts": True}}


def test_unknown_reasoning_effort_names_the_accepted_values():
    with pytest.raises(ValueError, match="'low', 'medium', 'high'"):
        DIALECT.render(SETTINGS, [], [], RenderOptions(reasoning_effort="extreme"))


def test_auth_headers():
    assert DIALECT.name == "gemini"
    assert DIALECT.auth_headers(SETTINGS, "k-123") == {"x-goog-api-key": "k-123"}
    assert DIALECT.auth_headers(SETTINGS, None) == {}


# ------------------------------------------------------------------- parse


def body_with(parts, finish="STOP", usage=None, response_id=None):
    body = {"candidates": [{"content": {"role": "model", "parts": parts},
                            "finishReason": finish, "index": 0}]}
    if response_id is not None:
        body["responseId"] = response_id
    if usage is not None:
        body["usageMetadata"] = usage
    return body


def test_parse_text_thoughts_calls_and_meta():
    parts = copy.deepcopy(SIGNED_PARTS)
    parts[3]["functionCall"]["id"] = "fc-2"
    usage = {"promptTokenCount": 120, "cachedContentTokenCount": 100,
             "candidatesTokenCount": 30, "thoughtsTokenCount": 50, "totalTokenCount": 200}
    turn = DIALECT.parse(body_with(parts, usage=usage))
    assert turn.content == "Let me check."
    assert turn.reasoning == "The user wants Paris weather."
    assert [(c.name, json.loads(c.arguments_raw)) for c in turn.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert re.fullmatch(r"call_[0-9a-f]{16}", turn.tool_calls[0].call_id)  # invented
    assert turn.tool_calls[1].call_id == "fc-2"  # Gemini's own
    assert turn.finish_reason == "tool_calls"
    assert turn.provider_meta == {"gemini_parts": parts}
    assert turn.usage.to_dict() == {"input_tokens": 120, "cached_input_tokens": 100,
                                    "output_tokens": 80, "reasoning_tokens": 50}


def test_parse_usage_without_thoughts_or_cache():
    turn = DIALECT.parse(body_with([{"text": "hi"}], usage={
        "promptTokenCount": 5, "candidatesTokenCount": 2, "totalTokenCount": 7}))
    assert turn.usage.to_dict() == {"input_tokens": 5, "cached_input_tokens": 0,
                                    "output_tokens": 2, "reasoning_tokens": 0}
    assert turn.reasoning is None and turn.tool_calls == []


@pytest.mark.parametrize(("reason", "expected"), [
    ("STOP", "stop"), ("MAX_TOKENS", "length"), ("SAFETY", "content_filter"),
    ("RECITATION", "content_filter"), ("BLOCKLIST", "content_filter"),
    ("PROHIBITED_CONTENT", "content_filter"), ("SPII", "content_filter"),
    ("LANGUAGE", "content_filter"), ("IMAGE_SAFETY", "content_filter"),
    ("OTHER", "other"), ("MALFORMED_FUNCTION_CALL", "malformed_function_call"),
    ("UNEXPECTED_TOOL_CALL", "unexpected_tool_call"),
    ("TOO_MANY_TOOL_CALLS", "too_many_tool_calls"),
])
def test_finish_reason_mapping(reason, expected):
    assert DIALECT.parse(body_with([{"text": "x"}], finish=reason)).finish_reason == expected
    aggregator, _ = run_stream(chunk([{"text": "x"}], finish=reason))
    assert aggregator.result().finish_reason == expected


@pytest.mark.parametrize("reason", ["SOMETHING_NEW", "FINISH_REASON_UNSPECIFIED", "stop"])
def test_unknown_finish_reason_is_an_error(reason):
    with pytest.raises(ProviderAnswerError, match=f"unknown finishReason '{reason}'"):
        DIALECT.parse(body_with([], finish=reason))


def test_blocked_prompt_is_an_error():
    body = {"promptFeedback": {"blockReason": "SAFETY", "safetyRatings": []},
            "usageMetadata": {"promptTokenCount": 9}}
    with pytest.raises(ProviderResponseError, match="prompt blocked: SAFETY"):
        DIALECT.parse(body)


def test_no_candidates_and_error_objects_are_errors():
    with pytest.raises(ProviderResponseError, match="no candidates"):
        DIALECT.parse({"usageMetadata": {}})
    with pytest.raises(ProviderResponseError, match="RESOURCE_EXHAUSTED"):
        DIALECT.parse({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "slow"}})
    with pytest.raises(ProviderResponseError, match="JSON object"):
        DIALECT.parse("nope")


def test_candidate_without_content_has_no_text():
    turn = DIALECT.parse({"candidates": [{"finishReason": "SAFETY", "index": 0}]})
    assert turn.content is None and turn.finish_reason == "content_filter"
    assert turn.provider_meta == {"gemini_parts": []}


# --------------------------------------------------------------- streaming


def chunk(parts, finish=None, usage=None):
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    body = {"candidates": [candidate], "modelVersion": "gemini-2.5-flash",
            "responseId": "resp-1"}
    if usage:
        body["usageMetadata"] = usage
    return body


def compare(streamed, parsed):
    assert streamed.content == parsed.content
    assert streamed.reasoning == parsed.reasoning
    assert streamed.tool_calls == parsed.tool_calls
    assert streamed.finish_reason == parsed.finish_reason
    assert streamed.usage == parsed.usage
    assert json.dumps(streamed.provider_meta) == json.dumps(parsed.provider_meta)


def test_stream_assembles_the_same_turn_as_the_non_streaming_body():
    final_usage = {"promptTokenCount": 40, "candidatesTokenCount": 12,
                   "thoughtsTokenCount": 30, "totalTokenCount": 82}
    aggregator, deltas = run_stream(
        chunk([{"text": "The user wants ", "thought": True}],
              usage={"promptTokenCount": 40, "thoughtsTokenCount": 10}),
        chunk([{"text": "Paris weather.", "thought": True}]),
        chunk([{"text": "Let me "}], usage={"promptTokenCount": 40, "candidatesTokenCount": 3,
                                            "thoughtsTokenCount": 30}),
        chunk([{"text": "check."}]),
        chunk([{"text": "", "thoughtSignature": "c2lnLXRleHQ="}]),
        chunk([{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
                "thoughtSignature": "c2lnLWNhbGw="},
               {"functionCall": {"name": "get_weather", "args": {"city": "Lyon"}}}]),
        chunk([], finish="STOP", usage=final_usage),
    )
    assert aggregator.finished
    assert [(d.content, d.reasoning) if d else None for d in deltas] == [
        ("", "The user wants "), ("", "Paris weather."), ("Let me ", ""), ("check.", ""),
        None, None, None,
    ]
    streamed = aggregator.result()
    parsed = DIALECT.parse(body_with(copy.deepcopy(SIGNED_PARTS), usage=final_usage,
                                     response_id="resp-1"))
    compare(streamed, parsed)
    assert streamed.provider_meta["gemini_parts"] == SIGNED_PARTS
    assert streamed.usage.output_tokens == 42 and streamed.usage.reasoning_tokens == 30
    assert streamed.finish_reason == "tool_calls"


def test_stream_text_only_with_finish_on_the_last_text_chunk():
    aggregator, _ = run_stream(
        chunk([{"text": "Hel"}]),
        chunk([{"text": "lo"}]),
        chunk([{"text": "!", "thoughtSignature": "sig"}], finish="STOP",
              usage={"promptTokenCount": 3, "candidatesTokenCount": 2}),
    )
    parsed = DIALECT.parse(body_with([{"text": "Hello!", "thoughtSignature": "sig"}],
                                     usage={"promptTokenCount": 3, "candidatesTokenCount": 2},
                                     response_id="resp-1"))
    compare(aggregator.result(), parsed)
    assert aggregator.result().finish_reason == "stop"


def test_late_signature_on_an_empty_thought_part_joins_the_preceding_part():
    aggregator, _ = run_stream(
        chunk([{"text": "thinking", "thought": True}]),
        chunk([{"text": "", "thought": True, "thoughtSignature": "s1"}]),
        chunk([{"text": "answer"}], finish="STOP"),
    )
    assert aggregator.result().provider_meta["gemini_parts"] == [
        {"text": "thinking", "thought": True, "thoughtSignature": "s1"},
        {"text": "answer"},
    ]


def test_late_signature_is_kept_as_its_own_part_when_the_previous_part_is_signed():
    aggregator, _ = run_stream(
        chunk([{"functionCall": {"name": "a", "args": {}}, "thoughtSignature": "s1"}]),
        chunk([{"text": "", "thoughtSignature": "s2"}], finish="STOP"),
    )
    assert aggregator.result().provider_meta["gemini_parts"] == [
        {"functionCall": {"name": "a", "args": {}}, "thoughtSignature": "s1"},
        {"text": "", "thoughtSignature": "s2"},
    ]


def test_stream_error_chunk_raises():
    aggregator = GeminiAggregator()
    aggregator.feed(events(chunk([{"text": "par"}]))[0])
    with pytest.raises(ProviderResponseError, match="UNAVAILABLE"):
        aggregator.feed(SSEEvent(data=json.dumps(
            {"error": {"code": 503, "status": "UNAVAILABLE", "message": "overloaded"}})))


def test_stream_without_finish_reason_is_incomplete():
    aggregator, _ = run_stream(chunk([{"text": "partial"}]))
    assert not aggregator.finished
    with pytest.raises(ProviderResponseError, match="stream ended without a finishReason"):
        aggregator.result()


def test_stream_blocked_prompt_and_garbage_raise():
    aggregator = GeminiAggregator()
    with pytest.raises(ProviderResponseError, match="prompt blocked: OTHER"):
        aggregator.feed(SSEEvent(data=json.dumps({"promptFeedback": {"blockReason": "OTHER"}})))
    with pytest.raises(ProviderResponseError, match="unparseable"):
        GeminiAggregator().feed(SSEEvent(data="{not json"))
    assert GeminiAggregator().feed(SSEEvent(data="")) is None


def test_stream_unknown_finish_reason_fails_at_once():
    with pytest.raises(ProviderAnswerError, match="SOMETHING_NEW"):
        run_stream(chunk([], finish="SOMETHING_NEW"))


def _text_piece(i: int) -> str:  # ~40 characters, a few streamed words
    return f"{i % 10} lorem ipsum dolor sit amet, consec "


def _chunk_feed(count: int) -> list:
    chunks = [chunk([{"text": _text_piece(i), "thought": True} if i < 1000
                     else {"text": _text_piece(i)}]) for i in range(count)]
    chunks.append(chunk([{"text": "", "thoughtSignature": "sig"}], finish="STOP"))
    return list(events(*chunks))


def _aggregate_feed(feed: list) -> tuple:
    aggregator = GeminiAggregator()
    began = time.perf_counter()
    for event in feed:
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


def test_many_small_text_chunks_aggregate_in_linear_time():
    # Each chunk's text used to be appended to the string held in the part (and
    # every part deep-copied): quadratic, several seconds here. Now joined once.
    # A ratio, not a wall-clock limit: 10x the chunks must cost well under 100x
    # (quadratic) the time (25x leaves room for load), measured interleaved.
    small, count = 5_000, 50_000
    small_feed, feed = _chunk_feed(small), _chunk_feed(count)
    turn, small_time, elapsed = _ratio_timing(_aggregate_feed, small_feed, feed)
    thought = "".join(_text_piece(i) for i in range(1000))
    text = "".join(_text_piece(i) for i in range(1000, count))
    assert (turn.content, turn.reasoning) == (text, thought)
    assert turn.provider_meta["gemini_parts"] == [
        {"text": thought, "thought": True}, {"text": text, "thoughtSignature": "sig"}]
    assert elapsed < 25 * small_time, (
        f"{count} chunks took {elapsed:.3f}s, {elapsed / small_time:.0f}x the {small_time:.3f}s "
        f"of {small} (linear would be about 10x)")


def test_stream_result_is_repeatable_and_feeding_continues_the_open_part():
    aggregator, _ = run_stream(chunk([{"text": "Hel"}]), chunk([{"text": "lo"}]))
    with pytest.raises(ProviderResponseError):
        aggregator.result()  # not finished yet
    aggregator.feed(events(chunk([{"text": " there"}], finish="STOP"))[0])
    first = aggregator.result()
    assert first.provider_meta["gemini_parts"] == [{"text": "Hello there"}]
    assert aggregator.result().provider_meta == first.provider_meta


# ------------------------------------------------------------- invented ids


CALL_PARTS = [{"functionCall": {"name": "list_files", "args": {}}},
              {"functionCall": {"name": "list_files", "args": {}}}]


def test_invented_call_ids_are_unique_across_responses_and_within_one():
    first = DIALECT.parse({**body_with(copy.deepcopy(CALL_PARTS)), "responseId": "r-1"})
    second = DIALECT.parse({**body_with(copy.deepcopy(CALL_PARTS)), "responseId": "r-2"})
    ids = [c.call_id for c in first.tool_calls + second.tool_calls]
    assert len(set(ids)) == 4, ids  # used to be call_0, call_1, call_0, call_1
    assert all(re.fullmatch(r"call_[0-9a-f]{16}", i) for i in ids)
    # The same response parsed again gives the same ids (the stream matches the body).
    again = DIALECT.parse({**body_with(copy.deepcopy(CALL_PARTS)), "responseId": "r-1"})
    assert [c.call_id for c in again.tool_calls] == ids[:2]
    # Without a responseId the ids are random, still unique.
    anonymous = [c.call_id for _ in range(2)
                 for c in DIALECT.parse(body_with(copy.deepcopy(CALL_PARTS))).tool_calls]
    assert len(set(anonymous) | set(ids)) == 8
    assert all(re.fullmatch(r"call_[0-9a-f]{16}", i) for i in anonymous)


def test_invented_ids_round_trip_into_a_later_turn_without_going_on_the_wire():
    turn = DIALECT.parse({**body_with(copy.deepcopy(CALL_PARTS[:1])), "responseId": "r-9"})
    call_id = turn.tool_calls[0].call_id
    messages = [
        ChatMessage(role="user", content="ls"),
        ChatMessage(role="assistant", tool_calls=turn.tool_calls,
                    meta=copy.deepcopy(turn.provider_meta)),
        ChatMessage(role="tool", content="a.txt", tool_call_id=call_id),
    ]
    contents = DIALECT.render(SETTINGS, messages, []).payload["contents"]
    assert contents[2]["parts"] == [{"functionResponse": {
        "name": "list_files", "response": {"result": "a.txt"}}}]
    assert call_id not in json.dumps(contents)


# ------------------------------------------------------------------- retry


@pytest.mark.parametrize(("delay", "expected"), [("37s", 37.0), ("1.5s", 1.5), ("0s", 0.0)])
def test_retry_info_is_read_from_the_error_body(delay, expected):
    body = {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
    ]}}
    assert DIALECT.retry_after_from_body(body) == expected
    assert DIALECT.retry_after_from_body([body]) == expected
    assert DIALECT.retry_after_from_body(json.dumps(body)) == expected


@pytest.mark.parametrize("body", [
    None, "not json", {}, {"error": "x"}, {"error": {"details": []}},
    {"error": {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                            "retryDelay": "soon"}]}},
])
def test_retry_info_absent_gives_none(body):
    assert DIALECT.retry_after_from_body(body) is None
