"""Agents as tools: ``start_<agent>``, ``status_<agent>``, ``approve_<agent>`` and
``deny_<agent>`` per agent.

This module owns the toolset the blueprint builds for ``agents=[...]``. The
start tool starts a durable loop through the Agent API (``Agent.start``; the
caller's principal label becomes the loop's subject, ``("mcp_principal",
label)``, and is kept in its state), and returns the loop id at once: the loop
runs on the workers, so a client that disconnects loses nothing. The status
tool reads the loop through loops.queries, with the tool calls that await a
decision or a result; approve and deny decide a call that awaits an approval
through the Agent API (``by`` is ``mcp:<principal>``). Each answers only the
principal who started the loop.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidArgumentError
from ..loops import pending, queries
from ..mcp.toolset import CallContext, Toolset
from ..state import get_state

__all__ = ["PRINCIPAL_SUBJECT_TYPE", "agent_toolset", "tool_suffix"]

#: The loop's ``subject_type`` for loops started by an outside MCP client.
PRINCIPAL_SUBJECT_TYPE = "mcp_principal"


def tool_suffix(agent_name: str) -> str:
    """An agent name as a tool-name suffix every LLM provider accepts (no dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", agent_name)[:100]


def agent_toolset(name: str, agents: list[Any], label_of: Any) -> Toolset:
    """One toolset with the start and status tools of each agent class."""
    toolset = Toolset(f"{name}-agents")
    for agent_cls in agents:
        _add_agent(toolset, agent_cls, label_of)
    return toolset


def _add_agent(toolset: Toolset, agent_cls: Any, label_of: Any) -> None:
    agent_name = agent_cls._registered_name()
    suffix = tool_suffix(agent_name)
    summary = (agent_cls.__doc__ or "").strip().split("\n\n")[0].strip()
    about = f" {summary}" if summary else ""

    def start(message: str, ctx: CallContext) -> dict[str, Any]:
        """Start a loop.

        Args:
            message: The task, as a message to the agent.
        """
        label = label_of(ctx.principal)
        loop = agent_cls.start(message=message, subject=(PRINCIPAL_SUBJECT_TYPE, label),
                               state={"mcp_principal": label})
        return {"loop_id": loop.id, "status": loop.status,
                "next": f"call status_{suffix} with this loop_id to follow it"}

    def owned(loop_id: int, ctx: CallContext) -> tuple[Any, str]:
        """The caller's loop of this agent, and the caller's label."""
        label = label_of(ctx.principal)
        loop = queries.get_loop(get_state().db.session, loop_id)
        if (loop is None or loop.agent_name != agent_name
                or loop.subject_type != PRINCIPAL_SUBJECT_TYPE or loop.subject_id != label):
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
        answer = None
        if loop.status == "completed":
            for message in reversed(queries.messages(session, loop.id)):
                if message.role == "assistant" and message.content:
                    answer = message.content
                    break
        result: dict[str, Any] = {"loop_id": loop.id, "status": loop.status,
                                  "steps": loop.step_count}
        if answer is not None:
            result["answer"] = answer
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

    toolset.add_tool(start, name=f"start_{suffix}", description=(
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


def _pending(call: Any) -> dict[str, Any]:
    """A waiting call as the status tool shows it."""
    return {"tool_call_id": call.id, "tool": call.name, "arguments": call.arguments,
            "since": call.created_at.isoformat(),
            "times_out_at": call.wait_deadline.isoformat() if call.wait_deadline else None}
