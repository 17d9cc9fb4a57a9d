"""The only writer of loop, message, tool-call, MCP-session and event rows, and
of the jobs that follow their changes.

Every function here is one named transition: it takes the row locks it needs
(always the loop row first, then a tool-call row), re-checks the generation
fence where a turn writes, makes the change, enqueues the successor job on the
same session, and commits, so state and job land together or not at all
(docs/decisions/0009-one-owner-for-loop-state.md). The exceptions say so in
their docstring: :func:`create_loop` and :func:`record_tool_snapshots` leave
the commit to their caller, who adds its own writes to the same transaction.

Callers: the pipeline middlewares (a turn's writes), the runtime (claims and
unhandled failures), loops.control (host commands), the reaper (heals) and the
Agent facade (creation). A turn whose fence closed gets ``LostLeaseError``
from the turn-path functions and writes nothing; host commands and heals
return False or an empty list instead.

Lease *renewal* (extending the lease columns of a lease a turn holds) is the
one write elsewhere: leases.py, on the renewer's own connection.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from enum import Enum
from typing import TYPE_CHECKING, Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from sqlalchemy import func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from .. import signals
from .._typing import SessionLike
from ..dbapi import driver_connection, execute_on
from ..errors import LostLeaseError
from ..leases import worker_identity
from ..models import Event, Loop, McpSession, Message, ToolCall
from ..queue import sql as jobs_sql
from ..queue.current_job import (
    current_job_done_params,
    mark_current_job_done,
    note_current_job_done,
)
from . import queries, storable
from .fence import lock_loop, owns, transition
from .sole import fetch_one

if TYPE_CHECKING:
    from ..llm.client import WireRecord
    from ..llm.types import AssistantTurn
    from ..mcp.toolset import ToolResult
    from ..queue.dispatch import Adopted
    from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.store")

#: Longest error text stored on a loop (a database error can carry a whole
#: SQL statement and its parameters).
MAX_ERROR_TEXT = 2000
#: Longest tool error text kept on a tool call's event.
MAX_EVENT_ERROR = 2000
#: Candidates one heal step handles per pass.
HEAL_BATCH = 500


def error_text(exc: BaseException) -> str:
    """``Class: message`` for error_message, cut to a readable length."""
    text_ = f"{type(exc).__name__}: {exc}"
    return text_ if len(text_) <= MAX_ERROR_TEXT else text_[:MAX_ERROR_TEXT] + " [truncated]"


# -- shared pieces ----------------------------------------------------------------


def calls_to_run(call_ids: Sequence[int], *, sequential: bool) -> list[int]:
    """The tool calls of a phase to enqueue now: the head of the line in
    sequential mode (each answer enqueues the next), all of them otherwise."""
    return list(call_ids[:1]) if sequential else list(call_ids)


# An adopted tool call's lease, written by the commit that creates its phase
# (or answers its predecessor): compare-and-set on an unleased, unexecuted call.
_ADOPT_TOOL_CALL = text(
    "UPDATE solidloop_tool_calls SET lease_token = :lease, lease_holder = :holder, "
    "leased_until = now() + :ttl, updated_at = now() "
    "WHERE id = :id AND executed_at IS NULL AND lease_token IS NULL")


def _dispatch_tool_calls(state: SolidLoopState, session: SessionLike, loop_id: int,
                         token: uuid.UUID, call_ids: Sequence[int], *, sequential: bool,
                         adopt: bool = False) -> Adopted | None:
    """Enqueue the phase's calls to run now. ``adopt``: when this worker thread
    continues inline (Dispatcher.can_adopt), the first of them is leased to it
    in this transaction instead, with no job (the caller confirms it after its
    commit; docs/decisions/0015-turn-cost.md)."""
    to_run = calls_to_run(call_ids, sequential=sequential)
    adopted = None
    if adopt and to_run and state.dispatch.can_adopt():
        lease = uuid.uuid4()
        leased = session.execute(_ADOPT_TOOL_CALL, {
            "id": to_run[0], "lease": lease, "holder": worker_identity(),
            "ttl": timedelta(seconds=state.config.liveness_ttl)}).rowcount  # type: ignore[attr-defined]
        if leased:
            adopted = state.dispatch.adopt_tool_call(to_run[0], token, loop_id=loop_id,
                                                     lease_token=lease)
            to_run = to_run[1:]
    for call_id in to_run:
        state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
    return adopted


def _commit_with_job_done(session: SessionLike, *, keep_objects: bool = False) -> None:
    """Commit a claim together with its job marked done; once committed, tell the
    worker, so its consumer skips the acknowledgement that would match nothing.
    ``keep_objects``: the turn goes on with the rows it just locked and wrote,
    so they are not expired (and reloaded) by the commit."""
    marked = mark_current_job_done(session)
    if keep_objects:
        _commit_keeping_objects(session)
    else:
        session.commit()
    if marked:
        note_current_job_done()


_real = queries.real_session


def end_transaction(session: SessionLike) -> None:
    """Commit the session's open transaction, if it has one (a turn ends its
    reads before a network call or a tool run). Without one it does nothing:
    a bare ``commit()`` would begin and commit an empty transaction and expire
    every object the turn still uses."""
    if _real(session).in_transaction():
        session.commit()




def _commit_unless(committed: bool, session: SessionLike) -> None:
    """Commit the session, or, when :func:`~.sole.fetch_one`'s statement committed by
    itself, expire what it holds as that commit would have: the statement wrote
    rows the session's objects may hold, and they load again on next use."""
    if committed:
        _real(session).expire_all()
    else:
        session.commit()


def _commit_keeping_objects(session: SessionLike) -> None:
    """Commit without expiring the session's objects: after a commit of rows
    this transaction locked and wrote, they hold what the database holds, and
    reloading them would only cost a SELECT each (server-side defaults such as
    ``updated_at`` are expired by the flush and still load on access)."""
    real = _real(session)
    before = real.expire_on_commit
    real.expire_on_commit = False
    try:
        real.commit()
    finally:
        real.expire_on_commit = before


def _requeue_for_llm(state: SolidLoopState, session: SessionLike, loop: Loop, *,
                     adopt: bool = False) -> Adopted | None:
    """Queue the loop's next LLM turn (the caller holds the loop row lock).

    ``adopt``: when this worker thread continues inline (Dispatcher.can_adopt),
    the next turn is claimed for it in this transaction instead (the loop stays
    running under a fresh generation and LLM lease, as a claim leaves it), with
    no job; the caller confirms it after its commit."""
    if adopt and state.dispatch.can_adopt():
        session.flush()
        return _adopt_llm_turn(state, session, loop.id)
    loop.status = "queued"
    loop.queued_at = func.now()
    loop.execution_token = None
    loop.lease_expires_at = None
    loop.lease_holder = None
    session.flush()
    state.dispatch.llm_turn(session, loop.id)
    return None


def _adopt_llm_turn(state: SolidLoopState, session: SessionLike, loop_id: int, *,
                    open_shell: bool = False, read_history: bool = False) -> Adopted:
    """Claim the loop's next LLM turn for this thread in the caller's transaction
    (the caller holds the loop row lock and confirms after its commit).
    ``open_shell``: insert the turn's hidden shell in the same statement, for a
    stack whose request follows its initialization directly (the turn then
    makes no commit before its request). ``read_history``: read the turn's
    history here too, for a stack that starts with its initialization (see
    decision 0015, cut 14: the turn sends what it would have read)."""
    token = uuid.uuid4()
    row = driver_connection(session).cursor(row_factory=dict_row).execute(
        _ADOPT_WITH_SHELL if open_shell else _ADOPT_LLM_TURN,
        _prefixed("claim_", _claim_params(loop_id, token, state.config.liveness_ttl))
    ).fetchone()
    assert row is not None
    return _adopted_llm_turn(state, session, loop_id, token, row, open_shell=open_shell,
                             read_history=read_history)


def _claim_params(loop_id: int, token: uuid.UUID, lease_seconds: float) -> dict[str, Any]:
    """The parameters of the claim statements (:data:`_CLAIM`)."""
    return {"id": loop_id, "token": token, "holder": worker_identity(),
            "ttl": timedelta(seconds=lease_seconds)}


def _adopted_llm_turn(state: SolidLoopState, session: SessionLike, loop_id: int,
                      token: uuid.UUID, row: dict[str, Any], *, open_shell: bool,
                      read_history: bool, history: list[Any] | None = None) -> Adopted:
    """The adoption of the claim ``row`` (the loop's row whole, its shell's
    columns as ``shell_<column>`` when ``open_shell``), with its history read
    now if ``read_history`` (unless the claim's statement read it: ``history``)."""
    carried: tuple[tuple[Any, Any], ...] = ()
    shell_id = None
    if open_shell:
        shell = {column: row.pop(f"shell_{column}") for column in _SHELL_COLUMNS}
        shell_id = shell["id"]
        carried += ((Message, shell),)
    carried = ((Loop, row), *carried)
    if read_history and history is None:
        history = queries.history(session, loop_id)
    elif not read_history:
        history = None
    return state.dispatch.adopt_llm_turn(loop_id, execution_token=token,
                                         run_elapsed_seconds=float(row["run_elapsed"]),
                                         carried=carried, shell_id=shell_id, history=history)


# What claiming an LLM turn writes on the loop row. Leases are stamped and
# compared with the database clock, never a worker's. The row comes back whole,
# with the run's elapsed seconds by that clock.
_CLAIM = (
    "UPDATE solidloop_loops SET status = 'running', execution_token = %(token)s, "
    "lease_expires_at = now() + %(ttl)s, lease_holder = %(holder)s, "
    "started_at = coalesce(started_at, now()), "
    "run_started_at = coalesce(run_started_at, now()), updated_at = now() "
    "WHERE id = %(id)s {condition}"
    "RETURNING *, extract(epoch FROM now() - run_started_at) AS run_elapsed")
#: A queued loop's claim (its first turn, or a turn a consumer delivered).
_CLAIM_LLM_TURN = _CLAIM.format(condition="AND status = 'queued' ")
#: The claim a tool answer adopts for its thread (the caller holds the row lock),
#: its parameters ``claim_``-prefixed, as it is also part of a larger statement.
_ADOPTING_CLAIM = _CLAIM.replace("%(", "%(claim_")
_ADOPT_LLM_TURN = _ADOPTING_CLAIM.format(condition="")
_INSERT_SHELL = (
    "INSERT INTO solidloop_messages (loop_id, role, content, status, is_hidden) "
    "VALUES (%s, 'assistant', '', 'processing', true) RETURNING *")
_SHELL_COLUMNS = tuple(column.name for column in Message.__table__.columns)
#: The adopted claim and its turn's hidden shell, in one statement: the loop's
#: row whole, and the shell's columns as ``shell_<column>``.
def _shell_part(sources: str = "claim") -> str:
    """The ``shell`` part of a statement whose ``claim`` part claims the turn:
    its hidden ``processing`` shell, made from the rows of ``sources``."""
    return ("shell AS (INSERT INTO solidloop_messages (loop_id, role, content, status, "
            f"is_hidden) SELECT claim.id, 'assistant', '', 'processing', true FROM {sources} "
            "RETURNING *)")



_SHELL_SELECTED = ", ".join(f'shell.{column} AS "shell_{column}"' for column in _SHELL_COLUMNS)
_ADOPT_WITH_SHELL = (
    f"WITH claim AS ({_ADOPT_LLM_TURN}), {_shell_part()} "
    f"SELECT claim.*, {_SHELL_SELECTED} FROM claim, shell")


def _claim_row(session: SessionLike, statement: str, loop_id: int, token: uuid.UUID,
               lease_seconds: float) -> dict[str, Any] | None:
    """Run one of the claim statements; the loop's row, or None when it matched none."""
    return driver_connection(session).cursor(row_factory=dict_row).execute(
        statement, _claim_params(loop_id, token, lease_seconds)).fetchone()


def _hide_shells(session: SessionLike, loop_id: int) -> None:
    """Fail and hide the loop's ``processing`` shells: a partial never enters the history."""
    session.execute(
        update(Message)
        .where(Message.loop_id == loop_id, Message.status == "processing")
        .values(status="failed", is_hidden=True)
    )


def _clean(value: str | None) -> str | None:
    """Text made storable (NUL and lone surrogates replaced), for error texts."""
    return storable.text(value)[0]


def _sanitized(fields: dict[str, bool]) -> list[str]:
    """The names of the fields whose text had to be made storable."""
    return [name for name, altered in fields.items() if altered]


def _event_payload(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """A wire-log payload with each large body cut to an excerpt, made storable."""
    for part in ("request", "response"):
        section = payload.get(part)
        if isinstance(section, dict) and "body" in section:
            section["body"], _ = storable.excerpt(section["body"], limit)
    if "result" in payload:
        payload["result"], _ = storable.excerpt(payload["result"], limit)
    cleaned, _, _ = storable.json_value(payload)
    return cleaned  # type: ignore[no-any-return]


_INSERT_LLM_EVENT = (
    "INSERT INTO solidloop_events (loop_id, message_id, kind, status_code, duration_ms, "
    "error, payload) VALUES (%(loop_id)s, %(message_id)s, 'llm_request', %(status_code)s, "
    "%(duration_ms)s, %(error)s, %(payload)s)")


def _wire_event(session: SessionLike, loop_id: int, message_id: int | None,
                wire: WireRecord | None, *, body_limit: int, error: str | None = None,
                repeat_history: bool = False) -> None:
    """The turn's ``llm_request`` event. Its request body keeps the conversation
    from the model's last answer on (storable.conversation_tail) unless
    ``repeat_history`` (SOLIDLOOP_EVENT_REPEAT_HISTORY) keeps it whole."""
    params = _wire_event_params(loop_id, message_id, wire, body_limit=body_limit,
                                error=error, repeat_history=repeat_history)
    if params is not None:
        # A plain INSERT on the driver connection (nothing reads the row back).
        execute_on(session, _INSERT_LLM_EVENT, params)


def _wire_event_params(loop_id: int, message_id: int | None, wire: WireRecord | None, *,
                       body_limit: int, error: str | None = None,
                       repeat_history: bool = False, tools_logged: str | None = None,
                       tools: str | None = None) -> dict[str, Any] | None:
    """The parameters of :data:`_INSERT_LLM_EVENT` for ``wire`` (None: no event).
    ``tools_logged``: the digest of the tools an earlier event of the loop holds
    whole (see :class:`_LoggedTools`); the same tools are named, not repeated.
    ``tools``: this request's own digest, when the caller has it already."""
    if wire is None:
        return None
    payload = wire.to_payload()
    if not repeat_history:
        body = storable.conversation_tail(payload["request"]["body"])
        if tools_logged is not None and (
                tools if tools is not None else storable.tools_digest(body)) == tools_logged:
            body = storable.without_tools(body, tools_logged)
        payload["request"]["body"] = body
    return {"loop_id": loop_id, "message_id": message_id, "status_code": wire.status,
            "duration_ms": wire.duration_ms, "error": _clean(error),
            "payload": Jsonb(_event_payload(payload, body_limit))}


class _LoggedTools:
    """The digest of the tool declarations this process last committed whole in
    a loop's wire log, per loop (its id and ``created_at``; bounded: forgetting
    one only logs its tools whole again). Every request sends the agent's tools,
    often many kilobytes of schema; the wire log keeps them once per loop and
    process, and again whenever they change."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._digests: OrderedDict[tuple[int, Any], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, loop: tuple[int, Any]) -> str | None:
        with self._lock:
            return self._digests.get(loop)

    def remember(self, loop: tuple[int, Any], digest: str | None) -> None:
        if digest is None:
            return
        with self._lock:
            self._digests[loop] = digest
            self._digests.move_to_end(loop)
            while len(self._digests) > self.LIMIT:
                self._digests.popitem(last=False)


_logged_tools = _LoggedTools()


def _lock_call(session: SessionLike, loop_id: int, token: uuid.UUID, tool_call_id: int,
               lease_token: uuid.UUID | None) -> tuple[Loop, ToolCall]:
    """Lock loop then tool call (always that order) and check the call's fence.

    A job holding the call's lease (``lease_token``) is fenced on that lease
    alone: a pause, stop or resume of the loop does not take a running tool
    away from a live worker, so its result is never thrown away and the tool
    never runs twice for it. Only the reaper (a lapsed lease), a force stop or
    a cancelling resume revoke the lease. A job without a lease (a
    continuation: the tool already ran) is fenced on the loop's generation.
    """
    loop = lock_loop(session, loop_id)
    if loop is None or (lease_token is None and not owns(loop, token)):
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed generation during tool call")
    call = session.execute(
        select(ToolCall).where(ToolCall.id == tool_call_id).with_for_update()
        .execution_options(populate_existing=True)
    ).scalar_one()
    if lease_token is not None and call.lease_token != lease_token:
        session.rollback()
        raise LostLeaseError(f"tool call {call.id}: its lease was reclaimed")
    return loop, call


def fenced_transition(session: SessionLike, loop_id: int, token: uuid.UUID, *,
                      from_: str | tuple[str, ...], to: str, **changes: Any) -> bool:
    """A turn's own transition on its generation, committed now. False (and
    nothing written) when the loop is no longer that generation's."""
    if isinstance(changes.get("error_message"), str):
        changes["error_message"] = _clean(changes["error_message"])
    loop = transition(session, loop_id, from_=from_, to=to, expected_token=token, **changes)
    if loop is None:
        session.rollback()
        return False
    session.commit()
    signals.send_status(to, loop_id=loop_id, error=changes.get("error_message"))
    return True


# -- creation ---------------------------------------------------------------------


def _storable_content(content: str, meta: dict[str, Any] | None
                      ) -> tuple[str | None, dict[str, Any]]:
    """A new message's content made storable, and its metadata flagging that."""
    cleaned, altered = storable.text(content)
    meta = dict(meta or {})
    if altered:
        meta["sanitized"] = ["content"]
    return cleaned, meta


def _message(loop_id: int, role: str, content: str, **fields: Any) -> Message:
    """A new message row with storable content (flagged when it had to change)."""
    cleaned, meta = _storable_content(content, fields.pop("meta", None))
    return Message(loop_id=loop_id, role=role, content=cleaned, meta=meta, **fields)


def create_loop(state: SolidLoopState, session: SessionLike, *, agent_name: str,
                subject_type: str | None, subject_id: str | None, system_prompt: str,
                message: str, loop_state: dict[str, Any], enqueue: bool) -> Loop:
    """Insert a loop (queued, or init), its system and user messages and, when
    ``enqueue``, its first llm_turn job. Does not commit: the caller may add
    its own writes to the same transaction."""
    loop = Loop(agent_name=agent_name, subject_type=subject_type, subject_id=subject_id,
                status="queued" if enqueue else "init", state=dict(loop_state))
    session.add(loop)
    session.flush()
    if system_prompt:
        session.add(_message(loop.id, "system", system_prompt))
    session.add(_message(loop.id, "user", message))
    session.flush()
    if enqueue:
        state.dispatch.llm_turn(session, loop.id, first=True)
    signals.send_after_commit(session, signals.loop_started, loop_id=loop.id, agent=agent_name)
    return loop


# -- the LLM turn -----------------------------------------------------------------


def fail_unclaimed(session: SessionLike, loop_id: int, error_message: str) -> None:
    """Fail a queued loop that cannot run at all (an unregistered agent, a broken
    definition), marking its job done, so it never sits queued forever."""
    session.rollback()
    failed = transition(session, loop_id, from_="queued", to="failed",
                        error_message=_clean(error_message)) is not None
    if failed:
        _commit_with_job_done(session)
        signals.send(signals.loop_failed, loop_id=loop_id, error=_clean(error_message))
    else:
        session.commit()


@dataclass
class LlmClaim:
    """An LLM turn's claim as the turn's stack sees it. From :func:`start_llm_turn`
    its transaction is still open and holds the row lock until
    :func:`commit_claim`; an adopted or a delivered claim (``precommitted``)
    committed already, and what joins it commits on its own."""

    token: uuid.UUID
    #: Seconds since this run's first claim, by the database clock.
    run_elapsed_seconds: float
    #: Whether the running job was marked done in the claim's transaction.
    job_marked: bool
    #: The session transaction the claim was made in; when the session is in
    #: another one, someone committed or rolled the claim back meanwhile.
    transaction: Any = None
    committed: bool = False
    #: Run once the claim is committed (by :func:`commit_claim`, or found
    #: committed by someone else): the runtime registers the lease with the
    #: renewer here. Not before: a renewal inside the open transaction would
    #: see the loop still queued and call the lease lost.
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    #: The turn's history, when the commit that claimed it read it (an adopted
    #: turn: see _adopt_llm_turn); else None and the turn reads it.
    history: list[Any] | None = None
    #: The claim committed before the turn began (an adopted or a delivered
    #: claim): a rollback does not undo it.
    precommitted: bool = False

    def is_open(self, session: SessionLike) -> bool:
        return not self.committed and _real(session).get_transaction() is self.transaction


def start_llm_turn(session: SessionLike, loop_id: int, *, lease_seconds: float,
                   ) -> LlmClaim | None:
    """queued → running under a fresh execution token and lease, with the job
    marked done, in a transaction left open: the turn's initialization reads
    and its shell join it, and :func:`commit_claim` commits them all at once.
    The loop object in the session is refreshed from the claim (no reload).
    None (rolled back) when another claim won."""
    token = uuid.uuid4()
    row = _claim_row(session, _CLAIM_LLM_TURN, loop_id, token, lease_seconds)
    if row is None:
        session.rollback()
        return None
    queries.row_object(session, Loop, row)  # the session's loop, as claimed
    marked = mark_current_job_done(session)
    return LlmClaim(token=token, run_elapsed_seconds=float(row["run_elapsed"]), job_marked=marked,
                    transaction=_real(session).get_transaction())


def _claim_delivered_statement(open_shell: bool, read_history: bool) -> str:
    """A queued loop's LLM turn claimed in one statement (``claim_`` parameters):
    the claim, the running job marked done (``job_`` parameters, see
    :func:`~..queue.current_job.current_job_done_params`), the turn's shell
    when ``open_shell``, its history when ``read_history``. No row when the
    claim matched nothing.

    The history is read from the statement's snapshot, taken before the claim
    waits for the loop row (if it waits), so the claim holds only while the
    row is the version that snapshot saw (``xmin``: a version's writing
    transaction): the rechecked row of a loop that someone stopped and resumed
    with a message meanwhile is queued again, but a newer version, and the
    claim lets it be (the caller then claims the classic way, whose history
    read starts after the lock is held). What the check relies on: every
    write to a loop's history takes the loop row first, and a write that
    makes a loop queued, or adds to its history while it is queued, rewrites
    the row (creating it, resuming it, answering its tool phase's last call,
    requeueing it)."""
    claim = _ADOPTING_CLAIM.format(
        condition="AND status = 'queued' AND xmin = (SELECT xmin FROM seen) ")
    parts = ["WITH seen AS (SELECT xmin FROM solidloop_loops WHERE id = %(claim_id)s)",
             f"claim AS ({claim})",
             "job AS ({} RETURNING id)".format(
                 jobs_sql.MARK_DONE_WHEN.format(condition="AND EXISTS (SELECT 1 FROM claim)"))]
    selected = ["claim.*"]
    joined = "claim"
    if open_shell:
        parts.append(_shell_part())
        selected.append(_SHELL_SELECTED)
        joined += ", shell"
    if read_history:
        selected.append(f"{queries.history_json()} AS solidloop_history")
    # The job's update runs whatever the SELECT reads; reading it orders nothing.
    return f"{', '.join(parts)} SELECT {', '.join(selected)} FROM {joined}"


#: By (open_shell, read_history).
_CLAIM_DELIVERED = {(shell, history): _claim_delivered_statement(shell, history)
                    for shell in (False, True) for history in (False, True)}


@dataclass
class DeliveredClaim:
    """What :func:`claim_delivered_llm_turn` hands the turn: its claim, and the
    shell it wrote with it (None: the turn opens its own)."""

    claim: LlmClaim
    shell_id: int | None


def claim_delivered_llm_turn(session: SessionLike, loop_id: int, *, lease_seconds: float,
                             open_shell: bool, read_history: bool) -> DeliveredClaim | None:
    """A queued loop's LLM turn claimed as an adopted one starts (see
    :func:`_claim_delivered_statement`): one statement, in autocommit when the
    session holds nothing, with the job marked done, the shell written and
    the history read as the stack's shape allows (pipeline.stacks
    .adopted_turn_shape). The claim comes back committed but open, as
    :func:`adopted_llm_claim` leaves it: what the initialization adds commits
    on its own. None when nothing was claimed: a stale job, or a loop that
    changed since the statement's snapshot; the caller then asks
    :func:`start_llm_turn`, which decides with a fresh read."""
    token = uuid.uuid4()
    job_params, marks_job = current_job_done_params()
    params = {"loop_id": loop_id, **job_params,
              **_prefixed("claim_", _claim_params(loop_id, token, lease_seconds))}
    row, committed = fetch_one(session, _CLAIM_DELIVERED[(open_shell, read_history)],
                               params, sole=True)
    if row is None:
        return None
    history_rows = row.pop("solidloop_history", None)
    shell = ({column: row.pop(f"shell_{column}") for column in _SHELL_COLUMNS}
             if open_shell else None)
    _commit_unless(committed, session)
    if marks_job:
        note_current_job_done()
    # The rows as committed, loaded (and held: the identity map holds them weakly).
    real = _real(session)
    real.info["solidloop_claimed_loop"] = queries.row_object(session, Loop, row)
    if shell is not None:
        real.info["solidloop_open_shell"] = queries.row_object(session, Message, shell)
    if not real.in_transaction():
        real.begin()
    claim = LlmClaim(token=token, run_elapsed_seconds=float(row["run_elapsed"]),
                     job_marked=False, transaction=real.get_transaction(),
                     history=(queries.history_from_rows(history_rows or [])
                              if read_history else None), precommitted=True)
    return DeliveredClaim(claim, shell["id"] if shell is not None else None)


def commit_claim(session: SessionLike, claim: LlmClaim) -> None:
    """Commit the claim's transaction (the claim, the job done, whatever joined
    it). Objects stay loaded: they hold what this transaction wrote."""
    if claim.committed:
        return
    open_ = claim.is_open(session)
    claim.committed = True
    if open_:
        _commit_keeping_objects(session)
        if claim.job_marked:
            note_current_job_done()
    # else: committed (or rolled back) by someone else; the fence decides later.
    for callback in claim.after_commit:
        callback()


def adopted_llm_claim(session: SessionLike, adopted: Adopted) -> LlmClaim:
    """The claim of an LLM turn this thread adopted (see :func:`_requeue_for_llm`):
    already committed on the loop row, so what joins it here (the turn's
    initialization reads and its shell) commits on its own, without the row
    lock. The fence is not weakened by that: the turn's canonical write is
    fenced on the generation, and a shell left by a turn that lost the loop
    meanwhile is born hidden and healed by the reaper (``orphan_shells``)."""
    assert adopted.execution_token is not None
    real = _real(session)
    if not real.in_transaction():
        real.begin()
    return LlmClaim(token=adopted.execution_token,
                    run_elapsed_seconds=adopted.run_elapsed_seconds, job_marked=False,
                    transaction=real.get_transaction(), history=adopted.history,
                    precommitted=True)


def hand_back_llm_turn(state: SolidLoopState, session: SessionLike, loop_id: int,
                       token: uuid.UUID, *, delay_ms: int | None = None) -> bool:
    """An LLM turn claimed for this thread that it will not run after all (the
    worker is stopping, the chain broke, the database failed before the
    request): back to queued with a job (due in ``delay_ms``), if the
    generation is still the claimed one. False when it has moved on."""
    session.rollback()
    loop = transition(session, loop_id, from_="running", to="queued", expected_token=token)
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    state.dispatch.llm_turn(session, loop_id, delay_ms=delay_ms)
    session.commit()
    return True


_RELEASE_ADOPTED_CALL = text(
    "UPDATE solidloop_tool_calls SET lease_token = NULL, leased_until = NULL, "
    "lease_holder = NULL, updated_at = now() "
    "WHERE id = :id AND lease_token = :lease AND executed_at IS NULL")


def hand_back_tool_call(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                        tool_call_id: int, token: uuid.UUID, lease_token: uuid.UUID) -> bool:
    """An adopted tool call this thread will not run after all: its lease
    released and a job queued in one commit, if the lease is still the
    adopted one and the tool has not run. False otherwise."""
    session.rollback()
    lock_loop(session, loop_id)
    released = session.execute(_RELEASE_ADOPTED_CALL, {
        "id": tool_call_id, "lease": lease_token}).rowcount  # type: ignore[attr-defined]
    if not released:
        session.rollback()
        return False
    state.dispatch.tool_call(session, tool_call_id, token, loop_id=loop_id)
    session.commit()
    return True


def claim_llm_turn(session: SessionLike, loop_id: int, *, lease_seconds: float,
                   ) -> uuid.UUID | None:
    """queued → running under a fresh execution token and lease, with the job
    marked done, committed now. None when another claim won."""
    claim = start_llm_turn(session, loop_id, lease_seconds=lease_seconds)
    if claim is None:
        return None
    commit_claim(session, claim)
    return claim.token


def record_tool_snapshots(session: SessionLike, loop_id: int,
                          snapshots: dict[str, tuple[Any, Any]]) -> None:
    """Keep the tools a remote server listed for the first time as the loop's
    snapshot (the first writer wins). Does not commit: it joins the turn's
    initialization transaction."""
    for server_name, (tools, session_state) in snapshots.items():
        session.execute(
            pg_insert(McpSession)
            .values(loop_id=loop_id, server_name=server_name,
                    tools=storable.json_value(tools)[0],
                    session_state=storable.json_value(session_state)[0])
            .on_conflict_do_nothing(index_elements=["loop_id", "server_name"])
        )


def open_shell(session: SessionLike, loop_id: int, token: uuid.UUID,
               claim: LlmClaim | None = None) -> int:
    """Insert the hidden ``processing`` assistant message a turn streams into.

    Inside the open transaction of ``claim`` (the row lock is held, the fence
    cannot have moved) it joins that transaction and does not commit; otherwise
    it locks the loop, checks the fence and commits.
    """
    in_claim = claim is not None and claim.is_open(session)
    if not in_claim:
        loop = lock_loop(session, loop_id)
        if not owns(loop, token):
            session.rollback()
            raise LostLeaseError(f"loop {loop_id} changed hands before the request")
    session.flush()  # what the session holds goes first, as a flush would order it
    row = driver_connection(session).cursor(row_factory=dict_row).execute(
        _INSERT_SHELL, (loop_id,)).fetchone()
    assert row is not None
    shell_id = int(row["id"])
    # The session holds its objects weakly: keep the shell for the turn's
    # canonical write, which then finds it without a SELECT (when no commit or
    # rollback has expired it meanwhile).
    _real(session).info["solidloop_open_shell"] = queries.row_object(session, Message, row)
    if not in_claim:
        session.commit()
    return shell_id


#: The NOTIFY channel the admin's live stream LISTENs on (admin/live.py); the
#: payload is ``<loop_id>:<message_id>``. NOTIFY is transactional: it is
#: delivered when, and only if, the write it announces commits.
LIVE_CHANNEL = "solidloop_live"
_NOTIFY_PARTIAL = text(
    "SELECT pg_notify('" + LIVE_CHANNEL + "', loop_id::text || ':' || id::text) "
    "FROM solidloop_messages WHERE id = :id")


def record_partial(session: SessionLike, shell_id: int, content: str,
                   reasoning: str | None) -> None:
    """A streaming turn's text so far, onto its still-hidden shell."""
    session.execute(
        update(Message)
        .where(Message.id == shell_id, Message.status == "processing")
        .values(content=storable.text(content)[0], reasoning=storable.text(reasoning)[0])
    )
    # Admin live stream (issue 15): announce the partial in its own transaction.
    session.execute(_NOTIFY_PARTIAL, {"id": shell_id})
    session.commit()


@dataclass(frozen=True)
class NewToolCall:
    """A tool call the model asked for, routed to its server (if any offers it)."""

    call_id: str | None
    name: str
    arguments_raw: str | None
    arguments: dict[str, Any] | None
    server_name: str | None = None
    tool_name: str | None = None


def _tool_call_values(loop_id: int, message_id: int, position: int,
                      call: NewToolCall) -> dict[str, Any]:
    """A new tool call's column values (by attribute), its text made storable."""
    name, name_altered = storable.text(call.name)
    call_id, id_altered = storable.text(call.call_id or None)
    raw, raw_altered = storable.text(call.arguments_raw)
    arguments, arguments_altered, _ = storable.json_value(call.arguments)
    sanitized = _sanitized({"name": name_altered, "call_id": id_altered,
                            "arguments_raw": raw_altered, "arguments": arguments_altered})
    return {"loop_id": loop_id, "message_id": message_id, "position": position,
            "call_id": call_id, "name": name or "", "server_name": call.server_name,
            "tool_name": call.tool_name, "arguments_raw": raw, "arguments": arguments,
            "meta": {"sanitized": sanitized} if sanitized else None}


def finish_llm_turn(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                    token: uuid.UUID, shell_id: int, response: AssistantTurn,
                    meta: dict[str, Any], turn_cost: Decimal | None,
                    calls: Sequence[NewToolCall], wire: WireRecord | None,
                    sequential: bool) -> Message:
    """The LLM turn's canonical write, under the row lock and the fence: finalize
    the shell, record usage, cost, tool calls and the wire event, then complete
    the loop or enter the tool phase with its tool jobs, all in one commit.

    Plain statements on the driver connection, no unit of work: the loop's
    fenced ``UPDATE ... RETURNING`` is the row lock and the fence check at once
    (loop row first, as always), then the shell's ``UPDATE``, the calls'
    ``INSERT ... RETURNING id`` (the first one leased to this thread when it
    continues inline: adopted, no job), the event, the other calls' jobs."""
    usage = response.usage
    sets = ["step_count = step_count + 1", "lease_holder = NULL", "lease_expires_at = NULL",
            "updated_at = now()"]
    params: dict[str, Any] = {"id": loop_id, "token": token,
                              "live": f"{loop_id}:{shell_id}"}
    if usage is not None:
        sets += ["input_tokens = input_tokens + %(input)s",
                 "output_tokens = output_tokens + %(output)s"]
        params.update(input=usage.input_tokens, output=usage.output_tokens)
        if turn_cost is not None:
            sets.append("cost = coalesce(cost, 0) + %(cost)s")
            params["cost"] = turn_cost
    if not calls:
        sets += ["status = 'completed'", "execution_token = NULL", "finished_at = now()",
                 "error_message = NULL"]
    content, content_altered = storable.text(response.content)
    reasoning, reasoning_altered = storable.text(response.reasoning)
    meta, meta_altered, _ = storable.json_value(meta)
    sanitized = _sanitized({"content": content_altered, "reasoning": reasoning_altered,
                            "metadata": meta_altered})
    if sanitized:
        meta["sanitized"] = sanitized
    shell_params: dict[str, Any] = {
        "id": shell_id, "content": content, "reasoning": reasoning,
        "finish_reason": _clean(response.finish_reason), "meta": Jsonb(meta),
        "usage": Jsonb(usage.to_dict()) if usage is not None else None,
        "cost": turn_cost if usage is not None else None}
    # Tool phase: the loop stays running under this generation; no LLM lease. The
    # first call is born leased to this thread when it continues inline.
    lease = uuid.uuid4() if calls and state.dispatch.can_adopt() else None
    # The loop as this process's wire-log memory knows it: its id and its birth
    # (ids repeat across databases, and in one after a reset), from the loop
    # object the turn holds (not loaded for this: unknown, the tools are kept).
    known = _real(session).identity_map.get(identity_key(Loop, loop_id))
    born = known.__dict__.get("created_at") if known is not None else None
    repeat_history = state.config.event_repeat_history
    # Hashed once: to compare with what the log holds, and to remember after.
    tools = (storable.tools_digest(wire.request_body)
             if wire is not None and not repeat_history else None)
    event = _wire_event_params(
        loop_id, shell_id, wire, body_limit=state.config.event_body_limit,
        repeat_history=repeat_history, tools=tools,
        tools_logged=_logged_tools.get((loop_id, born)) if born is not None else None)
    # One statement writes the loop (fenced), the shell, the wire event and the
    # tool calls; the loop's row and the first call's come back whole: an
    # adopted tool call's step starts from them (Adopted.carried) instead of
    # reading them again. The admin's live stream is announced on commit (NOTIFY is
    # transactional: a turn that rolls back announces nothing).
    params.update(_prefixed("shell_", shell_params))
    if event is not None:
        params.update(_prefixed("event_", event))
    calls_values = None
    if calls:
        calls_values, call_params = _tool_call_rows(
            loop_id, shell_id, calls, lease, lease_seconds=state.config.liveness_ttl)
        params.update(call_params)
    # Nothing else joins this transaction when no other call is enqueued with it:
    # the statement then runs as its own transaction (no BEGIN, no COMMIT).
    sole = not calls or (lease is not None and (sequential or len(calls) == 1))
    fenced, committed = fetch_one(
        session, _finish_statement(sets, with_event=event is not None, calls_values=calls_values),
        params, sole=sole)
    if fenced is None:
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands during the request")
    agent_name = fenced["agent_name"]
    adopted = None
    if calls:
        call_ids: list[int] = fenced.pop("solidloop_call_ids")
        first_call = {column: fenced.pop(f"call_{column}") for column in _CALL_COLUMNS}
        to_run = calls_to_run(call_ids, sequential=sequential)
        if lease is not None:
            adopted = state.dispatch.adopt_tool_call(
                call_ids[0], token, loop_id=loop_id, lease_token=lease,
                carried=((Loop, fenced), (ToolCall, first_call)), sole_call=len(call_ids) == 1)
            to_run = to_run[1:]
        for call_id in to_run:
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
    # The shell as the session knows it (no SELECT now; it loads on first use).
    shell = _real(session).identity_map.get(identity_key(Message, shell_id))
    _commit_unless(committed, session)
    state.dispatch.confirm(adopted)
    if tools is not None:  # the event's tools are now in the log
        _logged_tools.remember((loop_id, fenced["created_at"]), tools)
    if not calls:
        signals.send(signals.loop_completed, loop_id=loop_id, agent=agent_name)
    if shell is None:
        shell = session.get(Message, shell_id)
    assert shell is not None
    return shell  # type: ignore[no-any-return]


_FINISH_SHELL = (
    "UPDATE solidloop_messages SET content = %(content)s, reasoning = %(reasoning)s, "
    "finish_reason = %(finish_reason)s, status = 'completed', is_hidden = false, "
    "completed_at = now(), metadata = %(meta)s, usage = coalesce(%(usage)s, usage), "
    "cost = coalesce(%(cost)s, cost), updated_at = now() WHERE id = %(id)s")


def _prefixed(prefix: str, params: dict[str, Any]) -> dict[str, Any]:
    return {prefix + key: value for key, value in params.items()}


def _finish_statement(sets: list[str], *, with_event: bool,
                      calls_values: str | None) -> str:
    """The turn end's fenced loop UPDATE with the shell's UPDATE, the wire
    event's INSERT (``shell_`` and ``event_`` parameters) and the tool calls'
    INSERT (``calls_values``, see :func:`_tool_call_rows`) as parts of one
    statement. Every WITH part runs once; the others write only when the fence
    matched (and a statement that matched nothing is rolled back anyway). It
    returns the loop's row whole; with calls, also their ids in order
    (``solidloop_call_ids``) and the first call's row whole (``call_<column>``:
    an adopted call's step starts from it)."""
    shell = _FINISH_SHELL.replace("%(", "%(shell_") + " AND EXISTS (SELECT 1 FROM fenced)"
    parts = [
        f"fenced AS (UPDATE solidloop_loops SET {', '.join(sets)} "
        "WHERE id = %(id)s AND status = 'running' AND execution_token = %(token)s "
        f"RETURNING *, pg_notify('{LIVE_CHANNEL}', %(live)s))",
        f"shell AS ({shell})"]
    if with_event:
        parts.append(
            "event AS (INSERT INTO solidloop_events (loop_id, message_id, kind, status_code, "
            "duration_ms, error, payload) SELECT %(event_loop_id)s, %(event_message_id)s, "
            "'llm_request', %(event_status_code)s, %(event_duration_ms)s, %(event_error)s, "
            "%(event_payload)s FROM fenced)")
    if calls_values is None:
        return f"WITH {', '.join(parts)} SELECT * FROM fenced"
    parts.append(
        "calls AS (INSERT INTO solidloop_tool_calls (loop_id, message_id, position, call_id, "
        "name, server_name, tool_name, arguments_raw, arguments, metadata, lease_token, "
        f"lease_holder, leased_until) SELECT v.* FROM (VALUES {calls_values}) AS v, fenced "
        "RETURNING *)")
    first = ", ".join(f'first.{column} AS "call_{column}"' for column in _CALL_COLUMNS)
    return (f"WITH {', '.join(parts)} SELECT fenced.*, "
            "ARRAY(SELECT id FROM calls ORDER BY position) AS solidloop_call_ids, "
            f"{first} FROM fenced, "
            "(SELECT * FROM calls ORDER BY position LIMIT 1) AS first")


#: The columns a new tool call is inserted with (by attribute), and their types.
_TOOL_CALL_TYPES = {"loop_id": "bigint", "message_id": "bigint", "position": "integer",
                    "call_id": "varchar", "name": "varchar", "server_name": "varchar",
                    "tool_name": "varchar", "arguments_raw": "text", "arguments": "jsonb",
                    "meta": "jsonb"}
_TOOL_CALL_COLUMNS = tuple(_TOOL_CALL_TYPES)


_CALL_COLUMNS = tuple(column.name for column in ToolCall.__table__.columns)


def _tool_call_rows(loop_id: int, message_id: int, calls: Sequence[NewToolCall],
                    lease: uuid.UUID | None, *, lease_seconds: float,
                    ) -> tuple[str, dict[str, Any]]:
    """The ``VALUES`` rows of a turn's tool calls (``call<n>_`` parameters), in
    the column order :func:`_finish_statement` inserts them; with ``lease``,
    the first is born leased to this worker (an adopted call). Each value is
    cast to its column's type: in a ``SELECT`` a parameter has none of its own."""
    rows, params = [], {}
    for position, call in enumerate(calls):
        values = _tool_call_values(loop_id, message_id, position, call)
        names = []
        for key in _TOOL_CALL_COLUMNS:
            value = values[key]
            params[f"call{position}_{key}"] = (
                Jsonb(value) if key in ("arguments", "meta") and value is not None else value)
            names.append(f"%(call{position}_{key})s::{_TOOL_CALL_TYPES[key]}")
        if position == 0 and lease is not None:
            params.update({"call_lease": lease, "call_holder": worker_identity(),
                           "call_ttl": timedelta(seconds=lease_seconds)})
            names += ["%(call_lease)s::uuid", "%(call_holder)s::varchar",
                      "now() + %(call_ttl)s::interval"]
        else:
            names += ["NULL::uuid", "NULL::varchar", "NULL::timestamptz"]
        rows.append(f"({', '.join(names)})")
    return ", ".join(rows), params


def end_llm_turn(session: SessionLike, loop_id: int, token: uuid.UUID, *, to: str,
                 error_message: str, shell_id: int | None,
                 wire: WireRecord | None, body_limit: int,
                 repeat_history: bool = False) -> bool:
    """End a turn with an expected outcome (a limit pauses, a provider error
    fails): the shell is failed and hidden, the wire record kept."""
    loop = transition(session, loop_id, from_="running", to=to, expected_token=token,
                      error_message=_clean(error_message))
    if loop is None:
        session.rollback()
        return False
    if shell_id is not None:
        shell = session.get(Message, shell_id)
        if shell is not None and shell.status == "processing":
            shell.status = "failed"
            shell.is_hidden = True
    _wire_event(session, loop_id, shell_id, wire, body_limit=body_limit, error=error_message,
                repeat_history=repeat_history)
    session.commit()
    signals.send_status(to, loop_id=loop_id, error=_clean(error_message))
    return True


def fail_turn(session: SessionLike, loop_id: int, token: uuid.UUID,
              error_message: str) -> bool:
    """Fail the loop for an error nothing else handled, if ``token`` still owns it."""
    loop = transition(session, loop_id, from_="running", to="failed", expected_token=token,
                      error_message=_clean(error_message))
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    session.commit()
    signals.send(signals.loop_failed, loop_id=loop_id, error=_clean(error_message))
    return True


# -- the tool turn ----------------------------------------------------------------


class ToolClaim(Enum):
    """How a tool job's claim ended."""

    #: The per-call lease is this job's: run the tool.
    CLAIMED = "claimed"
    #: The tool already ran (checkpointed); only its answer is missing.
    CONTINUATION = "continuation"
    #: Sequential mode, out of order: the head of the line was enqueued instead.
    REDIRECTED = "redirected"
    #: The generation rotated, or another live lease holds the call.
    LOST = "lost"


def claim_tool_call(state: SolidLoopState, session: SessionLike, call: ToolCall,
                    token: uuid.UUID, *, sequential: bool, lease_seconds: float,
                    reaper_lease_token: uuid.UUID | None = None,
                    ) -> tuple[ToolClaim, uuid.UUID | None]:
    """Claim a tool call for this job, marking the job done in the same commit.

    Returns the outcome and, when CLAIMED, the per-call lease token. A reaper
    reclaim arrives with the lease the reaper minted, which is adopted if it
    is still the call's.
    """
    loop_id = call.loop_id
    if sequential:
        pending = queries.unresolved_tool_calls(session, loop_id)
        if pending and pending[0].id != call.id:
            # Out of order: run nothing, but make sure the head of the line runs.
            state.dispatch.tool_call(session, pending[0].id, token, loop_id=loop_id)
            _commit_with_job_done(session)
            return ToolClaim.REDIRECTED, None
    if call.executed_at is not None:
        _commit_with_job_done(session, keep_objects=True)
        return ToolClaim.CONTINUATION, None
    loop = lock_loop(session, loop_id)
    if not owns(loop, token):
        session.rollback()
        return ToolClaim.LOST, None
    if reaper_lease_token is not None:
        session.refresh(call)
        if call.lease_token != reaper_lease_token:
            session.rollback()
            return ToolClaim.LOST, None
        call.lease_holder = worker_identity()
        _commit_with_job_done(session, keep_objects=True)
        return ToolClaim.CLAIMED, reaper_lease_token
    candidate = uuid.uuid4()
    claimed = session.execute(
        update(ToolCall)
        .where(ToolCall.id == call.id, ToolCall.executed_at.is_(None),
               or_(ToolCall.lease_token.is_(None), ToolCall.leased_until < func.now()))
        .values(lease_token=candidate, lease_holder=worker_identity(),
                leased_until=func.now() + timedelta(seconds=lease_seconds))
        .returning(*_CLAIMED_COLUMNS)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if claimed is None:
        session.rollback()
        return ToolClaim.LOST, None
    # The call object takes the claimed row's values: the tool runs from it,
    # and the session's readers see the lease. (SQLAlchemy 2.0 does not
    # refresh an object already loaded from an UPDATE's RETURNING, even with
    # populate_existing; 2.1 does.)
    for column, value in zip(_CLAIMED_COLUMNS, claimed, strict=True):
        set_committed_value(call, column.key, value)
    _commit_with_job_done(session, keep_objects=True)
    return ToolClaim.CLAIMED, candidate


#: What a tool call's claim sets on its row, read back into the call object.
_CLAIMED_COLUMNS = (ToolCall.lease_token, ToolCall.lease_holder, ToolCall.leased_until,
                    ToolCall.updated_at)


def checkpoint_tool_call(session: SessionLike, *, loop_id: int, token: uuid.UUID,
                         tool_call_id: int, lease_token: uuid.UUID | None,
                         result: ToolResult, duration_ms: float,
                         body_limit: int) -> tuple[ToolCall, ToolResult]:
    """Record a tool's canonical result (``executed_at``) under the call's lease,
    with its wire event. Exactly once: a second checkpoint finds it executed.
    The loop may be paused or stopped meanwhile: the result is recorded all the
    same (its effect happened), and resume answers the call from it.

    Returns the call and the result as stored: made storable (NUL and lone
    surrogates replaced) and, when a block held a value JSON cannot, with that
    value as text; the call's metadata says which. The full result is kept on
    the call; the event keeps an excerpt past ``body_limit``.
    """
    _, call = _lock_for_checkpoint(session, loop_id, token, tool_call_id, lease_token)
    canonical, notes = _canonical_result(call, result)
    _record_result(session, call, canonical, notes, duration_ms, body_limit)
    session.commit()
    return call, canonical


def checkpoint_and_answer_tool_call(
    state: SolidLoopState, session: SessionLike, *, loop_id: int, token: uuid.UUID,
    tool_call_id: int, lease_token: uuid.UUID | None, result: ToolResult,
    duration_ms: float, body_limit: int, answer_text: Callable[[ToolResult], str],
    sequential: bool, open_next_shell: bool = False, read_next_history: bool = False,
    known: KnownCall | None = None,
) -> tuple[ToolCall, ToolResult, bool]:
    """:func:`checkpoint_tool_call` and :func:`answer_tool_call` in one commit,
    for a tool stack with nothing between the two steps: the canonical result,
    its event, the tool message (``answer_text`` renders it from the stored
    result) and the successor job land together. A loop that is no longer
    running (paused or stopped while the tool ran) gets the checkpoint alone,
    as the two steps would have left it. When this thread adopts the loop's
    next LLM turn, ``open_next_shell`` and ``read_next_history`` say what of
    that turn is done here too (see pipeline.stacks.adopted_turn_shape).
    ``known``: the call as the step read it before the tool ran, when it is its
    message's only call and this thread adopted it; the whole outcome is then
    one statement (:func:`_answer_alone`). Returns the call, the stored result
    and whether the call was answered."""
    if lease_token is None:
        raise LostLeaseError(f"tool call {tool_call_id}: no lease to checkpoint under")
    if known is not None and known.id == tool_call_id and state.dispatch.can_adopt():
        outcome = _answer_alone(
            state, session, known, loop_id=loop_id, lease_token=lease_token, result=result,
            duration_ms=duration_ms, body_limit=body_limit, answer_text=answer_text,
            open_next_shell=open_next_shell, read_next_history=read_next_history)
        if outcome is not None:
            return outcome
    # Plain statements on the driver connection, no unit of work (the hot path
    # of every in-process tool turn): the loop row and the call's locked in one
    # statement, in that order (FOR UPDATE OF locks a joined row's tables in the
    # order it names them: the loop first, as everywhere).
    rows = execute_on(session, _LOCK_FOR_CHECKPOINT, (loop_id, tool_call_id), fetch=True)
    if not rows:
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed generation during tool call")
    loop_status, loop_token, *call_columns = rows[0]
    call = _CallRow(*call_columns)
    if call.lease_token != lease_token:
        session.rollback()
        raise LostLeaseError(f"tool call {tool_call_id}: its lease was reclaimed")
    if call.executed:  # someone else checkpointed first
        session.rollback()
        raise LostLeaseError(f"tool call {tool_call_id} was already executed")
    canonical, notes = _canonical_result(call, result)
    answered = loop_status == "running" and call.response_message_id is None
    params = _outcome_params(call, loop_id, canonical, notes, duration_ms, body_limit)
    remaining: list[int] = []
    adopted = None
    if answered:
        # The tool message, the result, its event and what is left to answer, in
        # one statement (see _RECORD_AND_ANSWER); when this thread continues
        # inline, with the next LLM turn's claim (and shell) for the last answer.
        content, message_meta = _storable_content(
            answer_text(canonical), {"is_error": canonical.is_error, "tool_name": call.name})
        params.update(content=content, message_meta=Jsonb(message_meta))
        if state.dispatch.can_adopt():
            next_token = uuid.uuid4()
            params.update(_prefixed("claim_", _claim_params(
                loop_id, next_token, state.config.liveness_ttl)))
            row = driver_connection(session).cursor(row_factory=dict_row).execute(
                _RECORD_ANSWER_AND_ADOPT[open_next_shell], params).fetchone()
            assert row is not None
            remaining = row.pop("solidloop_remaining")
            if row["id"] is not None:  # the last answer: the claim was made
                adopted = _adopted_llm_turn(state, session, loop_id, next_token, row,
                                            open_shell=open_next_shell,
                                            read_history=read_next_history)
            elif not remaining:  # one snapshot decides both; never leave the loop unqueued
                _requeue_loop_for_llm(state, session, loop_id)
        else:
            (remaining,), = execute_on(session, _RECORD_AND_ANSWER, params, fetch=True)
            if not remaining:
                _requeue_loop_for_llm(state, session, loop_id)
    else:
        execute_on(session, _RECORD_RESULT, params)
    if answered and remaining and sequential:
        # The loop's current generation: a resume may have rotated it while the
        # tool ran under its lease.
        adopted = _dispatch_tool_calls(state, session, loop_id, loop_token, remaining,
                                       sequential=True, adopt=True)
    # The call as the session knows it, expired by the commit: it reloads (the
    # stored result, the answer) when someone reads it.
    orm_call = _real(session).identity_map.get(identity_key(ToolCall, tool_call_id))
    session.commit()
    state.dispatch.confirm(adopted)
    if answered:
        signals.send(signals.tool_call_answered, loop_id=loop_id, tool_call_id=tool_call_id,
                     is_error=canonical.is_error)
    if orm_call is None:
        orm_call = session.get(ToolCall, tool_call_id)
    return orm_call, canonical, answered  # type: ignore[return-value]


_LOCK_FOR_CHECKPOINT = (
    "SELECT l.status, l.execution_token, c.id, c.loop_id, c.message_id, c.name, "
    "c.server_name, c.tool_name, c.arguments, c.arguments_raw, c.metadata, c.lease_token, "
    "c.executed_at IS NOT NULL, c.response_message_id "
    "FROM solidloop_loops l JOIN solidloop_tool_calls c ON c.loop_id = l.id "
    "WHERE l.id = %s AND c.id = %s FOR UPDATE OF l, c")
#: What a tool call's outcome sets on its row (its answer and lease are set
#: by the statement that answers it).
_RESULT_SET = (
    "result = %(result)s, is_success = %(is_success)s, error_kind = %(error_kind)s, "
    "executed_at = now(), duration_ms = %(duration_ms)s, "
    "metadata = coalesce(%(meta)s, metadata), updated_at = now()")
_INSERT_TOOL_EVENT = (
    "INSERT INTO solidloop_events (loop_id, tool_call_id, kind, duration_ms, error, payload) "
    "VALUES (%(loop_id)s, %(id)s, 'tool_call', %(duration_ms)s, %(error)s, %(payload)s)")
#: The checkpoint of a call whose loop no longer runs: the result and its event.
_RECORD_RESULT = (
    f"WITH event AS ({_INSERT_TOOL_EVENT}) "
    f"UPDATE solidloop_tool_calls SET {_RESULT_SET} WHERE id = %(id)s")
#: The checkpoint and the answer: the tool message, the result pointing at it
#: (the lease released), the event, and the message's calls still unanswered.
#: Every WITH part runs exactly once; the final SELECT sees the table as the
#: statement began (this call still unanswered, hence ``id <>``), and every
#: sibling answered before is visible: answering one takes the loop row lock,
#: which this transaction holds.
_ANSWER_PARTS = (
    "WITH answer AS (INSERT INTO solidloop_messages (loop_id, role, content, tool_call_id, "
    "metadata) VALUES (%(loop_id)s, 'tool', %(content)s, %(id)s, %(message_meta)s) "
    "RETURNING id), "
    f"recorded AS (UPDATE solidloop_tool_calls SET {_RESULT_SET}, "
    "response_message_id = (SELECT id FROM answer), lease_token = NULL, "
    "lease_holder = NULL, leased_until = NULL WHERE id = %(id)s), "
    f"event AS ({_INSERT_TOOL_EVENT})")
#: The message's other calls still unanswered, as the statement began.
_UNANSWERED_BESIDE = ("FROM solidloop_tool_calls s WHERE s.message_id = %(message_id)s "
                      "AND s.response_message_id IS NULL AND s.id <> %(id)s")
_REMAINING = f"ARRAY(SELECT s.id {_UNANSWERED_BESIDE} ORDER BY s.position)"
_RECORD_AND_ANSWER = f"{_ANSWER_PARTS} SELECT {_REMAINING}"


def _record_answer_and_adopt(open_shell: bool) -> str:
    """:data:`_RECORD_AND_ANSWER` with the loop's next LLM claim for this thread
    (``claim_`` parameters) as one more part, made only when no other call of
    the message is unanswered (the same snapshot as the siblings' list), and
    the turn's shell when ``open_shell``. It returns the siblings still
    unanswered (``solidloop_remaining``) and the claimed row whole (all NULL
    when no claim was made), with the shell's columns as ``shell_<column>``."""
    claim = _ADOPTING_CLAIM.format(
        condition=f"AND NOT EXISTS (SELECT 1 {_UNANSWERED_BESIDE}) ")
    parts = f"{_ANSWER_PARTS}, claim AS ({claim})"
    selected = "claim.*"
    joined = "LEFT JOIN claim ON true"
    if open_shell:
        # The shell is made from the answer's row too, so its id is drawn after
        # the answer's: a conversation is ordered by message id, and the parts
        # of one statement run in no given order otherwise.
        parts += ", " + _shell_part("claim, answer")
        selected += f", {_SHELL_SELECTED}"
        joined += " LEFT JOIN shell ON true"
    return (f"{parts} SELECT {_REMAINING} AS solidloop_remaining, {selected} "
            f"FROM (SELECT 1) AS one {joined}")


#: By whether the next turn's shell is written too.
_RECORD_ANSWER_AND_ADOPT = {open_shell: _record_answer_and_adopt(open_shell)
                            for open_shell in (False, True)}


@dataclass(frozen=True)
class KnownCall:
    """A tool call's columns that stay as they are until its checkpoint, read by
    its step before the tool runs (:meth:`of`), for the one-statement outcome
    (:func:`_answer_alone`)."""

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
    def of(cls, call: ToolCall) -> KnownCall:
        return cls(call.id, call.loop_id, call.message_id, call.name, call.server_name,
                   call.tool_name, call.arguments, call.arguments_raw, call.meta)

    @property
    def idempotency_key(self) -> str:
        return f"solidloop:tool_call:{self.id}"


def _outcome_params(call: KnownCall, loop_id: int, canonical: ToolResult,
                    notes: dict[str, Any], duration_ms: float,
                    body_limit: int) -> dict[str, Any]:
    """The parameters every statement that records a call's outcome takes: its
    canonical result on the call row, and its ``tool_call`` event."""
    stored = canonical.to_mcp()
    return {
        "id": call.id, "loop_id": loop_id, "message_id": call.message_id,
        "result": Jsonb(stored), "is_success": not canonical.is_error,
        "error_kind": canonical.error_kind, "duration_ms": duration_ms,
        "meta": Jsonb(notes) if notes else None,
        "error": canonical.text()[:MAX_EVENT_ERROR] if canonical.is_error else None,
        "payload": Jsonb(_event_payload({
            "name": call.name, "server": call.server_name, "tool": call.tool_name,
            "arguments": call.arguments if call.arguments is not None else call.arguments_raw,
            "idempotency_key": call.idempotency_key, "result": stored,
        }, body_limit))}


def _answer_alone_statement(open_shell: bool, read_history: bool) -> str:
    """The outcome of a call that is its message's only one, adopted by this
    thread, as one statement: the loop's and the call's row locks (loop first),
    the checks the two-step path makes in Python (the call's lease, not yet
    executed, no sibling), then, when they hold, the checkpoint, its event and,
    while the loop runs and the call is unanswered, the answer with the next
    LLM turn's claim for this thread (``claim_`` parameters), its shell when
    ``open_shell`` and its history when ``read_history``.

    Why one statement is enough here: a statement's snapshot is taken before
    it waits for the row locks, so it may miss what committed meanwhile. The
    locked rows themselves are read as they are now (``FOR UPDATE`` and
    ``UPDATE`` follow a row to its newest version); what else is read is a
    sibling's answer (none: there is no sibling, and which calls a message
    has never changes) and the history, whose writers all take the loop row
    lock first and, while this call is leased and unanswered, move the loop
    out of ``running`` or execute this call (then nothing is answered here).
    Calls with siblings keep the two-step path, whose answer statement starts
    after the lock is held."""
    answered = "(SELECT answered FROM ok)"
    parts = [
        "WITH locked AS (SELECT l.status, c.lease_token, c.executed_at IS NOT NULL AS executed, "
        "c.response_message_id, EXISTS (SELECT 1 FROM solidloop_tool_calls s "
        "WHERE s.message_id = c.message_id AND s.id <> c.id) AS siblings "
        "FROM solidloop_loops l JOIN solidloop_tool_calls c ON c.loop_id = l.id "
        "WHERE l.id = %(loop_id)s AND c.id = %(id)s FOR UPDATE OF l, c)",
        "ok AS (SELECT status = 'running' AND response_message_id IS NULL AS answered "
        "FROM locked WHERE lease_token = %(lease)s AND NOT executed AND NOT siblings)",
        "answer AS (INSERT INTO solidloop_messages (loop_id, role, content, tool_call_id, "
        "metadata) SELECT %(loop_id)s, 'tool', %(content)s, %(id)s, %(message_meta)s "
        "FROM ok WHERE ok.answered RETURNING id, content, metadata, tool_call_id)",
        f"recorded AS (UPDATE solidloop_tool_calls SET {_RESULT_SET}, "
        "response_message_id = coalesce((SELECT id FROM answer), response_message_id), "
        f"lease_token = CASE WHEN {answered} THEN NULL ELSE lease_token END, "
        f"lease_holder = CASE WHEN {answered} THEN NULL ELSE lease_holder END, "
        f"leased_until = CASE WHEN {answered} THEN NULL ELSE leased_until END "
        "WHERE id = %(id)s AND EXISTS (SELECT 1 FROM ok))",
        "event AS (INSERT INTO solidloop_events (loop_id, tool_call_id, kind, duration_ms, "
        "error, payload) SELECT %(loop_id)s, %(id)s, 'tool_call', %(duration_ms)s, %(error)s, "
        "%(payload)s FROM ok)",
        "claim AS ({})".format(_ADOPTING_CLAIM.format(condition=f"AND {answered} ")),
    ]
    selected = ["locked.status AS solidloop_status", "locked.lease_token AS solidloop_lease",
                "locked.executed AS solidloop_executed",
                "locked.siblings AS solidloop_siblings", f"{answered} AS solidloop_answered",
                "claim.*"]
    joined = "LEFT JOIN locked ON true LEFT JOIN claim ON true"
    if open_shell:
        parts.append(_shell_part("claim, answer"))
        selected.append(_SHELL_SELECTED)
        joined += " LEFT JOIN shell ON true"
    if read_history:
        # The history as the statement began, and the answer it adds.
        selected.append(queries.history_json(
            f"{queries.HISTORY_ROWS} UNION ALL SELECT false, a.id, 'tool', a.content, "
            "NULL, a.metadata, a.tool_call_id, NULL, NULL, a.id FROM answer a",
            where=answered) + " AS solidloop_history")
    return f"{', '.join(parts)} SELECT {', '.join(selected)} FROM (SELECT 1) AS one {joined}"


#: By (open_shell, read_history).
_ANSWER_ALONE = {(shell, history): _answer_alone_statement(shell, history)
                 for shell in (False, True) for history in (False, True)}


def _answer_alone(state: SolidLoopState, session: SessionLike, known: KnownCall, *,
                  loop_id: int, lease_token: uuid.UUID, result: ToolResult,
                  duration_ms: float, body_limit: int,
                  answer_text: Callable[[ToolResult], str], open_next_shell: bool,
                  read_next_history: bool) -> tuple[ToolCall, ToolResult, bool] | None:
    """:func:`checkpoint_and_answer_tool_call` in one statement (see
    :func:`_answer_alone_statement`), run as its own transaction when the
    session holds nothing. None when the call has siblings after all (nothing
    was written): the caller takes the two-step path."""
    canonical, notes = _canonical_result(known, result)
    content, message_meta = _storable_content(
        answer_text(canonical), {"is_error": canonical.is_error, "tool_name": known.name})
    next_token = uuid.uuid4()
    params = _outcome_params(known, loop_id, canonical, notes, duration_ms, body_limit)
    params.update(lease=lease_token, content=content, message_meta=Jsonb(message_meta),
                  **_prefixed("claim_", _claim_params(loop_id, next_token,
                                                      state.config.liveness_ttl)))
    row, committed = fetch_one(
        session, _ANSWER_ALONE[(open_next_shell, read_next_history)], params, sole=True)
    assert row is not None  # one row, always
    status = row.pop("solidloop_status")
    if status is None:
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed generation during tool call")
    if row.pop("solidloop_lease") != lease_token:
        session.rollback()
        raise LostLeaseError(f"tool call {known.id}: its lease was reclaimed")
    if row.pop("solidloop_executed"):
        session.rollback()
        raise LostLeaseError(f"tool call {known.id} was already executed")
    if row.pop("solidloop_siblings"):
        session.rollback()
        return None
    answered = bool(row.pop("solidloop_answered"))
    history_rows = row.pop("solidloop_history", None)
    adopted = None
    if answered and row["id"] is not None:
        adopted = _adopted_llm_turn(
            state, session, loop_id, next_token, row, open_shell=open_next_shell,
            read_history=read_next_history,
            history=queries.history_from_rows(history_rows or []) if read_next_history else None)
    elif answered:  # pragma: no cover - the claim matches whenever the answer is written
        _requeue_loop_for_llm(state, session, loop_id)
        committed = False
    orm_call = _real(session).identity_map.get(identity_key(ToolCall, known.id))
    _commit_unless(committed, session)
    state.dispatch.confirm(adopted)
    if answered:
        signals.send(signals.tool_call_answered, loop_id=loop_id, tool_call_id=known.id,
                     is_error=canonical.is_error)
    if orm_call is None:
        orm_call = session.get(ToolCall, known.id)
    return orm_call, canonical, answered  # type: ignore[return-value]


@dataclass(frozen=True)
class _CallRow(KnownCall):
    """A locked tool call as the two-step checkpoint reads it: what the step
    knew, and the columns that say whether it may still be checkpointed."""

    lease_token: uuid.UUID | None
    executed: bool
    response_message_id: int | None


def _requeue_loop_for_llm(state: SolidLoopState, session: SessionLike, loop_id: int) -> None:
    """:func:`_requeue_for_llm` for a loop locked by a plain statement that this
    thread does not adopt: queued, with its job."""
    session.execute(text(_REQUEUE_LOOP), {"id": loop_id})
    state.dispatch.llm_turn(session, loop_id)


def _lock_for_checkpoint(session: SessionLike, loop_id: int, token: uuid.UUID,
                         tool_call_id: int, lease_token: uuid.UUID | None,
                         ) -> tuple[Loop, ToolCall]:
    if lease_token is None:
        raise LostLeaseError(f"tool call {tool_call_id}: no lease to checkpoint under")
    loop, call = _lock_call(session, loop_id, token, tool_call_id, lease_token)
    if call.executed_at is not None:  # someone else checkpointed first
        session.rollback()
        raise LostLeaseError(f"tool call {tool_call_id} was already executed")
    return loop, call


def _canonical_result(call: ToolCall | KnownCall, result: ToolResult
                      ) -> tuple[ToolResult, dict[str, Any]]:
    """The result as it will be stored, and the call's notes about what changed."""
    from ..mcp.toolset import ToolResult

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


def _record_result(session: SessionLike, call: ToolCall, canonical: ToolResult,
                   notes: dict[str, Any], duration_ms: float, body_limit: int) -> None:
    """Set the call's canonical result and add its event (the caller commits)."""
    call.result = canonical.to_mcp()
    call.is_success = not canonical.is_error
    call.error_kind = canonical.error_kind
    call.executed_at = func.now()
    call.duration_ms = duration_ms
    if notes:
        call.meta = notes
    session.add(Event(
        loop_id=call.loop_id, tool_call_id=call.id, kind="tool_call", duration_ms=duration_ms,
        error=canonical.text()[:MAX_EVENT_ERROR] if canonical.is_error else None,
        payload=_event_payload({
            "name": call.name, "server": call.server_name, "tool": call.tool_name,
            "arguments": call.arguments if call.arguments is not None else call.arguments_raw,
            "idempotency_key": call.idempotency_key, "result": call.result,
        }, body_limit),
    ))


def store_mcp_session_state(session: SessionLike, loop_id: int, server_name: str | None,
                            session_state: dict[str, Any]) -> None:
    """Keep the loop's stored MCP session current (a server re-initialized it,
    or the protocol era changed), so the next call resumes instead of probing."""
    session.rollback()
    session.execute(
        update(McpSession)
        .where(McpSession.loop_id == loop_id, McpSession.server_name == server_name)
        .values(session_state=storable.json_value(session_state)[0])
    )
    session.commit()


def answer_tool_call(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                     token: uuid.UUID, tool_call_id: int, lease_token: uuid.UUID | None,
                     content: str, is_error: bool, sequential: bool) -> bool:
    """Write the one tool message answering the call; when it was the phase's
    last open call, queue the next LLM turn in the same commit (in sequential
    mode, the next call instead). False when nothing was written: a duplicate
    delivery (already answered), or a loop that is not running (paused or
    stopped while the tool ran: its result is checkpointed, and resume
    enqueues the answer)."""
    loop, call = _lock_call(session, loop_id, token, tool_call_id, lease_token)
    if call.response_message_id is not None or loop.status != "running":
        session.rollback()
        return False
    message_id = _add_tool_message(session, loop_id, call, content, is_error=is_error)
    adopted = _release_and_continue(state, session, loop, call, message_id,
                                    sequential=sequential)
    session.commit()
    state.dispatch.confirm(adopted)
    signals.send(signals.tool_call_answered, loop_id=loop_id, tool_call_id=tool_call_id,
                 is_error=is_error)
    return True


def _add_tool_message(session: SessionLike, loop_id: int, call: ToolCall, content: str, *,
                      is_error: bool) -> int:
    message = _message(loop_id, "tool", content, tool_call_id=call.id,
                       meta={"is_error": is_error, "tool_name": call.name})
    session.add(message)
    session.flush()
    return message.id


def _release_and_continue(state: SolidLoopState, session: SessionLike, loop: Loop,
                          call: ToolCall, message_id: int, *, sequential: bool,
                          ) -> Adopted | None:
    """The call answered by ``message_id``, its lease released, and the successor
    job: the next LLM turn after the phase's last call (the next call, in
    sequential mode), adopted by this thread when it continues inline. The
    caller holds both row locks, commits, and then confirms the adoption."""
    call.response_message_id = message_id
    call.lease_token = None
    call.lease_holder = None
    call.leased_until = None
    remaining = list(session.scalars(
        select(ToolCall.id).where(ToolCall.message_id == call.message_id,
                                  ToolCall.response_message_id.is_(None))
        .order_by(ToolCall.position)
    ))
    if not remaining:
        return _requeue_for_llm(state, session, loop, adopt=True)
    if sequential:
        # The loop's current generation: a resume may have rotated it while the
        # tool ran under its lease.
        assert loop.execution_token is not None
        return _dispatch_tool_calls(state, session, loop.id, loop.execution_token, remaining,
                                    sequential=True, adopt=True)
    return None


def fail_tool_call(session: SessionLike, *, loop_id: int, tool_call_id: int,
                   token: uuid.UUID, lease_token: uuid.UUID | None,
                   error_message: str) -> bool:
    """Fail the loop for a tool turn's unhandled error, if this job still holds
    the generation and (when it claimed one) the call's lease."""
    loop = lock_loop(session, loop_id)
    if not owns(loop, token):
        session.rollback()
        return False
    call = session.execute(
        select(ToolCall).where(ToolCall.id == tool_call_id)
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()
    if lease_token is not None and (call is None or call.lease_token != lease_token):
        session.rollback()
        return False
    failed = transition(session, loop_id, from_="running", to="failed", expected_token=token,
                        error_message=_clean(f"tool call {tool_call_id}: {error_message}"))
    session.commit()
    if failed is not None:
        signals.send(signals.loop_failed, loop_id=loop_id,
                     error=_clean(f"tool call {tool_call_id}: {error_message}"))
    return True


# -- host commands ----------------------------------------------------------------


def _leave(session: SessionLike, loop_id: int, *, from_: tuple[str, ...], to: str,
           error_message: str | None) -> bool:
    """A host-driven exit from ``from_`` (no fence: the host outranks any
    generation), hiding the loop's shells. Does not commit."""
    changes: dict[str, Any] = {} if error_message is None else {
        "error_message": _clean(error_message)}
    loop = transition(session, loop_id, from_=from_, to=to, **changes)
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    return True


_STOPPABLE = ("init", "queued", "running", "paused")


def pause(session: SessionLike, loop_id: int) -> bool:
    if not _leave(session, loop_id, from_=("queued", "running"), to="paused",
                  error_message=None):
        return False
    session.commit()
    signals.send(signals.loop_paused, loop_id=loop_id, reason="paused")
    return True


def stop(session: SessionLike, loop_id: int, *, reason: str) -> bool:
    if not _leave(session, loop_id, from_=_STOPPABLE, to="failed", error_message=reason):
        return False
    session.commit()
    signals.send(signals.loop_failed, loop_id=loop_id, error=_clean(reason))
    return True


def force_stop(state: SolidLoopState, session: SessionLike, loop_id: int, *,
               reason: str) -> bool:
    """Fail the loop, cancel its queued jobs and revoke its tool leases, at once."""
    if not _leave(session, loop_id, from_=_STOPPABLE, to="failed",
                  error_message=f"force stopped: {reason}"):
        return False
    session.execute(
        update(ToolCall)
        .where(ToolCall.loop_id == loop_id, ToolCall.executed_at.is_(None))
        .values(lease_token=None, leased_until=None)
    )
    state.broker.cancel_loop_jobs(session, loop_id, reason="cancelled by force stop")
    session.commit()
    signals.send(signals.loop_failed, loop_id=loop_id, error=_clean(f"force stopped: {reason}"))
    return True


def freeze(session: SessionLike, loop_id: int) -> bool:
    loop = lock_loop(session, loop_id)
    if loop is None or loop.frozen or loop.status in ("completed", "failed"):
        session.rollback()
        return False
    paused = loop.status in ("queued", "running")
    if paused:
        transition(session, loop_id, from_=("queued", "running"), to="paused",
                   error_message="frozen")
        _hide_shells(session, loop_id)
    loop.frozen = True
    session.commit()
    if paused:
        signals.send(signals.loop_paused, loop_id=loop_id, reason="frozen")
    return True


def unfreeze(session: SessionLike, loop_id: int) -> bool:
    loop = lock_loop(session, loop_id)
    if loop is None or not loop.frozen:
        session.rollback()
        return False
    loop.frozen = False
    session.commit()
    return True


def set_observed(session: SessionLike, loop_id: int, observed: bool) -> bool:
    changed = session.execute(
        update(Loop).where(Loop.id == loop_id, Loop.observed.is_not(observed))
        .values(observed=observed)
    ).rowcount  # type: ignore[attr-defined]
    session.commit()
    return bool(changed)


def _cancel_tool_calls(session: SessionLike, calls: Iterable[ToolCall], *, reason: str) -> None:
    """Answer pending calls: a call that already ran gets its recorded result (its
    effect happened; the model must not be told otherwise), the others an error."""
    from ..mcp.toolset import ToolResult

    for call in calls:
        if call.executed_at is not None and call.result is not None:
            content = ToolResult.from_mcp(call.result).text()
            meta: dict[str, Any] = {"is_error": not call.is_success, "tool_name": call.name}
        else:
            content = f"tool call {call.name!r} was not run: {reason}"
            meta = {"is_error": True, "tool_name": call.name, "cancelled": True}
        message = Message(loop_id=call.loop_id, role="tool", content=content,
                          tool_call_id=call.id, meta=meta)
        session.add(message)
        session.flush()
        call.response_message_id = message.id
        call.lease_token = None
        call.lease_holder = None
        call.leased_until = None
        if call.executed_at is None:
            call.is_success = False
            call.error_kind = "cancelled"


def resume(state: SolidLoopState, session: SessionLike, loop_id: int, allowed: Iterable[str],
           *, message: str | None, sequential: Callable[[Loop], bool]) -> bool:
    """Re-enter a loop whose status is in ``allowed``, in one locked transaction.

    If the newest assistant turn still has unanswered tool calls, the loop
    re-enters its tool phase under a fresh generation: the calls' leases are
    revoked first, then their jobs are enqueued. Otherwise it is queued for a
    new LLM turn. ``message`` appends a user message first (answering pending
    calls, since nothing may sit between a tool-call turn and its results).
    """
    loop = lock_loop(session, loop_id)
    if loop is None or loop.status not in tuple(allowed):
        session.rollback()
        return False
    if loop.frozen:
        logger.warning("loop %s is frozen; unfreeze it before resuming", loop_id)
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    loop.error_message = None
    loop.finished_at = None
    loop.run_started_at = None  # limits apply per run; the next claim starts the clock
    loop.run_step_base = loop.step_count
    pending = queries.unresolved_tool_calls(session, loop_id)
    if message:
        _cancel_tool_calls(session, pending, reason="the loop was resumed with a new message")
        pending = []
        session.add(_message(loop_id, "user", message))
    if pending:
        token = uuid.uuid4()
        loop.status = "running"
        loop.execution_token = token
        loop.lease_expires_at = None
        loop.lease_holder = None
        # A call whose worker still holds a live lease keeps running and answers
        # under the new generation itself; every other call (never started, its
        # lease lapsed, or executed while the loop was paused) is enqueued anew.
        live = set(session.scalars(
            select(ToolCall.id).where(ToolCall.id.in_([c.id for c in pending]),
                                      ToolCall.executed_at.is_(None),
                                      ToolCall.lease_token.is_not(None),
                                      ToolCall.leased_until > func.now())))
        ids = [call.id for call in pending if call.id not in live]
        if ids:
            session.execute(
                update(ToolCall).where(ToolCall.id.in_(ids), ToolCall.executed_at.is_(None))
                .values(lease_token=None, leased_until=None, lease_holder=None)
            )
        session.flush()
        if sequential(loop):
            # One call at a time: only if none is running already.
            if not live:
                _dispatch_tool_calls(state, session, loop_id, token, ids, sequential=True)
        else:
            _dispatch_tool_calls(state, session, loop_id, token, ids, sequential=False)
    else:
        _requeue_for_llm(state, session, loop)
    session.commit()
    return True


# -- heals (the reaper's repairs) ---------------------------------------------------
#
# Each selects its candidates with FOR UPDATE SKIP LOCKED and changes rows with
# a compare-and-set, so reapers racing on one loop resolve to one repair; each
# repair and the job it implies commit together.

_LIVE_JOB = (
    "EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = l.id "
    "AND j.state IN ('queued', 'running'))"
)
# A job already queued for the call (a reclaim waiting behind a backlog) will
# adopt or re-claim the lease when it runs: minting yet another one would only
# churn, so such calls are left alone.
_LIVE_TOOL_JOB = (
    "EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = t.loop_id "
    "AND j.state IN ('queued', 'running') AND j.actor_name = 'solidloop.tool_call' "
    "AND j.message->'args'->>0 = t.id::text)"
)

EXPIRED_LLM = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'running' AND l.lease_expires_at < now()
 ORDER BY l.lease_expires_at
 LIMIT {HEAL_BATCH}
 FOR UPDATE SKIP LOCKED
"""
STALLED_TOOLS = f"""
SELECT t.id, t.lease_token, t.loop_id, l.execution_token
  FROM solidloop_tool_calls t
  JOIN solidloop_loops l ON l.id = t.loop_id
 WHERE t.response_message_id IS NULL AND t.executed_at IS NULL
   AND t.lease_token IS NOT NULL AND t.leased_until < now()
   AND l.status = 'running'
   AND NOT {_LIVE_TOOL_JOB}
 ORDER BY t.leased_until
 LIMIT {HEAL_BATCH}
 FOR UPDATE OF l SKIP LOCKED
"""
# A tool call nobody holds (no lease, or executed and waiting for its answer)
# while its loop has no live job at all: its job was lost. A sibling still
# running under a live lease means the phase is in hand (in sequential mode
# the calls behind the head wait for it by design), so nothing is dropped.
DROPPED_TOOLS = f"""
SELECT t.id, t.loop_id, l.execution_token
  FROM solidloop_tool_calls t
  JOIN solidloop_loops l ON l.id = t.loop_id
 WHERE t.response_message_id IS NULL
   AND (t.lease_token IS NULL OR t.executed_at IS NOT NULL)
   AND l.status = 'running' AND l.lease_expires_at IS NULL
   AND t.updated_at < now() - make_interval(secs => :grace)
   AND NOT {_LIVE_JOB}
   AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls s
                    WHERE s.loop_id = t.loop_id AND s.response_message_id IS NULL
                      AND s.executed_at IS NULL AND s.lease_token IS NOT NULL
                      AND s.leased_until >= now())
 ORDER BY t.loop_id, t.position
 LIMIT {HEAL_BATCH}
 FOR UPDATE OF l SKIP LOCKED
"""
STUCK_TOOL_PHASE = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'running' AND l.lease_expires_at IS NULL
   AND l.updated_at < now() - make_interval(secs => :grace)
   AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls t
                    WHERE t.loop_id = l.id AND t.response_message_id IS NULL)
   AND NOT {_LIVE_JOB}
 LIMIT {HEAL_BATCH}
 FOR UPDATE SKIP LOCKED
"""
STUCK_QUEUED = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'queued'
   AND l.queued_at < now() - make_interval(secs => :grace)
   AND NOT {_LIVE_JOB}
 LIMIT {HEAL_BATCH}
 FOR UPDATE SKIP LOCKED
"""
ORPHAN_SHELLS = f"""
UPDATE solidloop_messages m SET status = 'failed', is_hidden = true, updated_at = now()
 WHERE m.id IN (SELECT m2.id FROM solidloop_messages m2
                  JOIN solidloop_loops l ON l.id = m2.loop_id
                 WHERE m2.status = 'processing' AND l.status <> 'running'
                 LIMIT {HEAL_BATCH})
RETURNING m.id
"""
_REQUEUE_LOOP = (
    "UPDATE solidloop_loops SET status = 'queued', queued_at = now(), "
    "execution_token = NULL, "
    "lease_expires_at = NULL, lease_holder = NULL, updated_at = now() WHERE id = :id"
)
_HIDE_SHELLS = (
    "UPDATE solidloop_messages SET status = 'failed', is_hidden = true, "
    "updated_at = now() WHERE loop_id = :id AND status = 'processing'"
)
_MINT_TOOL_LEASE = (
    "UPDATE solidloop_tool_calls SET lease_token = :new, lease_holder = NULL, "
    "updated_at = now(), "
    "leased_until = now() + :lease WHERE id = :id AND lease_token = :old "
    "AND executed_at IS NULL"
)
_TOUCH_TOOL_CALL = "UPDATE solidloop_tool_calls SET updated_at = now() WHERE id = :id"
_TOUCH_LOOP = ("UPDATE solidloop_loops SET updated_at = now(), queued_at = now() "
               "WHERE id = :id")


def heal_expired_llm(state: SolidLoopState, session: SessionLike) -> list[int]:
    """Running loops whose LLM lease expired: the generation is rotated away,
    shells hidden, and a new llm_turn queued."""
    ids = list(session.execute(text(EXPIRED_LLM)).scalars())
    for loop_id in ids:
        session.execute(text(_REQUEUE_LOOP), {"id": loop_id})
        session.execute(text(_HIDE_SHELLS), {"id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
    session.commit()
    return ids


def heal_stalled_tools(state: SolidLoopState, session: SessionLike, *,
                       lease_seconds: float) -> list[int]:
    """Unexecuted tool calls whose lease expired: a fresh lease (CAS on the old
    one) goes to a new tool job, so healthy siblings are not fenced."""
    healed = []
    for call_id, old_lease, loop_id, token in session.execute(text(STALLED_TOOLS)).all():
        new_lease = uuid.uuid4()
        claimed = session.execute(text(_MINT_TOOL_LEASE), {
            "new": new_lease, "lease": timedelta(seconds=lease_seconds),
            "id": call_id, "old": old_lease}).rowcount  # type: ignore[attr-defined]
        if claimed:
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id,
                                     reaper_lease_token=new_lease)
            healed.append(call_id)
    session.commit()
    return healed


def heal_dropped_tools(state: SolidLoopState, session: SessionLike, *, grace: float,
                       sequential: Callable[[int], bool]) -> list[int]:
    """Tool calls of a running tool phase that nobody holds and no live job will
    run: a new tool job (the checkpoint keeps the body from running twice). In
    sequential mode (``sequential(loop_id)``) only the head of the line."""
    by_loop: dict[int, tuple[uuid.UUID, list[int]]] = {}
    for call_id, loop_id, token in session.execute(text(DROPPED_TOOLS),
                                                   {"grace": grace}).all():
        by_loop.setdefault(loop_id, (token, []))[1].append(call_id)
    healed = []
    for loop_id, (token, call_ids) in by_loop.items():
        for call_id in calls_to_run(call_ids, sequential=sequential(loop_id)):
            session.execute(text(_TOUCH_TOOL_CALL), {"id": call_id})
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
            healed.append(call_id)
    session.commit()
    return healed


def heal_stuck_tool_phase(state: SolidLoopState, session: SessionLike, *,
                          grace: float) -> list[int]:
    """Tool phases with nothing left to answer and no live job: next LLM turn."""
    ids = list(session.execute(text(STUCK_TOOL_PHASE), {"grace": grace}).scalars())
    for loop_id in ids:
        session.execute(text(_REQUEUE_LOOP), {"id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
    session.commit()
    return ids


def heal_stuck_queued(state: SolidLoopState, session: SessionLike, *,
                      threshold: float) -> list[int]:
    """Queued loops with no live job (for example a dead-lettered one): a new job."""
    ids = list(session.execute(text(STUCK_QUEUED), {"grace": threshold}).scalars())
    for loop_id in ids:
        session.execute(text(_TOUCH_LOOP), {"id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
    session.commit()
    return ids


def heal_orphan_shells(session: SessionLike) -> list[int]:
    """``processing`` shells of loops that are not running: failed and hidden."""
    ids = list(session.execute(text(ORPHAN_SHELLS)).scalars())
    session.commit()
    return ids


# ============================================================================ inbound MCP
# Writes made for the MCP server blueprint (flask_solidloop/mcp_server/): the
# sessions outside MCP clients hold (solidloop_mcp_inbound_sessions) and one
# wire-log event per inbound request (kind "mcp_inbound", loop_id NULL). They
# live here because this module is the only writer of solidloop_events. Each
# runs in its own short transaction on the request's session: it rolls back
# whatever a tool left uncommitted first, so a request never commits a
# tool's half-done writes by accident.

#: The ``kind`` of an inbound MCP request's event row.
INBOUND_EVENT_KIND = "mcp_inbound"


def create_inbound_session(session: SessionLike, *, session_id: str, server_name: str,
                           principal_label: str, protocol_version: str,
                           client_info: dict[str, Any]) -> None:
    """Record a new handshake-era session (an ``initialize`` that succeeded)."""
    from ..models import McpInboundSession

    session.rollback()
    session.add(McpInboundSession(
        id=session_id, server_name=server_name, principal_label=principal_label[:200],
        protocol_version=protocol_version, client_info=storable.json_value(client_info)[0],
    ))
    session.commit()


# Wire-log rows and last-seen stamps are diagnostics: they commit without
# waiting for the WAL flush (a crash may lose the last few milliseconds of
# them, never a session's existence), so an inbound request pays no fsync.
_ASYNC_COMMIT = text("SET LOCAL synchronous_commit = off")

_FIND_INBOUND = text("""
SELECT protocol_version, last_seen_at < now() - make_interval(secs => :every) AS stale
FROM solidloop_mcp_inbound_sessions
WHERE id = :id AND server_name = :server AND principal_label = :principal
  AND terminated_at IS NULL
""")
_TOUCH_INBOUND = text(
    "UPDATE solidloop_mcp_inbound_sessions SET last_seen_at = now() WHERE id = :id")
#: ``last_seen_at`` is refreshed at most this often (seconds), so a busy session
#: costs one read per request, not a write.
INBOUND_TOUCH_EVERY = 30.0


def touch_inbound_session(session: SessionLike, *, session_id: str, server_name: str,
                          principal_label: str) -> str | None:
    """Find a live session of this principal on this server (refreshing its
    ``last_seen_at`` when it is older than :data:`INBOUND_TOUCH_EVERY`); return
    its negotiated protocol version, or None (unknown, terminated, another
    server's or another principal's: the caller answers all four alike, 404)."""
    session.rollback()
    row = session.execute(_FIND_INBOUND, {
        "id": session_id, "server": server_name, "principal": principal_label[:200],
        "every": INBOUND_TOUCH_EVERY,
    }).first()
    if row is not None and row.stale:
        session.execute(_ASYNC_COMMIT)
        session.execute(_TOUCH_INBOUND, {"id": session_id})
        session.commit()
    else:
        session.rollback()
    return row.protocol_version if row is not None else None


_TERMINATE_INBOUND = text("""
UPDATE solidloop_mcp_inbound_sessions SET terminated_at = now(), last_seen_at = now()
WHERE id = :id AND server_name = :server AND principal_label = :principal
  AND terminated_at IS NULL
""")


def terminate_inbound_session(session: SessionLike, *, session_id: str, server_name: str,
                              principal_label: str) -> bool:
    """End a session (the client's DELETE); False when there was no live one."""
    session.rollback()
    ended = session.execute(_TERMINATE_INBOUND, {
        "id": session_id, "server": server_name, "principal": principal_label[:200],
    }).rowcount  # type: ignore[attr-defined]
    session.commit()
    return bool(ended)


def record_inbound_event(session: SessionLike, *, payload: dict[str, Any],
                         status_code: int, duration_ms: float, error: str | None,
                         body_limit: int) -> None:
    """One wire-log row for one inbound MCP request. The payload arrives
    redacted (the blueprint strips tokens and secret headers); bodies are cut
    to ``body_limit`` characters here, as for every other event."""
    session.rollback()
    session.execute(_ASYNC_COMMIT)
    session.add(Event(
        loop_id=None, kind=INBOUND_EVENT_KIND, status_code=status_code,
        duration_ms=duration_ms, error=_clean(error[:MAX_EVENT_ERROR] if error else None),
        payload=_event_payload(payload, body_limit),
    ))
    session.commit()


def record_inbound_events(session: SessionLike, events: Sequence[dict[str, Any]], *,
                          body_limit: int) -> None:
    """Many inbound events in one transaction (the blueprint's background
    writer batches them); each dict holds ``payload``, ``status_code``,
    ``duration_ms`` and ``error`` as for :func:`record_inbound_event`."""
    session.rollback()
    session.execute(_ASYNC_COMMIT)
    session.add_all([Event(
        loop_id=None, kind=INBOUND_EVENT_KIND, status_code=event["status_code"],
        duration_ms=event["duration_ms"],
        error=_clean(event["error"][:MAX_EVENT_ERROR] if event.get("error") else None),
        payload=_event_payload(event["payload"], body_limit),
    ) for event in events])
    session.commit()
