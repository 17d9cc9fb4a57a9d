"""Build the LLM and tool stacks of one turn: the defaults, then the app's
global hooks, then the agent's own ``configure_*_middlewares``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AdoptedTurnShape:
    """What a tool answer that adopts the loop's next LLM turn may do for it in
    its own commit, given the agent's LLM stack."""

    #: The stack sends its request right after its initialization (the default):
    #: nothing in between can end the turn without a request, so the turn's
    #: shell may be written with its claim.
    open_shell: bool
    #: The stack starts with its initialization (only the built-in error handling
    #: before it): no host middleware runs before the history is read, so it may
    #: be read with the claim, under the loop row lock.
    read_history: bool


def adopted_turn_shape(state: SolidLoopState, agent: AgentLike, *,
                       builder: Builder | None = None) -> AdoptedTurnShape:
    """The shape of the agent's LLM stack; pass ``builder`` when the caller has
    built that stack already (a delivered turn then runs the same one)."""
    from .llm_stack import AgentInitialization, ErrorHandling, NetworkCalling

    def _is(middleware: object, cls: type) -> bool:
        return isinstance(middleware, type) and issubclass(middleware, cls)

    middlewares = list((builder or llm_stack(state, agent)).middlewares)
    initialization = next((i for i, m in enumerate(middlewares)
                           if _is(m, AgentInitialization)), None)
    return AdoptedTurnShape(
        open_shell=any(_is(first, AgentInitialization) and _is(then, NetworkCalling)
                       for first, then in itertools.pairwise(middlewares)),
        read_history=initialization is not None
        and middlewares[initialization] is AgentInitialization
        and all(m is ErrorHandling for m in middlewares[:initialization]))

