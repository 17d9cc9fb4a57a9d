"""Whether a new tool call waits, decided when the model's answer is parsed
(ResponseParsing): for an approval, or for a result the host supplies
(docs/decisions/0017-waiting-loops.md).

A call waits for an approval when its tool says so (``requires_approval=``
True, or a policy callable that returns True for the call's arguments) or when
the agent's ``approval_policy`` does (the way to gate tools of remote servers,
whose definitions the app does not own). A ``deferred`` tool's call always
waits for its result. A policy that raises makes the call wait: an error in a
safety check must not let the action through.

A child agent's call (an ``mcps`` entry with ``agent=``) waits for its result
too, the child's end: :func:`child_start` prepares the loop its turn's end
starts (loops/store/children.py), or why it cannot start.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..loops.store import APPROVAL, RESULT, CallWait, ChildStart
from ..mcp.registry import AgentServer, ToolsetServer, agent_name_of
from ..mcp.toolset import NO_WAIT, CallContext, WaitRule

if TYPE_CHECKING:
    from ..mcp.registry import ToolRoute
    from .context import LlmContext

logger = logging.getLogger("flask_solidloop.approvals")


def tool_wait_rule(route: ToolRoute | None) -> WaitRule:
    """The waiting rule its tool declares (an in-process toolset's tool), or none."""
    if route is None or not isinstance(route.server, ToolsetServer):
        return NO_WAIT
    try:
        return route.server.toolset.get(route.tool_name).wait
    except KeyError:  # UnknownToolError: gone since the tools were listed
        return NO_WAIT


def call_wait(ctx: LlmContext, name: str, route: ToolRoute | None,
              arguments: dict[str, Any] | None) -> CallWait | None:
    """How the call the model asked for (``name``, as advertised) waits, or None
    when it runs at once. A call whose arguments are not a JSON object never
    waits: it runs into its correctable error, which the model reads."""
    if arguments is None:
        return None
    if route is not None and isinstance(route.server, AgentServer):
        return CallWait(RESULT, None, child=child_start(ctx, route.server.entry["agent"],
                                                        arguments))
    rule = tool_wait_rule(route)
    if rule.agent is not None:  # a toolset's agent_tool
        return CallWait(RESULT, rule.result_timeout,
                        child=child_start(ctx, rule.agent, arguments))
    if rule.deferred:
        return CallWait(RESULT, rule.result_timeout)
    policy = ctx.agent.approval_policy
    if rule.requires_approval is False and _is_default(policy):
        return None
    call_ctx = CallContext(agent=ctx.agent, loop=ctx.loop, principal=ctx.agent.mcp_principal(),
                           server_name=route.server_name if route else None,
                           tool_name=route.tool_name if route else None)
    needs = _asks(rule.requires_approval, (arguments, call_ctx), f"requires_approval of {name!r}")
    if not needs and not _is_default(policy):
        needs = _asks(policy, (name, arguments, call_ctx), f"approval_policy for {name!r}")
    if not needs:
        return None
    timeout = rule.approval_timeout if rule.approval_timeout is not None \
        else ctx.state.config.approval_timeout
    return CallWait(APPROVAL, timeout, rule.on_timeout)


def child_start(ctx: LlmContext, spec: Any, arguments: dict[str, Any]) -> ChildStart:
    """The child loop a call of a child agent's tool starts (``spec``: the
    agent class or registered name): its agent, system prompt, message (the
    call's ``message``), budget and structured output's schema; or a refusal,
    which the model reads as the call's error result and can correct: no
    message, or an agent that cannot run (not registered, a broken
    definition)."""
    name = agent_name_of(spec) or str(spec)
    message = arguments.get("message")
    if not isinstance(message, str) or not message.strip():
        return ChildStart(name, refusal=(
            f'the child agent {name!r} was not started: call it with {{"message": "..."}}, '
            "a non-empty message (the task, with everything the agent needs to know)"))
    try:
        agent = ctx.state.agent_for(name)
        agent.validate()
        prompt = str(agent.render_system_prompt())  # type: ignore[attr-defined]
        budget = agent.budget_limits() or None  # type: ignore[attr-defined]
        output_schema = agent.output_schema()  # type: ignore[attr-defined]
    except Exception as exc:
        logger.warning("loop %s: child agent %r cannot start: %s", ctx.loop_id, name, exc)
        return ChildStart(name, refusal=f"the child agent {name!r} was not started: {exc}")
    return ChildStart(name, prompt, message, budget, output_schema=output_schema)


def _is_default(policy: Any) -> bool:
    """The base Agent's policy (no call needs an approval), not overridden: its
    reading would only cost the loop's row."""
    return bool(getattr(policy, "solidloop_default", False))


def _asks(policy: Any, args: tuple[Any, ...], what: str) -> bool:
    """A policy's answer: a bool as it is, a callable's result; True when it raises."""
    if isinstance(policy, bool):
        return policy
    try:
        return bool(policy(*args))
    except Exception:
        logger.exception("%s raised; the call waits for an approval", what)
        return True
