"""A toolset's tools as MCP tasks: task-augmented calls run as durable jobs on the workers.

This module owns what a task of an in-process tool *is* (the Tasks
extension's wire is :mod:`.tasks`): a tool declared with
``task="optional"`` or ``task="required"`` and called on 2026-07-28 by a
request that declares the extension is not run on the request's thread; the
call becomes an RQ-style job of the host-jobs machinery (flask_solidloop.jobs)
on the blueprint's ``tasks_queue``, written in the request's transaction, so
the ``CreateTaskResult`` is sent only once the task is durable. A worker runs
the tool (:func:`run_tool_task`) through ``Toolset.call``, as the request
would have, and the job's return value is the outcome: the ``CallToolResult``
(a tool that reported an error too: ``completed`` with ``isError``), a
raising tool's error (``failed``), or the tool's input requests
(``input_required``, :meth:`ToolResult.input_required`). The task id is the
first job's id, random and unguessable; its meta binds it to the caller's
principal label, and a task of another principal is unknown. A tool that
asks for input runs again, as a new job (``<task id>.<round>``), once the
client answered every request (``tasks/update``), with the answers in
``ctx.input_responses``. ``tasks/cancel`` cancels the current job. A worker
killed mid-run loses nothing: the queue redelivers the job (at least once).

:class:`TaskBackends` puts this backend and the agents' (:class:`.agents.LoopTasks`)
behind the one :class:`.tasks.TaskBackend` the protocol asks.
See docs/decisions/0043-agents-as-mcp-tasks.md, "Tools as tasks".
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from mcp_types.jsonrpc import INTERNAL_ERROR

from ..errors import InvalidArgumentError, NoSuchJobError
from ..jobs import Job, Queue, get_current_job
from ..jobs.rq import keep_job, lock_job_meta, write_job_meta
from ..mcp.toolset import CallContext, ToolResult, Toolset
from ..state import get_state
from .tasks import TaskBackend, TaskView

__all__ = ["TASK_TTL_SECONDS", "TaskBackends", "ToolTasks", "run_tool_task"]

logger = logging.getLogger("flask_solidloop.mcp_server")

#: How long a tool's task is kept after its last change (its jobs' result and
#: failure TTL): the ``ttlMs`` a client is told.
TASK_TTL_SECONDS = 3600
_PREFIX = "mcp-task-"
_META_KEY = "mcp_task"
#: A later round's job meta: the task (first job) it belongs to.
_ROUND_OF = "mcp_task_of"
_RUN = "flask_solidloop.mcp_server.tooltasks:run_tool_task"
# The task's state is its first job's meta (flask_solidloop.jobs' table), read
# and written in the request's transaction, so an update and the next round's
# job commit together.

#: Blueprint name -> (advertised tool -> (toolset, tool name), expose_errors): what
#: a worker runs a task's tool with. Filled when the blueprint is built, so a
#: worker that imports the host's app (which builds its blueprints) knows them.
_SERVERS: dict[str, tuple[dict[str, tuple[Toolset, str]], bool]] = {}


def register(name: str, tools: dict[str, tuple[Toolset, str]], expose_errors: bool) -> None:
    """Make blueprint ``name``'s tools runnable by :func:`run_tool_task` in this process."""
    _SERVERS[name] = (tools, expose_errors)


def run_tool_task(server: str, tool: str, arguments: Any, principal: str,
                  responses: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job of one task's run, on a worker: call the tool, return the outcome
    (``{"result": CallToolResult}``, ``{"error": {...}}`` or ``{"inputRequests": {...}}``)."""
    entry = _SERVERS.get(server)
    if entry is None or tool not in entry[0]:
        raise InvalidArgumentError(
            f"this worker has no MCP server blueprint {server!r} with tool {tool!r}: start "
            "the worker with the app (or --module) that calls mcp_blueprint(...)")
    tools, expose_errors = entry
    toolset, tool_name = tools[tool]
    session = get_state().db.session
    ctx = CallContext(principal=principal, session=session,
                      input_responses=dict(responses) if responses else None)
    result = toolset.call(tool_name, arguments, ctx)
    job = get_current_job()
    task_id = job.meta.get(_ROUND_OF) if job is not None else None
    if isinstance(task_id, str):
        # A later round ended: the task changed, its first job lives on.
        keep_job(session, task_id)
    session.commit()
    if result.input_requests:
        return {"inputRequests": result.input_requests}
    if result.raised:
        message = result.text()
        if not expose_errors:
            error_id = secrets.token_hex(6)
            logger.error("MCP server %r: tool %r raised in a task (error id %s): %s",
                         server, tool, error_id, message)
            message = f"the tool failed (error id {error_id}); the server's log has the details"
        return {"error": {"code": INTERNAL_ERROR, "message": message}}
    return {"result": result.to_mcp()}


class ToolTasks:
    """The task-supporting tools of one blueprint as MCP tasks (a
    :class:`~flask_solidloop.mcp_server.tasks.TaskBackend` for ``tasks/*``;
    :meth:`start` makes the task)."""

    def __init__(self, server: str, tools: dict[str, tuple[Toolset, str]],
                 label_of: Callable[[Any], str], queue: Queue) -> None:
        self.server = server
        self.label_of = label_of
        self.queue = queue
        self.support = {advertised: toolset.get(name).task
                        for advertised, (toolset, name) in tools.items()
                        if toolset.get(name).task is not None}

    def task_support(self, tool: str) -> str | None:
        """``"optional"``, ``"required"`` or None for the advertised tool ``tool``."""
        return self.support.get(tool)

    def supports(self, tool: str) -> bool:
        return False  # tasks are made by start(), before the tool runs

    def created(self, tool: str, result: ToolResult, principal: Any) -> TaskView | None:
        return None

    def start(self, tool: str, arguments: Any, principal: Any, session: Any) -> TaskView:
        """Enqueue the tool's first run in ``session``'s transaction and commit it:
        the task exists (a ``tasks/get`` finds it) before the caller hears of it."""
        label = self.label_of(principal)
        task_id = _PREFIX + secrets.token_urlsafe(24)
        meta = {_META_KEY: {"server": self.server, "tool": tool, "principal": label,
                            "round": 0, "answered": {}, "cancelled": False}}
        self._enqueue(task_id, tool, arguments, label, None, meta, session)
        session.commit()
        view = self.get(task_id, principal)
        assert view is not None  # just committed, and ours
        return view

    def get(self, task_id: str, principal: Any) -> TaskView | None:
        found = self._owned(task_id, principal)
        return None if found is None else _view(*found)

    def update(self, task_id: str, principal: Any, responses: Mapping[str, Any]) -> bool:
        found = self._owned(task_id, principal)
        if found is None:
            return False
        session = get_state().db.session
        # One update of a task at a time: its row is locked until the commit
        # that writes the answers (and the next round's job, in one transaction).
        task = _lock(session, task_id)
        _, current = self._owned(task_id, principal) or found
        pending = _pending(task, current)
        if not pending or task.get("cancelled"):
            session.rollback()
            return True  # nothing asked (or cancelled): the same empty ack
        answered = dict(task.get("answered") or {})
        answered.update({key: value for key, value in responses.items() if key in pending})
        task["answered"] = answered
        if set(pending) <= set(answered):
            # Every request of this round has its answer: the tool runs again.
            task["round"] = int(task.get("round", 0)) + 1
            arguments = current.args[2] if len(current.args) > 2 else {}
            self._enqueue(_job_id(task_id, task["round"]), task["tool"], arguments,
                          task["principal"], answered, {_ROUND_OF: task_id}, session)
        _save(session, task_id, task)
        session.commit()
        return True

    def cancel(self, task_id: str, principal: Any) -> bool:
        found = self._owned(task_id, principal)
        if found is None:
            return False
        first, current = found
        if _view(first, current).status in ("completed", "failed", "cancelled"):
            return True  # an ended task stays as it is: the same empty ack
        session = get_state().db.session
        task = _lock(session, task_id)
        task["cancelled"] = True
        _save(session, task_id, task)
        session.commit()
        current.cancel()
        return True

    def _enqueue(self, job_id: str, tool: str, arguments: Any, label: str,
                 responses: dict[str, Any] | None, meta: dict[str, Any], session: Any) -> Job:
        return self.queue.enqueue_call(
            _RUN, args=(self.server, tool, arguments, label, responses), job_id=job_id,
            meta=meta, session=session, result_ttl=TASK_TTL_SECONDS,
            failure_ttl=TASK_TTL_SECONDS, description=f"MCP task: tool {tool!r}")

    def _owned(self, task_id: str, principal: Any) -> tuple[Job, Job] | None:
        """The task's first job and its current round's job, when ``principal`` owns it."""
        if not task_id.startswith(_PREFIX) or len(task_id) > 100 or "." in task_id:
            return None
        try:
            first = Job.fetch(task_id, broker=self.queue.broker)
        except NoSuchJobError:
            return None
        task = first.meta.get(_META_KEY)
        if (not isinstance(task, dict) or task.get("server") != self.server
                or task.get("principal") != self.label_of(principal)):
            return None
        rounds = int(task.get("round", 0))
        if not rounds:
            return first, first
        try:
            return first, Job.fetch(_job_id(task_id, rounds), broker=self.queue.broker)
        except NoSuchJobError:
            return None


def _job_id(task_id: str, round_: int) -> str:
    return task_id if round_ == 0 else f"{task_id}.{round_}"


def _lock(session: Any, task_id: str) -> dict[str, Any]:
    """The task's meta, its first job's row locked in ``session``'s transaction."""
    return dict((lock_job_meta(session, task_id) or {}).get(_META_KEY) or {})


def _save(session: Any, task_id: str, task: dict[str, Any]) -> None:
    write_job_meta(session, task_id, {_META_KEY: task})


def _pending(task: dict[str, Any], current: Job) -> dict[str, Any]:
    """The input requests of the current round the client has not answered yet."""
    if current.get_status(refresh=False) != "finished":
        return {}
    outcome = current.return_value(refresh=False)
    requests = outcome.get("inputRequests") if isinstance(outcome, dict) else None
    if not isinstance(requests, dict):
        return {}
    answered = task.get("answered") or {}
    return {key: request for key, request in requests.items() if key not in answered}


def _view(first: Job, current: Job) -> TaskView:
    """The task as a client sees it, from its jobs."""
    stamps = [t for t in (current.enqueued_at, current.started_at, current.ended_at)
              if t is not None]
    created = first.enqueued_at or datetime.now().astimezone()
    view = TaskView(task_id=first.id, status="working", created_at=created,
                    updated_at=max([created, *stamps], key=lambda t: t.timestamp()),
                    ttl_ms=TASK_TTL_SECONDS * 1000)
    status = current.get_status(refresh=False)
    if first.meta[_META_KEY].get("cancelled") or status == "canceled":
        view.status = "cancelled"
    elif status == "failed":
        view.status = "failed"
        view.error = {"code": INTERNAL_ERROR, "message": "the task's job failed on the worker"}
    elif status == "finished":
        outcome = current.return_value(refresh=False)
        outcome = outcome if isinstance(outcome, dict) else {}
        if "inputRequests" in outcome:
            view.status = "input_required"
            view.input_requests = _pending(first.meta[_META_KEY], current)
            view.status_message = "the tool asks for your input"
        elif "error" in outcome:
            view.status = "failed"
            view.error = outcome["error"]
        else:
            view.status = "completed"
            view.result = outcome.get("result") or {"content": [], "isError": False}
    else:
        view.status_message = "queued" if status in ("queued", "scheduled") else "running"
    return view


class TaskBackends:
    """Several task backends as one: the agents' loops and the tools' jobs. A
    task id is one backend's (their shapes differ), so the first that knows it answers."""

    def __init__(self, *backends: TaskBackend) -> None:
        self.backends = backends

    def supports(self, tool: str) -> bool:
        return any(backend.supports(tool) for backend in self.backends)

    def created(self, tool: str, result: ToolResult, principal: Any) -> TaskView | None:
        for backend in self.backends:
            if backend.supports(tool):
                return backend.created(tool, result, principal)
        return None

    def get(self, task_id: str, principal: Any) -> TaskView | None:
        for backend in self.backends:
            view = backend.get(task_id, principal)
            if view is not None:
                return view
        return None

    def update(self, task_id: str, principal: Any, responses: Mapping[str, Any]) -> bool:
        return any(backend.update(task_id, principal, responses) for backend in self.backends)

    def cancel(self, task_id: str, principal: Any) -> bool:
        return any(backend.cancel(task_id, principal) for backend in self.backends)
