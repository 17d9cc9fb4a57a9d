"""The OpenAI-compatible dialect: render, parse, and the stream aggregator. Pure, no I/O."""

from __future__ import annotations

import json

import pytest

from flask_solidloop.errors import ProviderAnswerError, ProviderResponseError
from flask_solidloop.llm import openai
from flask_solidloop.llm.dialect import RenderOptions, SSEEvent, StreamDelta
from flask_solidloop.llm.openai import OpenAIAggregator, OpenAIDialect
from flask_solidloop.llm.reasoning import ThinkTagSplitter, split_think
from flask_solidloop.llm.sse import SSEParser
from flask_solidloop.llm.types import ChatMessage, ProviderSettings, ToolCallRequest

SETTINGS = ProviderSettings(dialect="openai", base_url="http://llm.test", model="m")
TOOLS = [{"name": "add", "description": "Add two numbers",
          "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def history() -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="add 2 and 3"),
        ChatMessage(role="assistant", content="Calling add.", reasoning="I should add.",
                    tool_calls=[ToolCallRequest("call_1", "add", '{"a": 2}')]),
        ChatMessage(role="tool", content="5", tool_call_id="call_1"),
        ChatMessage(role="assistant", content="It is 5.", reasoning=None),
        ChatMessage(role="user", content="thanks"),
    ]


def render(**kwargs):
    return OpenAIDialect().render(SETTINGS, history(), TOOLS, RenderOptions(**kwargs))


# -- render ------------------------------------------------------------------------------------


def test_render_shape():
    rendered = render()
    assert rendered.path == "/v1/chat/completions" == openai.PATH
    assert rendered.headers == {} and rendered.params == {}
    payload = rendered.payload
    assert payload["model"] == "m" and payload["stream"] is False
    assert "stream_options" not in payload
    assert payload["tools"] == [{"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": TOOLS[0]["inputSchema"]}}]
    messages = payload["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "add", "arguments": '{"a": 2}'}}]
    assert messages[3] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    assert "reasoning_effort" not in payload and "max_tokens" not in payload


def test_render_streaming_asks_for_usage():
    payload = render(stream=True).payload
    assert payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}


def test_render_default_strategy_sends_no_reasoning_field():
    # Issue 11, defect 2: OpenAI's ChatCompletionAssistantMessageParam has no
    # reasoning_content; strict servers refuse it. The default sends no field...
    messages = render().payload["messages"]
    assert all("reasoning_content" not in m and "reasoning" not in m for m in messages)
    assert messages[2]["content"] == "Calling add."
    assert render(reasoning_strategies=None).payload == render().payload


def test_render_default_for_deepseek_sends_reasoning_content():
    # ... except to a server that documents it: DeepSeek wants it back.
    deepseek = ProviderSettings(dialect="openai", base_url="https://api.deepseek.com",
                                model="deepseek-reasoner")
    messages = OpenAIDialect().render(deepseek, history(), TOOLS).payload["messages"]
    assert messages[2]["reasoning_content"] == "I should add."
    assert all("reasoning_content" not in m for i, m in enumerate(messages) if i != 2)


def test_render_field_strategy_reasoning():
    message = render(reasoning_strategies=["reasoning"]).payload["messages"][2]
    assert message["reasoning"] == "I should add."
    assert "reasoning_content" not in message and message["content"] == "Calling add."


def test_render_xml_strategy_welds_into_content():
    message = render(reasoning_strategies=["xml"]).payload["messages"][2]
    assert message["content"] == "<think>I should add.</think>Calling add."
    assert "reasoning_content" not in message and "reasoning" not in message
    # a message without reasoning is left alone
    assert render(reasoning_strategies=["xml"]).payload["messages"][4]["content"] == "It is 5."


def test_render_xml_is_only_a_fallback_when_a_field_applies():
    message = render(reasoning_strategies=["reasoning_content", "xml"]).payload["messages"][2]
    assert message["content"] == "Calling add."
    assert message["reasoning_content"] == "I should add."


def test_render_xml_bang_welds_alongside_the_field():
    message = render(reasoning_strategies=["xml!", "reasoning_content"]).payload["messages"][2]
    assert message["content"] == "<think>I should add.</think>Calling add."
    assert message["reasoning_content"] == "I should add."


def test_render_no_strategies_sends_no_reasoning():
    message = render(reasoning_strategies=[]).payload["messages"][2]
    assert message == {"role": "assistant", "content": "Calling add.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    ]}


def test_render_weld_with_no_content():
    messages = [ChatMessage(role="assistant", content=None, reasoning="hm")]
    payload = OpenAIDialect().render(SETTINGS, messages, [],
                                    RenderOptions(reasoning_strategies=["xml"])).payload
    assert payload["messages"][0]["content"] == "<think>hm</think>"
    assert "tools" not in payload


def test_render_empty_assistant_message_has_empty_string_content():
    # OpenAI rejects {"role": "assistant", "content": null} without tool_calls.
    empty = ChatMessage(role="assistant", content=None)
    assert openai.render_message(empty) == {"role": "assistant", "content": ""}
    field_only = ChatMessage(role="assistant", content=None, reasoning="hm")
    rendered = OpenAIDialect().render(SETTINGS, [field_only], [], RenderOptions(
        reasoning_strategies=["reasoning_content"])).payload["messages"][0]
    assert rendered == {"role": "assistant", "content": "", "reasoning_content": "hm"}


def test_render_tool_calling_message_has_empty_string_content():
    # Issue 11, defect 1: llama-cpp-python's server answers 500 ("Input should be a
    # valid string") to "content": null next to tool_calls; "" is what every server
    # (OpenAI, vLLM, Ollama, LiteLLM, llama-cpp-python) accepts.
    calling = ChatMessage(role="assistant", content=None,
                          tool_calls=[ToolCallRequest("c1", "add", "{}")])
    assert openai.render_message(calling)["content"] == ""
    assert all(m["content"] is not None for m in OpenAIDialect().render(
        SETTINGS, [calling, ChatMessage(role="tool", content=None, tool_call_id="c1")],
        []).payload["messages"])


@pytest.mark.parametrize("strategies, expected", [
    (None, {"messages": 0, "chars": 0, "inline_chars": 0, "tokens_est": 0}),
    (["reasoning_content"], {"messages": 1, "chars": 13, "inline_chars": 0, "tokens_est": 4}),
    (["reasoning"], {"messages": 1, "chars": 13, "inline_chars": 0, "tokens_est": 4}),
    (["xml"], {"messages": 1, "chars": 13, "inline_chars": 13, "tokens_est": 4}),
    (["xml!", "reasoning_content"], {"messages": 1, "chars": 13, "inline_chars": 13,
                                     "tokens_est": 4}),
    ([], {"messages": 0, "chars": 0, "inline_chars": 0, "tokens_est": 0}),
])
def test_reasoning_carried_matches_the_render(strategies, expected):
    assert openai.reasoning_carried(history(), strategies) == expected


def test_render_effort_and_max_tokens_param():
    payload = render(reasoning_effort="low", max_tokens=99).payload
    assert payload["reasoning_effort"] == "low" and payload["max_tokens"] == 99
    settings = ProviderSettings(dialect="openai", base_url="http://x", model="m",
                                max_tokens_param="max_completion_tokens")
    payload = OpenAIDialect().render(settings, history(), [], RenderOptions(max_tokens=5)).payload
    assert payload["max_completion_tokens"] == 5 and "max_tokens" not in payload


def test_llm_params_are_deep_merged_last():
    params = {"temperature": 0.2, "model": "other", "max_tokens": 7,
              "stream_options": {"include_usage": False, "extra": 1},
              "response_format": {"type": "json_object"}}
    payload = render(stream=True, max_tokens=99, llm_params=params).payload
    assert payload["temperature"] == 0.2
    assert payload["model"] == "other"  # verbatim, even over what we set
    assert payload["max_tokens"] == 7
    assert payload["stream_options"] == {"include_usage": False, "extra": 1}
    assert payload["response_format"] == {"type": "json_object"}
    assert payload["messages"] == render(stream=True).payload["messages"]
    assert params["stream_options"] == {"include_usage": False, "extra": 1}  # not mutated


def test_module_functions_match_the_dialect():
    path, payload = openai.render_request(SETTINGS, history(), TOOLS,
                                          RenderOptions(stream=True, llm_params={"seed": 1}))
    rendered = render(stream=True, llm_params={"seed": 1})
    assert (path, payload) == (rendered.path, rendered.payload)
    assert openai.auth_headers("sk-1") == {"Authorization": "Bearer sk-1"}
    assert OpenAIDialect().auth_headers(SETTINGS, "sk-1") == {"Authorization": "Bearer sk-1"}
    assert OpenAIDialect().auth_headers(SETTINGS, None) == {} == openai.auth_headers(None)
    assert OpenAIDialect().retry_after_from_body({"error": {}}) is None
    assert OpenAIDialect.name == "openai"
    assert openai.deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


# -- parse -------------------------------------------------------------------------------------


def body(message, finish_reason="stop", usage=None):
    return {"id": "x", "choices": [{"index": 0, "message": message,
                                    "finish_reason": finish_reason}], "usage": usage}


def test_parse_plain_with_tool_calls_and_usage():
    turn = OpenAIDialect().parse(body(
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        ]}, "tool_calls",
        {"prompt_tokens": 10, "completion_tokens": 5,
         "prompt_tokens_details": {"cached_tokens": 4},
         "completion_tokens_details": {"reasoning_tokens": 2}}))
    assert turn.content is None and turn.reasoning is None
    assert [(c.call_id, c.name, c.arguments_raw) for c in turn.tool_calls] == [
        ("c1", "add", "{}"), ("c2", "add", '{"a": 1}')]
    assert turn.usage.to_dict() == {"input_tokens": 10, "cached_input_tokens": 4,
                                    "output_tokens": 5, "reasoning_tokens": 2}
    assert turn.finish_reason == "tool_calls"


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_parse_reasoning_fields(field):
    turn = openai.parse_response(body({"role": "assistant", "content": "Hi", field: "think"}))
    assert (turn.content, turn.reasoning) == ("Hi", "think")


def test_parse_reasoning_content_wins_over_reasoning():
    turn = openai.parse_response(body({"content": "Hi", "reasoning_content": "a",
                                       "reasoning": "b"}))
    assert turn.reasoning == "a"


def test_parse_think_tags_in_content():
    turn = openai.parse_response(body({"content": "<think>step 1\nstep 2</think>\n\nAnswer."}))
    assert (turn.content, turn.reasoning) == ("Answer.", "step 1\nstep 2")


def test_parse_think_tags_only():
    turn = openai.parse_response(body({"content": "<think>only</think>"}))
    assert (turn.content, turn.reasoning) == (None, "only")


def test_parse_unterminated_think_is_all_reasoning():
    turn = openai.parse_response(body({"content": "<think>cut off"}, "length"))
    assert (turn.content, turn.reasoning) == (None, "cut off")


def test_parse_field_and_think_tags_are_both_kept():
    turn = openai.parse_response(body({"content": "<think>b</think>c", "reasoning": "a"}))
    assert (turn.content, turn.reasoning) == ("c", "a\n\nb")


def test_parse_content_parts():
    turn = openai.parse_response(body({"content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}))
    assert turn.content == "ab"


def test_parse_content_with_angle_brackets_is_untouched():
    turn = openai.parse_response(body({"content": "a <b> c"}))
    assert (turn.content, turn.reasoning) == ("a <b> c", None)


@pytest.mark.parametrize("text", [
    "wrap text in <think> and </think>. Done.",
    "Use <think>tags</think> like this.",
    "Answer first.\n<think>late</think>",
    "<thinking>not the tag</thinking>",
    "x <think>unterminated later",
])
def test_parse_think_tag_later_in_the_content_is_ordinary_content(text):
    turn = openai.parse_response(body({"content": text}))
    assert (turn.content, turn.reasoning) == (text, None)


def test_parse_leading_think_after_whitespace_and_later_tags_stay():
    turn = openai.parse_response(body(
        {"content": "\n  <think>plan</think>\n\nWrite <think> and </think> literally."}))
    assert (turn.content, turn.reasoning) == ("Write <think> and </think> literally.", "plan")


@pytest.mark.parametrize(("text", "expected"), [
    (None, (None, None)), ("", ("", None)), ("plain", ("plain", None)),
    ("<think>a</think>b", ("b", "a")), (" \n<think>a</think>\n\nb", ("b", "a")),
    ("<think>a</think>", (None, "a")), ("<think>cut", (None, "cut")),
    ("<think></think>\nb", ("b", "")), ("b<think>a</think>", ("b<think>a</think>", None)),
    ("<think>a</think>b<think>c</think>", ("b<think>c</think>", "a")),
    ("  ", ("  ", None)), ("<thi", ("<thi", None)),
])
def test_split_think(text, expected):
    assert split_think(text) == expected


# What the parse of a whole content and the stream of it in any pieces must agree on.
THINK_CASES = [
    "plain answer", "a < b and c > d", "<think>plan</think>\n\nThe answer <th",
    "wrap text in <think> and </think>. Done.", "  \n<think>x</think>y <think>z</think>",
    "<think>cut off</thi", "<think></think>\n\nok", "\n\n<thi", " <b>bold</b>", "  ",
    "<think>a</think>", "<think>é🚀</think>ok",
]


def stream_content(pieces):
    events = [chunk({"content": p}) for p in pieces]
    aggregator, deltas = run(*events, chunk({}, "stop"), DONE)
    return aggregator.result(), [d for d in deltas if d]


@pytest.mark.parametrize("text", THINK_CASES)
def test_stream_agrees_with_parse_for_every_split(text):
    parsed = openai.parse_response(body({"content": text}))
    expected = (parsed.content, parsed.reasoning)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        turn, visible = stream_content(pieces)
        assert (turn.content, turn.reasoning) == expected, pieces
        # What was shown live is the start of the result (a held-back tail, like
        # "</thi" or a lone "<thi", only joins it at the end; newlines after
        # </think> are trimmed from the result only).
        assert (turn.reasoning or "").startswith("".join(d.reasoning for d in visible))
        assert (turn.content or "").startswith(
            "".join(d.content for d in visible).lstrip("\n"))


def test_splitter_only_looks_for_the_tag_at_the_start():
    splitter = ThinkTagSplitter()
    assert splitter.feed("Say ") == ("Say ", "")
    assert splitter.feed("<think>") == ("<think>", "")
    assert splitter.flush() == ("", "")
    splitter = ThinkTagSplitter()
    assert splitter.feed("\n ") == ("", "")  # whitespace held: a tag may follow
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>r") == ("", "r")
    assert splitter.matched
    assert splitter.feed("</think>a <think>b</think>") == ("a <think>b</think>", "")
    assert splitter.feed("<") == ("<", "")  # after the closing tag nothing is held back
    assert splitter.flush() == ("", "")
    splitter = ThinkTagSplitter()
    assert splitter.feed(" \n") == ("", "")
    assert splitter.flush() == (" \n", "")  # no tag came: the whitespace is content
    assert not splitter.matched


@pytest.mark.parametrize("bad", [
    "not a dict", {"error": {"message": "boom"}}, {"choices": []},
    body({"content": "x"}, "weird_reason"), body({"content": "x"}, {"type": "stop"}),
])
def test_parse_errors(bad):
    with pytest.raises(ProviderResponseError):
        OpenAIDialect().parse(bad)


def test_extra_finish_reasons_of_compatible_servers():
    # Mistral: the context window filled up, a truncation like "length".
    assert openai.parse_response(body({"content": "x"}, "model_length")).finish_reason \
        == "length"
    aggregator, _ = run(chunk({"content": "x"}), chunk({}, "model_length"), DONE)
    assert aggregator.result().finish_reason == "length"
    # DeepSeek / Mistral: the server gave up; the answer is unusable.
    for reason in ("insufficient_system_resource", "error"):
        with pytest.raises(ProviderAnswerError, match=f"could not finish.*{reason}"):
            openai.parse_response(body({"content": "x"}, reason))
        with pytest.raises(ProviderAnswerError, match=f"could not finish.*{reason}"):
            run(chunk({"content": "x"}), chunk({}, reason))
    with pytest.raises(ProviderAnswerError, match="unknown finish_reason 'weird_reason'"):
        openai.parse_response(body({"content": "x"}, "weird_reason"))


# -- aggregator --------------------------------------------------------------------------------


def chunk(delta=None, finish_reason=None, usage=None, choices=True, **extra):
    data = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason}]
            if choices else [], **extra}
    if usage is not None:
        data["usage"] = usage
    return SSEEvent(json.dumps(data))


DONE = SSEEvent("[DONE]")


def run(*events):
    aggregator = OpenAIDialect().aggregator()
    deltas = [aggregator.feed(e) for e in events]
    return aggregator, deltas


def test_content_stream_with_usage_chunk():
    aggregator, deltas = run(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}), chunk({"content": "lo"}),
        chunk({}, "stop", usage=None),
        chunk(choices=False, usage={"prompt_tokens": 3, "completion_tokens": 2}),
        DONE,
    )
    assert deltas == [None, StreamDelta("Hel"), StreamDelta("lo"), None, None, None]
    assert aggregator.finished
    turn = aggregator.result()
    assert (turn.content, turn.finish_reason, turn.reasoning) == ("Hello", "stop", None)
    assert turn.usage.input_tokens == 3 and turn.usage.output_tokens == 2
    assert turn.tool_calls == []
    assert turn.raw["choices"][0]["message"]["content"] == "Hello"
    assert aggregator.result() is turn


def test_tool_calls_merged_by_index_with_repeated_id_and_name():
    # llama.cpp repeats id and name in every delta; OpenAI sends them once.
    aggregator, deltas = run(
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "add", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "add", "arguments": '{"a"'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "mul", "arguments": '{"x":'}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "add", "arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": " 2}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "", "function": {"name": "",
                                                                 "arguments": ""}}]}),
        chunk({}, "tool_calls"),
        DONE,
    )
    assert not any(deltas)  # tool-call arguments are not visible text
    turn = aggregator.result()
    assert [(c.call_id, c.name, c.arguments_raw) for c in turn.tool_calls] == [
        ("call_a", "add", '{"a": 1}'), ("call_b", "mul", '{"x": 2}')]
    assert turn.content is None and turn.finish_reason == "tool_calls"


def test_tool_call_arguments_over_hundreds_of_deltas():
    arguments = json.dumps({"query": "lorem ipsum " * 100, "n": 3})
    events = [chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                     "function": {"name": "search", "arguments": ""}}]})]
    events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[i:i + 3]}}]})
               for i in range(0, len(arguments), 3)]
    aggregator, _ = run(*events, chunk({}, "tool_calls"), DONE)
    assert aggregator.result().tool_calls[0].arguments_raw == arguments


def test_tool_calls_out_of_order_indexes_are_sorted():
    aggregator, _ = run(
        chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "y"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "x"}}]}),
        chunk({}, "tool_calls"), DONE,
    )
    assert [c.call_id for c in aggregator.result().tool_calls] == ["a", "b"]


def test_tool_calls_without_index_are_matched_by_id():
    aggregator, _ = run(
        chunk({"tool_calls": [{"id": "a", "function": {"name": "x", "arguments": "{"}}]}),
        chunk({"tool_calls": [{"function": {"arguments": "}"}}]}),
        chunk({"tool_calls": [{"id": "b", "function": {"name": "y", "arguments": {"k": 1}}}]}),
        chunk({}, "tool_calls"), DONE,
    )
    assert [(c.call_id, c.name, c.arguments_raw) for c in aggregator.result().tool_calls] == [
        ("a", "x", "{}"), ("b", "y", '{"k": 1}')]


def test_usage_last_non_null_wins():
    aggregator, _ = run(
        chunk({"content": "a"}, usage={"prompt_tokens": 1, "completion_tokens": 1}),
        chunk({"content": "b"}, usage={"prompt_tokens": 1, "completion_tokens": 2}),
        SSEEvent(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                             "usage": None})),
        DONE,
    )
    assert aggregator.result().usage.output_tokens == 2
    aggregator, _ = run(
        chunk({"content": "a"}, usage={"prompt_tokens": 1, "completion_tokens": 1}),
        chunk({}, "stop"),
        chunk(choices=False, usage={"prompt_tokens": 9, "completion_tokens": 8,
                                    "prompt_tokens_details": {"cached_tokens": 5}}),
        DONE,
    )
    usage = aggregator.result().usage
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (9, 5, 8)


def test_usage_inside_the_final_choice_or_x_groq():
    aggregator, _ = run(
        SSEEvent(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                          "usage": {"completion_tokens": 4}}]})),
        DONE,
    )
    assert aggregator.result().usage.output_tokens == 4
    aggregator, _ = run(chunk({}, "stop", x_groq={"usage": {"completion_tokens": 6}}), DONE)
    assert aggregator.result().usage.output_tokens == 6


def test_no_usage_at_all():
    aggregator, _ = run(chunk({"content": "a"}), chunk({}, "stop"), DONE)
    assert aggregator.result().usage is None


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_deltas(field):
    aggregator, deltas = run(
        chunk({"role": "assistant", "content": None, field: ""}),
        chunk({field: "Let me "}), chunk({field: "think."}),
        chunk({"content": "Done."}), chunk({}, "stop"), DONE,
    )
    assert deltas[1:4] == [StreamDelta(reasoning="Let me "), StreamDelta(reasoning="think."),
                           StreamDelta("Done.")]
    turn = aggregator.result()
    assert (turn.content, turn.reasoning) == ("Done.", "Let me think.")
    assert turn.raw["choices"][0]["message"]["reasoning_content"] == "Let me think."


def test_think_tags_split_across_chunks():
    pieces = ["<thi", "nk>plan", "ning", "</th", "ink>\n\nThe an", "swer <th"]
    aggregator, deltas = run(*(chunk({"content": p}) for p in pieces), chunk({}, "stop"), DONE)
    visible = [d for d in deltas if d]
    assert "".join(d.reasoning for d in visible) == "planning"
    # after </think> everything is content: "<th" is not held back as a tag start
    assert "".join(d.content for d in visible) == "\n\nThe answer <th"
    turn = aggregator.result()
    assert turn.reasoning == "planning"
    assert turn.content == "The answer <th"  # the newlines after </think> dropped, as parse does


def test_think_tag_later_in_the_stream_is_content():
    pieces = ["wrap text in <th", "ink> and </th", "ink>. Done."]
    aggregator, deltas = run(*(chunk({"content": p}) for p in pieces), chunk({}, "stop"), DONE)
    assert [d.content for d in deltas if d] == pieces  # nothing held back
    turn = aggregator.result()
    assert (turn.content, turn.reasoning) == ("wrap text in <think> and </think>. Done.", None)


def test_leading_whitespace_then_think_tag_in_the_stream():
    pieces = ["\n", " <", "think>idea", "</think>\n\nAnswer <think>"]
    aggregator, deltas = run(*(chunk({"content": p}) for p in pieces), chunk({}, "stop"), DONE)
    # the whitespace and "<" are held until the tag is certain, then dropped
    assert [(d.content, d.reasoning) for d in deltas if d] == [
        ("", "idea"), ("\n\nAnswer <think>", "")]
    turn = aggregator.result()
    assert (turn.content, turn.reasoning) == ("Answer <think>", "idea")


def test_think_tag_unterminated_at_end_is_reasoning():
    aggregator, _ = run(chunk({"content": "<think>cut"}), chunk({"content": " off</thi"}),
                        chunk({}, "length"), DONE)
    turn = aggregator.result()
    assert (turn.content, turn.reasoning) == (None, "cut off</thi")


def test_angle_brackets_that_are_not_tags_are_content():
    aggregator, deltas = run(chunk({"content": "a < b"}), chunk({"content": " and c > d"}),
                             chunk({}, "stop"), DONE)
    assert aggregator.result().content == "a < b and c > d"
    assert all(d is None or d.reasoning == "" for d in deltas)


def test_reasoning_field_and_think_tags_together():
    aggregator, deltas = run(chunk({"reasoning_content": "a", "content": "<think>b</think>c"}),
                             chunk({}, "stop"), DONE)
    assert deltas[0] == StreamDelta("c", "ab")
    assert (aggregator.result().content, aggregator.result().reasoning) == ("c", "ab")


def test_content_parts_in_a_delta():
    aggregator, deltas = run(chunk({"content": [{"type": "text", "text": "hi"}]}),
                             chunk({}, "stop"), DONE)
    assert deltas[0] == StreamDelta("hi") and aggregator.result().content == "hi"


def test_mid_stream_error_object_raises_with_its_message():
    aggregator = OpenAIAggregator()
    aggregator.feed(chunk({"content": "partial"}))
    with pytest.raises(ProviderResponseError, match="Rate limit reached"):
        aggregator.feed(SSEEvent(json.dumps(
            {"error": {"message": "Rate limit reached", "type": "rate_limit_error"}})))
    with pytest.raises(ProviderResponseError, match="overloaded"):
        OpenAIAggregator().feed(SSEEvent('{"error": "overloaded"}'))


def test_error_event_raises():
    with pytest.raises(ProviderResponseError, match="upstream died"):
        OpenAIAggregator().feed(SSEEvent('{"message": "upstream died"}', event="error"))


def test_malformed_chunk_raises_naming_the_text():
    with pytest.raises(ProviderResponseError, match=r"not JSON: '\{\"choices\": \[oops'"):
        OpenAIAggregator().feed(SSEEvent('{"choices": [oops'))
    with pytest.raises(ProviderResponseError, match="not JSON: 'Internal Server Error'"):
        OpenAIAggregator().feed(SSEEvent("Internal Server Error"))
    with pytest.raises(ProviderResponseError, match="not JSON"):
        OpenAIAggregator().feed(SSEEvent('{"a": 1} trailing'))
    long = "{" + "x" * 5000
    with pytest.raises(ProviderResponseError) as caught:
        OpenAIAggregator().feed(SSEEvent(long))
    assert len(str(caught.value)) < 300 and "..." in str(caught.value)


def test_json_that_is_not_an_object_or_has_the_wrong_shape_raises():
    with pytest.raises(ProviderResponseError, match="not a JSON object"):
        OpenAIAggregator().feed(SSEEvent("[1, 2]"))
    with pytest.raises(ProviderResponseError, match="unexpected shape"):
        OpenAIAggregator().feed(SSEEvent('{"choices": ["x"]}'))
    with pytest.raises(ProviderResponseError, match="unexpected shape"):
        OpenAIAggregator().feed(SSEEvent('{"choices": [{"delta": {"tool_calls": [1]}}]}'))


def test_unknown_finish_reason_raises():
    with pytest.raises(ProviderAnswerError, match="unknown finish_reason 'exploded'"):
        OpenAIAggregator().feed(chunk({}, "exploded"))


def test_missing_terminator_without_finish_reason_raises():
    aggregator, _ = run(chunk({"content": "Hel"}), chunk({"content": "lo"}))
    assert not aggregator.finished
    with pytest.raises(ProviderResponseError, match=r"stream ended without \[DONE\]"):
        aggregator.result()


def test_missing_terminator_after_finish_reason_is_accepted():
    aggregator, _ = run(chunk({"content": "Hi"}), chunk({}, "stop"))
    assert not aggregator.finished
    assert aggregator.result().content == "Hi"


def test_events_after_done_and_keepalives_are_ignored():
    aggregator, deltas = run(SSEEvent(""), chunk({"content": "a"}), chunk({}, "stop"),
                             SSEEvent(" [DONE] "), chunk({"content": "late"}))
    assert deltas == [None, StreamDelta("a"), None, None, None]
    assert aggregator.result().content == "a"


def test_chunk_with_leading_whitespace_is_accepted():
    aggregator, deltas = run(SSEEvent('  {"choices": [{"delta": {"content": "a"}}]}'),
                             chunk({}, "stop"), DONE)
    assert deltas[0] == StreamDelta("a") and aggregator.result().content == "a"


def test_other_choices_are_ignored():
    aggregator, _ = run(
        SSEEvent(json.dumps({"choices": [{"index": 1, "delta": {"content": "B"}}]})),
        SSEEvent(json.dumps({"choices": [{"index": 1, "delta": {"content": "X"}},
                                         {"index": 0, "delta": {"content": "A"}}]})),
        chunk({}, "stop"), DONE,
    )
    assert aggregator.result().content == "A"


def test_whole_stream_through_the_parser_in_odd_pieces():
    events = [chunk({"role": "assistant", "content": ""}), chunk({"content": "<think>é"}),
              chunk({"content": "🚀</think>ok"}),
              chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f",
                                                                         "arguments": "{}"}}]}),
              chunk({}, "tool_calls"), chunk(choices=False, usage={"completion_tokens": 3}),
              DONE]
    stream = "".join(f"data: {e.data}\r\n\r\n" for e in events).encode()
    parser, aggregator = SSEParser(), OpenAIAggregator()
    for i in range(0, len(stream), 5):
        for event in parser.feed(stream[i:i + 5]):
            aggregator.feed(event)
    for event in parser.close():
        aggregator.feed(event)
    turn = aggregator.result()
    assert (turn.content, turn.reasoning, turn.usage.output_tokens) == ("ok", "é🚀", 3)
    assert turn.tool_calls[0].arguments_raw == "{}"
