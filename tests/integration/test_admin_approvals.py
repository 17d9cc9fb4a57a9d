"""The admin's approvals: the "Waiting for approval" page, decisions on the loop
page (approve, edit and approve, deny, supply a result), bulk decisions over a
filtered set after a confirmation, the dashboard's counts, and the live
stream of a waiting loop. Flask's test client, real PostgreSQL, the drain."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, ToolCall

from ..support.support_app import ShopAgent, solidloop

SAME = {"Sec-Fetch-Site": "same-origin"}


@pytest.fixture
def client(app):
    app.register_blueprint(solidloop.admin_blueprint(
        authorize=lambda request: True,
        operator=lambda request: request.headers.get("X-Staff")), url_prefix="/admin")
    return app.test_client()


def waiting_loop(llm, drain, message, *calls):
    llm.script(message, {"content": "Waiting on you.", "tool_calls": [
        {"name": name, "arguments": arguments} for name, arguments in calls]})
    loop = ShopAgent.start(message=message)
    drain()
    return loop


def call_of(session, loop_id, name):
    session.expire_all()
    return session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id,
                                                  ToolCall.name == name)).one()


def test_the_approvals_page_lists_and_filters_waiting_calls(session, client, llm, drain):
    a = waiting_loop(llm, drain, "refund 90", ("refund", {"order": "1", "amount": 90}))
    b = waiting_loop(llm, drain, "email bob", ("send_email", {"to": "bob", "body": "<b>hi</b>"}))
    c = waiting_loop(llm, drain, "ask", ("ask_human", {"question": "ok?"}))
    page = client.get("/admin/approvals").get_data(as_text=True)
    assert 'href="/admin/approvals"' in page  # in the navigation
    rows = re.findall(r'<tr data-call="(\d+)">', page)
    assert rows == [str(call_of(session, a.id, "refund").id),
                    str(call_of(session, b.id, "send_email").id)]
    assert "&lt;b&gt;hi&lt;/b&gt;" in page and "<b>hi</b>" not in page
    only = client.get("/admin/approvals?tool=send_email").get_data(as_text=True)
    assert re.findall(r'<tr data-call="(\d+)">', only) == [str(call_of(session, b.id,
                                                                       "send_email").id)]
    results = client.get("/admin/approvals?waits=result").get_data(as_text=True)
    assert re.findall(r'<tr data-call="(\d+)">', results) == [str(call_of(session, c.id,
                                                                          "ask_human").id)]
    assert 'id="bulk-approvals"' not in results  # bulk decisions are for approvals
    assert client.get("/admin/approvals?agent=assistant").get_data(as_text=True).count(
        'id="none-waiting"') == 1
    bad = client.get("/admin/approvals?waits=maybe")
    assert bad.status_code == 400 and b"use approval, result or any" in bad.data
    dashboard = client.get("/admin/").get_data(as_text=True)
    assert re.search(r'id="awaiting-approval">2<', dashboard)
    assert re.search(r'id="awaiting-result">1<', dashboard)


def test_decisions_on_the_loop_page_record_the_operator(session, client, llm, drain):
    loop = waiting_loop(llm, drain, "refund and email",
                        ("refund", {"order": "2", "amount": 80}),
                        ("send_email", {"to": "x", "body": "y"}))
    refund, email = call_of(session, loop.id, "refund"), call_of(session, loop.id, "send_email")
    llm.script(lambda body: sum(m["role"] == "tool" for m in body["messages"]) == 2,
               {"content": "Done."})
    page = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert 'class="status status-waiting"' in page
    assert 'sse-connect="/admin/loops/' in page  # a waiting loop's page listens live
    assert f'data-decide="{refund.id}"' in page and "Edit and approve" in page
    bad = client.post(f"/admin/calls/{refund.id}/approve", headers=SAME,
                      data={"loop_id": loop.id, "next": "loop", "arguments": "[1]"})
    assert bad.status_code == 400 and b"must be a JSON object" in bad.data
    approved = client.post(f"/admin/calls/{refund.id}/approve",
                           headers={**SAME, "X-Staff": "olga"},
                           data={"loop_id": loop.id, "next": "loop",
                                 "arguments": '{"order": "2", "amount": 50}'})
    assert approved.status_code == 303
    shown = client.get(approved.headers["Location"]).get_data(as_text=True)
    assert f'id="decided" data-call="{refund.id}"' in shown and "approved" in shown
    empty = client.post(f"/admin/calls/{email.id}/deny", headers=SAME,
                        data={"loop_id": loop.id, "next": "loop", "reason": " "})
    assert "not+decided" in empty.headers["Location"] or "not%20decided" in \
        empty.headers["Location"]
    client.post(f"/admin/calls/{email.id}/deny", headers=SAME,
                data={"loop_id": loop.id, "next": "loop", "reason": "not today"})
    refund, email = call_of(session, loop.id, "refund"), call_of(session, loop.id, "send_email")
    assert (refund.decision, refund.decided_by, refund.arguments["amount"]) == (
        "approved", "olga", 50)
    assert (email.decision, email.decided_by, email.decision_reason) == (
        "denied", "admin", "not today")
    again = client.post(f"/admin/calls/{email.id}/approve", headers=SAME,
                        data={"loop_id": loop.id, "next": "loop"})
    assert "was+denied+by+admin" in again.headers["Location"]
    assert client.post(f"/admin/calls/{email.id}/shrug", headers=SAME,
                       data={}).status_code == 404
    # Cross-site posts are refused like every other admin action.
    other = waiting_loop(llm, drain, "email eve", ("send_email", {"to": "eve", "body": "z"}))
    forged = client.post(f"/admin/calls/{call_of(session, other.id, 'send_email').id}/approve",
                         headers={"Sec-Fetch-Site": "cross-site"}, data={"loop_id": other.id})
    assert forged.status_code == 403
    assert call_of(session, other.id, "send_email").decision is None
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    page = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert "the model asked for" in page and "not today" in page


def test_supplying_a_deferred_result_from_the_admin(session, client, llm, drain):
    loop = waiting_loop(llm, drain, "ask it", ("ask_human", {"question": "color?"}))
    ask = call_of(session, loop.id, "ask_human")
    llm.script("blue", {"content": "Blue it is."})
    client.post(f"/admin/calls/{ask.id}/complete", headers=SAME,
                data={"loop_id": loop.id, "next": "loop", "result": "blue"})
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert call_of(session, loop.id, "ask_human").decision == "completed"


def test_bulk_deny_acts_on_the_filtered_set_after_a_confirmation(session, client, llm, drain):
    emails = [waiting_loop(llm, drain, f"email {n}", ("send_email", {"to": f"u{n}",
                                                                      "body": "b"}))
              for n in range(5)]
    refund = waiting_loop(llm, drain, "refund 70", ("refund", {"order": "3", "amount": 70}))
    form = {"action": "deny", "tool": "send_email", "waits": "approval"}
    no_reason = client.post("/admin/approvals/bulk", headers=SAME, data=form)
    assert no_reason.status_code == 400 and b"give a reason" in no_reason.data
    confirm = client.post("/admin/approvals/bulk", headers=SAME,
                          data={**form, "reason": "bulk no"}).get_data(as_text=True)
    assert 'data-count="5"' in confirm and "bulk no" in confirm
    max_id = re.search(r'name="max_id" value="(\d+)"', confirm).group(1)
    # A call that begins to wait after the confirmation is left alone.
    late = waiting_loop(llm, drain, "email late", ("send_email", {"to": "late", "body": "b"}))
    done = client.post("/admin/approvals/bulk", headers=SAME,
                       data={**form, "reason": "bulk no", "confirm": "1", "max_id": max_id})
    page = done.get_data(as_text=True)
    assert 'data-decided="5"' in page and 'data-skipped="0"' in page
    for loop in emails:
        call = call_of(session, loop.id, "send_email")
        assert (call.decision, call.decision_reason) == ("denied", "bulk no")
    assert call_of(session, refund.id, "refund").decision is None
    assert call_of(session, late.id, "send_email").decision is None
    unfiltered = client.post("/admin/approvals/bulk", headers=SAME,
                             data={"action": "approve"}).get_data(as_text=True)
    assert "No filter is set" in unfiltered and 'data-count="2"' in unfiltered


def test_a_decision_wakes_a_waiting_loops_stream(app, session, client, llm, drain):
    from flask_solidloop import streaming

    loop = waiting_loop(llm, drain, "email w", ("send_email", {"to": "w", "body": "b"}))
    email = call_of(session, loop.id, "send_email")
    state = app.extensions["solidloop"]
    hub = streaming.hub_for(state)
    hub.watch(loop.id)
    try:
        assert hub.connected.wait(10)
        seen = hub.version(loop.id)
        ShopAgent(loop).approve(email.id, by="stream test")
        # The decision's commit notifies: the stream wakes before any heartbeat.
        assert hub.wait(loop.id, seen, timeout=5.0) != seen
    finally:
        hub.unwatch(loop.id)
