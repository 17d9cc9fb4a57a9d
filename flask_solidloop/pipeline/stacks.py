"""Build the LLM and tool stacks of one turn: the defaults, then the app's
global hooks, then the agent's own ``configure_*_middlewares``."""

from __future__ import annotations

import itertools
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


def opens_shell_in_claim(state: SolidLoopState, agent: AgentLike) -> bool:
    """Whether ``agent``'s LLM stack sends its request right after its
    initialization (the default): then nothing in between can end the turn
    without a request, and the turn's shell may be written with its claim
    (AgentInitialization; for an adopted turn, the tool answer's commit)."""
    from .llm_stack import AgentInitialization, NetworkCalling

    def _is(middleware: object, cls: type) -> bool:
        return isinstance(middleware, type) and issubclass(middleware, cls)

    return any(_is(first, AgentInitialization) and _is(then, NetworkCalling)
               for first, then in itertools.pairwise(llm_stack(state, agent).middlewares))
