"""Issue 11, defect 10: the demo says why it exits 1 when the model called no tool,
and names the usual fix when the prompt tokens show the tools were dropped."""

from __future__ import annotations

from types import SimpleNamespace

from flask_solidloop import demo


class FakeSession:
    def __init__(self, event):
        self.event = event

    def scalars(self, _query):
        return SimpleNamespace(first=lambda: self.event)


def explain(monkeypatch, *, prompt_tokens, tools=3):
    body = {"tools": [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "x" * 200, "parameters": {}}} for i in range(tools)]}
    event = SimpleNamespace(payload={"request": {"body": body}})
    usage = None if prompt_tokens is None else {"input_tokens": prompt_tokens}
    message = SimpleNamespace(role="assistant", usage=usage)
    monkeypatch.setattr(demo.queries, "messages", lambda session, loop_id: [message])
    return demo.explain_no_tool_call(FakeSession(event), 1)


def test_dropped_tools_are_named_with_the_fix(monkeypatch):
    text = explain(monkeypatch, prompt_tokens=40)
    assert text.startswith("exit code 1:")
    assert "dropped the tools" in text and "--chat_format chatml-function-calling" in text


def test_tools_that_fit_get_the_generic_hint(monkeypatch):
    text = explain(monkeypatch, prompt_tokens=5000)
    assert "exit code 1:" in text and "dropped" not in text and "tool_choice" in text


def test_unknown_usage_says_it_cannot_tell(monkeypatch):
    assert "cannot be told" in explain(monkeypatch, prompt_tokens=None)
