"""The tool turn's writes: the call's claim, its outcome (the canonical result
recorded, the call answered, and on the phase's last answer the loop's next
LLM turn), a hand-back, and the stored MCP session.

Every outcome goes through one statement family (loops/sql.TOOL_OUTCOME):
the default stack records and answers in one statement, a stack with a host
middleware between the two steps records first and answers after, and a call
whose result was recorded before (a resumed phase, a redelivered job) is
answered alone. The checks are the statement's: the call's lease (or, for a
job that holds none, the loop's generation), recorded once, answered once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from ... import signals
from ..._typing import SessionLike, real_session
from ...errors import LostLeaseError
from ...leases import worker_identity
from ...mcp.toolset import ToolResult
from ...models import Loop, Message, ToolCall
from ...models.loop import LoopStatus
from .. import queries, sql, storable
from .adopted import Adopted, AdoptedLlmTurn, AdoptedToolCall
from .llm_turn import calls_to_run, claim_from_row, claim_params
from .transaction import (
    alone,
    commit_unless,
    commit_with_job_done,
    commits,
    execute,
    fetch_row,
    run_alone,
)
from .wirelog import tool_event

if TYPE_CHECKING:
    from ...state import SolidLoopState

logger = logging.getLogger("flask_solidloop.store")


class ToolClaim(Enum):
    """How a tool job's claim ended."""

    #: The per-call lease is this job's: run the tool.
    CLAIMED = "claimed"
    #: The tool already ran (its result is recorded); only its answer is missing.
    CONTINUATION = "continuation"
    #: Sequential mode, out of order: the head of the line was dispatched instead.
    REDIRECTED = "redirected"
    #: The generation rotated, or another live lease holds the call.
    LOST = "lost"


#: What a tool call's claim sets on its row, read back into the call object.
_CLAIMED_COLUMNS = ("lease_token", "lease_holder", "leased_until", "updated_at")


@commits
def claim_tool_call(state: SolidLoopState, session: SessionLike, call: ToolCall,
                    token: uuid.UUID, *, sequential: bool, lease_seconds: float,
                    reaper_lease_token: uuid.UUID | None = None,
                    ) -> tuple[ToolClaim, uuid.UUID | None]:
    """Claim a delivered tool call for this job, marking the job done in the same
    commit (loops/sql.CLAIM_CALL). Returns the outcome and, when CLAIMED, the
    call's lease. A reaper reclaim arrives with the lease the reaper minted,
    which is taken if it is still the call's."""
    loop_id = call.loop_id
    if sequential:
        pending = queries.unresolved_tool_calls(session, loop_id)
        if pending and pending[0].id != call.id:
            # Out of order: run nothing, but make sure the head of the line runs
            # (unless it awaits a decision or a result: that brings its job).
            head = pending[0]
            if head.waits_for is None or head.decision is not None:
                state.dispatch.tool_call(session, head.id, token, loop_id=loop_id)
            commit_with_job_done(session)
            return ToolClaim.REDIRECTED, None
    if call.executed_at is not None:
        commit_with_job_done(session, keep_objects=True)
        return ToolClaim.CONTINUATION, None
    lease = uuid.uuid4()
    claimed = fetch_row(session, sql.CLAIM_CALL, {
        "loop_id": loop_id, "call_id": call.id, "token": token, "lease": lease,
        "reaper_lease": reaper_lease_token, "holder": worker_identity(),
        "ttl": timedelta(seconds=lease_seconds)})
    if claimed is None:
        session.rollback()
        return ToolClaim.LOST, None
    # The call object takes the claimed row's values: the tool runs from it,
    # and the session's readers see the lease.
    for column in _CLAIMED_COLUMNS:
        set_committed_value(call, column, claimed[column])
    commit_with_job_done(session, keep_objects=True)
    return ToolClaim.CLAIMED, claimed["lease_token"]


@dataclass(frozen=True)
class CallFacts:
    """A tool call's columns that stay as they are until its outcome is recorded,
    read by its step before the tool runs: what the outcome's event and result
    notes are made from, with no read under the locks."""

    id: int
    loop_id: int
    message_id: int
    name: str
    server_name: str | None
    tool_name: str | None
    arguments: dict[str, Any] | None
    arguments_raw: str | None
    meta: dict[str, Any] | None

    @classmethod
    def of(cls, call: ToolCall) -> CallFacts:
        return cls(call.id, call.loop_id, call.message_id, call.name, call.server_name,
                   call.tool_name, call.arguments, call.arguments_raw, call.meta)

    @property
    def idempotency_key(self) -> str:
        return f"solidloop:tool_call:{self.id}"


@dataclass(frozen=True)
class NextTurn:
    """What a tool answer that claims the loop's next LLM turn does for it in its
    own statement, as the agent's LLM stack allows (pipeline.plan)."""

    open_shell: bool = False
    read_history: bool = False


@dataclass
class ToolOutcome:
    """What an outcome statement did."""

    #: The call as the session knows it (its row changed: it reloads on use).
    call: ToolCall
    #: The result as stored (made storable), when this outcome recorded it.
    result: ToolResult | None
    #: The tool message was written (False: a duplicate, or the loop is not
    #: running: its result is recorded, and resume answers it).
    answered: bool
    #: The step this thread's commit claimed for it (``adopt``), if any.
    adopted: Adopted | None = None
    #: The loop now waits: what is left of its tool phase awaits decisions or results.
    waited: bool = False


def canonical_result(call: CallFacts | ToolCall, result: ToolResult
                     ) -> tuple[ToolResult, dict[str, Any]]:
    """The result as it will be stored, and the call's notes about what changed."""
    stored, altered, unserializable = storable.json_value(result.to_mcp())
    notes: dict[str, Any] = dict(call.meta or {})
    if altered:
        notes["sanitized"] = sorted({*notes.get("sanitized", []), "result"})
    if unserializable:
        notes["unserializable"] = True
        logger.warning("tool call %s (%s): its result held values JSON cannot; they were "
                       "stored as text", call.id, call.name)
    canonical = ToolResult.from_mcp(stored) if isinstance(stored, dict) else ToolResult(
        content=[{"type": "text", "text": str(stored)}], is_error=result.is_error)
    canonical.error_kind = result.error_kind
    return canonical, notes


@alone
def checkpoint_tool_call(state: SolidLoopState, session: SessionLike, call: CallFacts, *,
                         token: uuid.UUID, lease: uuid.UUID | None, result: ToolResult,
                         duration_ms: float, body_limit: int) -> ToolOutcome:
    """Record a tool's canonical result (``executed_at``) under the call's lease,
    with its wire event, and nothing else: its answer is written after (a
    stack with a host middleware between the two steps sees the recorded
    result first). Exactly once: a second checkpoint finds it executed. The
    loop may be paused or stopped meanwhile: the result is recorded all the
    same (its effect happened), and resume answers the call from it."""
    return _outcome(state, session, call, token=token, lease=lease, result=result,
                    duration_ms=duration_ms, body_limit=body_limit)


@alone
def answer_tool_call(state: SolidLoopState, session: SessionLike, call: CallFacts, *,
                     token: uuid.UUID, lease: uuid.UUID | None, content: str, is_error: bool,
                     sequential: bool, adopt: bool, next_turn: NextTurn = NextTurn(),
                     ) -> ToolOutcome:
    """Write the one tool message answering a call whose result is recorded;
    when it is the phase's last open call, the loop's next LLM turn follows in
    the same commit (claimed for this thread when ``adopt``; in sequential
    mode, the next call instead). Nothing is written for a duplicate (already
    answered) or a loop that is not running."""
    return _outcome(state, session, call, token=token, lease=lease, content=content,
                    is_error=is_error, sequential=sequential, adopt=adopt,
                    next_turn=next_turn)


@alone
def checkpoint_and_answer_tool_call(
    state: SolidLoopState, session: SessionLike, call: CallFacts, *, token: uuid.UUID,
    lease: uuid.UUID, result: ToolResult, duration_ms: float, body_limit: int,
    answer_text: Callable[[ToolResult], str], sequential: bool, adopt: bool,
    next_turn: NextTurn = NextTurn(), sole_call: bool = False,
) -> ToolOutcome:
    """:func:`checkpoint_tool_call` and :func:`answer_tool_call` in one statement,
    for a stack with nothing between the two steps: the canonical result, its
    event, the tool message (``answer_text`` renders it from the stored
    result) and what follows the last answer land together. A loop that is no
    longer running gets the checkpoint alone. ``sole_call``: the call is its
    message's only one and this thread adopted it, so the statement runs
    without taking the locks first (in autocommit when the session holds
    nothing: the whole outcome is one round trip)."""
    return _outcome(state, session, call, token=token, lease=lease, result=result,
                    duration_ms=duration_ms, body_limit=body_limit, answer_text=answer_text,
                    sequential=sequential, adopt=adopt, next_turn=next_turn,
                    alone=sole_call and adopt)


def _outcome(state: SolidLoopState, session: SessionLike, call: CallFacts, *,
             token: uuid.UUID, lease: uuid.UUID | None, result: ToolResult | None = None,
             duration_ms: float = 0.0, body_limit: int = 0,
             answer_text: Callable[[ToolResult], str] | None = None,
             content: str | None = None, is_error: bool = False, sequential: bool = False,
             adopt: bool = False, next_turn: NextTurn = NextTurn(),
             alone: bool = False) -> ToolOutcome:
    """One statement of the outcome family (see the module docstring)."""
    record = result is not None
    answer = answer_text is not None or content is not None
    params: dict[str, Any] = {
        "loop_id": call.loop_id, "call_id": call.id, "message_id": call.message_id,
        "token": token, "lease": lease, "alone": alone}
    canonical = None
    if result is not None:
        canonical, notes = canonical_result(call, result)
        stored = canonical.to_mcp()
        params.update(tool_event(call, stored, canonical, duration_ms, body_limit),
                      result=Jsonb(stored), is_success=not canonical.is_error,
                      error_kind=canonical.error_kind,
                      meta=Jsonb(notes) if notes else None)
        if answer_text is not None:
            content, is_error = answer_text(canonical), canonical.is_error
    if answer:
        text, message_meta = storable.message_content(
            content or "", {"is_error": is_error, "tool_name": call.name})
        new_token = uuid.uuid4()
        params.update(content=text, message_meta=Jsonb(message_meta), sequential=sequential)
        if adopt:
            params.update(open_shell=next_turn.open_shell, read_history=next_turn.read_history,
                          **claim_params(call.loop_id, new_token, state.config.liveness_ttl))
    statement = sql.TOOL_OUTCOME[(record, answer, adopt and answer)]
    row: dict[str, Any] | None = None
    committed = False
    if alone:
        row, committed = run_alone(session, statement, params, sole=True)
        assert row is not None  # one row, always
        if row["solidloop_siblings"] and row["solidloop_answered"] is None:
            # Siblings after all (nothing was written): take the locks first.
            if not committed:
                session.rollback()
            row, committed = None, False
    if row is None:
        params["alone"] = False
        execute(session, sql.LOCK_CALL, params)
        row = fetch_row(session, statement, params)
        assert row is not None
    _check(row, call, token=token, lease=lease, record=record, session=session,
           committed=committed)
    answered = bool(row.pop("solidloop_answered"))
    adopted: Adopted | None = None
    waited = False
    if answer:
        remaining: list[int] = row.pop("solidloop_remaining")
        awaiting: list[int] = row.pop("solidloop_waiting")
        waited = bool(row.pop("solidloop_waited"))
        if adopt and row["id"] is not None:  # the last answer: the next turn is ours
            claim, shell = claim_from_row(row, params["new_token"],
                                          read_history=next_turn.read_history)
            rows: tuple[tuple[type, dict[str, Any]], ...] = ((Loop, row),)
            if shell is not None:
                rows += ((Message, shell),)
            adopted = AdoptedLlmTurn(call.loop_id, claim, rows)
        if not adopt and row.pop("solidloop_requeued"):
            state.dispatch.llm_turn(session, call.loop_id)
        if answered and remaining and sequential and not waited \
                and remaining[0] not in awaiting:
            # The loop's current generation: a resume may have rotated it while
            # the tool ran under its lease.
            adopted = _dispatch_line(state, session, call.loop_id, row["solidloop_token"],
                                     remaining, adopt=adopt)
    # The call as the session knows it: its row changed, so it reloads on use.
    orm_call = real_session(session).identity_map.get(identity_key(ToolCall, call.id))
    commit_unless(committed, session)
    if answered:
        signals.send(signals.tool_call_answered, loop_id=call.loop_id, tool_call_id=call.id,
                     is_error=is_error)
    if orm_call is None:
        orm_call = session.get(ToolCall, call.id)
    assert orm_call is not None
    return ToolOutcome(orm_call, canonical, answered, adopted, waited)


def _check(row: dict[str, Any], call: CallFacts, *, token: uuid.UUID,
           lease: uuid.UUID | None, record: bool, session: SessionLike,
           committed: bool) -> None:
    """Raise LostLeaseError, naming why, when the outcome's checks failed (the
    statement then wrote nothing)."""
    if row["solidloop_answered"] is not None:
        return
    if not committed:
        session.rollback()
    status, holder = row["solidloop_status"], row["solidloop_lease"]
    if status is None:
        raise LostLeaseError(f"loop {call.loop_id} or its tool call {call.id} is gone")
    if lease is not None and holder != lease:
        raise LostLeaseError(f"tool call {call.id}: its lease was reclaimed")
    if lease is None and not (status == LoopStatus.RUNNING and row["solidloop_token"] == token):
        raise LostLeaseError(f"loop {call.loop_id} changed generation during tool call")
    if record and row["solidloop_executed"]:
        raise LostLeaseError(f"tool call {call.id} was already executed")
    raise LostLeaseError(f"tool call {call.id}: its outcome's checks failed")


def _dispatch_line(state: SolidLoopState, session: SessionLike, loop_id: int,
                   token: uuid.UUID, remaining: Sequence[int], *,
                   adopt: bool) -> AdoptedToolCall | None:
    """The next call of a sequential line: leased to this thread when it
    continues inline (its row carried), else its job."""
    (next_call,) = calls_to_run(remaining, sequential=True)
    if adopt:
        lease = uuid.uuid4()
        leased = fetch_row(session, sql.ADOPT_CALL, {
            "call_id": next_call, "lease": lease, "holder": worker_identity(),
            "ttl": timedelta(seconds=state.config.liveness_ttl)})
        if leased is not None:
            return AdoptedToolCall(loop_id, next_call, token, lease,
                                   rows=((ToolCall, leased),))
    state.dispatch.tool_call(session, next_call, token, loop_id=loop_id)
    return None


@commits
def release_tool_call(state: SolidLoopState, session: SessionLike, adopted: AdoptedToolCall,
                      ) -> bool:
    """An adopted tool call this thread will not run after all: its lease
    released and its job queued in one commit, if the lease is still the
    adopted one and the tool has not run. False otherwise. Rolls back what the
    session holds first."""
    return hand_back_tool_call(state, session, loop_id=adopted.loop_id,
                               tool_call_id=adopted.tool_call_id,
                               execution_token=adopted.execution_token,
                               lease_token=adopted.lease_token)


@commits
def hand_back_tool_call(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                        tool_call_id: int, execution_token: uuid.UUID,
                        lease_token: uuid.UUID, delay_ms: int | None = None) -> bool:
    """A claimed call whose tool has not run, given back: its lease released and
    its job queued (due in ``delay_ms``) in one commit, compare-and-set on the
    lease (loops/sql.RELEASE_CALL). False, with nothing written, when the lease
    is no longer this one or the tool ran. Rolls back what the session holds
    first."""
    session.rollback()
    if fetch_row(session, sql.RELEASE_CALL, {
            "loop_id": loop_id, "call_id": tool_call_id, "lease": lease_token}) is None:
        session.rollback()
        return False
    state.dispatch.tool_call(session, tool_call_id, execution_token, loop_id=loop_id,
                             delay_ms=delay_ms)
    session.commit()
    return True


@commits
def store_mcp_session_state(session: SessionLike, loop_id: int, server_name: str | None,
                            session_state: dict[str, Any]) -> None:
    """Keep the loop's stored MCP session current (a server re-initialized it, or
    the protocol era changed), so the next call resumes instead of probing.
    Rolls back what the session holds first (a tool's leftovers)."""
    session.rollback()
    execute(session, sql.STORE_MCP_SESSION, {
        "loop_id": loop_id, "server": server_name,
        "session_state": Jsonb(storable.json_value(session_state)[0])})
    session.commit()
