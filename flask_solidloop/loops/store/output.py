"""Structured output's own turn end: a final answer that does not match the
loop's output schema (docs/decisions/0036-structured-output.md). A valid
answer ends its turn as any final answer does (``finish_llm_turn`` with
``output``)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from ... import signals
from ..._typing import SessionLike
from ...errors import LostLeaseError
from ...models.loop import LoopStatus
from .. import sql, storable
from .ending import LoopEnds, run_loop_end_hooks
from .llm_turn import answer_params, streamed_tail
from .transaction import commits, fetch_row
from .wirelog import logged_tools

if TYPE_CHECKING:
    from ...llm.client import WireRecord
    from ...llm.types import AssistantTurn
    from ...state import SolidLoopState


@commits
def end_with_invalid_output(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                            token: uuid.UUID, shell_id: int, response: AssistantTurn,
                            meta: dict[str, Any], turn_cost: Decimal | None,
                            wire: WireRecord | None, retry: str | None,
                            retry_meta: dict[str, Any] | None = None,
                            error_message: str | None = None, ends: LoopEnds | None = None,
                            streamed: str | None = None,
                            event_id: int | None = None) -> str:
    """An answer that failed validation, under the row lock and the fence
    (loops/sql.OUTPUT_INVALID): kept as an ordinary assistant message with
    the turn's usage, cost and wire event; then, with ``retry`` (the error as
    the model reads it), a user message carrying it and the loop queued for
    another LLM turn, its job in the same commit; without, the loop failed
    with ``error_message`` and the host's ``on_loop_end`` hooks (``ends``) in
    the same commit. Returns the loop's new status; LostLeaseError, with
    nothing written, when the loop is no longer the turn's. Rolls back what
    the session holds first."""
    session.rollback()
    to = LoopStatus.QUEUED if retry is not None else LoopStatus.FAILED
    params, _, tools = answer_params(state, session, loop_id=loop_id, token=token,
                                     shell_id=shell_id, response=response, meta=meta,
                                     turn_cost=turn_cost, wire=wire, event_id=event_id)
    error = storable.text(error_message)[0] if retry is None else None
    params.update(streamed_tail(params["content"], streamed), to=to.value,
                  error_message=error, retry=storable.text(retry)[0],
                  retry_meta=Jsonb(retry_meta or {}))
    fenced = fetch_row(session, sql.OUTPUT_INVALID, params)
    if fenced is None:
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands during the request")
    if retry is not None:
        state.dispatch.llm_turn(session, loop_id)
    elif ends is not None and ends.apply_to(to.value):
        run_loop_end_hooks(session, loop_id, ends)
    session.commit()
    if tools is not None:  # the event's tools are now in the log
        logged_tools.remember((loop_id, fenced["created_at"]), tools)
    if retry is None:
        signals.send_status(to.value, loop_id=loop_id, error=error)
    return to.value
