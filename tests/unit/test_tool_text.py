"""llm/tool_text.py: tool calls written as text, parsed and rendered. Pure functions."""

from __future__ import annotations

import json

import pytest

from flask_solidloop.llm import tool_text
from flask_solidloop.llm.types import ChatMessage, ToolCallRequest

TOOLS = {"add", "echo"}


def calls(parsed):
    return [(c.name, json.loads(c.arguments_raw) if c.error is None else None)
            for c in parsed.calls]


def test_hermes_blocks_several_per_answer_removed_from_the_text():
    text = ('Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>')
    parsed = tool_text.parse_tool_calls(text, TOOLS)
    assert parsed.content == "Checking." and parsed.format == "hermes"
    assert calls(parsed) == [("add", {"a": 1}), ("echo", {"text": "x"})]


def test_an_unclosed_last_block_and_string_arguments_and_a_fence_inside_the_tags():
    parsed = tool_text.parse_tool_calls(
        '<tool_call>\n```json\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n```\n</tool_call>'
        '<tool_call>{"name": "echo", "arguments": {}}')
    assert calls(parsed) == [("add", {"a": 3}), ("echo", {})] and parsed.content is None


def test_fenced_json_is_a_call_only_when_it_names_a_tool():
    call = tool_text.parse_tool_calls(
        'Sure:\n```json\n{"name": "add", "arguments": {"a": 1}}\n```', TOOLS)
    assert call.format == "fenced" and call.content == "Sure:"
    example = 'Example:\n```json\n{"name": "weather", "arguments": {}}\n```'
    assert tool_text.parse_tool_calls(example, TOOLS).calls == []
    assert tool_text.parse_tool_calls(example, TOOLS).content == example


@pytest.mark.parametrize("text", [
    '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
    '{"name": "echo", "parameters": {"text": "a;b"}}<|eom_id|>',
    '<function=add>{"a": 1}</function><function=echo>{"text": "a;b"}</function>',
])
def test_llama_forms(text):
    parsed = tool_text.parse_tool_calls(text, TOOLS)
    assert parsed.format == "llama" and parsed.content is None
    assert calls(parsed) == [("add", {"a": 1}), ("echo", {"text": "a;b"})]


def test_a_bare_json_answer_is_a_call_only_when_it_names_a_tool():
    assert calls(tool_text.parse_tool_calls('{"name": "add", "parameters": {"a": 1}}', TOOLS)) \
        == [("add", {"a": 1})]
    assert tool_text.parse_tool_calls('{"name": "x", "parameters": {}}', TOOLS).calls == []


def test_malformed_calls_keep_their_name_and_raw_text():
    bad = tool_text.parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}'
                                     '</tool_call>').calls[0]
    assert bad.name == "add" and "not valid JSON" in bad.error
    assert bad.arguments_raw == '{"name": "add", "arguments": {"a": 1,}}'
    nameless = tool_text.parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').calls[0]
    assert nameless.name == "" and "no \"name\"" in nameless.error
    listed = tool_text.parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}'
                                        '</tool_call>').calls[0]
    assert listed.arguments_raw == "[1]" and listed.error


def test_text_without_calls_is_untouched():
    for text in ("plain", "a < b and <b>bold</b>", "", None):
        assert tool_text.parse_tool_calls(text, TOOLS).content == text


def test_ids_are_stable_and_fit_every_dialect():
    first = tool_text.call_id("7:12", 0)
    assert first == tool_text.call_id("7:12", 0) != tool_text.call_id("7:12", 1)
    assert first.startswith("call_") and first.replace("_", "").isalnum()


def test_no_prefix_of_a_streamed_answer_shows_markup():
    answer = ('Let me see <b>. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
              '</tool_call> and <|python_tag|>{"name": "echo"}')
    for end in range(len(answer) + 1):
        shown = tool_text.visible_text(answer[:end])
        assert "<tool" not in shown and "<|" not in shown and "{" not in shown, shown
        for opener in ("<tool_call>", "<|python_tag|>", "<function="):
            assert not any(shown.endswith(opener[:n]) for n in range(1, len(opener)))
    assert tool_text.visible_text(answer).startswith("Let me see <b>. ")


def test_tool_prompting_renders_the_tools_into_the_system_prompt():
    tools = [{"name": "add", "description": "Add.", "inputSchema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}]
    history = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    out, sent = tool_text.prepare_request(history, tools, prompting="xml",
                                          result_format="user_xml")
    assert sent == [] and out[0].content.startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in out[0].content and "<tool_call>" in out[0].content
    assert history[0].content == "Be brief."  # the loop's own history is left alone
    untouched, native = tool_text.prepare_request(history, tools, prompting=None,
                                                  result_format="tool")
    assert untouched == history and native == tools


def test_results_as_tool_response_blocks_in_one_user_message():
    history = [
        ChatMessage("user", "go"),
        ChatMessage("assistant", "Working.", tool_calls=[
            ToolCallRequest("c1", "add", '{"a": 1}'), ToolCallRequest("c2", "echo", "{}")]),
        ChatMessage("tool", "1", tool_call_id="c1", name="add"),
        ChatMessage("tool", "ok", tool_call_id="c2", name="echo"),
    ]
    out, _ = tool_text.prepare_request(history, [], prompting=None, result_format="user_xml")
    assert [m.role for m in out] == ["user", "assistant", "user"]
    assert out[1].tool_calls == [] and out[1].content.count("<tool_call>") == 2
    assert out[2].content.count("<tool_response>") == 2 and out[2].meta == {}
    assert json.loads(out[2].content.split("\n")[1]) == {"name": "add", "content": "1"}


def test_result_format_defaults():
    assert tool_text.result_format(None, "xml") == "user_xml"
    assert tool_text.result_format(None, None) == "tool"
    assert tool_text.result_format("tool", "xml") == "tool"
