"""The reads of tool calls that wait for a decision or a result: one loop's,
every loop's (of an agent, of a tool), the admin's pages and bulk selection,
and the dashboard's counts.

Every read here selects on the predicate of the partial index over awaiting
calls (migration 0012), so its cost follows the number of calls that wait,
never the size of the history. Listings are oldest first, paged by id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Select, func, select

from .._typing import SessionLike
from ..models import Loop, ToolCall

__all__ = ["PendingFilter", "awaiting_calls", "count_pending", "newest_pending_id",
           "pending_counts", "pending_ids", "pending_rows"]

#: A call that awaits: it waits, nothing decided it, and nothing answered it
#: (a resume with a message cancels a waiting call by answering it).
_AWAITING = (ToolCall.waits_for.is_not(None), ToolCall.decision.is_(None),
             ToolCall.response_message_id.is_(None))


@dataclass(frozen=True)
class PendingFilter:
    """Which awaiting calls: every field optional. ``max_id`` freezes a bulk
    selection to the calls that waited when it was confirmed."""

    loop_id: int | None = None
    agent: str | None = None
    tool: str | None = None
    waits_for: str | None = None
    max_id: int | None = None

    def frozen(self, max_id: int) -> PendingFilter:
        return replace(self, max_id=max_id)


def _select(filters: PendingFilter, *columns: Any) -> Select[Any]:
    query = select(*columns).where(*_AWAITING)
    if filters.loop_id is not None:
        query = query.where(ToolCall.loop_id == filters.loop_id)
    if filters.waits_for is not None:
        query = query.where(ToolCall.waits_for == filters.waits_for)
    if filters.tool:
        query = query.where(ToolCall.name == filters.tool)
    if filters.max_id is not None:
        query = query.where(ToolCall.id <= filters.max_id)
    if filters.agent:
        query = query.join(Loop, Loop.id == ToolCall.loop_id).where(
            Loop.agent_name == filters.agent)
    return query


def awaiting_calls(session: SessionLike, *, loop_id: int | None = None,
                   agent: str | None = None, waits_for: str | None = None,
                   limit: int = 200) -> list[ToolCall]:
    """Awaiting calls (``waits_for``: only those awaiting an ``approval``, or a
    ``result``), oldest first, of one loop or of every loop (of ``agent``)."""
    filters = PendingFilter(loop_id=loop_id, agent=agent, waits_for=waits_for)
    return list(session.scalars(_select(filters, ToolCall).order_by(ToolCall.id).limit(limit)))


def pending_rows(session: SessionLike, filters: PendingFilter, *, limit: int,
                 after_id: int | None = None) -> list[tuple[ToolCall, str]]:
    """A page of awaiting calls with their loop's agent, oldest first, after
    ``after_id`` (the last id of the previous page)."""
    query = _select(replace(filters, agent=None), ToolCall, Loop.agent_name).join(
        Loop, Loop.id == ToolCall.loop_id)
    if filters.agent:
        query = query.where(Loop.agent_name == filters.agent)
    if after_id is not None:
        query = query.where(ToolCall.id > after_id)
    return [(row[0], row[1]) for row in session.execute(
        query.order_by(ToolCall.id).limit(limit))]


def pending_ids(session: SessionLike, filters: PendingFilter, *, limit: int,
                after_id: int | None = None) -> list[int]:
    """The ids of a bulk selection's next batch, oldest first."""
    query = _select(filters, ToolCall.id)
    if after_id is not None:
        query = query.where(ToolCall.id > after_id)
    return list(session.scalars(query.order_by(ToolCall.id).limit(limit)))


def count_pending(session: SessionLike, filters: PendingFilter, *, cap: int) -> int:
    """How many calls match, counting no further than ``cap + 1``."""
    inner = _select(filters, ToolCall.id).limit(cap + 1).subquery()
    return int(session.scalar(select(func.count()).select_from(inner)) or 0)


def newest_pending_id(session: SessionLike) -> int | None:
    """The newest awaiting call's id (a bulk confirmation freezes its set to it)."""
    return session.scalar(_select(PendingFilter(), func.max(ToolCall.id)))


def pending_counts(session: SessionLike, *, cap: int = 10_000) -> dict[str, int]:
    """Awaiting calls by what they wait for (``approval``, ``result``), each
    counted no further than ``cap + 1``."""
    return {kind: count_pending(session, PendingFilter(waits_for=kind), cap=cap)
            for kind in ("approval", "result")}
