"""The host's ``on_loop_end`` hooks, run inside the transaction that ends a loop.

Every transition that ends a loop (its final answer, a failure, a stop)
takes a :class:`LoopEnds` and, when its fenced statement changed the loop,
calls :func:`run_loop_end_hooks` before its COMMIT: what a hook writes (a
notification job enqueued with ``session=session``, a row of the host's)
commits with the ending, or not at all. A transition whose fence found the
loop taken over by a newer generation wrote nothing, and runs no hook.

Each hook runs in a savepoint: if it raises, its writes are undone, the error
is logged, and the loop ends all the same.

A child agent's loop (one with a parent's tool call) has one more thing done
in that transaction, before the host's hooks: its end decided as its
parent's call's result (children.decide_parent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._typing import SessionLike, real_session
from ...models import Loop
from ...models.loop import LoopStatus

if TYPE_CHECKING:
    from ...state import SolidLoopState

logger = logging.getLogger("flask_solidloop.store")

#: A host function called as ``hook(loop, session)`` when a loop ends.
LoopEndHook = Callable[[Loop, SessionLike], Any]

#: The statuses whose transitions run the hooks.
ENDED = frozenset({LoopStatus.COMPLETED.value, LoopStatus.FAILED.value})


@dataclass(frozen=True)
class LoopEnds:
    """The host's hooks an ending may run: ``(agent name or None, hook)`` pairs,
    None meaning every agent's loops."""

    hooks: tuple[tuple[str | None, LoopEndHook], ...] = ()
    #: The app's state when the ending may be a child agent's, whose end
    #: decides its parent's call (None: it is not, nothing to decide).
    parents: Any = None

    def __bool__(self) -> bool:
        return bool(self.hooks) or self.parents is not None

    def for_agent(self, agent_name: str | None) -> LoopEnds:
        """The hooks that apply to the loops of ``agent_name``."""
        return LoopEnds(tuple((agent, hook) for agent, hook in self.hooks
                              if agent is None or agent == agent_name), self.parents)

    def apply_to(self, to: str) -> bool:
        """Whether a transition to ``to`` runs these hooks."""
        return bool(self) and str(to) in ENDED


NO_HOOKS = LoopEnds()


def loop_ends(state: SolidLoopState, agent: str | Loop | None = None) -> LoopEnds:
    """What the end of a loop runs in its transaction: the host's
    ``on_loop_end`` hooks for the loops of ``agent`` (an agent's name, or the
    loop itself; None: all of them, each applied when a loop of its agent
    ends), and, for a child agent's loop (given the loop, or None: any loop
    may be one), the decision on its parent's call."""
    agent_name = agent.agent_name if isinstance(agent, Loop) else agent
    child = agent is None or (isinstance(agent, Loop) and agent.parent_tool_call_id is not None)
    hooks = tuple(state.extension.loop_end_hooks)
    if not hooks and not child:
        return NO_HOOKS
    ends = LoopEnds(hooks, state if child else None)
    return ends if agent_name is None else ends.for_agent(agent_name)


def run_loop_end_hooks(session: SessionLike, loop_id: int, ends: LoopEnds | None) -> None:
    """Run the hooks that apply to the loop ``loop_id``, which the session's
    open transaction has just ended, each in a savepoint, with the loop as
    that transaction now sees it."""
    if not ends:
        return
    loop = session.get(Loop, loop_id, populate_existing=True)
    if loop is None:
        return
    if ends.parents is not None and loop.parent_tool_call_id is not None \
            and loop.status in ENDED:
        from .children import decide_parent  # children.py builds on commands.py, on this

        decide_parent(ends.parents, session, loop)
    for agent, hook in ends.hooks:
        if agent is not None and agent != loop.agent_name:
            continue
        savepoint = real_session(session).begin_nested()
        try:
            hook(loop, session)
        except Exception:
            savepoint.rollback()
            logger.exception("on_loop_end hook %s raised for loop %s; the loop ended all the "
                             "same, without what the hook wrote",
                             getattr(hook, "__qualname__", hook), loop_id)
        else:
            savepoint.commit()
