"""The bodies of the two turn actors: one LLM call, or one tool execution.

Both take ids only and are idempotent: a duplicate or stale delivery finds the
loop in a state it does not own and returns having written nothing. Each marks
its own job done inside the transaction of its first state change (the claim),
so from then on recovery belongs to the loop and tool leases (and the reaper),
never to a blind job redelivery.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

import psycopg
from sqlalchemy import func, or_, update
from sqlalchemy.exc import SQLAlchemyError

from ..durability.renewer import RenewerHandle
from ..errors import LostLeaseError
from ..models import Loop, Message, ToolCall
from ..pipeline.context import LlmContext, ToolContext
from ..queue.current_job import mark_current_job_done
from .control import unresolved_tool_calls
from .fence import lock_loop, owns, transition

if TYPE_CHECKING:
    from ..extension import SolidLoopState

logger = logging.getLogger("flask_solidloop.turns")


def run_llm_turn(state: SolidLoopState, loop_id: int) -> None:
    session = state.db.session
    loop = session.get(Loop, loop_id)
    if loop is None:
        logger.warning("llm_turn: loop %s does not exist; dropping the job", loop_id)
        return
    if loop.status != "queued":
        logger.debug("llm_turn: loop %s is %s, not queued; stale job", loop_id, loop.status)
        session.rollback()
        return
    try:
        agent = state.agent_for(loop.agent_name, loop)
        agent.validate()
        lease = state.config.llm_lease_seconds(agent.provider().read_timeout)
        max_duration = agent.effective_max_duration(state.config.default_max_duration)
    except (SQLAlchemyError, psycopg.Error):
        raise  # the database, not the agent: let dramatiq retry the job
    except Exception as exc:
        # Fail visibly, before any claim: an unregistered agent or a broken
        # definition will not heal by retrying, and the loop must not sit queued.
        logger.error("llm_turn: loop %s cannot run: %s", loop_id, exc)
        session.rollback()
        if transition(session, loop_id, from_="queued", to="failed",
                      error_message=error_text(exc)) is not None:
            mark_current_job_done(session)
        session.commit()
        return

    token = uuid.uuid4()
    # Leases are stamped and compared with the database clock, never a worker's.
    claimed = session.execute(
        update(Loop)
        .where(Loop.id == loop_id, Loop.status == "queued")
        .values(status="running", execution_token=token,
                lease_expires_at=func.now() + timedelta(seconds=lease),
                started_at=func.coalesce(Loop.started_at, func.now()),
                run_started_at=func.coalesce(Loop.run_started_at, func.now()))
    ).rowcount  # type: ignore[attr-defined]
    if not claimed:
        session.rollback()
        return
    mark_current_job_done(session)
    session.commit()

    # From here the lease is renewed by this process's renewer until the turn ends.
    lease_handle = RenewerHandle(None, None)
    ctx = LlmContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                     agent=agent, lease=lease_handle)
    try:
        renewer = state.renewer()
        lease_handle.renewer = renewer
        lease_handle.registration = renewer.register(
            loop_id, token, lease_seconds=lease,
            ceiling_seconds=max_duration + state.config.lease_leak_grace,
        )
        builder = state.llm_stack()
        agent.configure_llm_middlewares(builder)
        builder.build()(ctx)
    except LostLeaseError as exc:
        session.rollback()
        logger.info("llm_turn: loop %s: lease lost, yielding the turn: %s", loop_id, exc)
    except Exception as exc:
        session.rollback()
        if ctx.committed:
            # The turn's canonical write is in; a middleware after it failed. The
            # loop is fine and its successor job is queued: report, do not fail it.
            logger.exception("llm_turn: loop %s: error after the turn committed", loop_id)
        elif not _reconcile_failure(session, loop_id, token, exc):
            raise
    finally:
        lease_handle.release()


MAX_ERROR_TEXT = 2000


def error_text(exc: BaseException) -> str:
    """``Class: message`` for error_message, cut to a readable length (a database
    error can carry a whole SQL statement and its parameters)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + " [truncated]"


def _reconcile_failure(session, loop_id: int, token: uuid.UUID, exc: BaseException) -> bool:
    """Fail the loop for an error nothing else handled, if this generation still owns it."""
    logger.exception("loop %s failed with an unhandled error", loop_id, exc_info=exc)
    loop = transition(session, loop_id, from_="running", to="failed", expected_token=token,
                      error_message=error_text(exc))
    if loop is None:
        session.rollback()
        return False
    session.execute(
        update(Message)
        .where(Message.loop_id == loop_id, Message.status == "processing")
        .values(status="failed", is_hidden=True)
    )
    session.commit()
    return True


def run_tool_call(
    state: SolidLoopState,
    tool_call_id: int,
    execution_token: str,
    reaper_lease_token: str | None = None,
) -> None:
    session = state.db.session
    token = uuid.UUID(execution_token)
    call = session.get(ToolCall, tool_call_id)
    if call is None:
        logger.warning("tool_call: tool call %s does not exist; dropping the job", tool_call_id)
        return
    loop = session.get(Loop, call.loop_id)
    if not owns(loop, token):
        session.rollback()
        return
    assert loop is not None
    loop_id = loop.id
    ctx = ToolContext(state=state, session=session, loop_id=loop_id, execution_token=token,
                      agent=None, tool_call_id=tool_call_id)  # type: ignore[arg-type]
    tool_lease = RenewerHandle(None, None)
    try:
        agent = state.agent_for(loop.agent_name, loop)
        ctx.agent = agent
        if agent.option("sequential_tool_calls"):
            pending = unresolved_tool_calls(session, loop_id)
            if pending and pending[0].id != tool_call_id:
                # Out of order: run nothing, but make sure the head of the line runs.
                state.dispatch.tool_call(session, pending[0].id, token, loop_id=loop_id)
                mark_current_job_done(session)
                session.commit()
                return
        if call.executed_at is not None:
            lease_token = None  # continuation: the body ran; only the response is missing
            mark_current_job_done(session)
            session.commit()
        else:
            lease_token = _claim_tool_lease(state, session, call, token, agent, reaper_lease_token)
            if lease_token is None:
                logger.info(
                    "tool_call: lease claim for tool call %s lost (generation rotated, or "
                    "another live lease holds it); no-op", tool_call_id,
                )
                return
            max_duration = agent.effective_max_duration(state.config.default_max_duration)
            renewer = state.renewer()
            tool_lease = RenewerHandle(renewer, renewer.register_tool(
                tool_call_id, lease_token,
                lease_seconds=state.config.tool_lease_seconds(agent_http_timeouts(agent)),
                ceiling_seconds=max_duration + state.config.lease_leak_grace,
            ))
        ctx.lease_token = lease_token
        ctx.tool_call = session.get(ToolCall, tool_call_id)
        builder = state.tool_stack()
        agent.configure_tool_middlewares(builder)
        builder.build()(ctx)
    except LostLeaseError as exc:
        session.rollback()
        logger.info("tool_call %s: yielding: %s", tool_call_id, exc)
    except Exception as exc:
        session.rollback()
        if ctx.committed:
            logger.exception("tool_call %s: error after the result committed", tool_call_id)
        elif not _reconcile_tool_failure(session, loop_id, tool_call_id, token,
                                         ctx.lease_token, exc):
            raise
    finally:
        tool_lease.release()


def _claim_tool_lease(state, session, call: ToolCall, token: uuid.UUID, agent,
                      reaper_lease_token: str | None) -> uuid.UUID | None:
    """Claim the per-call lease under the loop lock, after re-checking the generation."""
    loop = lock_loop(session, call.loop_id)
    if not owns(loop, token):
        session.rollback()
        return None
    if reaper_lease_token is not None:
        adopted = uuid.UUID(reaper_lease_token)
        session.refresh(call)
        if call.lease_token != adopted:
            session.rollback()
            return None
        mark_current_job_done(session)
        session.commit()
        return adopted
    candidate = uuid.uuid4()
    lease = state.config.tool_lease_seconds(agent_http_timeouts(agent))
    claimed = session.execute(
        update(ToolCall)
        .where(ToolCall.id == call.id, ToolCall.executed_at.is_(None),
               or_(ToolCall.lease_token.is_(None), ToolCall.leased_until < func.now()))
        .values(lease_token=candidate, leased_until=func.now() + timedelta(seconds=lease))
    ).rowcount  # type: ignore[attr-defined]
    if not claimed:
        session.rollback()
        return None
    mark_current_job_done(session)
    session.commit()
    return candidate


def agent_http_timeouts(agent) -> list[float]:
    timeouts = []
    for entry in agent.tool_entries():
        if entry.get("url") is not None:
            timeouts.append(float(entry.get("timeout") or 60))
    return timeouts


def _reconcile_tool_failure(session, loop_id: int, tool_call_id: int, token: uuid.UUID,
                            lease_token: uuid.UUID | None, exc: BaseException) -> bool:
    logger.exception("tool call %s failed with an unhandled error", tool_call_id, exc_info=exc)
    loop = lock_loop(session, loop_id)
    if not owns(loop, token):
        session.rollback()
        return False
    call = session.get(ToolCall, tool_call_id)
    if lease_token is not None and (call is None or call.lease_token != lease_token):
        session.rollback()
        return False
    transition(session, loop_id, from_="running", to="failed", expected_token=token,
               error_message=f"tool call {tool_call_id}: {error_text(exc)}")
    session.commit()
    return True

