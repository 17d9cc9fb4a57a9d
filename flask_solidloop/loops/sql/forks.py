"""A fork: a new loop with a copy of another's history (loops/store/forks.py,
docs/decisions/0039-forks.md)."""

from __future__ import annotations

#: The loop a fork is made from, held against retention's delete and its
#: history's writers (their fenced writes lock the row) while the fork reads
#: and copies it: a consistent history, whatever the loop is doing.
FORK_SOURCE = ("SELECT id, agent_name, subject_type, subject_id, state, budget, llm_override, "
               "output_schema FROM solidloop_loops WHERE id = %(loop_id)s FOR SHARE")

#: What a fork point is chosen among, in one snapshot: the loop's tool calls
#: (id, the message that asked for it, the message that answered it) and its
#: visible, completed messages that no summary replaced (id, role, the call a
#: tool message answers), the history's own rows (loops/sql.HISTORY_ROWS)
#: without their text, in its order (a summary where the first message it
#: replaced sat). A summary's role reads ``summary``: it is neither the task's
#: user message nor one a fork may replace.
FORK_ROWS = (
    "SELECT true AS is_call, id, NULL AS role, message_id AS ref, response_message_id, "
    "id AS sort_key FROM solidloop_tool_calls WHERE loop_id = %(loop_id)s "
    "UNION ALL "
    "SELECT false, id, CASE WHEN kind = 'summary' THEN 'summary' ELSE role END, tool_call_id, "
    "NULL, CASE WHEN kind = 'summary' THEN coalesce((metadata->>'sorts_at')::bigint, id) "
    "ELSE id END FROM solidloop_messages "
    "WHERE loop_id = %(loop_id)s AND NOT is_hidden AND status = 'completed' "
    "AND compacted_by IS NULL "
    "ORDER BY is_call DESC, sort_key")

#: Where a fork point that is not in the history is (an error names it).
FORK_POINT = ("SELECT loop_id, role, is_hidden, status, compacted_by FROM solidloop_messages "
              "WHERE id = %(message_id)s")

#: Ids for a fork's messages and tool calls, taken from their tables' own
#: sequences (the copy maps each old id to a new one up front).
FORK_IDS = (
    "SELECT ARRAY(SELECT nextval(pg_get_serial_sequence('solidloop_messages', 'id')) "
    "FROM generate_series(1, %(messages)s)) AS messages, "
    "ARRAY(SELECT nextval(pg_get_serial_sequence('solidloop_tool_calls', 'id')) "
    "FROM generate_series(1, %(calls)s)) AS calls")

#: The copy, one statement: the chosen messages under their new ids, in the
#: history's order (``old_messages`` in it, ``new_messages`` ascending), with
#: their text, kind, reasoning and metadata (the provider's blocks the next
#: request sends back; a summary's ``sorts_at`` dropped, its new id being its
#: place) but not their usage or cost (the original paid for them); the
#: chosen tool calls under theirs, with their results and decisions, each
#: answered by its answer's copy, no lease held, their wire ids kept (a call
#: the provider gave no id is sent as ``call_<its old row id>``, as the
#: original's requests sent it); and the original's tool snapshots, without
#: its MCP sessions (the fork opens its own). The foreign keys between the
#: two copies are checked at the statement's end, when both are in.
FORK_COPY = (
    "WITH m AS (SELECT * FROM unnest(%(old_messages)s::bigint[], %(new_messages)s::bigint[]) "
    "AS t(old_id, new_id)), "
    "c AS (SELECT * FROM unnest(%(old_calls)s::bigint[], %(new_calls)s::bigint[]) "
    "AS t(old_id, new_id)), "
    "messages AS (INSERT INTO solidloop_messages (id, loop_id, role, content, status, "
    "is_hidden, reasoning, tool_call_id, finish_reason, metadata, completed_at, kind) "
    "SELECT m.new_id, %(fork_id)s, s.role, s.content, s.status, false, s.reasoning, c.new_id, "
    "s.finish_reason, s.metadata - 'sorts_at', s.completed_at, s.kind FROM m "
    "JOIN solidloop_messages s ON s.id = m.old_id LEFT JOIN c ON c.old_id = s.tool_call_id "
    "ORDER BY m.new_id RETURNING id), "
    "calls AS (INSERT INTO solidloop_tool_calls (id, loop_id, message_id, position, call_id, "
    "name, server_name, tool_name, arguments_raw, arguments, is_success, result, error_kind, "
    "executed_at, metadata, duration_ms, lapsed_runs, waits_for, decision, decided_at, "
    "decided_by, decision_reason, requested_arguments, response_message_id) "
    "SELECT c.new_id, %(fork_id)s, asked.new_id, t.position, coalesce(t.call_id, 'call_' || t.id), "
    "t.name, t.server_name, t.tool_name, t.arguments_raw, t.arguments, t.is_success, t.result, "
    "t.error_kind, t.executed_at, t.metadata, t.duration_ms, t.lapsed_runs, t.waits_for, "
    "t.decision, t.decided_at, t.decided_by, t.decision_reason, t.requested_arguments, "
    "answer.new_id FROM c JOIN solidloop_tool_calls t ON t.id = c.old_id "
    "JOIN m asked ON asked.old_id = t.message_id "
    "JOIN m answer ON answer.old_id = t.response_message_id RETURNING id), "
    "snapshots AS (INSERT INTO solidloop_mcp_sessions (loop_id, server_name, tools) "
    "SELECT %(fork_id)s, server_name, tools FROM solidloop_mcp_sessions "
    "WHERE loop_id = %(loop_id)s RETURNING id) "
    "SELECT (SELECT count(*) FROM messages) AS messages, (SELECT count(*) FROM calls) AS calls")
