"""The loop retention's writes: ended loops deleted, a batch per transaction,
each with all its rows, after the host's ``on_loop_archive`` hooks have seen it
(docs/decisions/0030-loop-retention.md).

A loop goes with its messages, tool calls, wire-log events, stream events and
MCP sessions (the foreign keys cascade, and the stream events' statement
trigger deletes them, in the deleting statement; the events' own statement
trigger deletes their LLM answers). Its done
and dead-lettered jobs, and its subject's spend ledger rows, stay for their
own rules (:data:`LEFT`); what may hold a loop back is in loops/sql/retention.py.

The hooks run inside the deleting transaction while it holds the batch's row
locks, each call in a savepoint: what a hook writes through the session
commits with the delete; a hook that raises undoes its own writes and keeps
its loop, and the rest of the batch goes. A copy sent outside the database is
at least once (a crash before the commit keeps the loop for the next pass).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from psycopg.rows import dict_row

from ..._typing import SessionLike, real_session
from .. import sql
from .transaction import _on_driver, commits, fetch_row, fetch_rows, joins

logger = logging.getLogger("flask_solidloop.store")

#: Columns that name a loop, per table, and what the retention does with them
#: (tests/unit/test_loop_retention_links.py keeps this complete):
#: ``cascade``: deleted with the loop (a foreign key ``ON DELETE CASCADE``, or,
#: for the tables in :data:`DELETED_BY_TRIGGER`, a statement trigger on the
#: loops table).
DELETED_WITH_THE_LOOP: dict[str, str] = {
    "solidloop_messages": "loop_id",
    "solidloop_tool_calls": "loop_id",
    "solidloop_events": "loop_id",
    "solidloop_stream_events": "loop_id",
    "solidloop_mcp_sessions": "loop_id",
}
#: Deleted with the loop by ``solidloop_stream_loops_deleted``, an ``AFTER
#: DELETE ... FOR EACH STATEMENT`` trigger on the loops table (migration 0024:
#: a foreign key's check locked the loop row once more per stream event).
DELETED_BY_TRIGGER: dict[str, str] = {
    "solidloop_stream_events": "loop_id",
}
#: Left to their own rules: done jobs to SOLIDLOOP_FINISHED_JOB_RETENTION (a
#: queued or running job holds its loop back: loops/sql/retention.py),
#: dead-lettered jobs kept, the subject's spend ledger to
#: SOLIDLOOP_SPEND_RETENTION (it counts against the budget window); a fork's
#: origin is a record, not a link (its history was copied: the fork needs
#: nothing of the original, which may go before it).
LEFT: dict[str, str] = {
    "solidloop_jobs": "loop_id",
    "solidloop_spend": "loop_id",
    "solidloop_loops": "forked_from_loop_id",
}
#: Links from a loop to another loop: a child agent's parent (its
#: ``parent_loop_id``, ``ON DELETE SET NULL``). One added here must hold its
#: loops back in loops/sql/retention.py.
LINKS: dict[str, str] = {
    "solidloop_loops": "parent_loop_id",
}

#: The start of a pass's cursor: before every loop.
START = (datetime(1900, 1, 1, tzinfo=UTC), 0)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


@dataclass(frozen=True)
class ArchivedLoop:
    """An ended loop about to be deleted, as an ``on_loop_archive`` hook gets it.

    Each row is a dict of its columns as stored (the tables' column names:
    ``solidloop_loops``, ``solidloop_messages``, ``solidloop_tool_calls``),
    with Python values (``datetime``, ``Decimal``, ``UUID``, dicts for JSON).
    Messages and tool calls are in id order. Wire-log and stream events are
    not included."""

    loop: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def id(self) -> int:
        """The loop's id (a stable key for an idempotent copy)."""
        return int(self.loop["id"])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: datetimes in ISO 8601, decimals and UUIDs as strings."""
        return {"loop": _plain(self.loop), "messages": _plain(self.messages),
                "tool_calls": _plain(self.tool_calls)}


#: ``hook(archived, session)``: a host function that copies an ended loop
#: before the retention deletes it; raising keeps the loop.
LoopArchiveHook = Callable[[ArchivedLoop, SessionLike], Any]


@dataclass
class PurgedBatch:
    """What one batch did."""

    #: Loops the batch took (locked); fewer than the batch size: the pass is over.
    taken: int = 0
    #: Loops deleted, with all their rows.
    deleted: int = 0
    #: ``(loop id, error)`` of the loops a hook kept by raising.
    kept: list[tuple[int, BaseException]] = field(default_factory=list)
    #: The cursor after the batch: the last loop it took.
    cursor: tuple[datetime, int] = START


def _params(age: timedelta, batch: int, after: tuple[datetime, int]) -> dict[str, Any]:
    return {"age": age, "batch": batch, "after_at": after[0], "after_id": after[1]}


def _dict_rows(session: SessionLike, query: str, params: Any) -> list[dict[str, Any]]:
    return _on_driver(session, lambda driver: driver.cursor(row_factory=dict_row).execute(
        query, params, prepare=True).fetchall())


@commits
def purge_ended_loops(session: SessionLike, *, age: timedelta, batch: int,
                      after: tuple[datetime, int] = START,
                      hooks: Sequence[LoopArchiveHook] = ()) -> PurgedBatch:
    """One batch: up to ``batch`` loops that ended longer than ``age`` ago and
    that nothing holds back, after the cursor ``after``, oldest first, locked
    (``SKIP LOCKED``: a loop a transition holds is left), shown to ``hooks``
    (each in a savepoint), and deleted with all their rows; committed. Without
    hooks, one statement."""
    params = _params(age, batch, after)
    done = PurgedBatch(cursor=after)
    if not hooks:
        rows = fetch_rows(session, sql.PURGE_ENDED, params)
        session.commit()
        done.taken = done.deleted = len(rows)
        if rows:
            done.cursor = max((finished_at, loop_id) for loop_id, finished_at in rows)
        return done
    loops = _dict_rows(session, sql.LOCK_ENDED, params)
    done.taken = len(loops)
    if not loops:
        session.commit()
        return done
    done.cursor = (loops[-1]["finished_at"], loops[-1]["id"])
    ids = [row["id"] for row in loops]
    messages = _by_loop(_dict_rows(session, sql.ARCHIVED_MESSAGES, {"ids": ids}))
    calls = _by_loop(_dict_rows(session, sql.ARCHIVED_TOOL_CALLS, {"ids": ids}))
    going = []
    for row in loops:
        archived = ArchivedLoop(loop=row, messages=messages.get(row["id"], []),
                                tool_calls=calls.get(row["id"], []))
        error = _run_hooks(session, archived, hooks)
        if error is None:
            going.append(row["id"])
        else:
            done.kept.append((row["id"], error))
    if going:
        deleted = fetch_rows(session, sql.DELETE_ENDED, {"ids": going, "age": age})
        done.deleted = len(deleted)
    session.commit()
    return done


def _by_loop(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(row["loop_id"], []).append(row)
    return grouped


def _run_hooks(session: SessionLike, archived: ArchivedLoop,
               hooks: Sequence[LoopArchiveHook]) -> BaseException | None:
    """Every hook on ``archived`` in one savepoint; the first error (the
    savepoint rolled back), or None."""
    savepoint = real_session(session).begin_nested()
    try:
        for hook in hooks:
            hook(archived, session)
    except Exception as exc:
        savepoint.rollback()
        return exc
    savepoint.commit()
    return None


@joins
def count_ended_loops(session: SessionLike, *, age: timedelta) -> int:
    """The loops a pass would delete now (``prune --dry-run``), in the caller's
    transaction."""
    row = fetch_row(session, sql.COUNT_ENDED, {"age": age})
    return int(row["count"]) if row else 0
