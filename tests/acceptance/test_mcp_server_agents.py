"""Agents and the MCP server blueprint: an agent of ours using it through its
``url=`` entry, and agents exposed as start/status tools to an outside client.

The blueprint runs under gunicorn; the loops run on this process's worker
(``drain``), the LLM is the emulator.
"""

from __future__ import annotations

import asyncio

import httpx2
import psycopg
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import select

from flask_solidloop.models import Event, Loop, Message, ToolCall
from flask_solidloop.urls import libpq_url

from ..support import mcp_server_app
from ..support.mcp_gunicorn import eventually
from ..support.mcp_server_app import REMOTE_URL_ENV, TICKET_ARGUMENTS, RemoteCalcAgent


def test_an_agent_of_ours_uses_the_blueprint_through_its_url_entry(
        app, session, llm, drain, mcp_gunicorn, monkeypatch, database_url):
    monkeypatch.setenv(REMOTE_URL_ENV, f"{mcp_gunicorn}/mcp/calc")
    llm.script("add remotely", {"content": "adding", "tool_calls": [
        {"name": "add", "arguments": {"a": 40, "b": 2}},
        {"name": "whoami", "arguments": {}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "it is 42"})
    loop = RemoteCalcAgent.start(message="add remotely")
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "completed", loop.error_message
    calls = {c.tool_name: c for c in session.scalars(
        select(ToolCall).where(ToolCall.loop_id == loop.id))}
    assert calls["add"].is_success and calls["add"].result["content"][0]["text"] == "42"
    me = calls["whoami"].result["structuredContent"]
    # The remote tool saw our agent as an outside principal, with the call's key.
    assert me["principal"] == "our-agent" and me["loop"] is False
    assert me["idempotency_key"] == calls["whoami"].idempotency_key
    # Our side: the tool_call events of the loop. Their side: the inbound events.
    ours = list(session.scalars(select(Event).where(Event.loop_id == loop.id,
                                                    Event.kind == "tool_call")))
    assert len(ours) == 2
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        theirs = eventually(lambda: conn.execute(
            "SELECT payload->>'tool', payload->'request'->'headers'->>'authorization' "
            "FROM solidloop_events WHERE kind = 'mcp_inbound' AND payload->>'method' = "
            "'tools/call' AND payload->>'principal' = 'our-agent' ORDER BY id").fetchall(),
            lambda rows: len(rows) >= 2)
    assert sorted(tool for tool, _ in theirs) == ["add", "whoami"]
    assert {auth for _, auth in theirs} == {"[redacted]"}


async def _call(url: str, who: str, name: str, arguments: dict) -> dict:
    headers = {"Authorization": f"Bearer token-{who}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http, \
            Client(streamable_http_client(url, http_client=http), mode="auto") as client:
        result = await client.call_tool(name, arguments)
        return {"error": result.is_error, "data": result.structured_content,
                "text": result.content[0].text if result.content else ""}


async def _start_schema(url: str, who: str) -> dict:
    headers = {"Authorization": f"Bearer token-{who}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http, \
            Client(streamable_http_client(url, http_client=http), mode="auto") as client:
        listed = await client.list_tools()
        return next(t.input_schema for t in listed.tools if t.name == "start_assistant")


def test_the_host_maps_the_callers_principal_and_arguments_to_the_loops_subject_and_state(
        app, session, llm, drain, mcp_gunicorn):
    url = f"{mcp_gunicorn}/mcp/tickets"
    schema = asyncio.run(_start_schema(url, "erin"))
    assert schema["required"] == ["message", "ticket_id"]
    assert schema["properties"]["ticket_id"] == TICKET_ARGUMENTS["ticket_id"]
    assert schema["properties"]["priority"]["enum"] == ["low", "normal", "high"]
    assert schema["additionalProperties"] is False

    llm.script("Ticket 42: the printer is on fire", {"content": "extinguished"})
    started = asyncio.run(_call(url, "erin", "start_assistant", {
        "message": "the printer is on fire", "ticket_id": 42, "priority": "high"}))
    assert not started["error"], started
    loop = session.get(Loop, started["data"]["loop_id"])
    # on_start chose the subject, the state and the message; the blueprint added the
    # caller's label, which binds the loop to its caller.
    assert (loop.subject_type, loop.subject_id) == ("Ticket", "42")
    assert loop.state == {"ticket_id": 42, "priority": "high", "mcp_principal": "erin"}
    first = session.scalars(select(Message).where(Message.loop_id == loop.id,
                                                  Message.role == "user")).one()
    assert first.content == "Ticket 42: the printer is on fire"
    drain()
    done = asyncio.run(_call(url, "erin", "status_assistant", {"loop_id": loop.id}))
    assert done["data"]["status"] == "completed" and done["data"]["answer"] == "extinguished"
    other = asyncio.run(_call(url, "frank", "status_assistant", {"loop_id": loop.id}))
    assert other["error"] and "started by you" in other["text"]

    # Bad arguments are checked against the schema before on_start runs: each is a tool
    # error naming the argument, and no loop is written; on_start may refuse the caller.
    loops_before = session.query(Loop).count()
    for who, arguments, named in [
        ("erin", {"message": "hi"}, "'start_assistant': ticket_id: Field required"),
        ("erin", {"message": "hi", "ticket_id": 0}, "ticket_id: 0 is less than the minimum"),
        ("erin", {"message": "hi", "ticket_id": 7, "priority": "urgent"},
         "priority: 'urgent' is not one of"),
        ("erin", {"message": "hi", "ticket_id": 7, "colour": "red"},
         "('colour' was unexpected)"),
        ("erin", {"message": "", "ticket_id": 7}, "message: '' should be non-empty"),
        ("mallory", {"message": "hi", "ticket_id": 7},
         "PermissionError: mallory may not open tickets"),
    ]:
        refused = asyncio.run(_call(url, who, "start_assistant", arguments))
        assert refused["error"] and named in refused["text"], (arguments, refused)
    session.expire_all()
    assert session.query(Loop).count() == loops_before


def test_agents_as_tools_start_durable_loops_and_report_their_answer(
        app, session, llm, drain, mcp_gunicorn):
    url = f"{mcp_gunicorn}/mcp/agents"
    llm.script("summarise", {"content": "the summary"})
    started = asyncio.run(_call(url, "carol", "start_assistant", {"message": "summarise it"}))
    assert not started["error"], started
    loop_id = started["data"]["loop_id"]
    # The client is gone; the loop is durable and runs on the workers.
    loop = session.get(Loop, loop_id)
    assert loop.status == "queued"
    assert (loop.subject_type, loop.subject_id) == ("mcp_principal", "carol")
    assert loop.state["mcp_principal"] == "carol"
    pending = asyncio.run(_call(url, "carol", "status_assistant", {"loop_id": loop_id}))
    assert pending["data"]["status"] == "queued" and "answer" not in pending["data"]
    drain()
    done = asyncio.run(_call(url, "carol", "status_assistant", {"loop_id": loop_id}))
    assert done["data"]["status"] == "completed" and done["data"]["answer"] == "the summary"
    # Another principal cannot read it; a bad id is a tool error the model can act on.
    other = asyncio.run(_call(url, "mallory", "status_assistant", {"loop_id": loop_id}))
    assert other["error"] and "started by you" in other["text"]
    bad = asyncio.run(_call(url, "carol", "status_assistant", {"loop_id": "x"}))
    assert bad["error"] and "invalid arguments" in bad["text"]
    assert mcp_server_app.agents_blueprint.name == "mcp_agents"


def test_an_outside_client_sees_and_decides_its_loops_pending_approvals(
        app, session, llm, drain, mcp_gunicorn, effects):
    url = f"{mcp_gunicorn}/mcp/agents"
    llm.script("refund 77 and email", {"content": "Both need you.", "tool_calls": [
        {"name": "refund", "arguments": {"order": "9", "amount": 77}},
        {"name": "send_email", "arguments": {"to": "ceo", "body": "hi"}}]})
    llm.script(lambda body: sum(m["role"] == "tool" for m in body["messages"]) == 2,
               {"content": "Refunded; no email."})
    started = asyncio.run(_call(url, "dana", "start_shop", {"message": "refund 77 and email"}))
    loop_id = started["data"]["loop_id"]
    drain()
    status = asyncio.run(_call(url, "dana", "status_shop", {"loop_id": loop_id}))
    assert status["data"]["status"] == "waiting"
    pending = {p["tool"]: p for p in status["data"]["pending_approvals"]}
    assert set(pending) == {"refund", "send_email"}
    assert pending["refund"]["arguments"] == {"order": "9", "amount": 77}
    assert "approve_shop" in status["data"]["next"]
    refund_id, email_id = pending["refund"]["tool_call_id"], pending["send_email"]["tool_call_id"]
    # Only the principal who started the loop may decide.
    stranger = asyncio.run(_call(url, "mallory", "approve_shop",
                                 {"loop_id": loop_id, "tool_call_id": refund_id}))
    assert stranger["error"] and "started by you" in stranger["text"]
    approved = asyncio.run(_call(url, "dana", "approve_shop",
                                 {"loop_id": loop_id, "tool_call_id": refund_id,
                                  "arguments": {"order": "9", "amount": 70}}))
    assert approved["data"] == {"tool_call_id": refund_id, "decision": "approved",
                                "status": "the tool runs"}
    denied = asyncio.run(_call(url, "dana", "deny_shop",
                               {"loop_id": loop_id, "tool_call_id": email_id,
                                "reason": "no emails to the CEO"}))
    assert denied["data"]["decision"] == "denied"
    twice = asyncio.run(_call(url, "dana", "deny_shop",
                              {"loop_id": loop_id, "tool_call_id": refund_id, "reason": "x"}))
    assert twice["error"] and "was approved by mcp:dana" in twice["text"]
    drain()
    done = asyncio.run(_call(url, "dana", "status_shop", {"loop_id": loop_id}))
    assert done["data"]["status"] == "completed" and "pending_approvals" not in done["data"]
    refund = session.get(ToolCall, refund_id)
    assert refund.arguments["amount"] == 70 and refund.decided_by == "mcp:dana"
    assert len(effects(f"solidloop:tool_call:{refund_id}", "refund")) == 1
