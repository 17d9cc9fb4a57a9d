"""Structured output's pure parts: an output_type's schema checked, each
dialect's request, an answer lifted out of the output tool, and its check."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, field_validator

from flask_solidloop.errors import AgentDefinitionError
from flask_solidloop.llm import anthropic, gemini, openai, output
from flask_solidloop.llm.dialect import RenderOptions
from flask_solidloop.llm.types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest


class Item(BaseModel):
    sku: str
    qty: int = 1


class Order(BaseModel):
    items: list[Item]
    note: str | None = None

    @field_validator("items")
    @classmethod
    def not_empty(cls, value: list[Item]) -> list[Item]:
        if not value:
            raise ValueError("an order needs at least one item")
        return value


SCHEMA = Order.model_json_schema()
HISTORY = [ChatMessage(role="user", content="order two apples")]
TOOL = {"name": "lookup", "description": "", "inputSchema": {
    "type": "object", "properties": {"q": {"type": "string"}}}}


def settings(dialect: str) -> ProviderSettings:
    return ProviderSettings.from_dict({"dialect": dialect, "base_url": "http://x",
                                       "model": "m"}, agent="a")


@pytest.mark.parametrize(("value", "named"), [
    (42, "must be a pydantic model class or a JSON Schema dict"),
    ({"type": "array", "items": {}}, "must describe an object"),
    ({"type": "object", "properties": {"a": {"type": "nope"}}}, "not a valid JSON Schema"),
])
def test_a_bad_output_type_is_refused_naming_the_fix(value, named):
    with pytest.raises(AgentDefinitionError, match=named):
        output.schema_of(value, agent="a")


def test_openai_sends_a_strict_schema_when_it_can_and_a_loose_one_otherwise():
    body = openai.OpenAIDialect().render(settings("openai"), HISTORY, [],
                                         RenderOptions(output_schema=SCHEMA)).payload
    spec = body["response_format"]["json_schema"]
    assert spec["strict"] is True and spec["name"] == "final_answer"
    item = spec["schema"]["$defs"]["Item"]
    assert item["required"] == ["sku", "qty"] and "default" not in item["properties"]["qty"]
    assert SCHEMA["$defs"]["Item"]["required"] == ["sku"]  # the loop's copy is untouched
    open_ended = {"type": "object", "properties": {"tags": {
        "type": "object", "additionalProperties": {"type": "string"}}}}
    spec = openai.response_format(open_ended)["json_schema"]
    assert spec["strict"] is False and spec["schema"] == open_ended


def test_anthropic_forces_the_tool_unless_thinking_or_other_tools():
    dialect = anthropic.AnthropicDialect()
    alone = dialect.render(settings("anthropic"), HISTORY, [],
                           RenderOptions(output_schema=SCHEMA)).payload
    assert alone["tool_choice"] == {"type": "tool", "name": "final_answer"}
    assert alone["tools"][0]["input_schema"] == SCHEMA
    with_tools = dialect.render(settings("anthropic"), HISTORY, [TOOL],
                                RenderOptions(output_schema=SCHEMA)).payload
    assert with_tools["tool_choice"] == {"type": "any"}
    assert [t["name"] for t in with_tools["tools"]] == ["lookup", "final_answer"]
    thinking = dialect.render(settings("anthropic"), HISTORY, [],
                              RenderOptions(output_schema=SCHEMA, reasoning_effort="low")).payload
    assert thinking["tool_choice"] == {"type": "auto"} and "thinking" in thinking


def test_gemini_uses_response_schema_alone_and_a_function_beside_tools():
    alone = gemini.render_request(settings("gemini"), HISTORY, [],
                                  RenderOptions(output_schema=SCHEMA, max_tokens=100)).payload
    config = alone["generationConfig"]
    assert config["maxOutputTokens"] == 100 and config["responseMimeType"] == "application/json"
    assert config["responseSchema"]["properties"]["items"]["items"]["properties"]["sku"] \
        == {"type": "string"}
    beside = gemini.render_request(settings("gemini"), HISTORY, [TOOL],
                                   RenderOptions(output_schema=SCHEMA)).payload
    assert "generationConfig" not in beside
    assert beside["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    assert beside["tools"][0]["functionDeclarations"][-1]["name"] == "final_answer"


def test_an_answer_through_the_output_tool_becomes_the_text():
    turn = AssistantTurn(content="thinking aloud", tool_calls=[
        ToolCallRequest("c1", "lookup", "{}"),
        ToolCallRequest("c2", "final_answer", '{"items": [{"sku": "A"}]}')],
        finish_reason="tool_calls")
    lifted, call = output.lift_answer(turn)
    assert (lifted.content, lifted.tool_calls, lifted.finish_reason) == (
        '{"items": [{"sku": "A"}]}', [], "stop")
    assert call == {"call_id": "c2", "dropped_calls": ["lookup"]}
    plain = AssistantTurn(content="{}", tool_calls=[], finish_reason="stop")
    assert output.lift_answer(plain) == (plain, None)


def test_the_check_names_where_and_what():
    assert output.check('{"items": [{"sku": "A", "qty": 2}]}', SCHEMA).value \
        == {"items": [{"sku": "A", "qty": 2}]}
    assert output.check('```json\n{"items": [{"sku": "A"}]}\n```', SCHEMA).valid
    bad = output.check('{"items": [{"qty": "x"}]}', SCHEMA)
    assert bad.error == ("at 'items.0': 'sku' is a required property; "
                         "at 'items.0.qty': 'x' is not of type 'integer'")
    assert "is not JSON" in output.check("sure, here it is", SCHEMA).error
    # The model class's own validators count, after the schema.
    assert output.check('{"items": []}', SCHEMA).valid
    assert "an order needs at least one item" in output.check('{"items": []}', SCHEMA,
                                                              Order).error
    assert isinstance(output.instance(Order, {"items": [{"sku": "A"}]}), Order)
    assert output.instance(SCHEMA, {"x": 1}) == {"x": 1}
