"""Creating a loop, and the host's commands on one: pause, stop, force stop,
freeze, unfreeze, observe and resume (loops/control.py is their facade).

Host commands carry no fence: the host outranks any generation. Each takes
the loop row's lock in its first statement, and a turn of the old generation
finds its fence closed and writes nothing.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from ... import signals
from ..._typing import SessionLike
from ...mcp.toolset import ToolResult
from ...models import RESUMABLE_STATUSES, Loop, Message, ToolCall
from ...models.loop import LoopStatus
from ...telemetry import tracing
from .. import queries, sql, storable
from .caps import fair_ranks
from .ending import LoopEnds, run_loop_end_hooks
from .transaction import commits, execute, fetch_row, fetch_rows, joins

if TYPE_CHECKING:
    from ...state import SolidLoopState

logger = logging.getLogger("flask_solidloop.store")

_STOPPABLE = (LoopStatus.INIT, LoopStatus.QUEUED, LoopStatus.RUNNING, LoopStatus.WAITING,
              LoopStatus.PAUSED)
#: What pause and freeze stop: a loop that runs, is about to, or waits.
_LIVE = (LoopStatus.QUEUED, LoopStatus.RUNNING, LoopStatus.WAITING)
#: The reason a freeze gives the loop it pauses (unfreeze clears it again).
FROZEN = "frozen"


def applicable(status: str, *, frozen: bool, observed: bool) -> tuple[str, ...]:
    """The host commands that would change a loop in ``status`` (``frozen``,
    ``observed``), from the same transitions the commands below take: what an
    operator may be offered. Resume is listed for the statuses it re-enters
    (RESUMABLE_STATUSES) unless the loop is frozen."""
    ended = status in (LoopStatus.COMPLETED, LoopStatus.FAILED)
    offered = {
        "pause": status in _LIVE,
        "resume": status in RESUMABLE_STATUSES and not frozen,
        "stop": status in _STOPPABLE,
        "force_stop": status in _STOPPABLE,
        "freeze": not frozen and not ended,
        "unfreeze": frozen,
        "observe": not observed,
        "unobserve": observed,
    }
    return tuple(name for name, ok in offered.items() if ok)


def new_message(loop_id: int, role: str, content: str, **fields: Any) -> Message:
    """A new message row with storable content (flagged when it had to change)."""
    cleaned, meta = storable.message_content(content, fields.pop("meta", None))
    return Message(loop_id=loop_id, role=role, content=cleaned, meta=meta, **fields)


@joins
def create_loop(state: SolidLoopState, session: SessionLike, *, agent_name: str,
                subject_type: str | None, subject_id: str | None, system_prompt: str,
                message: str, loop_state: dict[str, Any], enqueue: bool,
                budget: dict[str, float] | None = None,
                output_schema: dict[str, Any] | None = None,
                parent: tuple[int, int, int] | None = None) -> Loop:
    """Insert a loop (queued, or init), its system and user messages and, when
    ``enqueue``, its first llm_turn job. The caller commits, and may add its
    own writes to the same transaction. ``budget``: the loop's own limits;
    ``output_schema``: its structured output's JSON Schema; ``parent``: a
    child agent's ``(parent loop, parent tool call, depth)``."""
    rank = fair_ranks(state, session, [(subject_type, subject_id)])[0]
    # The run's trace context (None when tracing is off): its first job carries
    # it. A loop created without its job has no run yet: its resume begins one.
    run = tracing.new_run() if enqueue else None
    loop = Loop(agent_name=agent_name, subject_type=subject_type, subject_id=subject_id,
                status=LoopStatus.QUEUED if enqueue else LoopStatus.INIT,
                state=dict(loop_state), budget=budget or None, fair_rank=rank, trace=run,
                output_schema=output_schema)
    if parent is not None:
        loop.parent_loop_id, loop.parent_tool_call_id, loop.depth = parent
    session.add(loop)
    session.flush()
    if system_prompt:
        session.add(new_message(loop.id, "system", system_prompt))
    session.add(new_message(loop.id, "user", message))
    session.flush()
    if enqueue:
        with tracing.carrying(run["traceparent"] if run else None):
            state.dispatch.llm_turn(session, loop.id, first=True)
    signals.send_after_commit(session, signals.loop_started, loop_id=loop.id, agent=agent_name)
    return loop


@dataclass(frozen=True)
class NewLoop:
    """One loop of a bulk start, checked: its subject's key, state and message."""

    subject_type: str | None
    subject_id: str | None
    state: dict[str, Any]
    message: str


@joins
def create_loops(state: SolidLoopState, session: SessionLike, *, agent_name: str,
                 system_prompt: str, loops: Sequence[NewLoop], enqueue: bool,
                 output_schema: dict[str, Any] | None = None) -> list[int]:
    """Many loops of one agent, as :func:`create_loop` writes one, in three
    statements whatever their number: their ids, the loops with their system
    and user messages (loops/sql.START_MANY), and, when ``enqueue``, their first
    jobs with one NOTIFY. Their ids, in the order given; the caller commits."""
    if not loops:
        return []
    ids = [row[0] for row in fetch_rows(session, sql.NEW_LOOP_IDS, {"n": len(loops)})]
    contents = [storable.message_content(loop.message, None) for loop in loops]
    system_content, system_meta = storable.message_content(system_prompt, None) \
        if system_prompt else (None, {})
    # Each loop's run's trace context, when tracing is on: its first job carries it.
    runs = [tracing.new_run() for _ in ids] if enqueue and tracing.enabled() else None
    fetch_row(session, sql.START_MANY, {
        "ids": ids, "agent_name": agent_name,
        "status": (LoopStatus.QUEUED if enqueue else LoopStatus.INIT).value,
        "subject_types": [loop.subject_type for loop in loops],
        "subject_ids": [loop.subject_id for loop in loops],
        "fair_ranks": fair_ranks(state, session, [(loop.subject_type, loop.subject_id)
                                                  for loop in loops]),
        "states": [json.dumps(loop.state) for loop in loops],
        "messages": [content for content, _ in contents],
        "metas": [json.dumps(meta) for _, meta in contents],
        "system_prompt": system_content, "system_meta": json.dumps(system_meta),
        "output_schema": json.dumps(output_schema) if output_schema is not None else None,
        "traces": [json.dumps(run) for run in runs] if runs is not None else [None] * len(ids)})
    if enqueue:
        state.dispatch.first_llm_turns(
            session, ids, traceparents=[r["traceparent"] for r in runs]  # type: ignore[index]
            if runs is not None else None)
    for loop_id in ids:
        signals.send_after_commit(session, signals.loop_started, loop_id=loop_id,
                                  agent=agent_name)
    return ids


def _leave(session: SessionLike, loop_id: int, *, from_: Iterable[str], to: LoopStatus,
           error_message: str | None = None, freeze: bool = False,
           revoke_leases: bool = False) -> bool:
    """A host-driven exit (loops/sql.LEAVE) in the session's transaction."""
    return fetch_row(session, sql.LEAVE, {
        "loop_id": loop_id, "from": [str(status) for status in from_], "to": to.value,
        "error_message": storable.text(error_message)[0], "freeze": freeze,
        "revoke_leases": revoke_leases}) is not None


def _done(session: SessionLike, changed: bool) -> bool:
    """Commit when the command changed the loop; roll back otherwise."""
    if changed:
        session.commit()
    else:
        session.rollback()
    return changed


@commits
def pause(session: SessionLike, loop_id: int) -> bool:
    """queued, running or waiting → paused, and its live child agents' loops
    with it (their reason naming it); jobs of the old generation find nothing
    to do (a decision on a waiting call is kept for the resume). Resuming the
    loop resumes its paused descendants (:func:`resume`)."""
    descendants = _descendants(session, loop_id)
    if not _leave(session, loop_id, from_=_LIVE, to=LoopStatus.PAUSED):
        session.rollback()
        return False
    paused = [loop_id, *(child for child in descendants if _leave(
        session, child, from_=_LIVE, to=LoopStatus.PAUSED,
        error_message=f"paused with its parent loop {loop_id}"))]
    session.commit()
    for node in paused:
        signals.send(signals.loop_paused, loop_id=node, reason="paused")
    return True


def _descendants(session: SessionLike, loop_id: int) -> list[int]:
    """The loop's descendants (child agents' loops, theirs, ...), locked with the
    loop itself, deepest first and the loop last (loops/sql.LOCK_TREE: the
    order a child's ending takes them in). The loop's own lock comes last."""
    from .children import lock_tree  # children.py builds on this module

    return [node.id for node in lock_tree(session, loop_id) if node.id != loop_id]


def _leave_tree(session: SessionLike, loop_id: int, *, reason: str,
                revoke_leases: bool = False) -> list[int]:
    """Fail the loop and its live descendants (children stopped with it, their
    reason naming it); the loops that left, the loop first, or [] when the
    loop itself could not. Every loop is failed before any ending runs, so a
    child's result is kept on its failed parent's call and enqueues nothing."""
    descendants = _descendants(session, loop_id)
    if not _leave(session, loop_id, from_=_STOPPABLE, to=LoopStatus.FAILED,
                  error_message=reason, revoke_leases=revoke_leases):
        return []
    left = [loop_id]
    for child in descendants:
        if _leave(session, child, from_=_STOPPABLE, to=LoopStatus.FAILED,
                  error_message=f"its parent loop {loop_id} was stopped: {reason}",
                  revoke_leases=revoke_leases):
            left.append(child)
    return left


@commits
def stop(session: SessionLike, loop_id: int, *, reason: str,
         ends: LoopEnds | None = None) -> bool:
    """Fail a live, paused or init loop with ``reason``, and its live child
    agents' loops with it, with the host's ``on_loop_end`` hooks (``ends``) in
    the same commit."""
    left = _leave_tree(session, loop_id, reason=reason)
    for ended in left:
        run_loop_end_hooks(session, ended, ends)
    if not _done(session, bool(left)):
        return False
    for ended in left:
        signals.send(signals.loop_failed, loop_id=ended, error=storable.text(reason)[0])
    return True


@commits
def force_stop(state: SolidLoopState, session: SessionLike, loop_id: int, *,
               reason: str, ends: LoopEnds | None = None) -> bool:
    """Fail the loop, revoke its tool leases and cancel its queued jobs, at once,
    and its live child agents' loops with it, with the host's ``on_loop_end``
    hooks (``ends``) in the same commit."""
    error = f"force stopped: {reason}"
    left = _leave_tree(session, loop_id, reason=error, revoke_leases=True)
    if not left:
        session.rollback()
        return False
    for ended in left:
        state.broker.cancel_loop_jobs(session, ended, reason="cancelled by force stop")
    for ended in left:
        run_loop_end_hooks(session, ended, ends)
    session.commit()
    for ended in left:
        signals.send(signals.loop_failed, loop_id=ended, error=storable.text(error)[0])
    return True


@commits
def freeze(session: SessionLike, loop_id: int) -> bool:
    """Pause a live loop and lock it against resume until unfrozen; a paused or
    init loop is only locked. Its child agents' loops that have not ended are
    frozen with it. False for a finished or already frozen loop."""
    descendants = _descendants(session, loop_id)
    locked = fetch_row(session, sql.LOCK_LOOP, {"loop_id": loop_id})
    if locked is None or locked["frozen"] or locked["status"] in (
            LoopStatus.COMPLETED, LoopStatus.FAILED):
        session.rollback()
        return False
    paused = [node for node in (loop_id, *descendants) if _freeze_one(session, node)]
    session.commit()
    for node in paused:
        signals.send(signals.loop_paused, loop_id=node, reason="frozen")
    return True


def _freeze_one(session: SessionLike, loop_id: int) -> bool:
    """Freeze one loop of a tree (locked): paused when live, else only locked;
    an ended or frozen one is left. Whether it was paused."""
    if _leave(session, loop_id, from_=_LIVE, to=LoopStatus.PAUSED, error_message=FROZEN,
              freeze=True):
        return True
    execute(session, sql.FREEZE_UNENDED, {"loop_id": loop_id})
    return False


@commits
def unfreeze(session: SessionLike, loop_id: int) -> bool:
    """Lift a freeze, the loop's and its child agents' loops'; each stays where
    it is (usually paused) until resumed, and a loop the freeze paused no
    longer carries its "frozen" reason. False when the loop was not frozen."""
    lifted = {row[0] for row in fetch_rows(session, sql.UNFREEZE_TREE,
                                           {"loop_id": loop_id, "reason": FROZEN})}
    session.commit()
    return loop_id in lifted


@commits
def set_observed(session: SessionLike, loop_id: int, observed: bool) -> bool:
    """Mark a loop as watched live, or no longer; False when it already was so."""
    return _mark_watch(session, sql.SET_OBSERVED, {"loop_id": loop_id, "observed": observed})


@commits
def mark_watched(session: SessionLike, loop_id: int, seconds: float) -> bool:
    """An open stream watches the loop for ``seconds`` more: its events are
    notified and its streaming turns flush at SOLIDLOOP_STREAM_MAX_HZ. False
    when the mark was fresh enough already (or the loop is gone)."""
    return _mark_watch(session, sql.MARK_WATCHED, {"loop_id": loop_id, "ttl": float(seconds)})


def _mark_watch(session: SessionLike, statement: str, params: dict[str, Any]) -> bool:
    """Write a watch mark; the first watcher of a running loop is notified on
    sql.WATCH_CHANNEL in the same commit (its streaming turn flushes at once).
    Only arrivals notify: a notifying commit is serialised cluster-wide."""
    row = fetch_row(session, statement, params)
    if row is not None and row["arrived"]:
        execute(session, sql.NOTIFY_WATCH, {"loop_id": params["loop_id"]})
    session.commit()
    return row is not None


#: What a pending call is answered with when a resume brings a new message.
RESUMED = "the loop was resumed with a new message"


def _answer_cancelled(session: SessionLike, loop_id: int, calls: list[ToolCall], *,
                      reason: str) -> None:
    """Answer pending calls (loops/sql.ANSWER_CANCELLED): a call that already ran
    gets its recorded result (its effect happened; the model must not be told
    otherwise), the others an error saying why they were not run."""
    contents, metas = [], []
    for call in calls:
        if call.executed_at is not None and call.result is not None:
            content = ToolResult.from_mcp(call.result).text()
            meta: dict[str, Any] = {"is_error": not call.is_success, "tool_name": call.name}
        else:
            content = f"tool call {call.name!r} was not run: {reason}"
            meta = {"is_error": True, "tool_name": call.name, "cancelled": True}
        cleaned, meta = storable.message_content(content, meta)
        contents.append(cleaned)
        metas.append(Jsonb(meta))
    execute(session, sql.ANSWER_CANCELLED, {
        "loop_id": loop_id, "call_ids": [call.id for call in calls], "contents": contents,
        "metas": metas})


@commits
def resume(state: SolidLoopState, session: SessionLike, loop_id: int, allowed: Iterable[str],
           *, message: str | None, sequential: Callable[[int], bool],
           budget: dict[str, float] | None = None, cancel_reason: str = RESUMED) -> bool:
    """Re-enter a loop whose status is in ``allowed``, in one locked transaction.

    If the newest assistant turn still has unanswered tool calls, the loop
    re-enters its tool phase under a fresh generation: a call a live worker
    still runs keeps its lease (it answers under the new generation itself),
    a call that still awaits a decision or a result keeps waiting, and every
    other call's lease is revoked and its job enqueued (only the head of the
    line in sequential mode, ``sequential(loop_id)``, and only if none runs).
    When nothing runs and something awaits, the loop waits. Otherwise the
    loop is queued for a new LLM turn. ``message`` appends
    a user message first, answering the pending calls (nothing may sit
    between a tool-call turn and its results) with ``cancel_reason``.

    A loop queued for a new turn gets the messages of its inbox first
    (loops/sql.DELIVER_INBOX), before ``message``: they came before it. A
    live loop (queued, running, waiting: ``allowed`` names them only for an
    interrupt, loops/store/conversation.py) is taken from its worker the same
    way: its new generation fences the old one's writes off.

    A paused loop's paused, unfrozen descendants (child agents' loops, paused
    with it by :func:`pause` or on their own) are resumed with it, each the
    same way, in the same transaction."""
    allowed = tuple(allowed)
    # A paused loop's paused descendants are resumed with it: the tree is
    # locked first, deepest first (the order a child's ending takes).
    tree = _paused_tree(session, loop_id) if LoopStatus.PAUSED in allowed else []
    locked = fetch_row(session, sql.LOCK_LOOP, {"loop_id": loop_id})
    if locked is None or locked["status"] not in allowed:
        session.rollback()
        return False
    if locked["frozen"]:
        logger.warning("loop %s is frozen; unfreeze it before resuming", loop_id)
        session.rollback()
        return False
    _resume_locked(state, session, loop_id, message=message, sequential=sequential,
                   budget=budget, cancel_reason=cancel_reason)
    if locked["status"] == LoopStatus.PAUSED:
        for child in tree:
            _resume_locked(state, session, child, message=None, sequential=sequential,
                           budget=None, cancel_reason=cancel_reason)
    session.commit()
    return True


def _paused_tree(session: SessionLike, loop_id: int) -> list[int]:
    """The loop's paused, unfrozen descendants, the whole tree locked (the
    loop last); shallowest first, the order they are resumed in."""
    from .children import lock_tree  # children.py builds on this module

    return [node.id for node in reversed(lock_tree(session, loop_id))
            if node.id != loop_id and node.status == LoopStatus.PAUSED and not node.frozen]


def _resume_locked(state: SolidLoopState, session: SessionLike, loop_id: int, *,
                   message: str | None, sequential: Callable[[int], bool],
                   budget: dict[str, float] | None, cancel_reason: str) -> None:
    """Re-enter one locked loop (its shells hidden, a new trace run), uncommitted."""
    execute(session, sql.HIDE_SHELLS, {"loop_id": loop_id})
    # A new run, a new invoke_agent span linked to the last (tracing on only).
    run = None
    if tracing.enabled():
        last = fetch_row(session, sql.LOOP_TRACE, {"loop_id": loop_id})
        run = tracing.new_run(last["trace"] if last is not None else None)
        execute(session, sql.SET_TRACE, {"loop_id": loop_id, "trace": Jsonb(run)})
    with tracing.carrying(run["traceparent"] if run else None):
        _resume_rest(state, session, loop_id, message=message, sequential=sequential,
                     budget=budget, cancel_reason=cancel_reason)


def _resume_rest(state: SolidLoopState, session: SessionLike, loop_id: int, *,
                 message: str | None, sequential: Callable[[int], bool],
                 budget: dict[str, float] | None, cancel_reason: str) -> None:
    """The rest of :func:`_resume_locked`, the loop locked and its shells hidden."""
    if budget:
        # Raised limits; a loop resumed with a budget has its spend decided by
        # the operator: its subject's budget, and its ancestors' (a child
        # agent's: limits/admission.check_loop), no longer stop it.
        execute(session, sql.RAISE_BUDGET, {
            "loop_id": loop_id, "budget": Jsonb({**budget, "over_subject": True})})
    pending = queries.unresolved_tool_calls(session, loop_id)
    if message:
        if pending:
            _answer_cancelled(session, loop_id, pending, reason=cancel_reason)
        pending = []
    if not pending:
        fetch_rows(session, sql.DELIVER_INBOX, {"loop_id": loop_id})
    if message:
        session.add(new_message(loop_id, "user", message))
    if pending:
        token = uuid.uuid4()
        calls = fetch_rows(session, sql.REVOKE_IDLE_LEASES,
                           {"call_ids": [call.id for call in pending]})
        running = any(live for _, live, _ in calls)
        one_at_a_time = sequential(loop_id)
        if one_at_a_time:
            # The head of the line, if nothing runs and it does not await.
            head = calls[0]
            to_run = [] if running or head[2] else [head[0]]
        else:
            to_run = [call_id for call_id, live, awaiting in calls
                      if not live and not awaiting]
        to = LoopStatus.RUNNING if running or to_run else LoopStatus.WAITING
        execute(session, sql.RESUME_TO_CALLS, {"loop_id": loop_id, "new_token": token,
                                               "to": to.value})
        for call_id in to_run:
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
    else:
        execute(session, sql.RESUME_TO_TURN, {"loop_id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
