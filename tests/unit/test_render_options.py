"""RenderOptions: one value shapes a request in every dialect. Pure, no I/O."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from flask_solidloop.llm.dialect import Dialect, RenderOptions
from flask_solidloop.llm.registry import get_dialect
from flask_solidloop.llm.types import DIALECTS, ChatMessage, ProviderSettings, ToolCallRequest

TOOLS = [{"name": "add", "description": "Add", "inputSchema": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}, {"name": "now"}]
OPTIONS = RenderOptions(stream=True, llm_params={"temperature": 0.5}, reasoning_effort="low",
                        max_tokens=64, reasoning_strategies=["xml"])


def history() -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="add 2"),
        ChatMessage(role="assistant", content="Calling.", reasoning="I add.",
                    tool_calls=[ToolCallRequest("c1", "add", '{"a": 2}')]),
        ChatMessage(role="tool", content="2", tool_call_id="c1"),
    ]


def settings(name: str) -> ProviderSettings:
    return ProviderSettings(dialect=name, base_url="http://llm.test", model="m")


def test_defaults_are_the_former_keyword_defaults():
    assert RenderOptions() == RenderOptions(stream=False, llm_params=None, reasoning_effort=None,
                                            max_tokens=None, reasoning_strategies=None)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RenderOptions().stream = True  # type: ignore[misc]


@pytest.mark.parametrize("name", DIALECTS)
def test_every_dialect_takes_the_same_signature(name):
    expected = inspect.signature(Dialect.render)
    assert inspect.signature(type(get_dialect(name)).render) == expected


@pytest.mark.parametrize("name", DIALECTS)
def test_options_shape_the_request(name):
    dialect = get_dialect(name)
    plain = dialect.render(settings(name), history(), TOOLS)
    assert plain == dialect.render(settings(name), history(), TOOLS, RenderOptions())
    shaped = dialect.render(settings(name), history(), TOOLS, OPTIONS)
    assert shaped != plain
    assert "temperature" in str(shaped.payload)  # llm_params, merged last


@pytest.mark.parametrize("name", DIALECTS)
def test_an_unknown_keyword_is_a_type_error(name):
    with pytest.raises(TypeError, match="streaming"):
        get_dialect(name).render(settings(name), history(), TOOLS, streaming=True)  # type: ignore[call-arg]
