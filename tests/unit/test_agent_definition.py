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
