"""The bodies of the two turn actors: one LLM call, or one tool execution.

Both take ids only and are idempotent: a duplicate or stale delivery finds the
loop in a state it does not own and returns having written nothing. Each marks
its own job done inside the transaction of its claim (loops/store.py), so from
then on recovery belongs to the loop and tool leases (and the reaper), never
to a blind job redelivery.

The path of a turn goes down the layers once: read (loops.queries), claim
(loops.store), run the pipeline (which writes through loops.store), and on an
unhandled error fail the loop (loops.store) if this generation still owns it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import psycopg
from sqlalchemy.exc import SQLAlchemyError

from ..errors import LostLeaseError
from ..leases import RenewerHandle
from ..loops import queries, store
from ..loops.fence import owns
from ..pipeline.context import LlmContext, ToolContext
from ..pipeline.stacks import adopted_turn_shape, llm_stack, tool_stack
from ..pipeline.xml_tools import parses_tool_text
from ..queue.dispatch import Adopted
from ..state import SolidLoopState
from .job_log import logged_job

logger = logging.getLogger("flask_solidloop.turns")

#: Kept importable from here (the first release documented it here).
error_text = store.error_text
#: How long a turn handed back after a database error waits in the queue.
DATABASE_RETRY_DELAY_MS = 2000


def llm_turn_job(state: SolidLoopState, loop_id: int, *, inline: bool = False,
                 adopted: Adopted | None = None) -> None:
    """The llm_turn job: the turn between its two log lines (``inline``: this
    thread ran the loop's previous job and claimed this one itself;
    ``adopted``: that job's commit claimed it, runtime/inline.py)."""
    with logged_job(state, "llm_turn", loop_id=loop_id, inline=inline):
        run_llm_turn(state, loop_id, adopted=adopted)


def tool_call_job(state: SolidLoopState, tool_call_id: int, execution_token: str,
                  reaper_lease_token: str | None = None, *, inline: bool = False,
                  adopted: Adopted | None = None) -> None:
    """The tool_call job: the tool turn between its two log lines."""
    with logged_job(state, "tool_call", tool_call_id=tool_call_id, inline=inline):
        run_tool_call(state, tool_call_id, execution_token, reaper_lease_token,
                      adopted_lease=adopted.lease_token if adopted else None,
                      sole_call=adopted.sole_call if adopted else False)


def run_llm_turn(state: SolidLoopState, loop_id: int, *,
                 adopted: Adopted | None = None) -> None:
    """One LLM turn: claim the queued loop, or go on with the claim the previous
    turn's commit made for this thread (``adopted``), then run the LLM stack."""
    session = state.db.session
    loop = queries.get_loop(session, loop_id)
    if loop is None:
        logger.warning("llm_turn: loop %s does not exist; dropping the job", loop_id)
        return
    if adopted is not None:
        if not owns(loop, adopted.execution_token):
            # Paused, stopped or resumed since the claim committed: theirs now.
            logger.debug("llm_turn: loop %s moved on since its adopted claim", loop_id)
            session.rollback()
            return
    elif loop.status != "queued":
        logger.debug("llm_turn: loop %s is %s, not queued; stale job", loop_id, loop.status)
        session.rollback()
        return
    try:
        agent = state.agent_for(loop.agent_name, loop)
        agent.validate()
        # The agent's LLM stack, built once: its shape decides what a delivered
        # claim may do, and the turn runs it. A hook that raises here is a broken
        # definition like any other.
        builder = llm_stack(state, agent)
        lease = state.config.liveness_ttl
        max_duration = agent.effective_max_duration(state.config.default_max_duration)
    except (SQLAlchemyError, psycopg.Error):
        raise  # the database, not the agent: let dramatiq retry the job
    except Exception as exc:
        # Fail visibly, before any claim: an unregistered agent or a broken
        # definition will not heal by retrying, and the loop must not sit queued.
        logger.error("llm_turn: loop %s cannot run: %s", loop_id, exc)
        if adopted is None:
            store.fail_unclaimed(session, loop_id, store.error_text(exc))
        else:
            assert adopted.execution_token is not None
            store.fail_turn(session, loop_id, adopted.execution_token, store.error_text(exc))
        return

    # The claim's transaction stays open: the stack's initialization (limits,
    # tools, history) and the turn's shell join it, so the turn commits once
    # before its request (AgentInitialization commits it; see LlmContext.claim).
    claim: store.LlmClaim | None
    # The turn's shell, when the statement that claimed it wrote it too.
    shell_id = adopted.shell_id if adopted is not None else None
    if adopted is None:
        # A delivered turn claims as an adopted one starts: claim, job done,
        # shell and history in one statement where the stack allows it; the
        # classic claim decides whatever that statement leaves undecided.
        shape = adopted_turn_shape(state, agent, builder=builder)
        delivered = store.claim_delivered_llm_turn(
            session, loop_id, lease_seconds=lease, open_shell=shape.open_shell,
            read_history=shape.read_history)
        if delivered is not None:
            claim, shell_id = delivered.claim, delivered.shell_id
        else:
            claim = store.start_llm_turn(session, loop_id, lease_seconds=lease)
    else:
        claim = store.adopted_llm_claim(session, adopted)
    if claim is None:
        return
    token = claim.token

    # From here the lease is renewed by this process's renewer until the turn ends.
    lease_handle = RenewerHandle(None, None)
    ctx = LlmContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                     agent=agent, lease=lease_handle, claim=claim, shell_id=shell_id)

    def register_lease() -> None:
        renewer = state.renewer()
        lease_handle.renewer = renewer
        lease_handle.registration = renewer.register(
            loop_id, token, lease_seconds=lease,
            ceiling_seconds=max_duration + state.config.lease_leak_grace,
        )

    # The renewer takes the lease once the claim is committed (see LlmClaim).
    claim.after_commit.append(register_lease)

    def run() -> None:
        # Answers carrying tool calls as text: partials hide their markup.
        ctx.extras["tool_text"] = parses_tool_text(agent, builder.middlewares)
        builder.build()(ctx)

    def database_failed(exc: BaseException) -> bool:
        # A claim that committed before the stack ran is not undone by the
        # rollback: until the request is sent nothing of the turn is written,
        # so the turn goes back to the queue, a little later, rather than fail
        # the loop on what may be a blip. After the request the turn's end may
        # have committed, and the usual outcome applies.
        if not claim.precommitted or ctx.requested:
            return False
        try:
            handed = store.hand_back_llm_turn(state, session, loop_id, token,
                                              delay_ms=DATABASE_RETRY_DELAY_MS)
        except (SQLAlchemyError, psycopg.Error):
            session.rollback()
            logger.warning("llm_turn: loop %s: the database failed before the request "
                           "(%s), and so did handing the turn back; its lease lapses and "
                           "the reaper queues it again", loop_id, store.error_text(exc))
            return True
        logger.warning("llm_turn: loop %s: the database failed before the request (%s); %s",
                       loop_id, store.error_text(exc),
                       f"queued again in {DATABASE_RETRY_DELAY_MS / 1000:g}s" if handed
                       else "the loop moved on meanwhile")
        return True

    try:
        _guarded(ctx, run, f"llm_turn: loop {loop_id}",
                 fail=lambda error: store.fail_turn(session, loop_id, token, error),
                 database_failed=database_failed)
    finally:
        # A stack that never reached AgentInitialization (a host middleware
        # before it returned early) still commits the claim it inherited.
        if claim.is_open(session):
            store.commit_claim(session, claim)
        lease_handle.release()


def _guarded(ctx: LlmContext | ToolContext, run: Callable[[], None], label: str, *,
             fail: Callable[[str], bool],
             database_failed: Callable[[BaseException], bool] | None = None) -> None:
    """Run a turn; turn what escapes it into the outcome the fence allows.

    A lost lease yields silently. An error after the turn's canonical commit is
    reported and leaves the loop alone (its successor job is queued). A
    database error that ``database_failed`` handles (True) ends the turn
    there. Any other error fails the loop through ``fail`` if this
    generation still owns it, and is re-raised otherwise (dramatiq's retry
    policy then sees it).
    """
    session = ctx.session
    try:
        run()
    except LostLeaseError as exc:
        session.rollback()
        logger.info("%s: lease lost, yielding: %s", label, exc)
    except Exception as exc:
        session.rollback()
        if ctx.committed:
            logger.exception("%s: error after the turn committed", label)
            return
        if database_failed is not None and isinstance(exc, SQLAlchemyError | psycopg.Error) \
                and database_failed(exc):
            return
        logger.exception("%s failed with an unhandled error", label, exc_info=exc)
        if not fail(store.error_text(exc)):
            raise


def run_tool_call(
    state: SolidLoopState,
    tool_call_id: int,
    execution_token: str,
    reaper_lease_token: str | None = None,
    *,
    adopted_lease: uuid.UUID | None = None,
    sole_call: bool = False,
) -> None:
    """One tool turn: claim the call's lease, or run under the lease the previous
    turn's commit took for this thread (``adopted_lease``; ``sole_call``: it is
    its message's only call), then the tool stack.
    A held lease is the call's fence: like a claimed call, an adopted one runs
    and is checkpointed even if the loop was paused meanwhile."""
    session = state.db.session
    token = uuid.UUID(execution_token)
    call = queries.get_tool_call(session, tool_call_id)
    if call is None:
        logger.warning("tool_call: tool call %s does not exist; dropping the job", tool_call_id)
        return
    loop = queries.get_loop(session, call.loop_id)
    if loop is None or (adopted_lease is None and not owns(loop, token)):
        session.rollback()
        return
    loop_id = loop.id
    ctx = ToolContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                      agent=None, tool_call_id=tool_call_id,  # type: ignore[arg-type]
                      sole_call=sole_call and adopted_lease is not None)
    tool_lease = RenewerHandle(None, None)

    def run() -> None:
        nonlocal tool_lease
        agent = state.agent_for(loop.agent_name, loop)
        ctx.agent = agent
        lease_seconds = state.config.liveness_ttl
        lease_token: uuid.UUID | None
        if adopted_lease is not None:
            outcome, lease_token = store.ToolClaim.CLAIMED, adopted_lease
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
            tool_lease = RenewerHandle(renewer, renewer.register_tool(
                tool_call_id, lease_token, lease_seconds=lease_seconds,
                ceiling_seconds=limit + state.config.lease_leak_grace,
            ))
        ctx.lease_token = lease_token
        ctx.tool_call = queries.get_tool_call(session, tool_call_id)
        tool_stack(state, agent).build()(ctx)

    try:
        _guarded(ctx, run, f"tool_call {tool_call_id}", fail=lambda error: store.fail_tool_call(
            session, loop_id=loop_id, tool_call_id=tool_call_id, token=token,
            lease_token=ctx.lease_token, error_message=error))
    finally:
        tool_lease.release()
