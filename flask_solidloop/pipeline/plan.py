"""Each agent's two stacks, built once, and what the durable writes may fuse
given their shape (:class:`StackPlan`).

The stacks are the defaults, then the app's global hooks, then the agent's
own ``configure_*_middlewares``. They are built once per agent class and set
of hooks in a process (a hook must not depend on the loop), and the plan is
read from them then, so no step inspects its neighbour and a tool turn knows
the next LLM turn's shape without building that stack:

* ``open_shell``: NetworkCalling follows AgentInitialization directly, so
  nothing in between can end a turn without a request: the claim that starts
  a turn writes its hidden shell too;
* ``read_history``: the LLM stack starts with AgentInitialization (the
  built-in ErrorHandling alone before it): no host middleware changes the
  conversation before it is read, so the claim reads it, under the loop row
  lock;
* ``fuse_outcome``: ResponseCreation follows ToolExecution directly: a call's
  result and its answer are one statement;
* ``parses_tool_text``: ToolCallXmlParser is in the LLM stack (streamed
  partials then hide call markup; so does an agent that prompts its tools as
  text, an option read per turn).
* ``hands_off``: the steps before NetworkCalling are ErrorHandling and
  AgentInitialization alone, so in async mode (SOLIDLOOP_LLM_IO) the turn
  thread may hand the request to the I/O loop and the rest of the stack run
  on a commit thread: no host middleware wraps the network call.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..loops.store import NextTurn
from ..state import AgentLike, SolidLoopState
from .builder import Builder, Handler, MiddlewareClass
from .llm_stack import DEFAULT_LLM_STACK, AgentInitialization, ErrorHandling, NetworkCalling
from .tool_stack import DEFAULT_TOOL_STACK, ResponseCreation, ToolExecution
from .xml_tools import ToolCallXmlParser

_STATE_KEY = "pipeline.stack_plans"
_lock = threading.Lock()


@dataclass(frozen=True)
class StackPlan:
    """An agent's stacks (outermost first) and what their shape allows."""

    llm: tuple[MiddlewareClass, ...]
    tool: tuple[MiddlewareClass, ...]
    open_shell: bool
    read_history: bool
    fuse_outcome: bool
    parses_tool_text: bool
    hands_off: bool = False

    @classmethod
    def of(cls, llm: Sequence[MiddlewareClass], tool: Sequence[MiddlewareClass]) -> StackPlan:
        """The plan of two stacks."""
        llm, tool = tuple(llm), tuple(tool)
        initialization = next((i for i, m in enumerate(llm) if m is AgentInitialization), None)
        return cls(
            llm=llm, tool=tool,
            open_shell=_follows(llm, AgentInitialization, NetworkCalling),
            read_history=initialization is not None
            and all(m is ErrorHandling for m in llm[:initialization]),
            fuse_outcome=_follows(tool, ToolExecution, ResponseCreation),
            parses_tool_text=ToolCallXmlParser in llm,
            hands_off=llm[:2] == (ErrorHandling, AgentInitialization)
            and llm[2:3] == (NetworkCalling,))

    @property
    def next_turn(self) -> NextTurn:
        """What a tool answer that claims the agent's next LLM turn does for it."""
        return NextTurn(open_shell=self.open_shell, read_history=self.read_history)

    def llm_handler(self) -> Handler:
        """The LLM stack chained for one turn (middlewares are made per turn: a
        host's may keep state of its own)."""
        return Builder(self.llm).build()

    def tool_handler(self) -> Handler:
        return Builder(self.tool).build()


def _follows(stack: Sequence[MiddlewareClass], first: type, then: type) -> bool:
    return any(a is first and b is then for a, b in itertools.pairwise(stack))


def _built(defaults: tuple[MiddlewareClass, ...],
           hooks: Sequence[Callable[[Builder], None]]) -> list[MiddlewareClass]:
    builder = Builder(defaults)
    for hook in hooks:
        hook(builder)
    return builder.middlewares


def stack_plan(state: SolidLoopState, agent: AgentLike) -> StackPlan:
    """The agent's plan, built on first use per agent class and hook set. A
    hook that raises raises here (and is tried again next time)."""
    extension = state.extension
    llm_hooks = tuple(extension.llm_middleware_hooks)
    tool_hooks = tuple(extension.tool_middleware_hooks)
    key: Any = (type(agent), llm_hooks, tool_hooks)
    plans: dict[Any, StackPlan] = state.extras.setdefault(_STATE_KEY, {})
    plan = plans.get(key)
    if plan is None:
        plan = StackPlan.of(
            _built(DEFAULT_LLM_STACK, (*llm_hooks, agent.configure_llm_middlewares)),
            _built(DEFAULT_TOOL_STACK, (*tool_hooks, agent.configure_tool_middlewares)))
        with _lock:
            plans[key] = plan
    return plan
