"""The reads of child agents' trees (docs/decisions/0037-child-agents.md): a
loop's parent and its children, as ``status`` and the admin's loop page show
them. Children are found through ix_solidloop_loops_parent."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from .._typing import SessionLike
from ..models import Loop

__all__ = ["Kin", "Lineage", "lineage"]


@dataclass(frozen=True)
class Kin:
    """A loop of the tree, as a line shows it."""

    id: int
    agent_name: str
    status: str
    #: The tool call of the parent that started it (a child), or None.
    tool_call_id: int | None


@dataclass(frozen=True)
class Lineage:
    """A loop's place in its tree: its parent (None for a loop the host
    started), its depth, and its children in the order they started."""

    parent: Kin | None
    depth: int
    children: list[Kin]


def lineage(session: SessionLike, loop: Loop) -> Lineage:
    """The loop's parent and children (two reads by key)."""
    parent = None
    if loop.parent_loop_id is not None:
        row = session.execute(select(Loop.id, Loop.agent_name, Loop.status).where(
            Loop.id == loop.parent_loop_id)).first()
        if row is not None:
            parent = Kin(row[0], row[1], row[2], loop.parent_tool_call_id)
    children = [Kin(row[0], row[1], row[2], row[3]) for row in session.execute(
        select(Loop.id, Loop.agent_name, Loop.status, Loop.parent_tool_call_id)
        .where(Loop.parent_loop_id == loop.id).order_by(Loop.id))]
    return Lineage(parent, loop.depth, children)
