"""The MCP Tasks extension (``io.modelcontextprotocol/tasks``) on the server blueprint.

This module owns the extension's wire on the 2026-07-28 protocol: whether a
request declares the extension (per request, in
``_meta["io.modelcontextprotocol/clientCapabilities"]``), the answers to
``tasks/get``, ``tasks/update`` and ``tasks/cancel`` (params checked here,
results shaped here: a flat ``Task``, with ``result``, ``error`` or
``inputRequests`` inlined on ``tasks/get``; an empty ack for update and
cancel), and the ``CreateTaskResult`` a ``tools/call`` of a task-supporting
tool answers, and the ``Mcp-Name`` rule of the task methods (the HTTP layer
applies it). What a task *is* belongs to a :class:`TaskBackend`: for the
blueprint, the exposed agents' loops (:mod:`.agents`). The shapes follow the
official conformance suite's tasks scenarios (docs/decisions/0043-agents-as-mcp-tasks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from mcp.shared.inbound import MCP_NAME_HEADER, InboundLadderRejection, decode_header_value
from mcp_types import CLIENT_CAPABILITIES_META_KEY
from mcp_types.jsonrpc import HEADER_MISMATCH, INVALID_PARAMS, MISSING_REQUIRED_CLIENT_CAPABILITY

from ..errors import SolidLoopError
from ..mcp.toolset import ToolResult

__all__ = ["EXTENSION_ID", "TASK_METHODS", "TaskBackend", "TaskView", "TasksError",
           "answer", "created", "declared", "name_header_mismatch"]

#: The extension's identifier, advertised under ``capabilities.extensions``.
EXTENSION_ID = "io.modelcontextprotocol/tasks"
#: The methods the extension adds (``tasks/result`` and ``tasks/list`` were removed).
TASK_METHODS = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
#: How often a client is asked to poll ``tasks/get``: a loop's turn takes seconds.
POLL_INTERVAL_MS = 1000
#: Task statuses on the wire.
STATUSES = ("working", "input_required", "completed", "failed", "cancelled")


class TasksError(SolidLoopError):
    """A JSON-RPC error answer to a tasks request (the protocol turns it into one)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@dataclass
class TaskView:
    """One task as a client sees it: its status and what that status carries."""

    task_id: str
    status: str
    created_at: datetime
    updated_at: datetime
    status_message: str | None = None
    #: ``input_required``: request key -> the request (``{"method", "params"}``).
    input_requests: dict[str, dict[str, Any]] | None = None
    #: ``completed``: a ``CallToolResult``.
    result: dict[str, Any] | None = None
    #: ``failed``: a JSON-RPC error object (``code``, ``message``).
    error: dict[str, Any] | None = None
    #: How long the task is kept, in milliseconds (None: no fixed TTL).
    ttl_ms: int | None = None

    def envelope(self) -> dict[str, Any]:
        """The ``Task`` fields every answer about the task carries."""
        task: dict[str, Any] = {
            "taskId": self.task_id, "status": self.status,
            "createdAt": self.created_at.isoformat(),
            "lastUpdatedAt": self.updated_at.isoformat(),
            # A loop lives until the host's retention deletes it: no fixed TTL.
            "ttlMs": self.ttl_ms,
            "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if self.status_message:
            task["statusMessage"] = self.status_message
        return task

    def detailed(self) -> dict[str, Any]:
        """The ``tasks/get`` answer: the envelope with what the status carries inlined."""
        task = self.envelope()
        if self.status == "input_required" and self.input_requests:
            task["inputRequests"] = self.input_requests
        elif self.status == "completed" and self.result is not None:
            task["result"] = self.result
        elif self.status == "failed" and self.error is not None:
            task["error"] = self.error
        return task


class TaskBackend(Protocol):
    """What owns the tasks of one blueprint. Each method answers only the
    principal the task belongs to: a task of another principal is unknown
    (None / False), exactly like a task that does not exist."""

    def supports(self, tool: str) -> bool:
        """Whether a call of ``tool`` (advertised name) becomes a task."""
        ...

    def created(self, tool: str, result: ToolResult, principal: Any) -> TaskView | None:
        """The task the tool call that returned ``result`` made (None: no task)."""
        ...

    def get(self, task_id: str, principal: Any) -> TaskView | None: ...

    def update(self, task_id: str, principal: Any,
               responses: Mapping[str, Any]) -> bool: ...

    def cancel(self, task_id: str, principal: Any) -> bool: ...


def declared(params: Mapping[str, Any] | None) -> bool:
    """Whether a request declares the extension in its ``_meta`` client capabilities."""
    meta = (params or {}).get("_meta")
    capabilities = meta.get(CLIENT_CAPABILITIES_META_KEY) if isinstance(meta, dict) else None
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and EXTENSION_ID in extensions


def name_header_mismatch(params: Any,
                         headers: Mapping[str, str]) -> InboundLadderRejection | None:
    """A ``tasks/*`` request must mirror ``params.taskId`` in its ``Mcp-Name``
    header (``headers``: lower-cased names); a missing or different one is
    ``-32020``, as for ``tools/call``'s tool name."""
    task_id = params.get("taskId") if isinstance(params, dict) else None
    if task_id is None or decode_header_value(headers.get(MCP_NAME_HEADER)) == task_id:
        return None
    return InboundLadderRejection(
        code=HEADER_MISMATCH,
        message="Mcp-Name header does not match the request body's 'taskId' parameter")


def created(view: TaskView) -> dict[str, Any]:
    """The ``CreateTaskResult`` a task-making ``tools/call`` answers: flat, no
    result, error or input requests (those live on ``tasks/get``)."""
    return {"resultType": "task", **view.envelope()}


def answer(backend: TaskBackend, method: str, params: Mapping[str, Any],
           principal: Any) -> dict[str, Any]:
    """The result of one ``tasks/*`` request (without ``resultType`` and the
    server stamp, which the protocol adds), or :class:`TasksError`."""
    if not declared(params):
        raise TasksError(
            MISSING_REQUIRED_CLIENT_CAPABILITY,
            f"{method} needs the {EXTENSION_ID} extension: declare it in "
            f"_meta[{CLIENT_CAPABILITIES_META_KEY!r}].extensions",
            {"requiredCapabilities": {"extensions": {EXTENSION_ID: {}}}})
    task_id = params.get("taskId")
    if not isinstance(task_id, str) or not task_id:
        raise TasksError(INVALID_PARAMS, f"{method} needs params.taskId, the taskId "
                                         "tools/call returned (a string)")
    if method == "tasks/get":
        view = backend.get(task_id, principal)
        if view is None:
            raise _unknown(task_id)
        return view.detailed()
    if method == "tasks/update":
        responses = params.get("inputResponses")
        if not isinstance(responses, dict):
            raise TasksError(INVALID_PARAMS, "tasks/update needs params.inputResponses, an "
                                             "object keyed by the inputRequests keys")
        if not backend.update(task_id, principal, responses):
            raise _unknown(task_id)
        return {}
    if not backend.cancel(task_id, principal):
        raise _unknown(task_id)
    return {}


def _unknown(task_id: str) -> TasksError:
    return TasksError(INVALID_PARAMS, f"Unknown task: {task_id[:100]!r} (pass a taskId that "
                                      "a tools/call of yours returned)")
