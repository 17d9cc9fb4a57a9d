"""Agents as tools: ``start_<agent>``, ``status_<agent>``, ``approve_<agent>`` and
``deny_<agent>`` per agent.

This module owns the toolset the blueprint builds for ``agents=[...]``, and
:class:`ExposedAgent`, the entry that lets the host shape an agent's start
tool. The start tool starts a durable loop through the Agent API
(``Agent.start``) and returns the loop id at once: the loop runs on the
workers, so a client that disconnects loses nothing. By default the caller's
principal label becomes the loop's subject, ``("mcp_principal", label)``; an
``ExposedAgent`` adds arguments to the tool's input schema and maps the
caller's principal and arguments to the loop's subject, state and message
(``on_start``). Either way the label is kept in the loop's state
(``mcp_principal``), and that is what binds the loop to its caller: the
status tool reads the loop through loops.queries, with the tool calls that
await a decision or a result; approve and deny decide a call that awaits an
approval through the Agent API (``by`` is ``mcp:<principal>``). Each answers
only the principal who started the loop.

:class:`LoopTasks` is the same loops as MCP tasks (the blueprint's
:class:`.tasks.TaskBackend`): the task id is the loop id, a loop waiting on
approvals is ``input_required`` (``tasks/update`` decides them), and
``tasks/cancel`` stops the loop with :data:`CANCEL_REASON`, the reason that
tells a cancelled task from a failed one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jsonschema import exceptions as schema_errors
from jsonschema.validators import Draft202012Validator
from mcp_types.jsonrpc import INTERNAL_ERROR

from ..agent import Agent
from ..errors import ConfigurationError, InvalidArgumentError, SolidLoopError
from ..loops import pending, queries
from ..mcp.toolset import CallContext, ToolResult, Toolset
from ..state import get_state
from .tasks import TaskView

__all__ = [
    "CANCEL_REASON",
    "PRINCIPAL_STATE_KEY",
    "PRINCIPAL_SUBJECT_TYPE",
    "ExposedAgent",
    "LoopTasks",
    "agent_toolset",
    "tool_suffix",
]

#: The loop's ``subject_type`` for loops started by an outside MCP client, unless
#: the host's ``on_start`` names another subject.
PRINCIPAL_SUBJECT_TYPE = "mcp_principal"
#: The loop-state key holding the label of the principal who started the loop:
#: the status, approve and deny tools answer only that principal.
PRINCIPAL_STATE_KEY = Agent.MCP_PRINCIPAL_STATE_KEY
#: The stop reason of a loop a client cancelled with ``tasks/cancel``: such a
#: loop ends ``failed`` (the host may resume it) and its task reads ``cancelled``.
CANCEL_REASON = "cancelled by the MCP client (tasks/cancel)"

_MESSAGE_SCHEMA = {"type": "string", "minLength": 1,
                   "description": "The task, as a message to the agent."}
_START_KEYS = ("subject", "state", "message")
_ARGUMENT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")

#: ``on_start(principal, arguments)``: the caller's principal (what ``auth``
#: returned) and the start tool's arguments, ``message`` included; returns a
#: mapping with any of ``subject``, ``state`` and ``message``, or None.
StartHook = Callable[[Any, dict[str, Any]], Mapping[str, Any] | None]


@dataclass(frozen=True)
class ExposedAgent:
    """An agent for ``mcp_blueprint(agents=[...])`` whose start tool the host shapes.

    ``arguments`` adds properties to ``start_<agent>``'s input schema, beside
    ``message`` (name -> JSON Schema); ``required`` names those the caller must
    pass. A call's arguments are checked against the whole schema (an unknown
    or ill-typed argument is a tool error naming it) before ``on_start`` sees
    them. ``on_start(principal, arguments)`` returns the loop's ``subject``
    (a model instance or a ``(type, id)`` tuple), its ``state`` and its
    ``message`` (each optional: the defaults are the principal's label as
    subject, an empty state and the caller's message), or raises to refuse
    the start (the client reads the message of an ``InvalidArgumentError``,
    or of any exception with ``expose_errors=True``). It runs in the
    request's app context, before the loop is written; what it adds to
    ``db.session`` commits with the loop.
    """

    agent: type[Agent]
    arguments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    required: Sequence[str] = ()
    on_start: StartHook | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.arguments, Mapping):
            raise ConfigurationError(
                "arguments", self.arguments,
                "must be a dict of argument name -> JSON Schema, e.g. "
                "{'ticket_id': {'type': 'integer'}}")
        for name, schema in self.arguments.items():
            if not isinstance(name, str) or not _ARGUMENT_NAME.match(name) or name == "message":
                raise ConfigurationError(
                    "arguments", name,
                    "argument names match ^[A-Za-z][A-Za-z0-9_]{0,63}$ and 'message' is "
                    "the start tool's own")
            if not isinstance(schema, Mapping):
                raise ConfigurationError(
                    f"arguments[{name!r}]", schema,
                    "must be a JSON Schema dict, e.g. {'type': 'integer'}")
        if isinstance(self.required, str) or not all(
                isinstance(name, str) for name in self.required):
            raise ConfigurationError("required", self.required,
                                     "must be a list of argument names")
        unknown = [name for name in self.required if name not in self.arguments]
        if unknown:
            raise ConfigurationError(
                "required", list(self.required),
                f"names {unknown} that arguments= does not declare; declare them there")
        if self.on_start is not None and not callable(self.on_start):
            raise ConfigurationError(
                "on_start", self.on_start,
                "must be a callable on_start(principal, arguments) returning a dict with "
                "any of 'subject', 'state', 'message'")
        try:
            Draft202012Validator.check_schema(self.input_schema())
        except schema_errors.SchemaError as exc:
            raise ConfigurationError(
                "arguments", dict(self.arguments),
                f"is not valid JSON Schema: {exc.message}") from None

    def input_schema(self) -> dict[str, Any]:
        """The start tool's input schema: ``message`` and the host's arguments."""
        return {"type": "object",
                "properties": {"message": dict(_MESSAGE_SCHEMA),
                               **{name: dict(schema) for name, schema in self.arguments.items()}},
                "required": ["message", *self.required],
                "additionalProperties": False}


def tool_suffix(agent_name: str) -> str:
    """An agent name as a tool-name suffix every LLM provider accepts (no dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", agent_name)[:100]


def agent_toolset(name: str, agents: list[type[Agent] | ExposedAgent],
                  label_of: Callable[[Any], str]) -> Toolset:
    """One toolset with the start, status, approve and deny tools of each agent."""
    toolset = Toolset(f"{name}-agents")
    for entry in agents:
        _add_agent(toolset, entry if isinstance(entry, ExposedAgent) else ExposedAgent(entry),
                   label_of)
    return toolset


def _add_agent(toolset: Toolset, exposed: ExposedAgent,
               label_of: Callable[[Any], str]) -> None:
    agent_cls = exposed.agent
    validator = Draft202012Validator(exposed.input_schema())
    agent_name = agent_cls._registered_name()
    suffix = tool_suffix(agent_name)
    summary = (agent_cls.__doc__ or "").strip().split("\n\n")[0].strip()
    about = f" {summary}" if summary else ""

    def start(call: CallContext, **arguments: Any) -> dict[str, Any]:
        """Start a loop."""
        problem = schema_errors.best_match(validator.iter_errors(arguments))
        if problem is not None:
            where = ".".join(str(part) for part in problem.absolute_path)
            raise InvalidArgumentError(
                f"invalid arguments for tool 'start_{suffix}': "
                f"{where + ': ' if where else ''}{problem.message}")
        label = label_of(call.principal)
        chosen = _run_on_start(exposed, call.principal, arguments)
        if PRINCIPAL_STATE_KEY in chosen.get("state", {}):
            raise ConfigurationError(
                "on_start", f"state[{PRINCIPAL_STATE_KEY!r}]",
                "is set by the blueprint (the caller's principal label, which binds the "
                "loop to its caller); store yours under another key")
        loop = agent_cls.start(
            message=chosen.get("message", arguments["message"]),
            subject=chosen.get("subject", (PRINCIPAL_SUBJECT_TYPE, label)),
            state={**chosen.get("state", {}), PRINCIPAL_STATE_KEY: label})
        return {"loop_id": loop.id, "status": loop.status,
                "next": f"call status_{suffix} with this loop_id to follow it"}

    def owned(loop_id: int, ctx: CallContext) -> tuple[Any, str]:
        """The caller's loop of this agent, and the caller's label."""
        label = label_of(ctx.principal)
        loop = queries.get_loop(get_state().db.session, loop_id)
        if (loop is None or loop.agent_name != agent_name
                or (loop.state or {}).get(PRINCIPAL_STATE_KEY) != label):
            raise InvalidArgumentError(f"no {agent_name} loop {loop_id} started by you; pass the "
                                       f"loop_id that start_{suffix} returned")
        return loop, label

    def status(loop_id: int, ctx: CallContext) -> dict[str, Any]:
        """Follow a loop.

        Args:
            loop_id: The id the start tool returned.
        """
        loop, _ = owned(loop_id, ctx)
        session = get_state().db.session
        answer = _final_answer(session, loop) if loop.status == "completed" else None
        result: dict[str, Any] = {"loop_id": loop.id, "status": loop.status,
                                  "steps": loop.step_count}
        if answer is not None:
            result["answer"] = answer
        if loop.output is not None:  # a structured-output agent's validated answer
            result["output"] = loop.output
        if loop.error_message:
            result["error"] = loop.error_message
        waiting = pending.awaiting_calls(session, loop_id=loop.id)
        for kind, key in (("approval", "pending_approvals"), ("result", "pending_results")):
            calls = [_pending(call) for call in waiting if call.waits_for == kind]
            if calls:
                result[key] = calls
        if waiting:
            result["next"] = (f"decide each pending approval with approve_{suffix} or "
                              f"deny_{suffix}")
        return result

    def approve(loop_id: int, tool_call_id: int, ctx: CallContext,
                arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """Approve a tool call of your loop that awaits an approval: its tool runs.

        Args:
            loop_id: The id the start tool returned.
            tool_call_id: A tool_call_id from the status tool's pending_approvals.
            arguments: Run the tool with these arguments instead of the ones the agent
                asked for (both are kept).
        """
        loop, label = owned(loop_id, ctx)
        decided = agent_cls(loop).approve(tool_call_id, by=f"mcp:{label}", arguments=arguments)
        return {"tool_call_id": tool_call_id, "decision": decided.decision,
                "status": "the tool runs" if decided.enqueued
                else "recorded; it takes effect when the loop is resumed"}

    def deny(loop_id: int, tool_call_id: int, reason: str, ctx: CallContext) -> dict[str, Any]:
        """Deny a tool call of your loop that awaits an approval: it never runs, and
        the agent reads your reason.

        Args:
            loop_id: The id the start tool returned.
            tool_call_id: A tool_call_id from the status tool's pending_approvals.
            reason: Why; the agent reads it as the call's result.
        """
        loop, label = owned(loop_id, ctx)
        decided = agent_cls(loop).deny(tool_call_id, reason, by=f"mcp:{label}")
        return {"tool_call_id": tool_call_id, "decision": decided.decision}

    toolset.add_tool(start, name=f"start_{suffix}", input_schema=exposed.input_schema(),
                     description=(
        f"Start the {agent_name} agent on a task; returns the id of its durable loop at "
        f"once (the work goes on in the background).{about}"))
    toolset.add_tool(status, name=f"status_{suffix}", description=(
        f"The status of a {agent_name} loop you started, with its final answer once it "
        "has completed, and the tool calls that await your approval."))
    toolset.add_tool(approve, name=f"approve_{suffix}", description=(
        f"Approve a tool call of a {agent_name} loop you started that awaits an approval "
        f"(see status_{suffix}); optionally with edited arguments."))
    toolset.add_tool(deny, name=f"deny_{suffix}", description=(
        f"Deny a tool call of a {agent_name} loop you started that awaits an approval; "
        "the agent reads the reason."))


def _final_answer(session: Any, loop: Any) -> str | None:
    """The last assistant text of a completed loop."""
    for message in reversed(queries.messages(session, loop.id)):
        if message.role == "assistant" and message.content:
            return str(message.content)
    return None


def _pending(call: Any) -> dict[str, Any]:
    """A waiting call as the status tool shows it."""
    return {"tool_call_id": call.id, "tool": call.name, "arguments": call.arguments,
            "since": call.created_at.isoformat(),
            "times_out_at": call.wait_deadline.isoformat() if call.wait_deadline else None}


def _run_on_start(exposed: ExposedAgent, principal: Any,
                  arguments: dict[str, Any]) -> dict[str, Any]:
    """What the host's ``on_start`` chose for the loop, checked; {} without a hook."""
    if exposed.on_start is None:
        return {}
    chosen = exposed.on_start(principal, dict(arguments))
    if chosen is None:
        return {}
    if not isinstance(chosen, Mapping) or set(chosen) - set(_START_KEYS):
        # The keys or the type, never the values: this error reaches the client.
        shape = sorted(map(str, chosen)) if isinstance(chosen, Mapping) else type(chosen).__name__
        raise ConfigurationError(
            "on_start", shape,
            "must return None or a dict with any of 'subject', 'state', 'message'")
    if "state" in chosen and not isinstance(chosen["state"], Mapping):
        raise ConfigurationError("on_start", type(chosen["state"]).__name__,
                                 "'state' must be a dict")
    return {key: (dict(value) if key == "state" else value) for key, value in chosen.items()}


# --------------------------------------------------------------------------- tasks

_TASK_ID_DIGITS = 18
_LIVE = ("running", "waiting")
_MESSAGE_LIMIT = 2000


class LoopTasks:
    """The exposed agents' loops as MCP tasks: the blueprint's
    :class:`~flask_solidloop.mcp_server.tasks.TaskBackend`.

    A call of ``start_<agent>`` makes the task (the loop it started); any
    other id, or a loop of another principal or of an agent this blueprint
    does not expose, is unknown. Reads go through loops.queries and
    loops.pending; decisions and the stop through the Agent API.
    """

    def __init__(self, agents: Iterable[type[Agent] | ExposedAgent],
                 label_of: Callable[[Any], str]) -> None:
        self.label_of = label_of
        self.agents: dict[str, type[Agent]] = {}
        self.start_tools: set[str] = set()
        for entry in agents:
            agent_cls = entry.agent if isinstance(entry, ExposedAgent) else entry
            agent_name = agent_cls._registered_name()
            self.agents[agent_name] = agent_cls
            self.start_tools.add(f"start_{tool_suffix(agent_name)}")

    def supports(self, tool: str) -> bool:
        return tool in self.start_tools

    def created(self, tool: str, result: ToolResult, principal: Any) -> TaskView | None:
        started = result.structured_content
        if result.is_error or not isinstance(started, dict):
            return None  # the start was refused: the caller reads the tool error
        loop_id = started.get("loop_id")
        return self.get(str(loop_id), principal) if isinstance(loop_id, int) else None

    def get(self, task_id: str, principal: Any) -> TaskView | None:
        loop = self._owned(task_id, principal)
        return None if loop is None else _view(loop)

    def update(self, task_id: str, principal: Any, responses: Mapping[str, Any]) -> bool:
        loop = self._owned(task_id, principal)
        if loop is None:
            return False
        by = f"mcp:{self.label_of(principal)}"
        session = get_state().db.session
        awaiting = {str(call.id): call.id
                    for call in pending.awaiting_calls(session, loop_id=loop.id)
                    if call.waits_for == "approval"}
        agent = self.agents[loop.agent_name](loop)
        for key, response in responses.items():
            call_id = awaiting.get(key)
            if call_id is None:
                continue  # decided already, or not a key we sent: nothing to do
            action = response.get("action") if isinstance(response, dict) else None
            content = response.get("content") if isinstance(response, dict) else None
            try:
                if action == "accept":
                    agent.approve(call_id, by=by)
                else:  # decline, cancel or anything else: the call never runs
                    reason = content.get("reason") if isinstance(content, dict) else None
                    agent.deny(call_id, str(reason) if reason else
                               f"the MCP client answered {str(action)[:20]!r} to the approval",
                               by=by)
            except SolidLoopError:
                # Another decision landed first (the status tool, an operator):
                # that one stands, and the answer is the same ack.
                session.rollback()
        return True

    def cancel(self, task_id: str, principal: Any) -> bool:
        loop = self._owned(task_id, principal)
        if loop is None:
            return False
        # An ended loop stays as it is: cancelling it is the same empty ack.
        self.agents[loop.agent_name](loop).stop(reason=CANCEL_REASON)
        return True

    def _owned(self, task_id: str, principal: Any) -> Any:
        if not (task_id.isascii() and task_id.isdigit() and len(task_id) <= _TASK_ID_DIGITS):
            return None
        loop = queries.get_loop(get_state().db.session, int(task_id))
        if (loop is None or loop.agent_name not in self.agents
                or (loop.state or {}).get(PRINCIPAL_STATE_KEY) != self.label_of(principal)):
            return None
        return loop


def _view(loop: Any) -> TaskView:
    """A loop as a task: its status mapped, and what that status carries."""
    session = get_state().db.session
    stamps = [t for t in (loop.updated_at, loop.started_at, loop.finished_at) if t is not None]
    view = TaskView(task_id=str(loop.id), status="working", created_at=loop.created_at,
                    updated_at=max([loop.created_at, *stamps], key=_aware))
    if loop.status == "completed":
        view.status = "completed"
        view.result = _tool_result(_final_answer(session, loop), loop.output)
    elif loop.status == "failed":
        if loop.error_message == CANCEL_REASON:
            view.status = "cancelled"
        else:
            view.status = "failed"
            view.error = {"code": INTERNAL_ERROR,
                          "message": loop.error_message or "the loop failed"}
    else:
        approvals = []
        if loop.status in _LIVE:
            approvals = [call for call in pending.awaiting_calls(session, loop_id=loop.id)
                         if call.waits_for == "approval"]
        if approvals:
            view.status = "input_required"
            view.input_requests = {str(call.id): _approval_request(call) for call in approvals}
            view.status_message = "tool calls await your approval"
        else:
            view.status_message = {"waiting": "waiting for a tool's result",
                                   "paused": "paused by the host"}.get(loop.status, loop.status)
    return view


def _aware(stamp: datetime) -> float:
    return stamp.timestamp()


def _tool_result(answer: str | None, output: Any) -> dict[str, Any]:
    """A completed loop as the ``CallToolResult`` its task carries."""
    text = answer if answer is not None else (
        json.dumps(output, ensure_ascii=False) if output is not None else "")
    result: dict[str, Any] = {"content": [{"type": "text", "text": text}], "isError": False}
    if isinstance(output, dict):
        result["structuredContent"] = output
    elif output is not None:
        result["structuredContent"] = {"output": output}
    return result


def _approval_request(call: Any) -> dict[str, Any]:
    """A call awaiting an approval as an ``elicitation/create`` input request:
    accept approves it, decline (with an optional reason) denies it."""
    arguments = json.dumps(call.arguments, ensure_ascii=False, default=str)
    message = (f"The agent asks to call the tool {call.name!r} with arguments {arguments}. "
               "Accept to run it; decline to deny it (the agent reads your reason).")
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT - 1] + "…"
    return {"method": "elicitation/create", "params": {
        "mode": "form", "message": message,
        "requestedSchema": {"type": "object", "properties": {"reason": {
            "type": "string", "description": "Why you decline (the agent reads it)"}}},
    }}
