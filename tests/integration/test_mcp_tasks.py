"""Exposed agents as MCP Tasks (2026-07-28, ``io.modelcontextprotocol/tasks``), and the
blueprint's ``expose_errors`` option: the blueprint in the test app, the loops drained
on this process."""

from __future__ import annotations

import json
import logging
import re

import pytest
from pydantic import BaseModel
from sqlalchemy import select

from flask_solidloop import Agent, CallContext, ConfigurationError, Toolset
from flask_solidloop.errors import InvalidArgumentError
from flask_solidloop.mcp_server.agents import CANCEL_REASON
from flask_solidloop.models import Loop, Message, ToolCall
from flask_solidloop.state import get_state

from ..support.support_app import Assistant, ShopAgent, llm_settings, solidloop

MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"

who_tools = Toolset("tasks_who")


@who_tools.tool
def whoami(ctx: CallContext) -> dict:
    """Who the call acts for."""
    return {"principal": ctx.principal}


@solidloop.agent("tasks_who")
class WhoAgent(Agent):
    """Says who it works for."""

    system_prompt = "You check who you act for."
    mcps = [{"name": "who", "toolset": who_tools}]

    def llm(self) -> dict:
        return llm_settings()

    def approval_policy(self, name, arguments, ctx) -> bool:
        POLICY_SAW.append(ctx.principal)
        return False


#: The principals WhoAgent's approval policy was asked about.
POLICY_SAW: list = []


class Verdict(BaseModel):
    ok: bool
    note: str


@solidloop.agent("tasks_judge")
class JudgeAgent(Agent):
    """Judges, with a structured verdict."""

    system_prompt = "You judge."
    output_type = Verdict

    def llm(self) -> dict:
        return llm_settings()


def rpc(client, who, method, params=None, *, tasks=True, path="/mcp/tasks",
        name_header=True):
    """One 2026-07-28 request; the JSON-RPC answer (result or error)."""
    capabilities = {"extensions": {TASKS: {}}} if tasks else {}
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {
        **(params or {}), "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                                    "io.modelcontextprotocol/clientCapabilities": capabilities}}}
    headers = {"Accept": "application/json, text/event-stream",
               "Authorization": f"Bearer {who}", "MCP-Protocol-Version": MODERN,
               "Mcp-Method": method}
    if method == "tools/call":
        headers["Mcp-Name"] = params["name"]
    elif method.startswith("tasks/") and name_header:
        headers["Mcp-Name"] = params["taskId"]
    # The test client's requests run in the test's app context, so in its session:
    # read what the workers committed, as a request of a real server would.
    get_state().db.session.expire_all()
    return client.post(path, json=body, headers=headers).get_json()


@pytest.fixture
def client(app):
    blueprint = solidloop.mcp_blueprint(auth=lambda token, request: token, name="mcp_tasks",
                                        agents=[WhoAgent, ShopAgent, JudgeAgent],
                                        allowed_hosts=["localhost"])
    app.register_blueprint(blueprint, url_prefix="/mcp/tasks")
    tools_only = solidloop.mcp_blueprint(who_tools, auth=lambda token, request: token,
                                         name="mcp_tools_only", allowed_hosts=["localhost"])
    app.register_blueprint(tools_only, url_prefix="/mcp/tools")
    return app.test_client()


def start(client, who, agent, message, **kwargs):
    return rpc(client, who, "tools/call",
               {"name": f"start_{agent}", "arguments": {"message": message}}, **kwargs)


def test_the_blueprint_advertises_the_extension_only_with_agents(client):
    discovered = rpc(client, "ann", "server/discover")["result"]
    assert discovered["capabilities"]["extensions"] == {TASKS: {}}
    assert "tasks" not in discovered["capabilities"]
    plain = rpc(client, "ann", "server/discover", path="/mcp/tools")["result"]
    assert "extensions" not in plain["capabilities"]
    # No agents, no task methods.
    assert rpc(client, "ann", "tasks/get", {"taskId": "1"}, path="/mcp/tools")[
        "error"]["code"] == -32601


def test_a_start_is_a_task_polled_to_its_answer_and_the_tools_act_for_the_caller(
        client, session, llm, drain):
    llm.script("who", {"tool_calls": [{"name": "whoami", "arguments": {}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "You, alice."})
    created = start(client, "alice", "tasks_who", "who do you work for?")["result"]
    # A flat CreateTaskResult: the loop's id, nothing the task will carry later.
    assert created["resultType"] == "task"
    loop = session.scalars(select(Loop).where(Loop.agent_name == "tasks_who")).one()
    assert created["taskId"] == str(loop.id) and created["status"] == "working"
    assert created["ttlMs"] is None and created["pollIntervalMs"] == 1000
    assert re.match(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}", created["createdAt"])
    assert not {"result", "error", "inputRequests", "requestState", "content"} & set(created)
    working = rpc(client, "alice", "tasks/get", {"taskId": created["taskId"]})["result"]
    assert working["status"] == "working" and working["resultType"] == "complete"
    assert "result" not in working

    drain()
    done = rpc(client, "alice", "tasks/get", {"taskId": created["taskId"]})["result"]
    assert done["status"] == "completed", done
    assert done["result"]["content"] == [{"type": "text", "text": "You, alice."}]
    assert done["result"]["isError"] is False
    # The loop's in-process tool saw the MCP caller as ctx.principal.
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    assert call.result["structuredContent"] == {"principal": "alice"}
    assert POLICY_SAW[-1] == "alice"  # and so did the agent's approval policy
    # A loop started another way has no MCP caller.
    assert WhoAgent(Assistant.start(message="no caller")).mcp_principal() is None

    # Another principal, an id that is no loop of ours, a loop of an agent not exposed:
    # all the same "unknown task", so an id tells nothing.
    other = Assistant.start(message="not exposed here")
    for who, task_id in [("bob", created["taskId"]), ("alice", "tasks-nonexistent-1"),
                         ("alice", "99999999999"), ("alice", str(other.id))]:
        for method in ("tasks/get", "tasks/cancel"):
            error = rpc(client, who, method, {"taskId": task_id})["error"]
            assert error["code"] == -32602 and "Unknown task" in error["message"], (who, task_id)
    # Without the extension declared, the task methods are refused, naming it.
    gated = rpc(client, "alice", "tasks/get", {"taskId": created["taskId"]}, tasks=False)
    assert gated["error"]["code"] == -32021 and TASKS in gated["error"]["message"]
    # The task methods mirror the task id in Mcp-Name, like tools/call's tool name.
    for method in ("tasks/get", "tasks/cancel"):
        unnamed = rpc(client, "alice", method, {"taskId": created["taskId"]}, name_header=False)
        assert unnamed["error"]["code"] == -32020 and "taskId" in unnamed["error"]["message"]
    assert rpc(client, "alice", "tasks/get", {"taskId": created["taskId"]})["result"]
    # The methods the extension removed are not served.
    for removed in ("tasks/result", "tasks/list"):
        assert rpc(client, "alice", removed, {"taskId": created["taskId"]})[
            "error"]["code"] == -32601


def test_a_structured_output_agents_task_carries_its_output(client, llm, drain):
    llm.script("judge this", {"output": {"ok": True, "note": "fine"}})
    task_id = start(client, "hal", "tasks_judge", "judge this")["result"]["taskId"]
    drain()
    done = rpc(client, "hal", "tasks/get", {"taskId": task_id})["result"]
    assert done["status"] == "completed", done
    assert done["result"]["structuredContent"] == {"ok": True, "note": "fine"}
    assert json.loads(done["result"]["content"][0]["text"]) == {"ok": True, "note": "fine"}


def test_a_client_without_the_extension_gets_the_loop_id_and_the_polling_tools(
        client, session, llm, drain):
    llm.script("plain", {"content": "plain answer"})
    started = start(client, "carl", "tasks_who", "plain start", tasks=False)["result"]
    assert started["resultType"] == "complete" and "taskId" not in started
    loop_id = started["structuredContent"]["loop_id"]
    drain()
    status = rpc(client, "carl", "tools/call", {"name": "status_tasks_who",
                                                "arguments": {"loop_id": loop_id}},
                 tasks=False)["result"]["structuredContent"]
    assert status["status"] == "completed" and status["answer"] == "plain answer"
    # The same loop is a task for a client that speaks the extension.
    assert rpc(client, "carl", "tasks/get", {"taskId": str(loop_id)})[
        "result"]["status"] == "completed"


def test_approvals_are_input_requests_and_tasks_update_decides_them(
        client, session, llm, drain, effects):
    llm.script("refund 77 and email", {"content": "Both need you.", "tool_calls": [
        {"name": "refund", "arguments": {"order": "9", "amount": 77}},
        {"name": "send_email", "arguments": {"to": "ceo", "body": "hi"}}]})
    llm.script(lambda body: sum(m["role"] == "tool" for m in body["messages"]) == 2,
               {"content": "Refunded; no email."})
    task_id = start(client, "dana", "shop", "refund 77 and email")["result"]["taskId"]
    drain()
    waiting = rpc(client, "dana", "tasks/get", {"taskId": task_id})["result"]
    assert waiting["status"] == "input_required"
    calls = {c.name: c for c in session.scalars(
        select(ToolCall).where(ToolCall.loop_id == int(task_id)))}
    requests = waiting["inputRequests"]
    assert set(requests) == {str(calls["refund"].id), str(calls["send_email"].id)}
    refund_request = requests[str(calls["refund"].id)]
    assert refund_request["method"] == "elicitation/create"
    assert "'refund'" in refund_request["params"]["message"]
    assert '"amount": 77' in refund_request["params"]["message"]

    # A stranger's answer is refused like a missing task, and decides nothing.
    stranger = rpc(client, "mallory", "tasks/update", {
        "taskId": task_id, "inputResponses": {str(calls["refund"].id): {"action": "accept"}}})
    assert stranger["error"]["code"] == -32602
    # Partial answers: the accepted key leaves, the other stays; unknown keys are ignored.
    ack = rpc(client, "dana", "tasks/update", {"taskId": task_id, "inputResponses": {
        str(calls["refund"].id): {"action": "accept", "content": {}},
        "not-a-key": {"action": "accept"}}})["result"]
    assert ack["resultType"] == "complete"
    assert not {"taskId", "status", "result", "error", "inputRequests"} & set(ack)
    still = rpc(client, "dana", "tasks/get", {"taskId": task_id})["result"]
    assert still["status"] == "input_required"
    assert set(still["inputRequests"]) == {str(calls["send_email"].id)}
    rpc(client, "dana", "tasks/update", {"taskId": task_id, "inputResponses": {
        str(calls["send_email"].id): {"action": "decline",
                                      "content": {"reason": "no emails to the CEO"}}}})
    # Answering a decided call again changes nothing and is the same ack.
    again = rpc(client, "dana", "tasks/update", {"taskId": task_id, "inputResponses": {
        str(calls["refund"].id): {"action": "decline"}}})
    assert again["result"]["resultType"] == "complete"
    drain()
    done = rpc(client, "dana", "tasks/get", {"taskId": task_id})["result"]
    assert done["status"] == "completed", done
    assert done["result"]["content"][0]["text"] == "Refunded; no email."
    session.expire_all()
    refund, email = session.get(ToolCall, calls["refund"].id), session.get(
        ToolCall, calls["send_email"].id)
    assert (refund.decision, refund.decided_by) == ("approved", "mcp:dana")
    assert (email.decision, email.decided_by) == ("denied", "mcp:dana")
    denial = session.scalars(select(Message).where(Message.tool_call_id == email.id)).one()
    assert "no emails to the CEO" in denial.content
    assert len(effects(f"solidloop:tool_call:{refund.id}", "refund")) == 1


def test_tasks_cancel_stops_the_loop_and_a_host_stop_stays_failed(client, session, llm):
    task_id = start(client, "erin", "tasks_who", "a long job")["result"]["taskId"]
    ack = rpc(client, "erin", "tasks/cancel", {"taskId": task_id})["result"]
    assert ack["resultType"] == "complete"
    assert not {"taskId", "status", "result", "error"} & set(ack)
    cancelled = rpc(client, "erin", "tasks/get", {"taskId": task_id})["result"]
    assert cancelled["status"] == "cancelled" and "error" not in cancelled
    session.expire_all()
    loop = session.get(Loop, int(task_id))
    assert (loop.status, loop.error_message) == ("failed", CANCEL_REASON)
    # Cancelling an ended task is the same ack, and changes nothing.
    assert rpc(client, "erin", "tasks/cancel", {"taskId": task_id})["result"] == ack
    # A loop the host stopped is a failed task, with the loop's error.
    other = start(client, "erin", "tasks_who", "another job")["result"]["taskId"]
    WhoAgent(int(other)).stop(reason="the host stopped it")
    failed = rpc(client, "erin", "tasks/get", {"taskId": other})["result"]
    assert failed["status"] == "failed" and "result" not in failed
    assert failed["error"] == {"code": -32603, "message": "the host stopped it"}


def test_a_refused_start_is_a_tool_error_not_a_task(client, session):
    refused = rpc(client, "fay", "tools/call", {"name": "start_tasks_who",
                                                "arguments": {"message": ""}})["result"]
    assert refused["resultType"] == "complete" and refused["isError"] is True
    assert "message: '' should be non-empty" in refused["content"][0]["text"]
    assert session.scalars(select(Loop).where(Loop.agent_name == "tasks_who")).all() == []


# -- expose_errors ------------------------------------------------------------------

failing = Toolset("failing")


@failing.tool
def explode(what: str) -> str:
    """Fails with the database password in its message."""
    raise RuntimeError(f"could not reach {what} with password hunter2")


@failing.tool
def refuse(ticket: int) -> str:
    """Fails with a message written for the caller."""
    raise InvalidArgumentError(f"ticket {ticket} is closed; pass an open ticket")


def test_a_raising_tool_answers_outside_callers_a_generic_message_with_an_error_id(
        app, caplog):
    hidden = solidloop.mcp_blueprint(failing, auth=lambda token, request: token,
                                     name="mcp_hidden", allowed_hosts=["localhost"])
    shown = solidloop.mcp_blueprint(failing, auth=lambda token, request: token,
                                    name="mcp_shown", allowed_hosts=["localhost"],
                                    expose_errors=True)
    app.register_blueprint(hidden, url_prefix="/mcp/hidden")
    app.register_blueprint(shown, url_prefix="/mcp/shown")
    client = app.test_client()
    call = {"name": "explode", "arguments": {"what": "the db"}}
    with caplog.at_level(logging.ERROR, logger="flask_solidloop.mcp_server"):
        answer = rpc(client, "gus", "tools/call", call, path="/mcp/hidden")["result"]
    text = answer["content"][0]["text"]
    assert answer["isError"] is True and "hunter2" not in text
    error_id = re.search(r"error id ([0-9a-f]{12})", text).group(1)
    logged = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
    assert len(logged) == 1 and "hunter2" in logged[0]
    # The host that wants the text sends it.
    exposed = rpc(client, "gus", "tools/call", call, path="/mcp/shown")["result"]
    assert exposed["content"][0]["text"] == (
        "RuntimeError: could not reach the db with password hunter2")
    # InvalidArgumentError is written for the caller: it always reaches them.
    refused = rpc(client, "gus", "tools/call", {"name": "refuse", "arguments": {"ticket": 4}},
                  path="/mcp/hidden")["result"]
    assert refused["content"][0]["text"] == (
        "InvalidArgumentError: ticket 4 is closed; pass an open ticket")
    with pytest.raises(ConfigurationError, match="expose_errors='yes' is invalid"):
        solidloop.mcp_blueprint(failing, auth=lambda token, request: token,
                                expose_errors="yes")
