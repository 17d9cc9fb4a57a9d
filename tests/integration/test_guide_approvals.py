"""The worked example of docs/guides/approvals.md, run as written: its code block
becomes a module, its app runs on the test database and the LLM emulator, and
what the guide's step-by-step says happens is checked."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, text

from flask_solidloop.config import QUEUES
from flask_solidloop.models import Loop, ToolCall
from flask_solidloop.testing import drain

GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "approvals.md"


def worked_example() -> str:
    """The first Python block under the guide's worked-example heading."""
    section = GUIDE.read_text().split("## A worked example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def guide(tmp_path, monkeypatch, database_url, llm):
    (tmp_path / "guide_refunds.py").write_text(worked_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LLM_BASE_URL", llm.base_url)
    monkeypatch.setenv("LLM_MODEL", "test-model")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-guide")
    module = importlib.import_module("guide_refunds")
    app = module.create_app({"SQLALCHEMY_DATABASE_URI": database_url})
    with app.app_context():
        module.RefundAudit.__table__.create(module.db.engine, checkfirst=True)
        yield module, app
        module.db.session.remove()
        module.RefundAudit.__table__.drop(module.db.engine)
        for engine in module.db.engines.values():
            engine.dispose()
    app.extensions["solidloop"].stop_renewer()
    app.extensions["solidloop"].broker.close()
    sys.modules.pop("guide_refunds", None)


def test_the_guides_refund_example_runs_as_written(guide, llm):
    module, app = guide
    session = module.db.session
    client = app.test_client()
    llm.script("refund 120", {"content": "Let me refund that.", "tool_calls": [
        {"name": "refund", "arguments": {"order_id": "A1", "amount": 120}}]})
    llm.script("refund 20", {"content": "Small one.", "tool_calls": [
        {"name": "refund", "arguments": {"order_id": "B2", "amount": 20}}]})
    llm.script("refund 300", {"content": "Big one.", "tool_calls": [
        {"name": "refund", "arguments": {"order_id": "C3", "amount": 300}}]})
    llm.script("refunded 90.00 EUR on order A1", {"content": "Refunded 90 EUR."})
    llm.script("refunded 20.00 EUR on order B2", {"content": "Refunded 20 EUR."})
    llm.script("the manager", {"content": "Sorry, I cannot refund that."})

    big = client.post("/support", data={"message": "refund 120 on A1 please"}).json["loop"]
    small = client.post("/support", data={"message": "refund 20 on B2 please"}).json["loop"]
    huge = client.post("/support", data={"message": "refund 300 on C3 please"}).json["loop"]
    # solidloop's queues only: the host's notification jobs are drained last, below.
    drain(app, queues=QUEUES)
    # Step 1: the small refund ran on its own; the others wait, with their
    # notification jobs committed beside them.
    assert session.get(Loop, small).status == "completed"
    assert [r[:2] for r in module.REFUNDS] == [("B2", 20.0)]
    assert {session.get(Loop, big).status, session.get(Loop, huge).status} == {"waiting"}
    notifications = session.execute(text(
        "SELECT count(*) FROM solidloop_jobs WHERE queue_name = 'notifications'")).scalar()
    assert notifications == 2
    session.rollback()

    # Step 2: staff see them, and decide.
    assert client.get("/staff/refunds").status_code == 403
    listed = client.get("/staff/refunds", headers={"X-Staff": "alice"}).json["waiting"]
    assert [(w["loop"], w["arguments"]["amount"]) for w in listed] == [(big, 120), (huge, 300)]
    big_call, huge_call = (w["tool_call"] for w in listed)
    approved = client.post(f"/staff/refunds/{big_call}", headers={"X-Staff": "alice"},
                           data={"decision": "approve", "amount": "90"})
    assert approved.status_code == 200, approved.text
    denied = client.post(f"/staff/refunds/{huge_call}", headers={"X-Staff": "bob"},
                         data={"decision": "deny",
                               "reason": "refunds over 100 EUR go through the manager"})
    assert denied.status_code == 200, denied.text
    again = client.post(f"/staff/refunds/{huge_call}", headers={"X-Staff": "carol"},
                        data={"decision": "approve"})
    assert again.status_code == 409 and "was denied by bob at" in again.text
    audit = session.execute(text(
        "SELECT staff, decision FROM refund_audit ORDER BY id")).all()
    assert audit == [("alice", "approve"), ("bob", "deny")]  # not carol's: rolled back
    session.rollback()

    # Step 3: the approved refund runs with the edited amount; the model reads
    # the denial's reason.
    drain(app, queues=QUEUES)
    assert session.get(Loop, big).status == "completed"
    assert session.get(Loop, huge).status == "completed"
    assert [r[:2] for r in module.REFUNDS] == [("B2", 20.0), ("A1", 90.0)]
    call = session.get(ToolCall, big_call)
    assert call.requested_arguments == {"order_id": "A1", "amount": 120}
    last = llm.requests[-1].json["messages"][-1]
    assert "denied by bob" in last["content"] and "go through the manager" in last["content"]
    # The notifications are the host's jobs, run by its workers.
    assert drain(app, queues=("notifications",)) == 2
    assert session.scalars(select(ToolCall).where(ToolCall.decision.is_(None),
                                                  ToolCall.waits_for.is_not(None))).all() == []
