"""The writes of a loop that waits: the one decision on a tool call that awaits
an approval or a result, and a wait's timeout (docs/decisions/0017-waiting-loops.md).

A decision is a compare-and-set under the loop's and the call's row locks
(loops/sql.DECIDE): exactly one lands, however many race. An approval clears
the way for the tool; a denial or a supplied result is recorded as the call's
canonical result. Either way, when the loop runs or waits and the call can run
now, the call's ordinary tool job is enqueued in the same commit: an approved
call runs its tool, a decided one finds its result recorded and writes only
its answer. A decision on a paused or stopped loop is kept, and resume acts on
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from ... import signals
from ..._typing import SessionLike, real_session
from ...errors import DecisionConflictError, InvalidArgumentError
from ...mcp.toolset import ToolResult
from ...models import ToolCall
from ...models.loop import LoopStatus
from .. import sql, storable
from .tool_turn import CallFacts, canonical_result
from .transaction import commits, fetch_row, joins
from .wirelog import tool_event

if TYPE_CHECKING:
    from ...state import SolidLoopState

#: What a call waits for.
APPROVAL = "approval"
RESULT = "result"
#: The decisions.
APPROVED = "approved"
DENIED = "denied"
COMPLETED = "completed"
#: Who decides a wait that timed out.
TIMEOUT = "timeout"


@dataclass(frozen=True)
class Decision:
    """A decision that landed."""

    tool_call_id: int
    loop_id: int
    decision: str
    #: The call's job was enqueued with it (the loop runs or waits, and the call
    #: can run now); False: the loop is paused or stopped, or the call waits
    #: behind another in a sequential line.
    enqueued: bool


def denial(reason: str | None, by: str | None) -> ToolResult:
    """What the model reads of a denied call: why it was not run."""
    who = f" by {by}" if by else ""
    text = f"The tool call was not run: it was denied{who}."
    if reason:
        text += f" Reason: {reason}"
    result = ToolResult.error(text)
    result.error_kind = DENIED
    return result


def supplied(result: Any, *, is_error: bool) -> ToolResult:
    """The result a host supplies for a deferred call, as a ToolResult: text, an
    MCP ``CallToolResult`` dict, or a ToolResult."""
    if isinstance(result, ToolResult):
        return result
    if isinstance(result, dict):
        made = ToolResult.from_mcp(result)
        made.is_error = made.is_error or is_error
        return made
    if isinstance(result, str):
        return ToolResult(content=[{"type": "text", "text": result}], is_error=is_error)
    raise InvalidArgumentError(
        f"a call's result must be text, an MCP CallToolResult dict or a ToolResult; "
        f"got {type(result).__name__}")


@joins
def decide(state: SolidLoopState, session: SessionLike, tool_call_id: int, *,
           waits_for: str, decision: str, by: str | None = None, reason: str | None = None,
           arguments: dict[str, Any] | None = None, result: ToolResult | None = None,
           sequential: bool = False) -> Decision:
    """Take the one decision on a call that awaits ``waits_for``: ``approved``
    (with edited ``arguments``, or the model's), ``denied`` (``result`` is what
    the model reads) or ``completed`` (``result`` supplied). The call's job
    joins the same transaction when it can run now. Raises
    DecisionConflictError, naming the first decision, when another landed
    first; InvalidArgumentError when the call does not wait for that."""
    call = session.get(ToolCall, tool_call_id)
    if call is None:
        raise InvalidArgumentError(f"there is no tool call {tool_call_id}")
    records = result is not None
    params: dict[str, Any] = {
        "call_id": tool_call_id, "decision": decision, "by": storable.text(by)[0],
        "reason": storable.text(reason)[0], "waits_for": waits_for, "sequential": sequential}
    if records:
        assert result is not None
        canonical, notes = canonical_result(call, result)
        stored = canonical.to_mcp()
        params.update(tool_event(CallFacts.of(call), stored, canonical, 0.0,
                                 state.config.wire_body_limit),
                      result=Jsonb(stored), is_success=not canonical.is_error,
                      error_kind=canonical.error_kind, meta=Jsonb(notes) if notes else None)
    else:
        arguments_json = storable.json_value(arguments)[0] if arguments is not None else None
        params["arguments"] = Jsonb(arguments_json) if arguments_json is not None else None
    row = fetch_row(session, sql.DECIDE[records], params)
    assert row is not None
    # The call's row changed under the session's copy: read it again on use.
    real_session(session).expire(call)
    if not row["solidloop_decided"]:
        _refuse(tool_call_id, row, waits_for)
    enqueue = row["status"] in (LoopStatus.RUNNING, LoopStatus.WAITING) and (
        not sequential or row["head"] == tool_call_id)
    if enqueue:
        state.dispatch.tool_call(session, tool_call_id, row["execution_token"],
                                 loop_id=row["loop_id"])
    return Decision(tool_call_id, row["loop_id"], decision, enqueue)


def _refuse(tool_call_id: int, row: dict[str, Any], waits_for: str) -> None:
    if row["loop_id"] is None:
        raise InvalidArgumentError(f"there is no tool call {tool_call_id}")
    if row["decision"] is not None:
        raise DecisionConflictError(tool_call_id, row["decision"], row["decided_by"],
                                    row["decided_at"])
    if row["waits_for"] != waits_for:
        what = {APPROVAL: "an approval", RESULT: "a result"}.get(waits_for, waits_for)
        kind = {APPROVAL: "needs no approval", RESULT: "is not a deferred call"}.get(
            waits_for, "does not wait")
        raise InvalidArgumentError(
            f"tool call {tool_call_id} {kind}: nothing waits for {what} from it")
    raise DecisionConflictError(tool_call_id, "answered", None, None)


@dataclass(frozen=True)
class DueWait:
    """A wait its timeout job looks at: the call, its loop's agent, what it
    waits for, and whether its deadline has come (else ``left``: how long)."""

    tool_call_id: int
    loop_id: int
    agent_name: str
    waits_for: str
    on_timeout: str
    due: bool
    left_seconds: float


@joins
def due_wait(session: SessionLike, tool_call_id: int) -> DueWait | None:
    """The call's wait as its timeout finds it; None when it no longer waits."""
    row = fetch_row(session, sql.WAIT_DUE, {"call_id": tool_call_id})
    if row is None:
        return None
    left = row["left_"]
    return DueWait(row["id"], row["loop_id"], row["agent_name"], row["waits_for"],
                   str((row["metadata"] or {}).get("on_timeout") or "deny"), bool(row["due"]),
                   left.total_seconds() if left is not None else 0.0)


@commits
def time_out(state: SolidLoopState, session: SessionLike, wait: DueWait, *,
             sequential: bool) -> Decision | None:
    """A wait's timeout decides it (``by`` "timeout"): an approval as its tool's
    ``on_timeout`` says, a result as an error. None, with nothing written, when
    a decision landed first."""
    if wait.waits_for == APPROVAL and wait.on_timeout == "approve":
        kind, decision, result = APPROVAL, APPROVED, None
    elif wait.waits_for == APPROVAL:
        kind, decision = APPROVAL, DENIED
        result = denial("no decision came before the approval's timeout", TIMEOUT)
    else:
        kind, decision = RESULT, COMPLETED
        result = ToolResult.error("no result came before the call's timeout")
        result.error_kind = TIMEOUT
    try:
        decided = decide(state, session, wait.tool_call_id, waits_for=kind, decision=decision,
                         by=TIMEOUT, result=result, sequential=sequential)
    except DecisionConflictError:
        session.rollback()
        return None
    session.commit()
    signals.send(signals.tool_call_decided, loop_id=decided.loop_id,
                 tool_call_id=decided.tool_call_id, decision=decided.decision, by=TIMEOUT)
    return decided


@commits
def retry_time_out(state: SolidLoopState, session: SessionLike, wait: DueWait) -> None:
    """A timeout that ran before its deadline (a clock step): its job again, due
    when the deadline is."""
    state.dispatch.wait_timeout(session, wait.tool_call_id, loop_id=wait.loop_id,
                                delay_ms=max(1, int(wait.left_seconds * 1000)))
    session.commit()
