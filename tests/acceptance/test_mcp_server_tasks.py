"""Exposed agents as MCP Tasks, end to end: the official Python SDK's ``Client``
(mcp 2.3.0) with a Tasks client extension written on its ``ClientExtension`` API
(the SDK ships none), the blueprint under gunicorn (4 processes), and the loops
on a real ``dramatiq`` worker process.

The SDK speaks 2026-07-28 and sends ``_meta`` client capabilities (our extension
among them) and the ``Mcp-Name`` header on every request; a ``tools/call``
answered with ``resultType: "task"`` is handed to the extension's claim, which
polls ``tasks/get`` until the task ends, answering input requests or cancelling
on the way, and returns the task's result as the call's.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, Literal

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from pydantic import ConfigDict
from sqlalchemy import select

from flask_solidloop.mcp_server.agents import CANCEL_REASON
from flask_solidloop.models import Loop, ToolCall

from .test_e2e_workers import kill_group, spawn_workers

TASKS = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")


class CreatedTask(types.Result):
    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"]
    task_id: str
    status: str


class TaskParams(types.RequestParams):
    task_id: str


class UpdateParams(TaskParams):
    input_responses: dict[str, Any]


class DetailedTask(types.Result):
    model_config = ConfigDict(extra="allow")
    task_id: str
    status: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class GetTask(types.Request[TaskParams, Literal["tasks/get"]]):
    name_param = "taskId"


class CancelTask(types.Request[TaskParams, Literal["tasks/cancel"]]):
    name_param = "taskId"


class UpdateTask(types.Request[UpdateParams, Literal["tasks/update"]]):
    name_param = "taskId"


#: What the client does with a task that asks for input: ("cancel", None) or
#: ("update", inputResponses).
OnInput = Callable[[dict[str, Any]], tuple[str, dict[str, Any] | None]]


class Tasks(ClientExtension):
    """The client side of the Tasks extension: poll, answer or cancel, return the result."""

    identifier = TASKS

    def __init__(self, on_input: OnInput | None = None) -> None:
        self.on_input = on_input
        self.seen: list[str] = []

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=self.resolve)]

    async def resolve(self, created: CreatedTask, ctx: ClaimContext) -> types.CallToolResult:
        self.seen.append(f"created:{created.status}")
        params = {"taskId": created.task_id}
        for _ in range(300):
            task = await ctx.session.send_request(
                GetTask(method="tasks/get", params=TaskParams.model_validate(params)),
                DetailedTask)
            extra = task.model_extra or {}
            self.seen.append(task.status)
            if task.status == "completed":
                return types.CallToolResult.model_validate(task.result)
            if task.status in ("failed", "cancelled"):
                message = (task.error or {}).get("message", task.status)
                return types.CallToolResult(
                    content=[types.TextContent(type="text", text=f"{task.status}: {message}")],
                    is_error=True)
            if task.status == "input_required" and self.on_input is not None:
                action, responses = self.on_input(extra.get("inputRequests") or {})
                if action == "cancel":
                    await ctx.session.send_request(
                        CancelTask(method="tasks/cancel", params=TaskParams.model_validate(params)),
                        types.Result)
                else:
                    await ctx.session.send_request(
                        UpdateTask(method="tasks/update", params=UpdateParams.model_validate(
                            {**params, "inputResponses": responses})), types.Result)
            await asyncio.sleep(0.2)
        raise AssertionError(f"task {created.task_id} never ended: {self.seen}")


async def call(url: str, who: str, tool: str, message: str, tasks: Tasks) -> tuple[Any, str]:
    headers = {"Authorization": f"Bearer token-{who}"}
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http, \
            Client(streamable_http_client(url, http_client=http), mode="auto",
                   extensions=[tasks]) as client:
        await client.list_tools()
        result = await client.call_tool(tool, {"message": message})
        return result, client.protocol_version


def test_an_official_client_runs_agents_as_tasks_on_real_workers(
        app, session, llm, mcp_gunicorn, tmp_path, effects):
    url = f"{mcp_gunicorn}/mcp/agents"
    llm.script("summarise", {"content": "the summary"})
    # Refunds this large await an approval (ShopAgent's policy).
    llm.script("refund order 5", {"content": "Needs you.", "tool_calls": [
        {"name": "refund", "arguments": {"order": "5", "amount": 500}}]})
    llm.script("refund order 6", {"content": "Needs you.", "tool_calls": [
        {"name": "refund", "arguments": {"order": "6", "amount": 600}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "Refunded."})
    log = tmp_path / "workers.log"
    workers = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                             "--processes", "1", "--threads", "2"], log=log)
    try:
        # 1. Started as a task, polled to completion: the call returns the answer.
        plain = Tasks()
        result, version = asyncio.run(call(url, "ivy", "start_assistant", "summarise it", plain))
        assert version == "2026-07-28"
        assert not result.is_error, (result, log.read_text()[-3000:])
        assert result.content[0].text == "the summary"
        assert plain.seen[0] == "created:working" and plain.seen[-1] == "completed"
        loop = session.scalars(select(Loop).where(Loop.agent_name == "assistant")
                               .order_by(Loop.id.desc())).first()
        assert loop.status == "completed" and loop.state["mcp_principal"] == "ivy"

        # 2. A task waiting on an approval: the client accepts through tasks/update.
        asked: list[dict] = []

        def accept(requests: dict) -> tuple[str, dict]:
            asked.append(requests)
            return "update", {key: {"action": "accept"} for key in requests}

        approving = Tasks(on_input=accept)
        result, _ = asyncio.run(call(url, "ivy", "start_shop", "refund order 5", approving))
        assert result.content[0].text == "Refunded.", (result, approving.seen)
        assert "input_required" in approving.seen
        [requests] = asked[:1]
        [(key, request)] = requests.items()
        refund = session.get(ToolCall, int(key))
        assert request["method"] == "elicitation/create" and refund.name == "refund"
        assert refund.decided_by == "mcp:ivy"
        assert len(effects(f"solidloop:tool_call:{refund.id}", "refund")) == 1

        # 3. Another task, cancelled by the client while it waits: the loop is stopped.
        cancelling = Tasks(on_input=lambda requests: ("cancel", None))
        result, _ = asyncio.run(call(url, "ivy", "start_shop", "refund order 6", cancelling))
        assert result.is_error and result.content[0].text.startswith("cancelled")
        assert cancelling.seen[-1] == "cancelled"
        session.expire_all()
        stopped = session.scalars(select(Loop).where(Loop.agent_name == "shop")
                                  .order_by(Loop.id.desc())).first()
        assert (stopped.status, stopped.error_message) == ("failed", CANCEL_REASON)
        never = session.scalars(select(ToolCall).where(ToolCall.loop_id == stopped.id)).one()
        assert not effects(f"solidloop:tool_call:{never.id}", "refund")
    finally:
        kill_group(workers)
