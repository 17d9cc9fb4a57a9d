"""A toolset's ``task=`` tools as MCP Tasks (2026-07-28, ``io.modelcontextprotocol/tasks``):
the blueprint in the test app, each task's job drained on this process (the
conformance suite drives the same with a real worker process,
tests/acceptance/test_mcp_conformance.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from flask_solidloop import CallContext, ToolResult, Toolset
from flask_solidloop.errors import ToolDefinitionError
from flask_solidloop.jobs import Job

from ..support.support_app import solidloop
from .test_mcp_tasks import rpc

work = Toolset("tool_tasks")
RUNS: list = []


@work.tool(task="optional")
def measure(text: str, ctx: CallContext) -> dict:
    """Measures text, on a worker when called as a task."""
    RUNS.append(ctx.principal)
    return {"length": len(text), "for": ctx.principal}


@work.tool(task="required")
def refuse() -> ToolResult:
    """Reports an error (the tool ran)."""
    return ToolResult.error("no can do")


@work.tool(task="optional")
def explode() -> str:
    """Raises: its task fails."""
    raise RuntimeError("secret detail")


@work.tool(task="optional")
def ask(ctx: CallContext) -> ToolResult | str:
    """Asks the client two things, then answers with them."""
    answers = ctx.input_responses
    if not answers:
        form = {"mode": "form", "message": "?", "requestedSchema": {"type": "object"}}
        return ToolResult.input_required({
            "a": {"method": "elicitation/create", "params": form},
            "b": {"method": "elicitation/create", "params": form}})
    return ",".join(f"{key}={answers[key]['action']}" for key in sorted(answers))


@work.tool
def plain() -> str:
    """Never a task."""
    return "plain"


@pytest.fixture
def client(app):
    blueprint = solidloop.mcp_blueprint(work, auth=lambda token, request: token,
                                        name="mcp_tool_tasks", allowed_hosts=["localhost"])
    app.register_blueprint(blueprint, url_prefix="/mcp/tool-tasks")
    RUNS.clear()
    return app.test_client()


def call(client, who, name, arguments=None, **kwargs):
    return rpc(client, who, "tools/call", {"name": name, "arguments": arguments or {}},
               path="/mcp/tool-tasks", **kwargs)


def task(client, who, method, task_id, **params):
    return rpc(client, who, method, {"taskId": task_id, **params}, path="/mcp/tool-tasks")


def test_a_task_call_is_a_durable_job_and_its_result_is_the_tools(client, drain):
    created = call(client, "ann", "measure", {"text": "hello"})["result"]
    assert created["resultType"] == "task" and created["status"] == "working"
    assert created["ttlMs"] == 3_600_000 and "result" not in created
    task_id = created["taskId"]
    # Durable before the answer: the job is committed, and has not run.
    assert Job.fetch(task_id).get_status() == "queued" and RUNS == []
    assert task(client, "ann", "tasks/get", task_id)["result"]["status"] == "working"
    drain()
    done = task(client, "ann", "tasks/get", task_id)["result"]
    assert done["status"] == "completed"
    assert done["result"]["structuredContent"] == {"length": 5, "for": "ann"}
    assert done["result"]["isError"] is False
    assert RUNS == ["ann"]  # the tool saw the caller's principal label, on the worker


def test_a_task_belongs_to_its_caller(client, drain):
    task_id = call(client, "ann", "measure", {"text": "x"})["result"]["taskId"]
    for method, extra in (("tasks/get", {}), ("tasks/cancel", {}),
                          ("tasks/update", {"inputResponses": {}})):
        error = task(client, "bob", method, task_id, **extra)["error"]
        assert error["code"] == -32602 and "Unknown task" in error["message"]
    assert task(client, "ann", "tasks/get", "mcp-task-nope")["error"]["code"] == -32602
    drain()
    assert task(client, "ann", "tasks/get", task_id)["result"]["status"] == "completed"


def test_without_the_extension_an_optional_tool_answers_and_a_required_one_refuses(
        client):
    answered = call(client, "ann", "measure", {"text": "abc"}, tasks=False)["result"]
    assert answered["resultType"] == "complete"
    assert answered["structuredContent"] == {"length": 3, "for": "ann"}
    refused = call(client, "ann", "refuse", tasks=False)["error"]
    assert refused["code"] == -32021
    assert refused["data"] == {"requiredCapabilities": {"extensions": {
        "io.modelcontextprotocol/tasks": {}}}}
    # A tool without task= never becomes a task.
    assert call(client, "ann", "plain")["result"]["resultType"] == "complete"


def test_a_tool_error_completes_and_a_raising_tool_fails_without_its_text(client, drain):
    refused = call(client, "ann", "refuse")["result"]["taskId"]
    exploded = call(client, "ann", "explode")["result"]["taskId"]
    drain()
    done = task(client, "ann", "tasks/get", refused)["result"]
    assert done["status"] == "completed" and done["result"]["isError"] is True
    assert done["result"]["content"][0]["text"] == "no can do"
    failed = task(client, "ann", "tasks/get", exploded)["result"]
    assert failed["status"] == "failed" and "result" not in failed
    assert failed["error"]["code"] == -32603
    assert "secret detail" not in failed["error"]["message"]
    assert "error id" in failed["error"]["message"]


def test_input_requests_are_answered_one_by_one_then_the_tool_runs_again(client, drain):
    task_id = call(client, "ann", "ask")["result"]["taskId"]
    drain()
    asking = task(client, "ann", "tasks/get", task_id)["result"]
    assert asking["status"] == "input_required" and set(asking["inputRequests"]) == {"a", "b"}
    ack = task(client, "ann", "tasks/update", task_id,
               inputResponses={"a": {"action": "accept"}, "zzz": {"action": "accept"}})
    assert ack["result"] == {"resultType": "complete", "_meta": ack["result"]["_meta"]}
    still = task(client, "ann", "tasks/get", task_id)["result"]
    assert still["status"] == "input_required" and set(still["inputRequests"]) == {"b"}
    task(client, "ann", "tasks/update", task_id, inputResponses={"b": {"action": "decline"}})
    assert task(client, "ann", "tasks/get", task_id)["result"]["status"] == "working"
    drain()
    done = task(client, "ann", "tasks/get", task_id)["result"]
    assert done["status"] == "completed"
    assert done["result"]["content"][0]["text"] == "a=accept,b=decline"


def test_cancel_stops_a_queued_task_and_is_an_ack_on_an_ended_one(client, drain):
    task_id = call(client, "ann", "measure", {"text": "x"})["result"]["taskId"]
    ack = task(client, "ann", "tasks/cancel", task_id)["result"]
    assert set(ack) == {"resultType", "_meta"}
    drain()
    assert RUNS == []  # cancelled before a worker took it: never ran
    assert task(client, "ann", "tasks/get", task_id)["result"]["status"] == "cancelled"
    ended = call(client, "ann", "measure", {"text": "y"})["result"]["taskId"]
    drain()
    assert set(task(client, "ann", "tasks/cancel", ended)["result"]) == {"resultType", "_meta"}
    assert task(client, "ann", "tasks/get", ended)["result"]["status"] == "completed"


def test_task_support_is_checked_at_declaration():
    tools = Toolset("tool_tasks_bad")
    with pytest.raises(ToolDefinitionError, match="task= must be None"):
        tools.add_tool(lambda: "x", name="x", task="always")


def test_each_change_keeps_the_task_one_more_ttl(client, drain, session):
    task_id = call(client, "ann", "ask")["result"]["taskId"]
    drain()

    def expires_in() -> float:
        session.rollback()
        return session.execute(text(
            "SELECT extract(epoch FROM expires_at - now()) FROM solidloop_host_jobs "
            "WHERE id = :id"), {"id": task_id}).scalar_one()

    def expire_now() -> None:
        session.execute(text("UPDATE solidloop_host_jobs SET expires_at = now() "
                             "WHERE id = :id"), {"id": task_id})
        session.commit()

    expire_now()
    task(client, "ann", "tasks/update", task_id,
         inputResponses={"a": {"action": "accept"}, "b": {"action": "accept"}})
    assert expires_in() > 3000  # the update kept the task's state
    expire_now()
    drain()  # the second round ends: the task changed again
    assert expires_in() > 3000
    assert task(client, "ann", "tasks/get", task_id)["result"]["status"] == "completed"
