"""The reaper's repairs (maintenance/reaper.py runs them, each pass, in every
worker): each is one statement that picks its candidates with ``FOR UPDATE
SKIP LOCKED`` and repairs them, and the jobs the repairs imply, in one commit.
Reapers racing on one loop resolve to one repair; each is idempotent.

A repair that found nothing commits nothing: its statement changed no row
and locked none, and the session's transaction (reads only) goes on to the
next case, so an idle pass is one transaction, not one per case (the pass's
record ends it). A repair that changed something commits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ..._typing import SessionLike
from .. import sql
from .llm_turn import calls_to_run
from .transaction import commits, execute, fetch_rows

if TYPE_CHECKING:
    import uuid

    from ...state import SolidLoopState


def _requeued(state: SolidLoopState, session: SessionLike, statement: str,
              params: dict[str, object]) -> list[int]:
    """Run a repair that requeues loops, enqueue their next turns, commit."""
    ids = [row[0] for row in fetch_rows(session, statement, params)]
    for loop_id in ids:
        state.dispatch.llm_turn(session, loop_id)
    _commit_if(session, ids)
    return ids


def _commit_if(session: SessionLike, healed: list[int]) -> None:
    """Commit the repairs, if any (see the module docstring)."""
    if healed:
        session.commit()


@commits
def heal_expired_llm(state: SolidLoopState, session: SessionLike) -> list[int]:
    """Running loops whose LLM lease expired: the generation rotated away, the
    shells hidden, the turn queued again."""
    return _requeued(state, session, sql.HEAL_EXPIRED_LLM, {})


@commits
def heal_stuck_tool_phase(state: SolidLoopState, session: SessionLike, *,
                          grace: float) -> list[int]:
    """Tool phases with nothing left to answer and no live job: the next LLM turn."""
    return _requeued(state, session, sql.HEAL_STUCK_TOOL_PHASE, {"grace": grace})


@commits
def heal_stuck_queued(state: SolidLoopState, session: SessionLike, *,
                      threshold: float) -> list[int]:
    """Queued loops with no live job (a dead-lettered one, say): a new job."""
    ids = [row[0] for row in fetch_rows(session, sql.HEAL_STUCK_QUEUED, {"grace": threshold})]
    for loop_id in ids:
        state.dispatch.llm_turn(session, loop_id)
    _commit_if(session, ids)
    return ids


@commits
def heal_stalled_tools(state: SolidLoopState, session: SessionLike, *,
                       lease_seconds: float) -> list[int]:
    """Unexecuted tool calls whose lease lapsed: a fresh lease (compare-and-set on
    the old one) goes to a new tool job, so healthy siblings are not fenced."""
    healed = []
    for call_id, loop_id, lease, token in fetch_rows(
            session, sql.HEAL_STALLED_TOOLS, {"ttl": timedelta(seconds=lease_seconds)}):
        state.dispatch.tool_call(session, call_id, token, loop_id=loop_id,
                                 reaper_lease_token=lease)
        healed.append(call_id)
    _commit_if(session, healed)
    return healed


@commits
def heal_dropped_tools(state: SolidLoopState, session: SessionLike, *, grace: float,
                       sequential: Callable[[int], bool]) -> list[int]:
    """Tool calls of a running tool phase that nobody holds and no live job will
    run: a new tool job (the recorded result keeps the tool from running
    twice). In sequential mode (``sequential(loop_id)``) only the head of the
    line."""
    by_loop: dict[int, tuple[uuid.UUID, list[int]]] = {}
    for call_id, loop_id, token in fetch_rows(session, sql.DROPPED_TOOLS, {"grace": grace}):
        by_loop.setdefault(loop_id, (token, []))[1].append(call_id)
    healed = []
    for loop_id, (token, call_ids) in by_loop.items():
        for call_id in calls_to_run(call_ids, sequential=sequential(loop_id)):
            state.dispatch.tool_call(session, call_id, token, loop_id=loop_id)
            healed.append(call_id)
    if healed:
        execute(session, sql.TOUCH_CALLS, {"call_ids": healed})
    _commit_if(session, healed)
    return healed


@commits
def heal_expired_waits(state: SolidLoopState, session: SessionLike, *,
                       grace: float) -> list[int]:
    """Waits past their deadline whose timeout job is gone (dead-lettered,
    deleted): a timeout job again, due now."""
    healed = []
    for call_id, loop_id in fetch_rows(session, sql.EXPIRED_WAITS, {"grace": grace}):
        state.dispatch.wait_timeout(session, call_id, loop_id=loop_id, delay_ms=0)
        healed.append(call_id)
    _commit_if(session, healed)
    return healed


@commits
def heal_orphan_shells(session: SessionLike) -> list[int]:
    """``processing`` shells of loops that are not running: failed and hidden."""
    ids = [row[0] for row in fetch_rows(session, sql.HEAL_ORPHAN_SHELLS, {})]
    _commit_if(session, ids)
    return ids
