"""Child agents: a loop started by another loop's tool call, whose end is that
call's result (docs/decisions/0037-child-agents.md).

- **The start** joins the parent's turn end (:func:`start_children`, from
  ``finish_llm_turn``): the call is written as a deferred call (``waits_for =
  'result'``) by the same statement as ever, and the child loop, its messages
  and its first job are inserted in the same transaction. A child past
  SOLIDLOOP_MAX_AGENT_DEPTH, or of an agent that is already an ancestor (a
  cycle), is not started: the call is decided at once with an error result
  naming why, in the same transaction, and the model reads it.
- **The end** decides the parent's call in the child's final transaction
  (:func:`decide_parent`, from ``run_loop_end_hooks``), through the one
  compare-and-set every decision takes (waits.decide): the child's final
  answer, or an error result for a failure or a stop. A decision that
  landed first (a host's ``complete_call``, a timeout) wins, and the child's
  is dropped: exactly one result per call.
- **The cascades**: stop, force stop and freeze of a loop act on its
  descendants in the same transaction (commands.py, with :func:`lock_tree`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._typing import SessionLike, real_session
from ...errors import DecisionConflictError, InvalidArgumentError
from ...mcp.toolset import ToolResult
from ...models import Loop
from ...models.loop import LoopStatus
from .. import queries, sql
from .commands import create_loop
from .transaction import fetch_rows, joins
from .waits import COMPLETED, RESULT, decide

if TYPE_CHECKING:
    from ...state import SolidLoopState

logger = logging.getLogger("flask_solidloop.store")

#: Who a child's result, or a refusal to start one, is decided by.
REFUSED_BY = "solidloop"


@dataclass(frozen=True)
class ChildStart:
    """A child loop a tool call asks for, as the parent's turn prepared it: its
    agent's registered name, system prompt, first message, own budget and
    structured output's schema; or
    ``refusal``, why it cannot start (the call's error result)."""

    agent_name: str
    system_prompt: str = ""
    message: str = ""
    budget: dict[str, float] | None = None
    refusal: str | None = None
    #: The child agent's ``output_type`` as JSON Schema: its loop answers with
    #: a validated object, which the parent's call reads as its result.
    output_schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class TreeLoop:
    """One loop of a locked tree (:func:`lock_tree`)."""

    id: int
    status: str
    depth: int
    frozen: bool


@joins
def lock_tree(session: SessionLike, loop_id: int) -> list[TreeLoop]:
    """The loop and all its descendants, locked in the session's transaction,
    deepest first and the loop itself last (the lock order a child's ending
    keeps: child, then parent)."""
    return [TreeLoop(int(row[0]), str(row[1]), int(row[2]), bool(row[3]))
            for row in fetch_rows(session, sql.LOCK_TREE, {"loop_id": loop_id})]


def depth_refusal(agent_name: str, depth: int, limit: int) -> str:
    """Why a child ``depth`` levels deep is not started."""
    return (f"the child agent {agent_name!r} was not started: it would be {depth} levels "
            f"deep, past SOLIDLOOP_MAX_AGENT_DEPTH ({limit})")


def cycle_refusal(agent_name: str, chain: list[str]) -> str:
    """Why a child whose agent is already an ancestor is not started."""
    path = " -> ".join([*chain, agent_name])
    return (f"the child agent {agent_name!r} was not started: it is already an ancestor "
            f"of this loop, a cycle ({path})")


@joins
def start_children(state: SolidLoopState, session: SessionLike, loop_id: int,
                   children: list[tuple[int, ChildStart]], *, sequential: bool) -> list[int]:
    """In the parent's turn-end transaction, after its calls are written: a
    child loop for each ``(tool call id, ChildStart)``, with its first job, or
    the call decided with the refusal. The ids of the loops started."""
    if not children:
        return []
    # The parent first, then its ancestors (read under the parent's lock, which
    # the turn's end holds: a loop's ancestors never change).
    chain = fetch_rows(session, sql.ANCESTORS,
                       {"loop_id": loop_id})
    parent = chain[0]
    depth = int(parent[2]) + 1
    ancestors = [str(row[1]) for row in reversed(chain)]
    limit = state.config.max_agent_depth
    started = []
    for call_id, child in children:
        refusal = child.refusal
        if refusal is None and depth > limit:
            refusal = depth_refusal(child.agent_name, depth, limit)
        if refusal is None and child.agent_name in ancestors:
            refusal = cycle_refusal(child.agent_name, ancestors)
        if refusal is not None:
            result = ToolResult.error(refusal)
            result.error_kind = "child_refused"
            decide(state, session, call_id, waits_for=RESULT, decision=COMPLETED,
                   by=REFUSED_BY, result=result, sequential=sequential)
            continue
        loop = create_loop(state, session, agent_name=child.agent_name,
                           subject_type=parent[3], subject_id=parent[4],
                           system_prompt=child.system_prompt, message=child.message,
                           loop_state={}, enqueue=True, budget=child.budget,
                           output_schema=child.output_schema, parent=(loop_id, call_id, depth))
        started.append(loop.id)
    return started


@joins
def child_result(session: SessionLike, loop: Loop) -> ToolResult:
    """What the parent's call reads of its child's end: the final answer (its
    structured output when the loop has one), or an error for a failure or a
    stop."""
    if loop.status == LoopStatus.COMPLETED:
        output = loop.output
        if output is not None:
            return ToolResult(content=[{"type": "text", "text": json.dumps(output)}],
                              structured_content=output if isinstance(output, dict) else None)
        answer = queries.final_answer(session, loop.id) or ""
        return ToolResult(content=[{"type": "text", "text": answer}])
    reason = loop.error_message or "no reason recorded"
    result = ToolResult.error(
        f"the child agent {loop.agent_name!r} (loop {loop.id}) did not complete: {reason}")
    result.error_kind = "child_failed"
    return result


@joins
def decide_parent(state: SolidLoopState, session: SessionLike, loop: Loop) -> bool:
    """In a child loop's ending transaction: its result decided as its parent's
    call's, in a savepoint. False when the loop is no child, or a decision
    landed on the call first (that one stands)."""
    call_id = loop.parent_tool_call_id
    if call_id is None or loop.parent_loop_id is None:
        return False
    result = child_result(session, loop)
    sequential = False
    parent = session.get(Loop, loop.parent_loop_id)
    if parent is not None:
        try:
            sequential = bool(state.agent_for(parent.agent_name, parent)
                              .option("sequential_tool_calls"))
        except Exception:  # an agent no longer registered: its calls run in parallel
            sequential = False
    savepoint = real_session(session).begin_nested()
    try:
        decide(state, session, call_id, waits_for=RESULT, decision=COMPLETED,
               by=f"loop {loop.id}", result=result, sequential=sequential)
    except (DecisionConflictError, InvalidArgumentError) as exc:
        savepoint.rollback()
        logger.info("loop %s ended; its parent's call %s was already answered (%s)",
                    loop.id, call_id, exc)
        return False
    savepoint.commit()
    return True
