"""Build the LLM and tool stacks of one turn: the defaults, then the app's
global hooks, then the agent's own ``configure_*_middlewares``."""

from __future__ import annotations

from ..state import AgentLike, SolidLoopState
from .builder import Builder
from .llm_stack import DEFAULT_LLM_STACK
from .tool_stack import DEFAULT_TOOL_STACK


def llm_stack(state: SolidLoopState, agent: AgentLike) -> Builder:
    builder = Builder(DEFAULT_LLM_STACK)
    for hook in state.extension.llm_middleware_hooks:
        hook(builder)
    agent.configure_llm_middlewares(builder)
    return builder


def tool_stack(state: SolidLoopState, agent: AgentLike) -> Builder:
    builder = Builder(DEFAULT_TOOL_STACK)
    for hook in state.extension.tool_middleware_hooks:
        hook(builder)
    agent.configure_tool_middlewares(builder)
    return builder
