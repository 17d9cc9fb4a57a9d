"""The bodies of the turn actors: one LLM call, or one tool execution; and of a
wait's timeout.

Both take ids only and are idempotent: a duplicate or stale delivery finds the
loop in a state it does not own and returns having written nothing. Each marks
its own job done inside the transaction of its claim (loops/store), so from
then on recovery belongs to the loop and tool leases (and the reaper), never
to a blind job redelivery.

The path of a turn goes down the layers once: the turn's first read (the loop,
or the tool call and its loop: loops.queries), the claim (loops.store), the
agent's stack (pipeline, which writes through loops.store), and on an
unhandled error the loop failed (loops.store) if this generation still owns
it. Each body takes the intent to adopt (``adopt``: this thread continues
inline) and returns the next step its commit claimed for this thread
(runtime/inline.py runs it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import uuid
from collections.abc import Callable

import psycopg
from sqlalchemy.exc import SQLAlchemyError

from .._typing import SessionLike
from ..dbapi import is_transient
from ..errors import LostLeaseError
from ..leases import RenewerHandle
from ..loops import queries, storable, store
from ..loops.store import Adopted, AdoptedLlmTurn, AdoptedToolCall
from ..models import Loop, ToolCall
from ..models.loop import LoopStatus
from ..pipeline.context import LlmContext, ToolContext
from ..pipeline.llm_stack import HandedOff, handle_errors
from ..pipeline.plan import stack_plan
from ..state import SolidLoopState
from . import llm_io, traced
from .job_log import logged_job

logger = logging.getLogger("flask_solidloop.turns")

#: How long a turn handed back after a database error waits in the queue.
DATABASE_RETRY_DELAY_MS = 2000


def llm_turn_job(state: SolidLoopState, loop_id: int, *, adopt: bool = False,
                 adopted: AdoptedLlmTurn | None = None, inline: bool = False,
                 ) -> Adopted | None:
    """The llm_turn job: the turn's first read, then the turn between its two
    log lines (``inline``: this thread ran the loop's previous step and its
    commit claimed this one, ``adopted``)."""
    session = state.db.session
    try:
        # In autocommit when the session holds nothing: the turn's claim is a
        # statement of its own (store.claim_llm_turn).
        loop = queries.get_loop(session, loop_id, alone=adopted is None)
    except Exception:
        session.rollback()
        raise
    with logged_job("llm_turn", loop_id=loop_id,
                    agent=loop.agent_name if loop is not None else None, inline=inline):
        if loop is None:
            logger.warning("llm_turn: loop %s does not exist; dropping the job", loop_id)
            return None
        return run_llm_turn(state, loop, adopt=adopt, adopted=adopted)


def tool_call_job(state: SolidLoopState, tool_call_id: int, execution_token: str,
                  reaper_lease_token: str | None = None, *, adopt: bool = False,
                  adopted: AdoptedToolCall | None = None, inline: bool = False,
                  ) -> Adopted | None:
    """The tool_call job: the call and its loop read, then the tool turn
    between its two log lines. The read leaves its transaction open: the
    call's claim, a conditional UPDATE, joins it without a round trip more."""
    session = state.db.session
    call, loop = queries.get_tool_call_and_loop(session, tool_call_id)
    with logged_job("tool_call", loop_id=call.loop_id if call is not None else None,
                    agent=loop.agent_name if loop is not None else None,
                    tool_call_id=tool_call_id, inline=inline):
        if call is None or loop is None:
            logger.warning("tool_call: tool call %s does not exist; dropping the job",
                           tool_call_id)
            return None
        return run_tool_call(state, call, loop, execution_token, reaper_lease_token,
                             adopt=adopt, adopted=adopted)


def run_adopted(state: SolidLoopState, adopted: Adopted, adopt: bool) -> Adopted | None:
    """Run a step a previous commit claimed for this thread (runtime/inline.py)."""
    if isinstance(adopted, AdoptedLlmTurn):
        return llm_turn_job(state, adopted.loop_id, adopt=adopt, adopted=adopted, inline=True)
    return tool_call_job(state, adopted.tool_call_id, str(adopted.execution_token),
                         adopt=adopt, adopted=adopted, inline=True)


def run_llm_turn(state: SolidLoopState, loop: Loop, *, adopt: bool = False,
                 adopted: AdoptedLlmTurn | None = None) -> Adopted | None:
    """One LLM turn: claim the queued loop, or go on with the claim the previous
    step's commit made for this thread (``adopted``), then run the agent's
    LLM stack. Returns the step its end adopted, if any."""
    session = state.db.session
    loop_id = loop.id
    if adopted is not None:
        if not queries.owns(loop, adopted.claim.token):
            # Paused, stopped or resumed since the claim committed: theirs now.
            logger.debug("llm_turn: loop %s moved on since its adopted claim", loop_id)
            session.rollback()
            return None
    elif loop.status != LoopStatus.QUEUED:
        logger.debug("llm_turn: loop %s is %s, not queued; stale job", loop_id, loop.status)
        session.rollback()
        return None
    try:
        agent = state.agent_for(loop.agent_name, loop)
        agent.validate()
        # The agent's stacks and their plan: what the claim may write and read
        # for the turn, and the stack the turn runs.
        plan = stack_plan(state, agent)
        lease = state.config.liveness_ttl
        max_duration = agent.effective_max_duration(state.config.default_max_duration)
    except (SQLAlchemyError, psycopg.Error):
        raise  # the database, not the agent: let dramatiq retry the job
    except Exception as exc:
        # Fail visibly, before any claim: an unregistered agent or a broken
        # definition will not heal by retrying, and the loop must not sit queued.
        logger.error("llm_turn: loop %s cannot run: %s", loop_id, exc)
        ends = store.loop_ends(state, loop)
        if adopted is None:
            store.fail_unclaimed(session, loop_id, storable.error_text(exc), ends=ends)
        else:
            session.rollback()
            store.end_turn(session, loop_id, adopted.claim.token, to=LoopStatus.FAILED,
                           error_message=storable.error_text(exc), ends=ends)
        return None

    if adopted is None:
        # A concurrency cap applies and the loop is not in flight yet (its first
        # turn, or its first since a resume): admitted, or held and done here.
        caps = store.caps_for(state, agent, loop)
        if caps is not None and not store.admit(state, session, loop, caps):
            return None

    # The claim commits here, and only here, before the stack runs.
    # Read off the loop before the claim (after it, the object is expired).
    turn_run = traced.run_of(loop)
    claim = adopted.claim if adopted is not None else store.claim_llm_turn(
        session, loop_id, lease_seconds=lease, open_shell=plan.open_shell,
        read_history=plan.read_history)
    if claim is None:
        return None
    token = claim.token
    span = traced.chat_started(turn_run, agent, token, inline=adopted is not None)
    # From here the lease is renewed by this process's renewer until the turn ends.
    renewer = state.renewer()
    lease_handle = RenewerHandle(renewer, renewer.register(
        loop_id, token, lease_seconds=lease,
        ceiling_seconds=max_duration + state.config.lease_leak_grace))
    ctx = LlmContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                     agent=agent, lease=lease_handle, claim=claim, shell_id=claim.shell_id,
                     plan=plan, adopt_next=adopt)
    # Async mode: the request goes to the process's I/O loop (runtime/llm_io.py).
    io = llm_io.current(state) if plan.hands_off else None
    ctx.hand_off = io is not None

    def database_failed(exc: BaseException) -> None:
        # The claim committed before the stack ran, so a rollback does not undo
        # it: until the request is sent nothing of the turn is written, so the
        # turn goes back to the queue, a little later, rather than fail the
        # loop on what may be a blip. After the request the turn's end may have
        # committed (its retries ran out, or its COMMIT landed unseen): the
        # turn is left to its lease, which the reaper takes over once it
        # lapses if nothing ended the turn.
        if ctx.requested:
            logger.warning("llm_turn: loop %s: the database failed after the request (%s); "
                           "the turn is left to its lease", loop_id, storable.error_text(exc))
            return
        _hand_back(session, exc, lambda: store.requeue_llm_turn(
            state, session, loop_id, token, delay_ms=DATABASE_RETRY_DELAY_MS),
            f"llm_turn: loop {loop_id}: the database failed before the request",
            "the turn", "the loop")

    def fail(error: str) -> bool:
        # The request's event, when one was recorded, ends with the loop.
        return store.end_turn(session, loop_id, token, to=LoopStatus.FAILED,
                              error_message=error, ends=store.loop_ends(state, loop),
                              wire=ctx.wire, event_id=ctx.request_event_id,
                              shell_id=ctx.shell_id,
                              body_limit=state.config.wire_body_limit,
                              repeat_history=state.config.event_repeat_history)

    label = f"llm_turn: loop {loop_id}"
    handed: HandedOff | None = None
    try:
        with traced.turn(span, turn_run):
            _guarded(ctx, lambda: plan.llm_handler()(ctx), label, fail=fail,
                     database_failed=database_failed)
    except HandedOff as handoff:
        handed = handoff
    except BaseException as exc:
        traced.chat_ended(span, ctx, exc)
        raise
    finally:
        if handed is None:
            lease_handle.release()
    if handed is not None:
        assert io is not None
        resume = handed.resume

        def finish(error: BaseException | None) -> None:
            # On a commit thread: the rest of the turn, as the stack would have
            # run it here, fenced and failed the same way; then the lease goes.
            try:
                with traced.turn(span, turn_run):
                    _guarded(ctx, lambda: handle_errors(ctx, lambda: resume(error)), label,
                             fail=fail, database_failed=database_failed)
            finally:
                lease_handle.release()
                traced.chat_ended(span, ctx)
            if ctx.history_chars >= TRIM_AFTER_CHARS:
                ctx.history, ctx.claim, ctx.wire = [], None, None
                release_free_memory()

        try:
            io.hand(handed, finish)
        except BaseException as exc:
            lease_handle.release()  # never handed: the lease lapses, the reaper heals
            traced.chat_ended(span, ctx, exc)
            raise
        logger.debug("llm_turn: loop %s: the request went to the I/O loop", loop_id)
        return None
    traced.chat_ended(span, ctx)
    adopted_next = ctx.adopted
    if ctx.history_chars >= TRIM_AFTER_CHARS:
        # Drop what still holds the history (the claim's copy, the wire record's
        # request) before handing the freed memory back.
        ctx.history, ctx.claim, ctx.wire = [], None, None
        del ctx
        release_free_memory()
    return adopted_next


#: A turn whose history had this much text hands the memory it freed back to
#: the system after it ends (release_free_memory).
TRIM_AFTER_CHARS = 1_000_000


def release_free_memory() -> None:
    """Give the memory freed by a large turn back to the system. glibc keeps
    freed blocks in its heap for reuse, so a worker that once sent a 100 MB
    history would otherwise keep that much resident for good; malloc_trim
    returns it. A no-op where libc has no malloc_trim."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _guarded(ctx: LlmContext | ToolContext, run: Callable[[], None], label: str, *,
             fail: Callable[[str], bool],
             database_failed: Callable[[BaseException], None]) -> None:
    """Run a turn; turn what escapes it into the outcome the fence allows.

    A lost lease yields silently. An error after the turn's canonical commit is
    reported and leaves the loop alone (its successor is queued, or adopted).
    A transient database error never fails the loop: ``database_failed``
    decides what becomes of the step (hands it back, or leaves it to its
    lease), or raises for the job to be retried. Any other error fails the
    loop through ``fail`` if this generation still owns it, and is re-raised
    otherwise (dramatiq's retry policy then sees it).
    """
    session = ctx.session
    try:
        run()
    except HandedOff:
        raise  # not a failure: the turn goes on on the I/O loop (run_llm_turn)
    except LostLeaseError as exc:
        store.recover(session)
        logger.info("%s: lease lost, yielding: %s", label, exc)
    except Exception as exc:
        store.recover(session)
        if ctx.committed:
            logger.exception("%s: error after the turn committed", label)
            return
        if is_transient(exc):
            database_failed(exc)
            return
        logger.exception("%s failed with an unhandled error", label, exc_info=exc)
        if not fail(storable.error_text(exc)):
            raise


def run_tool_call(state: SolidLoopState, call: ToolCall, loop: Loop, execution_token: str,
                  reaper_lease_token: str | None = None, *, adopt: bool = False,
                  adopted: AdoptedToolCall | None = None) -> Adopted | None:
    """One tool turn: claim the call's lease, or run under the lease the previous
    step's commit took for this thread (``adopted``), then the agent's tool
    stack. A held lease is the call's fence: like a claimed call, an adopted
    one runs and is recorded even if the loop was paused meanwhile. Returns
    the step its answer adopted, if any."""
    session = state.db.session
    token = uuid.UUID(execution_token)
    tool_call_id, loop_id = call.id, loop.id
    if adopted is None and not queries.owns(loop, token):
        session.rollback()
        return None
    ctx = ToolContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                      agent=None, tool_call_id=tool_call_id,  # type: ignore[arg-type]
                      sole_call=adopted is not None and adopted.sole_call, adopt_next=adopt)
    tool_lease = RenewerHandle(None, None)
    if adopted is not None:
        ctx.lease_token = adopted.lease_token
    # Read off the call and its loop now: the claim's commit expires them.
    turn_run = traced.run_of(loop, call)
    span = None

    def run() -> None:
        nonlocal tool_lease, span
        agent = ctx.agent = state.agent_for(loop.agent_name, loop)
        plan = ctx.plan = stack_plan(state, agent)
        lease_seconds = state.config.liveness_ttl
        lease_token: uuid.UUID | None
        if adopted is not None:
            outcome, lease_token = store.ToolClaim.CLAIMED, adopted.lease_token
        else:
            outcome, lease_token = store.claim_tool_call(
                state, session, call, token,
                sequential=bool(agent.option("sequential_tool_calls")),
                lease_seconds=lease_seconds,
                reaper_lease_token=uuid.UUID(reaper_lease_token) if reaper_lease_token else None,
            )
        if outcome is store.ToolClaim.REDIRECTED:
            return
        if outcome is store.ToolClaim.LOST:
            logger.info(
                "tool_call: lease claim for tool call %s lost (generation rotated, or "
                "another live lease holds it); no-op", tool_call_id,
            )
            return
        if lease_token is not None:
            max_duration = agent.effective_max_duration(state.config.default_max_duration)
            limit = min(float(max_duration), state.tool_timeout_seconds(agent))
            renewer = state.renewer()
            tool_lease = ctx.lease = RenewerHandle(renewer, renewer.register_tool(
                tool_call_id, lease_token, lease_seconds=lease_seconds,
                ceiling_seconds=limit + state.config.lease_leak_grace,
            ))
        ctx.lease_token = lease_token
        ctx.tool_call = queries.get_tool_call(session, tool_call_id)
        span = traced.tool_started(turn_run, token, inline=adopted is not None)
        with traced.turn(span, turn_run):
            plan.tool_handler()(ctx)

    def fail(error: str) -> bool:
        return store.end_turn(session, loop_id, token, to=LoopStatus.FAILED,
                              error_message=f"tool call {tool_call_id}: {error}",
                              call_id=tool_call_id, lease=ctx.lease_token,
                              ends=store.loop_ends(state, loop))

    def database_failed(exc: BaseException) -> None:
        # Nothing of the call is ours yet (the claim did not commit, or cannot
        # be told to have): the job is retried (an adopted call is handed back
        # by the inline runner). Claimed, with the tool not run: handed back,
        # its lease released with its job queued a little later. The tool ran
        # and its outcome could not be written (its retries ran out): left to
        # the lease; the reaper takes the call over once it lapses (answering
        # a recorded result, running the tool again otherwise).
        if ctx.lease_token is None:
            raise exc
        if ctx.tool_ran:
            logger.warning("tool_call %s: the database failed after the tool ran (%s); the "
                           "call is left to its lease", tool_call_id, storable.error_text(exc))
            return
        lease_token = ctx.lease_token
        _hand_back(session, exc, lambda: store.hand_back_tool_call(
            state, session, loop_id=loop_id, tool_call_id=tool_call_id,
            execution_token=token, lease_token=lease_token,
            delay_ms=DATABASE_RETRY_DELAY_MS),
            f"tool_call {tool_call_id}: the database failed before the tool ran",
            "the call", "the call")

    failed: BaseException | None = None
    try:
        _guarded(ctx, run, f"tool_call {tool_call_id}", fail=fail,
                 database_failed=database_failed)
    except BaseException as exc:
        failed = exc
        raise
    finally:
        tool_lease.release()
        traced.tool_ended(span, ctx, failed)
    return ctx.adopted


def _hand_back(session: SessionLike, exc: BaseException, hand_back: Callable[[], bool], what: str,
               step: str, row: str) -> None:
    """A step the database failed under before it did anything: ``hand_back``
    queues it again, a little later (False: ``row`` moved on meanwhile). If
    that fails too, the step's lease lapses and the reaper takes it over."""
    try:
        handed = hand_back()
    except Exception as again:
        store.recover(session)
        if not is_transient(again):
            raise
        logger.warning("%s (%s), and so did handing %s back; its lease lapses and the "
                       "reaper takes it over", what, storable.error_text(exc), step)
        return
    logger.warning("%s (%s); %s", what, storable.error_text(exc),
                   f"queued again in {DATABASE_RETRY_DELAY_MS / 1000:g}s" if handed
                   else f"{row} moved on meanwhile")


def wait_timeout_job(state: SolidLoopState, tool_call_id: int) -> None:
    """The wait_timeout job: a waiting call's deadline came, so its timeout
    decides it (store.time_out), unless a decision landed first. Run early (a
    clock step), it puts itself off until the deadline."""
    session = state.db.session
    try:
        wait = store.due_wait(session, tool_call_id)
    except Exception:
        session.rollback()
        raise
    with logged_job("wait_timeout", loop_id=wait.loop_id if wait is not None else None,
                    agent=wait.agent_name if wait is not None else None,
                    tool_call_id=tool_call_id):
        if wait is None:
            session.rollback()
            logger.debug("wait_timeout: tool call %s no longer waits", tool_call_id)
            return
        if not wait.due:
            store.retry_time_out(state, session, wait)
            return
        agent = state.agent_for(wait.agent_name)
        decided = store.time_out(state, session, wait,
                                 sequential=bool(agent.option("sequential_tool_calls")))
        if decided is not None:
            logger.info("wait_timeout: tool call %s of loop %s timed out: %s", tool_call_id,
                        wait.loop_id, decided.decision)
