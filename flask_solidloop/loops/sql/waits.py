"""The statements of a call that waits: its one decision, and what its timeout
reads (docs/decisions/0017-waiting-loops.md)."""

from __future__ import annotations

from .parts import AWAITING, RUNNING, WAITING, tool_event


def _decide(records: bool) -> str:
    """The one decision on a call that awaits one (``waits_for``): under the loop
    row's lock and the call's, compare-and-set on an awaiting, unanswered call
    with no decision. An approval (``arguments``: edited ones, the model's kept
    in ``requested_arguments``) clears the way for the tool; a denial or a
    supplied result (``records``) is recorded as the call's canonical result,
    with its event. A waiting loop runs again when the call can run now (in
    ``sequential`` mode, when it is the head of its line). It returns what the
    locks found (the loop's id, status and generation, the call's wait and an
    earlier decision, the head of the line) and whether it decided
    (``solidloop_decided``) and woke the loop (``solidloop_woken``); the caller
    enqueues the call's job."""
    sets = ("result = %(result)s, is_success = %(is_success)s, "
            "error_kind = %(error_kind)s, executed_at = now(), duration_ms = %(duration_ms)s, "
            "metadata = coalesce(%(meta)s, metadata), " if records else
            "requested_arguments = CASE WHEN %(arguments)s::jsonb IS NULL "
            "THEN requested_arguments ELSE arguments END, "
            "arguments = coalesce(%(arguments)s::jsonb, arguments), ")
    parts = [
        "WITH locked AS (SELECT l.id AS loop_id, l.status, l.execution_token, c.waits_for, "
        "c.decision, c.decided_by, c.decided_at, c.response_message_id, "
        "(SELECT s.id FROM solidloop_tool_calls s WHERE s.message_id = c.message_id "
        "AND s.response_message_id IS NULL ORDER BY s.position LIMIT 1) AS head "
        "FROM solidloop_loops l JOIN solidloop_tool_calls c ON c.loop_id = l.id "
        "WHERE c.id = %(call_id)s FOR UPDATE OF l, c)",
        "decided AS (UPDATE solidloop_tool_calls SET decision = %(decision)s, "
        "decided_at = now(), decided_by = %(by)s, decision_reason = %(reason)s, "
        f"{sets}updated_at = now() WHERE id = %(call_id)s AND waits_for = %(waits_for)s "
        f"AND {AWAITING} AND response_message_id IS NULL RETURNING id, loop_id)",
        f"woken AS (UPDATE solidloop_loops SET status = {RUNNING}, updated_at = now() "
        f"WHERE id = (SELECT loop_id FROM decided) AND status = {WAITING} "
        "AND (NOT %(sequential)s OR (SELECT head FROM locked) = %(call_id)s) RETURNING id)",
    ]
    if records:
        parts.append(f"event AS ({tool_event('decided', loop='decided.loop_id')})")
    return (f"{', '.join(parts)} SELECT locked.*, "
            "EXISTS (SELECT 1 FROM decided) AS solidloop_decided, "
            "EXISTS (SELECT 1 FROM woken) AS solidloop_woken "
            "FROM (SELECT 1) AS one LEFT JOIN locked ON true")


#: By whether the decision records the call's result (a denial, a supplied
#: result) or approves the call to run.
DECIDE = {records: _decide(records) for records in (False, True)}

#: What a wait's timeout needs to know of its call, and whether it is due.
WAIT_DUE = (
    "SELECT c.id, c.loop_id, c.waits_for, c.metadata, l.agent_name, "
    "c.wait_deadline <= now() AS due, c.wait_deadline - now() AS left_ "
    "FROM solidloop_tool_calls c JOIN solidloop_loops l ON l.id = c.loop_id "
    "WHERE c.id = %(call_id)s AND c.waits_for IS NOT NULL AND c.decision IS NULL "
    "AND c.response_message_id IS NULL")
