"""The worked example of docs/guides/conversations.md's "Child agents" section,
run as written: its code block becomes a module, its app runs on the test
database and the LLM emulator, and what the step-by-step says happens is
checked."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, ToolCall
from flask_solidloop.testing import drain

GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "conversations.md"


def worked_example() -> str:
    """The first Python block under the section's worked-example heading."""
    section = GUIDE.read_text().split("## Child agents", 1)[1]
    section = section.split("### A worked example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def guide(tmp_path, monkeypatch, database_url, llm):
    llm.reset()  # the emulator is the session's: no earlier test's scripts or requests
    (tmp_path / "guide_fruit.py").write_text(worked_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LLM_BASE_URL", llm.base_url)
    monkeypatch.setenv("LLM_MODEL", "test-model")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-guide")
    module = importlib.import_module("guide_fruit")
    app = module.create_app({"SQLALCHEMY_DATABASE_URI": database_url})
    with app.app_context():
        yield module, app
        module.db.session.remove()
        for engine in module.db.engines.values():
            engine.dispose()
    app.extensions["solidloop"].stop_renewer()
    app.extensions["solidloop"].broker.close()
    sys.modules.pop("guide_fruit", None)


def test_the_guides_lead_and_researchers_run_as_written(guide, llm):
    module, app = guide
    llm.script("Compare apples and pears", {"content": "Delegating.", "tool_calls": [
        {"name": "research", "arguments": {"message": "research apples for a fruit stand"}},
        {"name": "research", "arguments": {"message": "research pears for a fruit stand"}}]})
    llm.script("research apples", {"content": "Apples keep for weeks."})
    llm.script("research pears", {"content": "Pears bruise easily."})
    llm.script(lambda body: any(m["role"] == "tool" for m in body["messages"]),
               {"content": "Stock apples; handle pears with care."})
    # The tool the model is offered: the entry's name, the class's docstring.
    loop = module.Lead.start(message="Compare apples and pears for a fruit stand")
    drain(app, max_jobs=1, queues=("solidloop_llm",))
    session = module.db.session
    session.expire_all()
    tools = llm.requests[0].json["tools"]
    assert [(t["function"]["name"], t["function"]["description"]) for t in tools] == [
        ("research", "Research one topic and report the findings in a paragraph.")]
    # Step 1: both calls wait, two researcher loops exist with their jobs.
    assert session.get(Loop, loop.id).status == "waiting"
    children = list(session.scalars(select(Loop).where(Loop.parent_loop_id == loop.id)
                                    .order_by(Loop.id)))
    assert [(c.agent_name, c.depth, c.status) for c in children] == [
        ("researcher", 1, "queued"), ("researcher", 1, "queued")]
    # status shows the tree as the guide prints it.
    shown = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop.id)])
    assert f"  children: {children[0].id} (researcher, queued), {children[1].id} " \
           "(researcher, queued)" in shown.output
    # Steps 2 to 4.
    drain(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert module.Lead(loop).result() == "Stock apples; handle pears with care."
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)
                                 .order_by(ToolCall.position)))
    assert [c.result["content"][0]["text"] for c in calls] == [
        "Apples keep for weeks.", "Pears bruise easily."]
    shown = app.test_cli_runner().invoke(args=["solidloop", "status", str(children[0].id)])
    assert f"  parent: loop {loop.id} (lead), tool call {calls[0].id}, depth 1" in shown.output
