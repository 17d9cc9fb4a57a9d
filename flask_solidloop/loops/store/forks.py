"""A fork: a new loop that starts from another's history up to a message
(``Agent(loop).fork``; docs/decisions/0039-forks.md), written in one
transaction with its first job, as a start is.

Where a fork point falls, and what is copied:

- The history is the loop's visible, completed messages (hidden shells and
  wire-log events are never copied: the fork's own requests are its record)
  up to and including the fork point, in the history's order (a summary, with
  the messages it replaced left out: the original keeps them).
- A tool phase is copied whole or not at all. When an assistant message that
  asked for tools is in that range and every one of its calls has been
  answered, its calls are copied with their results and answers, the answers
  after the fork point included: forking at the assistant message, or at any
  of its answers, gives the history the loop's next LLM turn read. When one
  of its calls has no answer yet (a phase still running, or waiting), the
  fork point moves back to just before that assistant message, and the fork's
  first turn asks the model again.
- With ``message``, the last user message of that history is replaced: the
  history ends just before it, then ``message`` follows (what came after the
  old message answered it, and is not copied).

The fork must end where a model has something to answer: a history without a
user message, or one that ends with the assistant's answer, is refused with
an error naming the fork point to use instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import signals
from ..._typing import SessionLike
from ...errors import InvalidArgumentError
from ...models import Loop
from ...models.loop import LoopStatus
from ...telemetry import tracing
from .. import sql
from .caps import fair_ranks
from .commands import new_message
from .transaction import fetch_row, fetch_rows, joins

if TYPE_CHECKING:
    from ...state import SolidLoopState


@dataclass(frozen=True)
class ForkPlan:
    """What a fork copies: the messages and tool calls, by their old ids in
    order, and whether the last user message among them is replaced."""

    messages: list[int]
    calls: list[int]
    replaced: int | None = None


def plan_fork(rows: Sequence[Sequence[Any]], at_message_id: int, *, loop_id: int,
              replace: bool) -> ForkPlan:
    """The copy for a fork of ``loop_id`` at ``at_message_id`` from its rows
    (loops/sql.FORK_ROWS, calls first): see the module. InvalidArgumentError,
    naming the fix, when the fork point is not in its history or leaves the
    model nothing to answer."""
    calls_of: dict[int, list[int]] = {}
    answer_of: dict[int, int | None] = {}
    messages: list[tuple[int, str]] = []
    for is_call, row_id, role, ref, answer, _sort_key in rows:
        if is_call:
            calls_of.setdefault(ref, []).append(row_id)
            answer_of[row_id] = answer
        else:
            messages.append((row_id, role))
    # Positions, not ids, order the history: a summary sits where the first
    # message it replaced sat (loops/sql.HISTORY_ROWS), whatever its own id.
    place = {row_id: index for index, (row_id, _) in enumerate(messages)}
    visible = set(place)
    if at_message_id not in visible:
        raise InvalidArgumentError(f"message {at_message_id} is not in loop {loop_id}'s history")
    kept: list[tuple[int, str]] = []
    calls: list[int] = []
    answers: set[int] = set()
    for row_id, role in messages:
        if place[row_id] > place[at_message_id] and row_id not in answers:
            break
        asked = calls_of.get(row_id, []) if role == "assistant" else []
        if asked and not all(answer_of[call] in visible for call in asked):
            break  # a phase not over: the fork point moves back to before it
        kept.append((row_id, role))
        calls.extend(asked)
        answers.update(answer_of[call] for call in asked)  # type: ignore[misc]
    replaced = None
    if replace:
        users = [row_id for row_id, role in kept if role == "user"]
        if users:
            replaced = users[-1]
            dropped = {row_id for row_id, _ in kept if place[row_id] >= place[replaced]}
            kept = [(row_id, role) for row_id, role in kept if row_id not in dropped]
            calls = [call for call in calls if answer_of[call] not in dropped]
    elif not any(role == "user" for _, role in kept):
        raise InvalidArgumentError(
            f"loop {loop_id}'s history up to message {at_message_id} has no user message: "
            "fork at the first user message or later, or pass message= to give one")
    elif kept[-1][1] == "assistant" and not calls_of.get(kept[-1][0]):
        users = [row_id for row_id, role in kept if role == "user"]
        raise InvalidArgumentError(
            f"message {kept[-1][0]} is the assistant's answer: a fork there leaves the model "
            f"nothing to answer; fork at user message {users[-1]} to ask again, or pass "
            "message= to replace it")
    return ForkPlan([row_id for row_id, _ in kept], calls, replaced)


@dataclass(frozen=True)
class ForkedLoop:
    """A fork written (not yet committed): the new loop and what it copied."""

    loop: Loop
    plan: ForkPlan


@joins
def fork_loop(state: SolidLoopState, session: SessionLike, loop_id: int,
              at_message_id: int | None, *, message: str | None,
              llm_override: dict[str, Any] | None) -> ForkedLoop:
    """Insert a fork of ``loop_id`` at ``at_message_id`` (see the module; None:
    at its first user message, a replay): the new loop, queued, with the
    origin recorded, ``llm_override`` merged over the original's, its copied
    history (and ``message`` in place of its last user message) and its first
    llm_turn job. The caller commits (and may add its own writes to the same
    transaction). InvalidArgumentError, naming the fix, for a loop or a
    message that cannot be forked; nothing is written."""
    source = fetch_row(session, sql.FORK_SOURCE, {"loop_id": loop_id})
    if source is None:
        raise InvalidArgumentError(f"there is no loop {loop_id}: fork an existing loop "
                                   "(`flask solidloop list` shows them)")
    rows = fetch_rows(session, sql.FORK_ROWS, {"loop_id": loop_id})
    if at_message_id is None:
        users = [row[1] for row in rows if not row[0] and row[2] == "user"]
        if not users:
            raise InvalidArgumentError(f"loop {loop_id} has no user message in its history "
                                       "to start from")
        at_message_id = users[0]
    try:
        plan = plan_fork(rows, at_message_id, loop_id=loop_id, replace=message is not None)
    except InvalidArgumentError:
        point = fetch_row(session, sql.FORK_POINT, {"message_id": at_message_id})
        if point is None or point["loop_id"] != loop_id:
            where = "no message" if point is None else f"loop {point['loop_id']}'s message"
            raise InvalidArgumentError(
                f"message {at_message_id} is {where}, not one of loop {loop_id}'s: fork at "
                f"a message id that `flask solidloop status {loop_id}` lists") from None
        if point["compacted_by"] is not None:
            raise InvalidArgumentError(
                f"message {at_message_id} was compacted into summary {point['compacted_by']} "
                f"of loop {loop_id}: fork at the summary or a later message") from None
        if point["is_hidden"] or point["status"] != "completed":
            raise InvalidArgumentError(
                f"message {at_message_id} is a hidden {point['status']} shell, not part of "
                f"loop {loop_id}'s history: fork at a visible message") from None
        raise
    override = {**(source["llm_override"] or {}), **(llm_override or {})} or None
    budget = {key: value for key, value in (source["budget"] or {}).items()
              if key != "over_subject"} or None
    rank = fair_ranks(state, session, [(source["subject_type"], source["subject_id"])])[0]
    run = tracing.new_run()
    fork = Loop(agent_name=source["agent_name"], subject_type=source["subject_type"],
                subject_id=source["subject_id"], status=LoopStatus.QUEUED,
                state=dict(source["state"] or {}), budget=budget, fair_rank=rank, trace=run,
                forked_from_loop_id=loop_id, forked_at_message_id=at_message_id,
                llm_override=override, output_schema=source["output_schema"])
    session.add(fork)
    session.flush()
    ids = fetch_row(session, sql.FORK_IDS, {"messages": len(plan.messages),
                                            "calls": len(plan.calls)})
    assert ids is not None
    fetch_row(session, sql.FORK_COPY, {
        "loop_id": loop_id, "fork_id": fork.id,
        "old_messages": plan.messages, "new_messages": sorted(ids["messages"]),
        "old_calls": plan.calls, "new_calls": sorted(ids["calls"])})
    if message is not None:
        session.add(new_message(fork.id, "user", message))
        session.flush()
    with tracing.carrying(run["traceparent"] if run else None):
        state.dispatch.llm_turn(session, fork.id, first=True)
    signals.send_after_commit(session, signals.loop_started, loop_id=fork.id,
                              agent=source["agent_name"])
    return ForkedLoop(fork, plan)
