"""The LLM turn's writes: its claim, its shell and partial text, its end, and its
exits (a limit, an error, a hand-back, a middleware's own transition).

A turn's claim commits before its stack runs (:func:`claim_llm_turn`, or the
tool answer that adopted it); everything the turn writes after is fenced on
the generation that claim minted: a turn whose loop changed hands gets
``LostLeaseError`` (or False) and writes nothing.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NamedTuple

from psycopg.types.json import Jsonb
from sqlalchemy import update
from sqlalchemy.orm.util import identity_key

from ... import signals
from ..._typing import SessionLike, real_session
from ...errors import InvalidArgumentError, LostLeaseError
from ...leases import worker_identity
from ...models import Loop, Message, ToolCall
from ...models.loop import LoopStatus
from ...queue.current_job import current_job_done_params, note_current_job_done
from .. import queries, sql, storable
from .adopted import AdoptedToolCall, LlmClaim
from .ending import LoopEnds, run_loop_end_hooks
from .transaction import (
    alone,
    commit_keeping_objects,
    commit_unless,
    commit_with_job_done,
    commits,
    execute,
    fetch_row,
    fetch_rows,
    joins,
    run_alone,
)
from .wirelog import llm_event, logged_tools, request_payload

logger = logging.getLogger("flask_solidloop.store")

if TYPE_CHECKING:
    from ...llm.client import WireRecord
    from ...llm.types import AssistantTurn
    from ...state import SolidLoopState
    from .children import ChildStart


def calls_to_run(call_ids: Sequence[int], *, sequential: bool) -> list[int]:
    """The tool calls of a phase to run now: the head of the line in sequential
    mode (each answer dispatches the next), all of them otherwise."""
    return list(call_ids[:1]) if sequential else list(call_ids)


def claim_params(loop_id: int, token: uuid.UUID, lease_seconds: float) -> dict[str, Any]:
    """The parameters of a claim (loops/sql.CLAIM_SET)."""
    return {"loop_id": loop_id, "new_token": token, "holder": worker_identity(),
            "ttl": timedelta(seconds=lease_seconds)}


def claim_from_row(row: dict[str, Any], token: uuid.UUID, *,
                   read_history: bool) -> tuple[LlmClaim, dict[str, Any] | None]:
    """The claim a claiming statement's row describes, and the shell it wrote
    (its columns taken out of ``row``, which is left the loop's)."""
    history_rows = row.pop("solidloop_history", None)
    columns = {column: row.pop(f"shell_{column}") for column in sql.SHELL_COLUMNS}
    shell = columns if columns["id"] is not None else None
    # NULL: too long to carry as JSON (loops/sql.history_json); the turn reads it.
    history = queries.history_from_rows(history_rows) \
        if read_history and history_rows is not None else None
    return LlmClaim(token=token, run_elapsed_seconds=float(row["run_elapsed"]),
                    shell_id=shell["id"] if shell is not None else None,
                    history=history), shell


def _hold(session: SessionLike, model: type, row: dict[str, Any], key: str) -> Any:
    """``row`` loaded into the session as committed, and held there (the
    identity map holds objects weakly): the turn reads it with no SELECT."""
    obj = queries.row_object(session, model, row)
    real_session(session).info[key] = obj
    return obj


@alone
def claim_llm_turn(session: SessionLike, loop_id: int, *, lease_seconds: float,
                   open_shell: bool, read_history: bool) -> LlmClaim | None:
    """queued → running under a fresh generation and LLM lease, with the running
    job marked done, the turn's shell written (``open_shell``) and its history
    read (``read_history``) as the agent's stack allows: one statement
    (loops/sql.CLAIM_TURN), committed before the turn's stack runs. When the
    loop changed since the statement's snapshot, the statement runs again
    after the loop row is locked. None, with nothing written, when the loop
    is not queued (a stale job)."""
    token = uuid.uuid4()
    job_params, marks_job = current_job_done_params()
    params = {**claim_params(loop_id, token, lease_seconds), **job_params,
              "open_shell": open_shell, "read_history": read_history}
    row, committed = run_alone(session, sql.CLAIM_TURN, params, sole=True)
    if row is None:
        if not committed:
            session.rollback()
        locked = fetch_row(session, sql.LOCK_LOOP, {"loop_id": loop_id})
        row = fetch_row(session, sql.CLAIM_TURN, params) if locked is not None and \
            locked["status"] == LoopStatus.QUEUED else None
        if row is None:
            session.rollback()
            return None
        committed = False
    claim, shell = claim_from_row(row, token, read_history=read_history)
    commit_unless(committed, session)
    if marks_job:
        note_current_job_done()
    _hold(session, Loop, row, "solidloop_claimed_loop")
    if shell is not None:
        _hold(session, Message, shell, "solidloop_open_shell")
    return claim


@joins
def record_tool_snapshots(session: SessionLike, loop_id: int,
                          snapshots: dict[str, tuple[Any, Any]]) -> None:
    """Keep the tools a remote server listed for the first time as the loop's
    snapshot (the first writer wins)."""
    for server_name, (tools, session_state) in snapshots.items():
        execute(session, sql.RECORD_SNAPSHOT, {
            "loop_id": loop_id, "server": server_name,
            "tools": Jsonb(storable.json_value(tools)[0]),
            "session_state": Jsonb(storable.json_value(session_state)[0])})


@alone
def open_shell(session: SessionLike, loop_id: int, token: uuid.UUID) -> int:
    """The hidden ``processing`` assistant message a turn streams into, written
    on its own, fenced on the turn's generation (for a stack whose claim did
    not write it)."""
    row, committed = run_alone(session, sql.OPEN_SHELL, {"loop_id": loop_id, "token": token},
                               sole=True)
    if row is None:
        if not committed:
            session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands before the request")
    commit_unless(committed, session)
    return int(_hold(session, Message, row, "solidloop_open_shell").id)


@alone
def record_partial(session: SessionLike, shell_id: int, content: str,
                   reasoning: str | None) -> bool | None:
    """A streaming turn's text so far, onto its still-hidden shell (text deltas
    off). Returns whether someone
    watches the loop; None when the shell is no longer unfinished."""
    row, committed = run_alone(session, sql.RECORD_PARTIAL, {
        "shell_id": shell_id, "content": storable.text(content)[0],
        "reasoning": storable.text(reasoning)[0]}, sole=True)
    commit_unless(committed, session)
    return None if row is None else bool(row["watched"])


@alone
def record_delta(session: SessionLike, shell_id: int, text: str, offset: int,
                 reasoning: str | None = None, reasoning_offset: int = 0) -> bool | None:
    """A streaming turn's text (and reasoning) since its last flush, as events
    of the loop's stream. Returns whether someone watches the loop; None when
    the shell is no longer unfinished (nothing was written)."""
    row, committed = run_alone(session, sql.RECORD_DELTA, {
        "shell_id": shell_id, "text": storable.text(text)[0] or None, "offset": offset,
        "reasoning": storable.text(reasoning)[0] if reasoning else None,
        "reasoning_offset": reasoning_offset}, sole=True)
    commit_unless(committed, session)
    return None if row is None else bool(row["watched"])


@dataclass(frozen=True)
class CallWait:
    """How a new tool call waits (decided when the model's answer is parsed):
    for an ``approval`` or a ``result``, at most ``timeout`` seconds, after
    which an approval is decided ``on_timeout`` (``deny`` or ``approve``) and a
    result is an error (loops/store/waits.py)."""

    waits_for: str
    timeout: float | None = None
    on_timeout: str = "deny"
    #: A child agent's call: the loop its turn's end starts (children.py).
    child: ChildStart | None = None


@dataclass(frozen=True)
class WaitRequest:
    """A tool call that began to wait, as the agent's ``on_wait`` hook sees it
    inside the turn's transaction: for an ``approval`` or a ``result``."""

    tool_call_id: int
    loop_id: int
    tool: str
    arguments: dict[str, Any] | None
    waits_for: str
    #: Seconds until its timeout decides it; None: it waits for ever.
    timeout: float | None


@dataclass(frozen=True)
class NewToolCall:
    """A tool call the model asked for, routed to its server (if any offers it),
    and how it waits, if it does."""

    call_id: str | None
    name: str
    arguments_raw: str | None
    arguments: dict[str, Any] | None
    server_name: str | None = None
    tool_name: str | None = None
    wait: CallWait | None = None


def _calls_params(calls: Sequence[NewToolCall]) -> dict[str, list[Any]]:
    """The new tool calls as the turn end's array parameters, in
    order, their text made storable (and each call flagged when it had to be)."""
    columns: dict[str, list[Any]] = {name: [] for name in (
        "call_ids", "call_names", "call_servers", "call_tools", "call_raws", "call_arguments",
        "call_metas", "call_waits", "call_timeouts")}
    for call in calls:
        name, name_altered = storable.text(call.name)
        call_id, id_altered = storable.text(call.call_id or None)
        raw, raw_altered = storable.text(call.arguments_raw)
        arguments, arguments_altered, _ = storable.json_value(call.arguments)
        altered = storable.sanitized({"name": name_altered, "call_id": id_altered,
                                      "arguments_raw": raw_altered,
                                      "arguments": arguments_altered})
        meta: dict[str, Any] = {"sanitized": altered} if altered else {}
        wait = call.wait
        if wait is not None and wait.on_timeout != "deny":
            meta["on_timeout"] = wait.on_timeout  # what its timeout job decides
        for key, value in (("call_ids", call_id), ("call_names", name or ""),
                           ("call_servers", call.server_name), ("call_tools", call.tool_name),
                           ("call_raws", raw),
                           ("call_arguments", Jsonb(arguments) if arguments is not None else None),
                           ("call_metas", Jsonb(meta) if meta else None),
                           ("call_waits", wait.waits_for if wait is not None else None),
                           ("call_timeouts", wait.timeout if wait is not None else None)):
            columns[key].append(value)
    return columns


def answer_params(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                  token: uuid.UUID, shell_id: int, response: AssistantTurn,
                  meta: dict[str, Any], turn_cost: Decimal | None, wire: WireRecord | None,
                  event_id: int | None) -> tuple[dict[str, Any], Any, Any]:
    """The parameters every statement that ends a turn with its answer takes
    (the fence, the loop's totals, the shell's completion, the wire event),
    the loop's birth as this process's wire-log memory knows it, and the
    digest of the request's tools (to remember once the event is in)."""
    usage = response.usage
    content, content_altered = storable.text(response.content)
    reasoning, reasoning_altered = storable.text(response.reasoning)
    meta, meta_altered, _ = storable.json_value(meta)
    altered = storable.sanitized({"content": content_altered, "reasoning": reasoning_altered,
                                  "metadata": meta_altered})
    if altered:
        meta["sanitized"] = altered
    # The loop as this process's wire-log memory knows it: its id and its birth,
    # from the loop object the turn holds (not loaded for this: unknown, the
    # tools are logged whole).
    known = real_session(session).identity_map.get(identity_key(Loop, loop_id))
    born = known.__dict__.get("created_at") if known is not None else None
    repeat_history = state.config.event_repeat_history
    # Hashed once: to compare with what the log holds, and to remember after
    # (a request recorded before it was sent was compared then).
    tools = (storable.tools_digest(wire.request_body)
             if wire is not None and not repeat_history and event_id is None else None)
    params: dict[str, Any] = {
        "loop_id": loop_id, "token": token, "shell_id": shell_id,
        "input_tokens": usage.input_tokens if usage is not None else None,
        "output_tokens": usage.output_tokens if usage is not None else None,
        "cost": turn_cost if usage is not None else None,
        "content": content, "reasoning": reasoning,
        "finish_reason": storable.text(response.finish_reason)[0],
        "message_meta": Jsonb(meta),
        "usage": Jsonb(usage.to_dict()) if usage is not None else None,
        "message_cost": turn_cost if usage is not None else None,
        **llm_event(wire, body_limit=state.config.wire_body_limit,
                    repeat_history=repeat_history, tools=tools, event_id=event_id,
                    tools_logged=logged_tools.get((loop_id, born)) if born is not None else None),
    }
    return params, born, tools


def streamed_tail(content: str | None, streamed: str | None) -> dict[str, Any]:
    """The ``tail`` parameters: the text of the answer the loop's stream was not
    sent as deltas yet (``streamed``: what it was sent; None when the turn did
    not stream deltas)."""
    tail = content[len(streamed):] if streamed is not None and content is not None \
        and len(content) > len(streamed) and content.startswith(streamed) else None
    return {"tail": tail, "tail_offset": len(streamed or "")}


@dataclass(frozen=True)
class FinishedTurn:
    """What :func:`finish_llm_turn` wrote: the final assistant message, and the
    tool call its commit leased to this thread (``adopt``), if any."""

    message: Message
    adopted: AdoptedToolCall | None = None
    #: The loop waits: none of its calls can run before a decision or a result.
    waiting: bool = False


@alone
def finish_llm_turn(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                    token: uuid.UUID, shell_id: int, response: AssistantTurn,
                    meta: dict[str, Any], turn_cost: Decimal | None,
                    calls: Sequence[NewToolCall], wire: WireRecord | None,
                    sequential: bool, adopt: bool,
                    on_wait: Callable[[WaitRequest, SessionLike], None] | None = None,
                    ends: LoopEnds | None = None,
                    streamed: str | None = None, event_id: int | None = None,
                    output: Any = None) -> FinishedTurn:
    """The LLM turn's canonical write, one statement under the row lock and the
    fence (loops/sql.FINISH_TURN): the shell finalized with its usage and cost,
    the wire event (the row :func:`record_request` wrote, ``event_id``,
    completed), the tool calls; the loop completed, or in its tool phase
    with the calls to run now enqueued in the same commit. ``adopt``: the
    thread that commits continues inline, so the first call that can run is
    leased to it instead of getting a job (returned as ``adopted``). A call
    that waits (``NewToolCall.wait``) gets no job, and its timeout's job when
    it has one; when none can run (in sequential mode: when the head of the
    line waits), the loop waits. ``on_wait`` runs for each call that waits,
    in the same transaction (a savepoint: what it writes, a notification job
    say, commits with the wait; if it raises, its writes are undone, the error
    logged, and the turn's end commits without them). A final answer runs the
    host's ``on_loop_end`` hooks (``ends``) in the same transaction
    (store/ending.py). ``streamed``: the text the loop's stream was sent as
    deltas; the rest of the answer goes out as its last delta. ``output``: a
    final answer's validated structured output, stored on the loop (the
    loop's ``output``; None for none). A turn end
    with nothing else to commit (a final answer with no hook, or an adopted
    call with no job beside it) runs in autocommit."""
    # The calls that may run now: those that wait for nothing (in sequential
    # mode, the head of the line, unless it waits).
    runnable = [n for n, call in enumerate(calls) if call.wait is None]
    if sequential:
        runnable = runnable[:1] if runnable[:1] == [0] else []
    waits = bool(calls) and not runnable
    lease = uuid.uuid4() if runnable and adopt else None
    params, _, tools = answer_params(state, session, loop_id=loop_id, token=token,
                                    shell_id=shell_id, response=response, meta=meta,
                                    turn_cost=turn_cost, wire=wire, event_id=event_id)
    if not calls:
        params["output"] = Jsonb(output) if output is not None else None
    timed = [n for n, call in enumerate(calls) if call.wait is not None
             and call.wait.timeout is not None]
    if calls:
        params.update(_calls_params(calls), lease=lease, holder=worker_identity(),
                      ttl=timedelta(seconds=state.config.liveness_ttl), waits=waits,
                      lease_position=runnable[0] + 1 if lease is not None else None)
    # A child agent's call starts its loop in this commit; the host's hook and
    # signals are for the waits the host answers.
    spawns = [n for n, call in enumerate(calls) if call.wait is not None
              and call.wait.child is not None]
    waiting = [n for n, call in enumerate(calls) if call.wait is not None
               and call.wait.child is None]
    hooked = on_wait is not None and bool(waiting)
    ended = not calls and bool(ends)
    # Nothing else joins this commit when no job is enqueued with it.
    sole = (len(runnable) - (1 if lease is not None else 0) + len(timed) == 0 and not hooked
            and not ended and not spawns)
    params.update(streamed_tail(params["content"], streamed))
    if not calls:
        params["requeue"] = not sole
    fenced, committed = run_alone(session, sql.FINISH_TURN[bool(calls)], params, sole=sole)
    if fenced is None and not calls and not params["requeue"] and fetch_row(
            session, sql.INBOX_WAITS, {"loop_id": loop_id, "token": token}) is not None:
        # Messages wait in the inbox: their turn's job must commit with this
        # end, so the end runs again in a transaction.
        params["requeue"] = True
        fenced, committed = run_alone(session, sql.FINISH_TURN[False], params, sole=False)
    if fenced is None:
        if not committed:
            session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands during the request")
    fenced.pop("solidloop_streamed", None)
    # A final answer with messages waiting: they are delivered and their turn
    # queued, in this commit, instead of the loop completing.
    delivered = not calls and fenced["status"] == LoopStatus.QUEUED
    adopted = None
    call_ids: list[int] = []
    if calls:
        call_ids = fenced.pop("solidloop_call_ids")
        leased = {column: fenced.pop(f"call_{column}") for column in sql.CALL_COLUMNS}
        to_run = [call_ids[n] for n in runnable]
        if lease is not None:
            adopted = AdoptedToolCall(loop_id, to_run[0], token, lease,
                                      rows=((Loop, fenced), (ToolCall, leased)),
                                      sole_call=len(call_ids) == 1)
            to_run = to_run[1:]
        for call_id in to_run:
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
        for n in timed:
            timeout = calls[n].wait.timeout  # type: ignore[union-attr]
            state.dispatch.wait_timeout(session, call_ids[n], loop_id=loop_id,
                                        delay_ms=int(timeout * 1000))  # type: ignore[operator]
        if spawns:
            # children.py builds on waits.py, which builds on this module's kin
            from .children import start_children

            start_children(state, session, loop_id,
                           [(call_ids[n], calls[n].wait.child)  # type: ignore[union-attr,misc]
                            for n in spawns], sequential=sequential)
        if hooked:
            assert on_wait is not None
            for n in waiting:
                _run_wait_hook(on_wait, session, _wait_request(calls[n], call_ids[n], loop_id))
    elif delivered:
        fetch_rows(session, sql.DELIVER_INBOX, {"loop_id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
    elif ended:
        run_loop_end_hooks(session, loop_id, ends)
    # The shell as the session knows it (no SELECT now; it loads on first use).
    shell = real_session(session).identity_map.get(identity_key(Message, shell_id))
    commit_unless(committed, session)
    if tools is not None:  # the event's tools are now in the log
        logged_tools.remember((loop_id, fenced["created_at"]), tools)
    if not calls and not delivered:
        signals.send(signals.loop_completed, loop_id=loop_id, agent=fenced["agent_name"])
    for n in waiting:
        request = _wait_request(calls[n], call_ids[n], loop_id)
        signals.send_wait_requested(request.waits_for, loop_id=loop_id,
                                    tool_call_id=request.tool_call_id, tool=request.tool,
                                    arguments=request.arguments)
    if shell is None:
        shell = session.get(Message, shell_id)
    assert shell is not None
    return FinishedTurn(shell, adopted, waits)


def _wait_request(call: NewToolCall, call_id: int, loop_id: int) -> WaitRequest:
    assert call.wait is not None
    return WaitRequest(call_id, loop_id, call.name, call.arguments, call.wait.waits_for,
                       call.wait.timeout)


def _run_wait_hook(on_wait: Callable[[WaitRequest, SessionLike], None], session: SessionLike,
                   request: WaitRequest) -> None:
    """The agent's ``on_wait`` in a savepoint of the turn's transaction."""
    savepoint = real_session(session).begin_nested()
    try:
        on_wait(request, session)
    except Exception:
        savepoint.rollback()
        logger.exception("on_wait raised for tool call %s of loop %s; the call waits "
                         "all the same, without what the hook wrote", request.tool_call_id,
                         request.loop_id)
    else:
        savepoint.commit()


@alone
def end_turn(session: SessionLike, loop_id: int, token: uuid.UUID, *, to: str,
             error_message: str, wire: WireRecord | None = None, shell_id: int | None = None,
             body_limit: int = 0, repeat_history: bool = False, call_id: int | None = None,
             lease: uuid.UUID | None = None, ends: LoopEnds | None = None,
             event_id: int | None = None) -> bool:
    """A turn's own exit from ``running`` on its generation (loops/sql.END_TURN):
    a limit pauses the loop, an error fails it (``to``); its shells are failed
    and hidden, the turn's wire record kept (its request's row, ``event_id``,
    completed: with ``wire``, or with the error alone). A tool turn passes
    its call and lease: the call must still be that lease's. False, with
    nothing written, when the loop is no longer the turn's. An end that fails
    the loop runs the host's ``on_loop_end`` hooks (``ends``) before its
    commit."""
    error = storable.text(error_message)[0]
    params = {"loop_id": loop_id, "token": token, "to": to, "error_message": error,
              "shell_id": shell_id, "call_id": call_id, "lease": lease,
              **llm_event(wire, body_limit=body_limit, error=error,
                          repeat_history=repeat_history, event_id=event_id)}
    hooked = ends is not None and ends.apply_to(to)
    row, committed = run_alone(session, sql.END_TURN, params, sole=not hooked)
    if row is not None and hooked:
        run_loop_end_hooks(session, loop_id, ends)
    commit_unless(committed, session)
    if row is None:
        return False
    signals.send_status(to, loop_id=loop_id, error=error)
    return True


@commits
def fail_unclaimed(session: SessionLike, loop_id: int, error_message: str, *,
                   ends: LoopEnds | None = None) -> None:
    """Fail a queued loop that cannot run at all (an unregistered agent, a broken
    definition), marking its job done, so it never sits queued forever, with
    the host's ``on_loop_end`` hooks (``ends``). Rolls back what the session
    holds first."""
    session.rollback()
    error = storable.text(error_message)[0]
    left = fetch_row(session, sql.LEAVE, {
        "loop_id": loop_id, "from": [LoopStatus.QUEUED.value], "to": LoopStatus.FAILED.value,
        "error_message": error, "freeze": False, "revoke_leases": False})
    if left is None:
        session.commit()
        return
    run_loop_end_hooks(session, loop_id, ends)
    commit_with_job_done(session)
    signals.send(signals.loop_failed, loop_id=loop_id, error=error)


@commits
def requeue_llm_turn(state: SolidLoopState, session: SessionLike, loop_id: int,
                     token: uuid.UUID, *, delay_ms: int | None = None) -> bool:
    """An LLM turn claimed for this thread that it will not run after all (the
    worker is stopping, the chain broke, the database failed before the
    request): back to queued with its job (due in ``delay_ms``), if the
    generation is still the claimed one. False when it has moved on. Rolls
    back what the session holds first."""
    session.rollback()
    if fetch_row(session, sql.REQUEUE_TURN, {"loop_id": loop_id, "token": token}) is None:
        session.rollback()
        return False
    state.dispatch.llm_turn(session, loop_id, delay_ms=delay_ms)
    session.commit()
    return True


@commits
def defer_for_capacity(state: SolidLoopState, session: SessionLike, loop_id: int,
                       token: uuid.UUID, *, delay_seconds: float,
                       slot: dict[str, Any] | None, wire: WireRecord | None = None,
                       event_id: int | None = None, error_message: str | None = None,
                       shell_id: int | None = None) -> bool:
    """A turn a rate limit deferred (loops/sql.DEFER_FOR_CAPACITY): queued again
    with its job due in ``delay_seconds``, at its slot, holding no thread,
    lease or connection; the reservation it holds kept on the loop (``slot``).
    A request the provider refused with a long wait completes its event
    (``event_id``) with ``wire`` and ``error_message``. False, with nothing
    written, when the generation moved on. Rolls back what the session holds
    first."""
    session.rollback()
    config = state.config
    if fetch_row(session, sql.DEFER_FOR_CAPACITY, {
            "loop_id": loop_id, "token": token, "shell_id": shell_id,
            "slot": Jsonb(slot) if slot is not None else None,
            # Before a request there is no record: no event (payload NULL).
            **llm_event(wire, body_limit=config.wire_body_limit, error=error_message,
                        repeat_history=config.event_repeat_history, event_id=event_id)},
                 ) is None:
        session.rollback()
        return False
    state.dispatch.llm_turn(session, loop_id, delay_ms=max(int(delay_seconds * 1000), 0))
    session.commit()
    return True


@alone
def take_capacity_slot(session: SessionLike, loop_id: int, token: uuid.UUID,
                       ) -> dict[str, Any] | None:
    """The reservation a deferred turn of this loop holds, cleared as it is taken
    (loops/sql.TAKE_CAPACITY_SLOT): the generation that sends the request uses
    it once. None when there is none or the generation moved on."""
    row, ran_alone = run_alone(session, sql.TAKE_CAPACITY_SLOT,
                               {"loop_id": loop_id, "token": token}, sole=True)
    if not ran_alone:
        commit_keeping_objects(session)
    return row["capacity_slot"] if row is not None else None


#: A deferred turn's first wait, and the longest (seconds); each deferral
#: doubles the last, with jitter.
DEFER_FIRST_WAIT = 5.0
DEFER_LONGEST_WAIT = 60.0


@dataclass(frozen=True)
class Deferral:
    """A turn deferred for its provider: when the outage began (the database's
    clock), how many turns it has deferred, and when the next try is due."""

    since: datetime
    attempts: int
    delay_seconds: float


def defer_delay(attempts: int) -> float:
    """The wait before a deferred turn's next try: 5 s doubling to 60 s, with up
    to a quarter more, so loops deferred together do not come back together."""
    base = min(DEFER_FIRST_WAIT * 2 ** max(0, attempts - 1), DEFER_LONGEST_WAIT)
    return base * (1 + random.random() / 4)


@commits
def defer_llm_turn(state: SolidLoopState, session: SessionLike, loop_id: int,
                   token: uuid.UUID, *, error_message: str, max_wait: float,
                   max_attempts: int | None = None, wire: WireRecord | None = None,
                   shell_id: int | None = None, event_id: int | None = None,
                   ) -> Deferral | None:
    """A turn whose provider is out, deferred (loops/sql.DEFER_TURN): queued
    again with its job due after :func:`defer_delay`, its shells hidden, its
    wire event kept (``event_id``: its request's row, completed), the
    outage's start and attempts on the loop. None, with nothing written, when
    the generation moved on or the outage began more than ``max_wait``
    seconds ago, or ``max_attempts`` turns were deferred in it already (the
    caller then fails the turn). Rolls back what the session holds first."""
    session.rollback()
    error = storable.text(error_message)[0]
    config = state.config
    params = {"loop_id": loop_id, "token": token, "error_message": error,
              "max_wait": max_wait, "max_attempts": max_attempts, "shell_id": shell_id,
              **llm_event(wire, body_limit=config.wire_body_limit, error=error,
                          repeat_history=config.event_repeat_history, event_id=event_id)}
    row = fetch_row(session, sql.DEFER_TURN, params)
    if row is None:
        session.rollback()
        return None
    delay = defer_delay(row["provider_wait_attempts"])
    state.dispatch.llm_turn(session, loop_id, delay_ms=int(delay * 1000))
    session.commit()
    return Deferral(row["provider_wait_since"], row["provider_wait_attempts"], delay)


@commits
def fenced_transition(session: SessionLike, loop_id: int, token: uuid.UUID, *,
                      from_: str | tuple[str, ...], to: str, ends: LoopEnds | None = None,
                      **changes: Any) -> bool:
    """A middleware's own transition on its turn's generation (``ctx.transition``),
    committed now: from one of ``from_`` to ``to`` (loops/sql.TRANSITION), then
    the other ``changes`` (columns of the loop), and for an ending the host's
    ``on_loop_end`` hooks (``ends``). False, with nothing written, when the
    loop is no longer that generation's or not in ``from_``."""
    allowed = (from_,) if isinstance(from_, str) else tuple(from_)
    for status in (*allowed, to):
        LoopStatus.check(status)
    for key in changes:
        if key not in Loop.__table__.columns:
            raise InvalidArgumentError(f"Loop has no column {key!r}")
    if isinstance(changes.get("error_message"), str):
        changes["error_message"] = storable.text(changes["error_message"])[0]
    moved = fetch_row(session, sql.TRANSITION, {
        "loop_id": loop_id, "token": token, "from": list(allowed), "to": to})
    if moved is None:
        session.rollback()
        return False
    if changes:
        session.execute(update(Loop).where(Loop.id == loop_id).values(**changes))
    if ends is not None and ends.apply_to(to):
        run_loop_end_hooks(session, loop_id, ends)
    session.commit()
    signals.send_status(to, loop_id=loop_id, error=changes.get("error_message"))
    return True


class RecordedRequest(NamedTuple):
    """A request on record: its event, and whether the loop was watched then."""

    event_id: int
    watched: bool


@alone
def record_request(session: SessionLike, loop_id: int, token: uuid.UUID, *,
                   shell_id: int | None, wire: WireRecord, body_limit: int,
                   repeat_history: bool) -> RecordedRequest:
    """The turn's ``llm_request`` event, on record before its request is sent
    (loops/sql.RECORD_REQUEST): the redacted request of ``wire``, pending (no
    response, no duration) until the write that ends the turn completes it
    (``event_id`` of :func:`finish_llm_turn`, :func:`end_turn`,
    :func:`defer_llm_turn`, :func:`defer_for_capacity`). Fenced on the
    turn's generation: LostLeaseError, with nothing written, when the loop
    changed hands. One statement: in autocommit when the session holds
    nothing, else in the session's transaction, committed with it. Returns
    the event's id and whether someone watches the loop."""
    known = real_session(session).identity_map.get(identity_key(Loop, loop_id))
    born = known.__dict__.get("created_at") if known is not None else None
    tools = storable.tools_digest(wire.request_body) if not repeat_history else None
    payload = request_payload(
        wire.to_payload(), body_limit, repeat_history=repeat_history, tools=tools,
        tools_logged=logged_tools.get((loop_id, born)) if born is not None else None)
    row, committed = run_alone(session, sql.RECORD_REQUEST, {
        "loop_id": loop_id, "token": token, "shell_id": shell_id,
        "payload": Jsonb(payload)}, sole=True)
    if row is None:
        if not committed:
            session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands before the request")
    # Run alone, it wrote only the event, which no object of the session holds:
    # nothing to expire (commit_unless would reload the loop the turn holds).
    if not committed:
        session.commit()
    if born is not None:  # the request's tools are now in the log
        logged_tools.remember((loop_id, born), tools)
    return RecordedRequest(int(row["id"]), bool(row["watched"]))
