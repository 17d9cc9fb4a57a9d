"""Host-driven loop controls: pause, stop and resume, each one locked transaction."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

from flask import current_app
from sqlalchemy import func, select, update

from .._typing import SessionLike
from ..models import Job, Loop, Message, ToolCall
from .fence import lock_loop, transition

logger = logging.getLogger("flask_solidloop.control")


def _hide_shells(session: SessionLike, loop_id: int) -> None:
    session.execute(
        update(Message)
        .where(Message.loop_id == loop_id, Message.status == "processing")
        .values(status="failed", is_hidden=True)
    )


def pause_loop(session: SessionLike, loop_id: int) -> bool:
    loop = transition(session, loop_id, from_=("queued", "running"), to="paused")
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    session.commit()
    return True


def stop_loop(session: SessionLike, loop_id: int, *, reason: str) -> bool:
    loop = transition(
        session, loop_id, from_=("init", "queued", "running", "paused"), to="failed",
        error_message=reason,
    )
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    session.commit()
    return True


def force_stop_loop(session: SessionLike, loop_id: int, *, reason: str) -> bool:
    """Stop now: fail the loop, cancel its queued jobs, revoke its tool leases.

    In-flight work of the old generation finds the fence closed and writes
    nothing; its external effects may still complete (at-least-once).
    """
    loop = transition(
        session, loop_id, from_=("init", "queued", "running", "paused"), to="failed",
        error_message=f"force stopped: {reason}",
    )
    if loop is None:
        session.rollback()
        return False
    _hide_shells(session, loop_id)
    session.execute(
        update(ToolCall)
        .where(ToolCall.loop_id == loop_id, ToolCall.executed_at.is_(None))
        .values(lease_token=None, leased_until=None)
    )
    session.execute(
        update(Job)
        .where(Job.loop_id == loop_id, Job.state == "queued")
        .values(state="done", finished_at=func.now(), last_error="cancelled by force stop")
    )
    session.commit()
    return True


def freeze_loop(session: SessionLike, loop_id: int) -> bool:
    """Pause a loop (if live) and lock it: resume() refuses until unfreeze_loop()."""
    loop = lock_loop(session, loop_id)
    if loop is None or loop.frozen or loop.status in ("completed", "failed"):
        session.rollback()
        return False
    if loop.status in ("queued", "running"):
        transition(session, loop_id, from_=("queued", "running"), to="paused",
                   error_message="frozen")
        _hide_shells(session, loop_id)
    loop.frozen = True
    session.commit()
    return True


def unfreeze_loop(session: SessionLike, loop_id: int) -> bool:
    """Lift a freeze; the loop stays where it is (usually paused) until resumed."""
    loop = lock_loop(session, loop_id)
    if loop is None or not loop.frozen:
        session.rollback()
        return False
    loop.frozen = False
    session.commit()
    return True


def set_observed(session: SessionLike, loop_id: int, observed: bool) -> bool:
    """Mark a loop as watched live (the admin streams observed loops)."""
    changed = session.execute(
        update(Loop).where(Loop.id == loop_id, Loop.observed.is_not(observed))
        .values(observed=observed)
    ).rowcount  # type: ignore[attr-defined]
    session.commit()
    return bool(changed)


def unresolved_tool_calls(session: SessionLike, loop_id: int) -> list[ToolCall]:
    """Tool calls of the newest assistant turn that have no tool message yet."""
    last_assistant = session.scalar(
        select(Message.id)
        .where(Message.loop_id == loop_id, Message.role == "assistant",
               Message.status == "completed")
        .order_by(Message.id.desc())
        .limit(1)
    )
    if last_assistant is None:
        return []
    return list(
        session.scalars(
            select(ToolCall)
            .where(ToolCall.message_id == last_assistant, ToolCall.response_message_id.is_(None))
            .order_by(ToolCall.position)
        )
    )


def _cancel_tool_calls(session: SessionLike, calls: list[ToolCall], *, reason: str) -> None:
    """Answer pending calls: a call that already ran gets its recorded result (its
    effect happened; the model must not be told otherwise), the others an error."""
    from ..mcp.toolset import ToolResult

    for call in calls:
        if call.executed_at is not None and call.result is not None:
            text = ToolResult.from_mcp(call.result).text()
            meta = {"is_error": not call.is_success, "tool_name": call.name}
        else:
            text = f"tool call {call.name!r} was not run: {reason}"
            meta = {"is_error": True, "tool_name": call.name, "cancelled": True}
        message = Message(loop_id=call.loop_id, role="tool", content=text, tool_call_id=call.id,
                          meta=meta)
        session.add(message)
        session.flush()
        call.response_message_id = message.id
        call.lease_token = None
        call.leased_until = None
        if call.executed_at is None:
            call.is_success = False
            call.error_kind = "cancelled"


def resume_loop(
    session: SessionLike, loop_id: int, allowed: Iterable[str], *, message: str | None = None
) -> bool:
    """Re-enter a loop in one locked transaction.

    If the newest assistant turn still has unanswered tool calls, the loop
    re-enters its tool phase under a fresh generation: the calls' leases are
    revoked first, then their jobs are enqueued. Otherwise it is queued for a
    new LLM turn.
    """
    dispatch = current_app.extensions["solidloop"].dispatch
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
    pending = unresolved_tool_calls(session, loop_id)
    if message:
        # A new user message cannot sit between a tool-call turn and its results:
        # answer each pending call with a tool error first, then add the message.
        _cancel_tool_calls(session, pending, reason="the loop was resumed with a new message")
        pending = []
        session.add(Message(loop_id=loop_id, role="user", content=message))
    if pending:
        token = uuid.uuid4()
        loop.status = "running"
        loop.execution_token = token
        loop.lease_expires_at = None
        ids = [call.id for call in pending]
        session.execute(
            update(ToolCall).where(ToolCall.id.in_(ids), ToolCall.executed_at.is_(None))
            .values(lease_token=None, leased_until=None)
        )
        sequential = current_app.extensions["solidloop"].agent_for(loop.agent_name, loop)
        to_enqueue = ids[:1] if sequential.option("sequential_tool_calls") else ids
        session.flush()
        for call_id in to_enqueue:
            dispatch.tool_call(session, call_id, token, loop_id=loop_id)
    else:
        loop.status = "queued"
        loop.execution_token = None
        loop.lease_expires_at = None
        session.flush()
        dispatch.llm_turn(session, loop_id)
    session.commit()
    return True
