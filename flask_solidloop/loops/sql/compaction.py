"""The summary turn's end (pipeline/compaction.py): the summary written, the
messages it replaces marked, the loop queued for its real turn, in one
statement under the loop row's lock and the generation fence."""

from __future__ import annotations

from .parts import OWNED, PROVIDER_WAIT_CLEARED, REQUEUE_SET, llm_event

#: A message's place in the history (loops/sql.HISTORY_ROWS): a summary sits
#: where the first message it replaced sat.
_SORT_KEY = "CASE WHEN kind = 'summary' THEN coalesce((metadata->>'sorts_at')::bigint, id) " \
    "ELSE id END"

#: A user message the host pinned (``Agent(loop).pin``): no summary replaces it.
PINNED = "coalesce((metadata->>'pinned')::boolean, false)"

#: Pin (or unpin) one of the loop's visible user messages that no summary has
#: replaced yet; no row when there is none such (loops/store.pin_message says
#: why). The summary turn's end checks the mark under the loop's lock, so a
#: pin that lands while a summary is written keeps its message either way.
PIN_MESSAGE = (
    "UPDATE solidloop_messages SET metadata = CASE WHEN %(pinned)s "
    "THEN metadata || '{\"pinned\": true}'::jsonb ELSE metadata - 'pinned' END, "
    "updated_at = now() WHERE id = %(message_id)s AND loop_id = %(loop_id)s "
    "AND role = 'user' AND kind = 'message' AND NOT is_hidden AND compacted_by IS NULL "
    "RETURNING id")
#: Where a message that cannot be pinned is (the error names why).
PIN_POINT = ("SELECT loop_id, role, kind, is_hidden, compacted_by FROM solidloop_messages "
             "WHERE id = %(message_id)s")

#: A summary turn's end, if the generation is still the writer's: the loop
#: queued again (its job is the caller's, in the same commit), the turn's usage
#: and cost counted on it; the summary (``role = 'user'``, ``kind =
#: 'summary'``) inserted, sorting where the first message it replaces sat
#: (``sorts_at`` in its metadata, with the count it replaces), only when every
#: one of ``message_ids`` is still in the history (none replaced already); each
#: of them marked ``compacted_by`` it (none pinned since it was read: a pinned
#: one leaves the span not whole); the summary request's wire event
#: answered. ``summary_id`` is NULL when the fence held but the span was no
#: longer whole: nothing is replaced, and the real turn reads the history as
#: it is. No row when the fence failed.
FINISH_SUMMARY_TURN = (
    f"WITH fenced AS (UPDATE solidloop_loops SET {REQUEUE_SET}, {PROVIDER_WAIT_CLEARED}, "
    "step_count = step_count + 1, "
    "input_tokens = input_tokens + coalesce(%(input_tokens)s::bigint, 0), "
    "output_tokens = output_tokens + coalesce(%(output_tokens)s::bigint, 0), "
    "cost = cost + coalesce(%(cost)s::numeric, 0) "
    f"WHERE id = %(loop_id)s AND {OWNED} RETURNING id), "
    f"replaced AS (SELECT id, {_SORT_KEY} AS sort_key FROM solidloop_messages "
    "WHERE loop_id = %(loop_id)s AND id = ANY(%(message_ids)s::bigint[]) "
    "AND compacted_by IS NULL AND NOT is_hidden AND status = 'completed' "
    f"AND NOT {PINNED} AND EXISTS (SELECT 1 FROM fenced)), "
    "summary AS (INSERT INTO solidloop_messages (loop_id, role, content, status, kind, usage, "
    "cost, metadata, completed_at) SELECT %(loop_id)s, 'user', %(content)s, 'completed', "
    "'summary', %(usage)s::jsonb, %(cost)s::numeric, %(message_meta)s::jsonb "
    "|| jsonb_build_object('sorts_at', min(r.sort_key), 'replaced', count(*)), now() "
    "FROM replaced r HAVING count(*) = cardinality(%(message_ids)s::bigint[]) RETURNING id), "
    "marked AS (UPDATE solidloop_messages m SET compacted_by = summary.id, updated_at = now() "
    "FROM summary WHERE m.id IN (SELECT id FROM replaced) RETURNING m.id), "
    f"{llm_event('fenced')} "
    "SELECT fenced.id, (SELECT id FROM summary) AS summary_id, "
    "(SELECT count(*) FROM marked) AS marked FROM fenced")
