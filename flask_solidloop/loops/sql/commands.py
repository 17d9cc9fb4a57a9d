"""The host's commands: pause, stop, freeze, observe, resume."""

from __future__ import annotations

from .parts import AWAITING, EXIT_SET, PROVIDER_WAIT_CLEARED, QUEUED, REQUEUE_SET, hide_shells

# -- the host's commands ---------------------------------------------------------------

#: A host-driven exit (pause, stop, force stop, freeze) from one of ``from`` to
#: ``to``, with no fence (the host outranks any generation): the error text
#: when ``error_message`` is given, the loop frozen when ``freeze``, its shells
#: hidden, and, when ``revoke_leases``, its unexecuted calls' leases revoked
#: (their workers' results will not be recorded).
LEAVE = (
    "WITH left_ AS (UPDATE solidloop_loops SET status = %(to)s::varchar, "
    "error_message = coalesce(%(error_message)s, error_message), "
    f"frozen = frozen OR %(freeze)s, {EXIT_SET} "
    "WHERE id = %(loop_id)s AND status = ANY(%(from)s::text[]) RETURNING id), "
    f"hidden AS ({hide_shells('SELECT id FROM left_')}), "
    "revoked AS (UPDATE solidloop_tool_calls SET lease_token = NULL, leased_until = NULL, "
    "updated_at = now() WHERE loop_id IN (SELECT id FROM left_) AND %(revoke_leases)s "
    "AND executed_at IS NULL) "
    "SELECT id FROM left_")

#: ``n`` ids for new loops, taken from the loops' own sequence in order (a bulk
#: start writes its loops, messages and jobs knowing their ids up front).
NEW_LOOP_IDS = ("SELECT nextval(pg_get_serial_sequence('solidloop_loops', 'id')) "
                "FROM generate_series(1, %(n)s)")

#: How many live loops (queued, running or waiting) each subject has, in the
#: order given: a new loop's fair rank (decision 0023) is its subject's count.
LIVE_PER_SUBJECT = (
    "SELECT (SELECT count(*) FROM solidloop_loops l WHERE l.subject_type = t.subject_type "
    "AND l.subject_id = t.subject_id AND l.status IN ('queued', 'running', 'waiting')) "
    "FROM unnest(%(subject_types)s::text[], %(subject_ids)s::text[]) WITH ORDINALITY "
    "AS t(subject_type, subject_id, n) ORDER BY t.n")

#: Many loops of one agent at once (Agent.start_many): each with its id, subject,
#: fair rank, state, run's trace context (NULL with tracing off) and user message
#: (its metadata saying whether the text was changed), the agent's system prompt
#: when there is one (system before user, in id order, as create_loop writes
#: them). The caller writes their first jobs.
START_MANY = (
    "WITH input AS (SELECT * FROM unnest(%(ids)s::bigint[], %(subject_types)s::text[], "
    "%(subject_ids)s::text[], %(fair_ranks)s::int[], %(states)s::text[], "
    "%(messages)s::text[], %(metas)s::text[], %(traces)s::text[]) "
    "AS t(id, subject_type, subject_id, fair_rank, state, message, meta, trace)), "
    "loops AS (INSERT INTO solidloop_loops (id, agent_name, subject_type, subject_id, "
    "fair_rank, status, state, trace, output_schema) SELECT id, %(agent_name)s, "
    "subject_type, subject_id, fair_rank, %(status)s, state::jsonb, trace::jsonb, "
    "%(output_schema)s::json FROM input RETURNING id), "
    "messages AS (INSERT INTO solidloop_messages (loop_id, role, content, metadata) "
    "SELECT loop_id, role, content, meta FROM ("
    "SELECT id AS loop_id, 0 AS rank, 'system' AS role, %(system_prompt)s::text AS content, "
    "%(system_meta)s::jsonb AS meta FROM input WHERE %(system_prompt)s::text IS NOT NULL "
    "UNION ALL SELECT id, 1, 'user', message, meta::jsonb FROM input) AS m "
    "ORDER BY loop_id, rank) "
    "SELECT count(*) AS started FROM loops")

#: A resumed run's trace context (telemetry/tracing.new_run), read and written
#: only while tracing is on: the last run's, and the new one.
LOOP_TRACE = "SELECT trace FROM solidloop_loops WHERE id = %(loop_id)s"
#: What an ended run's span reads of its loop (loops/traces.py), on the broker's
#: pool: its run's context, agent and totals.
RUN_ENDED = ("SELECT trace, agent_name, input_tokens, output_tokens, cost, step_count "
             "FROM solidloop_loops WHERE id = %(loop_id)s")
SET_TRACE = "UPDATE solidloop_loops SET trace = %(trace)s WHERE id = %(loop_id)s"

#: The frozen flag of a loop that stays where it is (paused, init); or lifted.
SET_FROZEN = ("UPDATE solidloop_loops SET frozen = %(frozen)s, updated_at = now() "
              "WHERE id = %(loop_id)s AND frozen <> %(frozen)s RETURNING id")

#: The channel that tells the workers a loop nobody watched now has a watcher:
#: its streaming turn flushes what it has at once (pipeline/llm_stack.py).
WATCH_CHANNEL = "solidloop_watch"

#: Whether the loop was watched before this statement (``o``: the row as the
#: statement found it), for the arrival's notification.
_WAS_WATCHED = "o.observed OR coalesce(o.watched_until > now(), false)"

#: Whether someone watches the loop live (the admin); ``arrived`` when nobody
#: watched it before.
SET_OBSERVED = ("UPDATE solidloop_loops l SET observed = %(observed)s, updated_at = now() "
                "FROM solidloop_loops o WHERE o.id = l.id AND l.id = %(loop_id)s "
                "AND l.observed <> %(observed)s "
                f"RETURNING l.id, NOT ({_WAS_WATCHED}) AND l.status = 'running' AS arrived")

#: An open stream watches the loop for ``ttl`` seconds more; written only when
#: less than half of that is left, so many streams of one loop write it rarely.
#: ``arrived`` when nobody watched the running loop before.
MARK_WATCHED = (
    "UPDATE solidloop_loops l "
    "SET watched_until = now() + make_interval(secs => %(ttl)s) "
    "FROM solidloop_loops o WHERE o.id = l.id AND l.id = %(loop_id)s "
    "AND (l.watched_until IS NULL "
    "OR l.watched_until < now() + make_interval(secs => %(ttl)s / 2)) "
    f"RETURNING l.id, NOT ({_WAS_WATCHED}) AND l.status = 'running' AS arrived")

#: Tell the workers (WATCH_CHANNEL), in the transaction of the mark.
NOTIFY_WATCH = f"SELECT pg_notify('{WATCH_CHANNEL}', %(loop_id)s::text)"

#: The loop's shells, failed and hidden (a resume starts clean).
HIDE_SHELLS = hide_shells("%(loop_id)s")

#: What a resume resets: limits apply per run, and the next claim starts the clock.
_RESUME_SET = ("error_message = NULL, finished_at = NULL, run_started_at = NULL, "
               f"run_step_base = step_count, {PROVIDER_WAIT_CLEARED}")
#: A resume that raises the loop's budget: its own limits updated by the given
#: ones (a locked loop; limits/budgets.py reads them).
RAISE_BUDGET = ("UPDATE solidloop_loops SET budget = CASE WHEN jsonb_typeof(budget) = 'object' "
                "THEN budget ELSE '{}'::jsonb END || %(budget)s WHERE id = %(loop_id)s")
#: A resumed loop queued for its next LLM turn (the caller enqueues its job).
RESUME_TO_TURN = f"UPDATE solidloop_loops SET {REQUEUE_SET}, {_RESUME_SET} WHERE id = %(loop_id)s"
#: A resumed loop back in its tool phase under a new generation: ``running``
#: (the caller enqueues the calls' jobs), or ``waiting`` when none can run.
RESUME_TO_CALLS = (
    "UPDATE solidloop_loops SET status = %(to)s::varchar, execution_token = %(new_token)s, "
    f"lease_expires_at = NULL, lease_holder = NULL, updated_at = now(), {_RESUME_SET} "
    "WHERE id = %(loop_id)s")

#: Of a resumed tool phase's calls (``call_ids``, in order): each one's id,
#: whether a live worker still runs it (it answers under the new generation
#: itself) and whether it awaits a decision or a result; every other
#: unexecuted call's lease is revoked, for a new job.
REVOKE_IDLE_LEASES = (
    "WITH calls AS (SELECT id, position, executed_at IS NULL AND lease_token IS NOT NULL "
    f"AND leased_until > now() AS live, {AWAITING} AS awaiting FROM solidloop_tool_calls "
    "WHERE id = ANY(%(call_ids)s::bigint[])), "
    "revoked AS (UPDATE solidloop_tool_calls t SET lease_token = NULL, leased_until = NULL, "
    "lease_holder = NULL, updated_at = now() FROM calls "
    "WHERE t.id = calls.id AND NOT calls.live AND t.executed_at IS NULL) "
    "SELECT id, live, awaiting FROM calls ORDER BY position")

#: Pending calls answered for a resume with a new message, in order (each
#: call's text and metadata are the caller's: a call that ran gets its recorded
#: result, the others a cancellation); an unexecuted call is marked cancelled.
ANSWER_CANCELLED = (
    "WITH answers AS (INSERT INTO solidloop_messages (loop_id, role, content, tool_call_id, "
    "metadata) SELECT %(loop_id)s, 'tool', a.content, a.call_id, a.metadata "
    "FROM unnest(%(call_ids)s::bigint[], %(contents)s::text[], %(metas)s::jsonb[]) "
    "WITH ORDINALITY AS a(call_id, content, metadata, n) ORDER BY a.n "
    "RETURNING id, tool_call_id) "
    "UPDATE solidloop_tool_calls c SET response_message_id = answers.id, lease_token = NULL, "
    "lease_holder = NULL, leased_until = NULL, updated_at = now(), "
    "is_success = CASE WHEN c.executed_at IS NULL THEN false ELSE c.is_success END, "
    "error_kind = CASE WHEN c.executed_at IS NULL THEN 'cancelled' ELSE c.error_kind END "
    "FROM answers WHERE c.id = answers.tool_call_id")


# -- a conversation's new messages (loops/store/conversation.py) -------------------------

#: A message sent while the loop is live, kept for later (``on_new_message =
#: "queue"``): appended to the loop's inbox, outside its history (no message
#: row: nothing sees it as part of the conversation yet). The caller holds the
#: row's lock. Returns how many wait now.
QUEUE_MESSAGE = (
    "UPDATE solidloop_loops SET inbox = coalesce(inbox, '[]'::jsonb) || jsonb_build_array("
    "jsonb_build_object('content', %(content)s::text, 'metadata', %(meta)s::jsonb, "
    "'queued_at', now())), updated_at = now() "
    "WHERE id = %(loop_id)s RETURNING jsonb_array_length(inbox) AS waiting")

#: The loop's queued messages delivered, at a point where its history is
#: consistent (a final answer, a resume, a new message to a queued loop):
#: inserted in the order they came as visible user messages (the moment they
#: join the conversation), their metadata saying when they were queued, and
#: the inbox cleared, under the loop row's lock, in one statement: a message
#: is either waiting or delivered, never both. Their ids; none when none waits.
DELIVER_INBOX = (
    "WITH held AS (SELECT id, inbox FROM solidloop_loops WHERE id = %(loop_id)s "
    "AND inbox IS NOT NULL FOR UPDATE), "
    "cleared AS (UPDATE solidloop_loops l SET inbox = NULL, updated_at = now() FROM held "
    "WHERE l.id = held.id) "
    "INSERT INTO solidloop_messages (loop_id, role, content, metadata) "
    "SELECT held.id, 'user', m.entry->>'content', coalesce(m.entry->'metadata', '{}'::jsonb) "
    "|| jsonb_build_object('queued_at', m.entry->'queued_at') "
    "FROM held, jsonb_array_elements(held.inbox) WITH ORDINALITY AS m(entry, n) "
    "ORDER BY m.n RETURNING id")

#: A user message joining a queued loop's history at once (its next turn reads
#: it), the loop row rewritten so that a claim whose snapshot predates it
#: runs again under the lock (loops/sql.CLAIM_TURN). No row when the loop is
#: not queued.
APPEND_TO_QUEUED = (
    "WITH touched AS (UPDATE solidloop_loops SET updated_at = now() "
    f"WHERE id = %(loop_id)s AND status = {QUEUED} RETURNING id) "
    "INSERT INTO solidloop_messages (loop_id, role, content, metadata) "
    "SELECT id, 'user', %(content)s::text, %(meta)s::jsonb FROM touched RETURNING id")
