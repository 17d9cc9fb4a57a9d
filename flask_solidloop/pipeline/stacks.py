"""Build the LLM and tool stacks of one turn: the defaults, then the app's
global hooks, then the agent's own ``configure_*_middlewares``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..state import AgentLike, SolidLoopState
from .builder import Builder
from .llm_stack import DEFAULT_LLM_STACK
from .tool_stack import DEFAULT_TOOL_STACK


def _stack(defaults: tuple[type, ...], hooks: Sequence[Callable[[Builder], None]],
           agent_hook: Callable[[Builder], None]) -> Builder:
    builder = Builder(defaults)
    for hook in (*hooks, agent_hook):
        hook(builder)
    return builder


def llm_stack(state: SolidLoopState, agent: AgentLike) -> Builder:
    return _stack(DEFAULT_LLM_STACK, state.extension.llm_middleware_hooks,
                  agent.configure_llm_middlewares)


def tool_stack(state: SolidLoopState, agent: AgentLike) -> Builder:
    return _stack(DEFAULT_TOOL_STACK, state.extension.tool_middleware_hooks,
                  agent.configure_tool_middlewares)
