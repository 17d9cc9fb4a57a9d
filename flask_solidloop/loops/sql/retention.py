"""The loop retention's statements (docs/decisions/0030-loop-retention.md):
which ended loops may go, their rows read for the host's ``on_loop_archive``
hooks, and the deletes, whose foreign keys' ``ON DELETE CASCADE`` take the
loop's messages, tool calls, wire-log events, stream events and MCP sessions
in the same statement.

Parameters: ``age`` (an interval: how long ago a loop must have ended),
``batch`` (loops per batch), ``after_at`` and ``after_id`` (the pass's cursor
on ``(finished_at, id)``: only loops after it), ``ids`` (the batch's loops).

Every statement that picks loops locks them ``FOR UPDATE SKIP LOCKED``, and
every delete re-checks the status and the age: a loop that a ``resume`` or
``send_message`` holds is skipped, and one those wait for is gone whole when
they get it (they take the loop row first, as every writer of a loop does).
"""

from __future__ import annotations

from .parts import TERMINAL

#: The loop ``l`` ended (``completed`` or ``failed``: a stop fails a loop)
#: longer than ``age`` ago. The status list matches ix_solidloop_loops_ended's
#: predicate, whose ``(finished_at, id)`` the scan follows.
_ENDED_BEFORE = f"l.status IN {TERMINAL} AND l.finished_at < now() - %(age)s::interval"

#: Whatever still needs the ended loop ``l``: a queued or running job of it
#: (ix_solidloop_jobs_live_loop), a tool call of it under a live lease (an
#: inline tool run has no job row), or a loop linked to it that has not
#: ended.
#:
#: Loops that name loops: a child agent's loop names its parent
#: (``parent_loop_id``, ix_solidloop_loops_parent). Held both ways: a parent
#: while a child has not ended (the child's end writes the parent's call's
#: result), a child while its parent has not (its result is still the
#: parent's to read, and the admin shows the tree). A link added later must be
#: added here too. tests/unit/test_loop_retention_links.py fails on any column
#: that names a loop and is not classified in the store's retention module.
#: The statuses of a loop that has not ended, named (an index on the status
#: serves a list, not its negation).
_UNENDED = "('init', 'queued', 'running', 'waiting', 'paused')"
_HELD = (
    "EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = l.id "
    "AND j.state IN ('queued','running')) "
    "OR EXISTS (SELECT 1 FROM solidloop_tool_calls c WHERE c.loop_id = l.id "
    "AND c.leased_until > now()) "
    "OR EXISTS (SELECT 1 FROM solidloop_loops k WHERE k.parent_loop_id IS NOT NULL "
    f"AND k.parent_loop_id = l.id AND k.status IN {_UNENDED}) "
    "OR (l.parent_loop_id IS NOT NULL AND EXISTS (SELECT 1 FROM solidloop_loops p "
    f"WHERE p.id = l.parent_loop_id AND p.status IN {_UNENDED}))")

_CANDIDATES = (
    f"FROM solidloop_loops l WHERE {_ENDED_BEFORE} "
    "AND (l.finished_at, l.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint) "
    f"AND NOT ({_HELD}) "
    "ORDER BY l.finished_at, l.id LIMIT %(batch)s::int FOR UPDATE OF l SKIP LOCKED")

#: One batch with no hooks to run: the oldest ended loops after the cursor,
#: locked, and deleted with all their rows, in one statement.
PURGE_ENDED = (
    f"WITH doomed AS (SELECT l.id {_CANDIDATES}) "
    "DELETE FROM solidloop_loops l USING doomed "
    f"WHERE l.id = doomed.id AND {_ENDED_BEFORE} "
    "RETURNING l.id, l.finished_at")

#: One batch for the hooks: the oldest ended loops after the cursor, locked
#: until the batch's commit, whole.
LOCK_ENDED = f"SELECT l.* {_CANDIDATES}"

#: The batch's messages and tool calls, each loop's in id order.
ARCHIVED_MESSAGES = ("SELECT * FROM solidloop_messages WHERE loop_id = ANY(%(ids)s::bigint[]) "
                     "ORDER BY loop_id, id")
ARCHIVED_TOOL_CALLS = ("SELECT * FROM solidloop_tool_calls WHERE loop_id = ANY(%(ids)s::bigint[]) "
                       "ORDER BY loop_id, id")

#: The batch's loops the hooks let go, deleted with all their rows.
DELETE_ENDED = (
    f"DELETE FROM solidloop_loops l WHERE l.id = ANY(%(ids)s::bigint[]) AND {_ENDED_BEFORE} "
    "RETURNING l.id")

#: What a pass would delete now (``prune --dry-run``).
COUNT_ENDED = f"SELECT count(*) FROM solidloop_loops l WHERE {_ENDED_BEFORE} AND NOT ({_HELD})"
