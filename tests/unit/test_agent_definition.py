"""The decorator-based agent API: options checked when an Agent class is defined."""

from __future__ import annotations

import pytest

from flask_solidloop import Agent, AgentDefinitionError


def test_unknown_option_is_an_error_with_a_suggestion():
    with pytest.raises(AgentDefinitionError, match=r"'streming'.*did you mean 'streaming'"):
        class Typo(Agent):
            streming = True


def test_helper_methods_are_allowed():
    class WithHelper(Agent):
        def summarize(self) -> str:
            return "ok"

    assert WithHelper().summarize() == "ok"


LLM = {"base_url": "http://127.0.0.1:9", "model": "m"}


@pytest.mark.parametrize(("option", "value", "named"), [
    ("tool_prompting", "json", r"tool_prompting must be None .* or 'xml'"),
    ("tool_result_format", "user", r"tool_result_format must be None, 'tool' .* 'user_xml'"),
])
def test_text_tool_options_are_validated(option, value, named):
    agent = type("TextTools", (Agent,), {"llm": LLM, option: value})
    agent.agent_name = "text_tools"
    with pytest.raises(AgentDefinitionError, match=named):
        agent().validate()
    good = type("TextToolsOk", (Agent,), {"llm": LLM, "tool_prompting": "xml",
                                          "tool_result_format": "tool"})
    good().validate()
