"""The spans only our rows can tell: a run's ``invoke_agent`` span when the run
ends, and a lapsed attempt's span with its takeover's (docs/decisions/0033-tracing.md).

A run ends in whichever process makes its last transition (a worker's turn,
the admin's stop, the reaper): the loop's signals fire there after the commit,
and :func:`connect` listens to them, reading the run's context off the loop
row (one read per ended run, only while tracing is on). A worker killed
mid-turn ends none of its spans; the reaper that takes the turn over emits
the attempt's span from the times on record (the claim's last write, the
lease's lapse), marked as an error, then its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import signals
from ..leases import worker_identity
from ..telemetry import tracing
from . import sql

if TYPE_CHECKING:
    from flask import Flask

    from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.traces")


def connect(app: Flask, state: SolidLoopState) -> None:
    """Emit each ended run's ``invoke_agent`` span in the process that ended it."""

    def ended(outcome: str) -> Any:
        def receiver(sender: Any, *, loop_id: int, error: str | None = None,
                     reason: str | None = None, **_: Any) -> None:
            if tracing.enabled():
                # After the turn that ended the run, if one did: its span ends first.
                tracing.after_turn(lambda: end_run(
                    state, loop_id, outcome, error=error if outcome == "failed" else None,
                    reason=reason))
        return receiver

    for signal, outcome in ((signals.loop_completed, "completed"),
                            (signals.loop_failed, "failed"),
                            (signals.loop_paused, "paused")):
        signal.connect_via(app, weak=False)(ended(outcome))


def end_run(state: SolidLoopState, loop_id: int, outcome: str, *, error: str | None = None,
            reason: str | None = None) -> bool:
    """The run's ``invoke_agent`` span, read off its loop (not on the caller's
    session, which may be anywhere in its work)."""
    try:
        # One pooled psycopg connection of the broker's: no SQLAlchemy
        # connection is checked out (or opened) for it.
        rows = state.broker._run(sql.RUN_ENDED, {"loop_id": loop_id})
    except Exception:
        logger.warning("loop %s: its run's span could not be read", loop_id, exc_info=True)
        return False
    if not rows or not rows[0][0]:
        return False
    run, agent, input_tokens, output_tokens, cost, steps = rows[0]
    return tracing.end_run(run, agent=agent, error=error, attributes={
        "gen_ai.conversation.id": str(loop_id),
        "gen_ai.usage.input_tokens": int(input_tokens),
        "gen_ai.usage.output_tokens": int(output_tokens),
        "solidloop.cost": float(cost),
        "solidloop.steps": int(steps),
        "solidloop.outcome": outcome,
        "solidloop.pause_reason": reason,
    })


def _ns(at: datetime | None) -> int | None:
    return int(at.timestamp() * 1e9) if at is not None else None


def took_over_turns(state: SolidLoopState, rows: Sequence[Sequence[Any]]) -> None:
    """For each LLM turn the reaper took over (loops/sql.HEAL_EXPIRED_LLM's
    rows): the lapsed attempt's ``chat {model}`` span, an error, and the
    takeover's."""
    if not rows or not tracing.enabled():
        return
    for loop_id, run, agent, holder, claimed, lapsed in rows:
        model = _model(state, agent)
        _took_over(run, loop_id, f"{tracing.CHAT} {model}" if model else tracing.CHAT,
                   holder=holder, start=claimed, lapsed=lapsed,
                   attributes={"gen_ai.operation.name": tracing.CHAT,
                               "gen_ai.request.model": model, "gen_ai.agent.name": agent})


def _model(state: SolidLoopState, agent_name: str) -> str | None:
    """The model the agent asks for, as far as the reaper can tell (an agent
    whose settings depend on the loop, or that is not registered here, has
    none to give)."""
    try:
        return str(state.agent_for(agent_name).provider().model)
    except Exception:
        return None


def took_over_calls(rows: Sequence[Sequence[Any]]) -> None:
    """For each tool call the reaper took over (loops/sql.HEAL_STALLED_TOOLS's
    rows) from a holder: the lapsed attempt's ``execute_tool`` span and the
    takeover's."""
    if not rows or not tracing.enabled():
        return
    for call_id, loop_id, _, _, name, provider_id, holder, claimed, lapsed, run, agent in rows:
        if holder is None:
            continue  # a lease minted for a job that never ran: no attempt
        _took_over(run, loop_id, f"{tracing.EXECUTE_TOOL} {name}", holder=holder,
                   start=claimed, lapsed=lapsed, attributes={
                       "gen_ai.operation.name": tracing.EXECUTE_TOOL,
                       "gen_ai.tool.name": name, "gen_ai.tool.call.id": provider_id or str(call_id),
                       "gen_ai.agent.name": agent, "solidloop.tool_call.id": call_id})


def _took_over(run: Any, loop_id: int, name: str, *, holder: str | None,
               start: datetime | None, lapsed: datetime | None,
               attributes: dict[str, Any]) -> None:
    traceparent = run.get("traceparent") if isinstance(run, dict) else None
    if traceparent is None:
        return
    common = {"gen_ai.conversation.id": str(loop_id)}
    tracing.lapsed_attempt(traceparent, name, start_ns=_ns(start), end_ns=_ns(lapsed),
                           attributes={**attributes, **common,
                                       "solidloop.lease_holder": holder})
    span = tracing.start_span("solidloop.takeover", traceparent, attributes={
        **common, "solidloop.lease_holder": worker_identity(),
        "solidloop.lapsed_holder": holder, "solidloop.taken_over": name})
    tracing.end_span(span)
