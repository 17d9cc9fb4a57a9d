"""The LLM turn's statements: its claim, its shell, its end, its requeue, and a
middleware's own fenced transition."""

from __future__ import annotations

from ...queue import sql as jobs_sql
from .parts import (
    CALL_COLUMNS,
    CLAIM_RETURNING,
    CLAIM_SET,
    COMPLETED,
    EXIT_SET,
    FAILED,
    HISTORY_ROWS,
    OWNED,
    PAUSED,
    PROVIDER_WAIT_CLEARED,
    QUEUED,
    REQUEUE_SET,
    SHELL_SELECTED,
    TERMINAL,
    WAITING,
    hide_shells,
    history_json,
    insert_shell,
    llm_event,
    shell_part,
)

# -- the LLM turn ---------------------------------------------------------------------

#: The loop row locked, and what a caller decides on under the lock.
LOCK_LOOP = ("SELECT status, frozen, execution_token FROM solidloop_loops "
             "WHERE id = %(loop_id)s FOR UPDATE")

#: A queued loop's LLM turn claimed in one statement: the claim, the running
#: job marked done (``job_id``, ``job_lease``: NULL when there is none), the
#: turn's shell when ``open_shell`` (as ``shell_<column>``), its history when
#: ``read_history`` (``solidloop_history``). No row when nothing was claimed.
#:
#: Run alone, its snapshot is taken before the claim waits for the loop row,
#: so it may miss what a holder of that row committed meanwhile (a loop
#: stopped and resumed with a message: queued again, with a message the
#: snapshot lacks). So the claim holds only on the row version that snapshot
#: saw (``xmin``: the transaction that wrote the version); every write that
#: makes a loop queued, or adds to its history while it is queued, rewrites the
#: loop row (creating, resuming, answering a tool phase's last call,
#: requeueing). When the row changed, nothing is written, and the caller runs
#: the statement again after :data:`LOCK_LOOP`, where its snapshot starts with
#: the lock held.
CLAIM_TURN = (
    "WITH seen AS (SELECT xmin FROM solidloop_loops WHERE id = %(loop_id)s), "
    f"claim AS (UPDATE solidloop_loops SET {CLAIM_SET} WHERE id = %(loop_id)s "
    f"AND status = {QUEUED} AND xmin = (SELECT xmin FROM seen) {CLAIM_RETURNING}), "
    "job AS ({} RETURNING id), ".format(
        jobs_sql.MARK_DONE_WHEN.format(condition="AND EXISTS (SELECT 1 FROM claim)"))
    + f"{shell_part('claim')} "
    f"SELECT claim.*, {SHELL_SELECTED}, CASE WHEN %(read_history)s "
    f"THEN {history_json(HISTORY_ROWS)} END AS solidloop_history "
    "FROM claim LEFT JOIN shell ON true")

#: A turn's shell on its own (a stack that runs host middlewares between its
#: initialization and its request), fenced on the generation under the row lock.
OPEN_SHELL = (f"{insert_shell('id')} FROM solidloop_loops "
              f"WHERE id = %(loop_id)s AND {OWNED} FOR UPDATE RETURNING *")

#: A streaming turn's text so far, onto its still-hidden shell (text deltas
#: off: SOLIDLOOP_STREAM_MAX_HZ = 0; watchers see the text when the message
#: completes). Whether someone watches the loop comes back (the next flush's pace).
RECORD_PARTIAL = (
    "WITH partial AS (UPDATE solidloop_messages SET content = %(content)s, "
    "reasoning = %(reasoning)s, updated_at = now() "
    "WHERE id = %(shell_id)s AND status = 'processing' RETURNING loop_id, id) "
    "SELECT (SELECT observed OR coalesce(watched_until > now(), false) FROM solidloop_loops l "
    "WHERE l.id = partial.loop_id) AS watched FROM partial")

#: A streaming turn's text since its last flush, as events of the loop's stream
#: (migration 0017: under the loop's row lock, notified when watched), while
#: its shell is unfinished. Whether someone watches the loop comes back.
RECORD_DELTA = (
    "SELECT solidloop_stream_delta(loop_id, id, %(text)s, %(offset)s, %(reasoning)s, "
    "%(reasoning_offset)s) AS watched "
    "FROM solidloop_messages WHERE id = %(shell_id)s AND status = 'processing'")

#: The tools a remote server listed for the loop for the first time (the first
#: writer wins).
RECORD_SNAPSHOT = (
    "INSERT INTO solidloop_mcp_sessions (loop_id, server_name, tools, session_state) "
    "VALUES (%(loop_id)s, %(server)s, %(tools)s, %(session_state)s) "
    "ON CONFLICT (loop_id, server_name) DO NOTHING")

#: The turn's shell is still unfinished: with calls, the loop stays running
#: under the same generation, so only this makes a second run of the turn's
#: end (a retry after a COMMIT that landed unseen) write nothing.
_UNFINISHED = (" AND EXISTS (SELECT 1 FROM solidloop_messages "
              "WHERE id = %(shell_id)s AND status = 'processing')")


#: A final answer completes the loop, unless messages wait in its inbox (sent
#: while it ran, loops/store/conversation.py): it is then queued for the turn
#: that answers them, as a new run (a resume's limits), and the caller
#: delivers them (:data:`DELIVER_INBOX`) and enqueues that turn in the same
#: commit. ``inbox`` is read from the row version the fence locked (a message
#: queued while this statement waited for the lock is seen), never from the
#: statement's snapshot.
_COMPLETES = (
    f"status = CASE WHEN inbox IS NULL THEN {COMPLETED} ELSE {QUEUED} END, "
    "execution_token = NULL, finished_at = CASE WHEN inbox IS NULL THEN now() END, "
    "queued_at = CASE WHEN inbox IS NULL THEN queued_at ELSE now() END, "
    "run_started_at = CASE WHEN inbox IS NULL THEN run_started_at END, "
    "run_step_base = CASE WHEN inbox IS NULL THEN run_step_base ELSE step_count + 1 END, "
    "error_message = NULL, output = %(output)s::jsonb, ")
#: A final answer run in autocommit cannot enqueue the turn its inbox needs:
#: with ``requeue`` off it writes nothing when messages wait, and the caller runs
#: it again in a transaction (:data:`INBOX_WAITS` tells the two refusals apart).
_INBOX_ALLOWED = " AND (inbox IS NULL OR %(requeue)s)"

#: Whether the loop is still the writer's and has messages waiting in its inbox.
INBOX_WAITS = (f"SELECT id FROM solidloop_loops WHERE id = %(loop_id)s AND {OWNED} "
               "AND inbox IS NOT NULL")


def _finish_turn(with_calls: bool) -> str:
    """The turn's end, one statement: the fenced loop update (the row lock and
    the fence at once), the shell finalized with usage and cost, and the wire
    event (none when ``payload`` is NULL). The other parts write only when the
    fence matched. Without calls the loop completes; with them (``with_calls``:
    each column an array parameter, in order; the first leased to this thread
    at ``lease_position`` when ``lease`` is set: an adopted call; each with
    what it waits for and its deadline; fenced on its shell being unfinished
    too) it enters its tool phase under the same generation, ``waiting`` when
    none of them can run yet (``waits``), and the statement returns the
    calls' ids in order
    (``solidloop_call_ids``) and the first call's row (``call_<column>``), which
    an adopted call's step starts from. Two texts rather than one with a
    switch: the turn's end is a statement of every turn, and each text then
    plans only the parts it runs."""
    completes = (f"status = CASE WHEN %(waits)s THEN {WAITING} ELSE status END, "
                 if with_calls else _COMPLETES)
    parts = [
        "fenced AS (UPDATE solidloop_loops SET step_count = step_count + 1, "
        "lease_holder = NULL, lease_expires_at = NULL, updated_at = now(), "
        "input_tokens = input_tokens + coalesce(%(input_tokens)s::bigint, 0), "
        "output_tokens = output_tokens + coalesce(%(output_tokens)s::bigint, 0), "
        f"{completes}{PROVIDER_WAIT_CLEARED}, cost = cost + coalesce(%(cost)s::numeric, 0) "
        f"WHERE id = %(loop_id)s AND {OWNED}{_UNFINISHED if with_calls else _INBOX_ALLOWED} "
        "RETURNING *)",
        "shell AS (UPDATE solidloop_messages SET content = %(content)s, "
        "reasoning = %(reasoning)s, finish_reason = %(finish_reason)s, status = 'completed', "
        "is_hidden = false, completed_at = now(), metadata = %(message_meta)s, "
        "usage = coalesce(%(usage)s, usage), cost = coalesce(%(message_cost)s, cost), "
        "updated_at = now() WHERE id = %(shell_id)s AND EXISTS (SELECT 1 FROM fenced) "
        "RETURNING id)",
        llm_event("fenced"),
        # The text the stream was not sent yet (none when the turn did not
        # stream deltas): before the shell's completion, whose event fires at
        # the statement's end, so a stream's deltas add up to the stored text.
        "streamed AS (SELECT solidloop_stream_delta(fenced.id, %(shell_id)s, %(tail)s::text, "
        "%(tail_offset)s::integer, NULL, 0) FROM fenced WHERE %(tail)s::text IS NOT NULL)",
    ]
    if not with_calls:
        return (f"WITH {', '.join(parts)} SELECT *, "
                "(SELECT count(*) FROM streamed) AS solidloop_streamed FROM fenced")
    # The calls are made from the shell's row, so the shell is written first:
    # its completion's stream event precedes theirs.
    parts.append(
        "calls AS (INSERT INTO solidloop_tool_calls (loop_id, message_id, position, call_id, "
        "name, server_name, tool_name, arguments_raw, arguments, metadata, waits_for, "
        "wait_deadline, lease_token, lease_holder, leased_until) "
        "SELECT fenced.id, %(shell_id)s, c.n - 1, c.call_id, "
        "c.name, c.server_name, c.tool_name, c.arguments_raw, c.arguments, c.metadata, "
        "c.waits_for, now() + make_interval(secs => c.timeout), "
        "CASE WHEN c.n = %(lease_position)s THEN %(lease)s::uuid END, "
        "CASE WHEN c.n = %(lease_position)s THEN %(holder)s END, "
        "CASE WHEN c.n = %(lease_position)s THEN now() + %(ttl)s::interval END "
        "FROM fenced, shell, unnest(%(call_ids)s::varchar[], %(call_names)s::varchar[], "
        "%(call_servers)s::varchar[], %(call_tools)s::varchar[], %(call_raws)s::text[], "
        "%(call_arguments)s::jsonb[], %(call_metas)s::jsonb[], %(call_waits)s::varchar[], "
        "%(call_timeouts)s::float8[]) WITH ORDINALITY "
        "AS c(call_id, name, server_name, tool_name, arguments_raw, arguments, metadata, "
        "waits_for, timeout, n) RETURNING *)")
    first = ", ".join(f'first.{column} AS "call_{column}"' for column in CALL_COLUMNS)
    # The row of the call leased to this thread, if one is (else the first).
    return (f"WITH {', '.join(parts)} SELECT fenced.*, "
            "(SELECT count(*) FROM streamed) AS solidloop_streamed, "
            "ARRAY(SELECT id FROM calls ORDER BY position) AS solidloop_call_ids, "
            f"{first} FROM fenced, (SELECT * FROM calls "
            "ORDER BY lease_token IS NULL, position LIMIT 1) AS first")


#: By whether the turn ends with tool calls.
FINISH_TURN = {with_calls: _finish_turn(with_calls) for with_calls in (False, True)}

#: A final answer that does not match the loop's output schema
#: (docs/decisions/0036-structured-output.md), one statement under the row
#: lock and the fence, as :data:`FINISH_TURN` ends a turn: the loop's totals,
#: the shell completed as an ordinary assistant message, the wire event, the
#: stream's last delta; then either the loop queued for another turn (``to``
#: queued: the caller enqueues it in the same commit) with a user message
#: carrying the validation error (``retry``, its metadata ``retry_meta``) after
#: the answer, or the loop failed (``to`` failed, ``error_message``: its last
#: retry spent). The loop's row comes back; no row when the fence failed.
OUTPUT_INVALID = (
    "WITH fenced AS (UPDATE solidloop_loops SET step_count = step_count + 1, "
    "status = %(to)s::varchar, execution_token = NULL, lease_holder = NULL, "
    "lease_expires_at = NULL, updated_at = now(), "
    f"queued_at = CASE WHEN %(to)s::varchar = {QUEUED} THEN now() ELSE queued_at END, "
    f"finished_at = CASE WHEN %(to)s::varchar IN {TERMINAL} THEN now() ELSE finished_at END, "
    "error_message = %(error_message)s, "
    "input_tokens = input_tokens + coalesce(%(input_tokens)s::bigint, 0), "
    "output_tokens = output_tokens + coalesce(%(output_tokens)s::bigint, 0), "
    f"{PROVIDER_WAIT_CLEARED}, cost = cost + coalesce(%(cost)s::numeric, 0) "
    f"WHERE id = %(loop_id)s AND {OWNED} RETURNING *), "
    "shell AS (UPDATE solidloop_messages SET content = %(content)s, "
    "reasoning = %(reasoning)s, finish_reason = %(finish_reason)s, status = 'completed', "
    "is_hidden = false, completed_at = now(), metadata = %(message_meta)s, "
    "usage = coalesce(%(usage)s, usage), cost = coalesce(%(message_cost)s, cost), "
    "updated_at = now() WHERE id = %(shell_id)s AND EXISTS (SELECT 1 FROM fenced) "
    f"RETURNING id), {llm_event('fenced')}, "
    "streamed AS (SELECT solidloop_stream_delta(fenced.id, %(shell_id)s, %(tail)s::text, "
    "%(tail_offset)s::integer, NULL, 0) FROM fenced WHERE %(tail)s::text IS NOT NULL), "
    # After the shell's completion (it is in ``shell``), so the error follows
    # the answer it is about in the history's order.
    "retry AS (INSERT INTO solidloop_messages (loop_id, role, content, metadata) "
    "SELECT fenced.id, 'user', %(retry)s::text, %(retry_meta)s::jsonb "
    "FROM fenced, shell WHERE %(retry)s::text IS NOT NULL RETURNING id) "
    "SELECT fenced.*, (SELECT count(*) FROM streamed) AS solidloop_streamed, "
    "(SELECT id FROM retry) AS solidloop_retry_id FROM fenced")

#: A running loop leaves ``running`` on the writer's generation: a limit
#: pauses it, an error fails it (``to``). Its shells are failed and hidden, and
#: the turn's wire event recorded (none when ``payload`` is NULL). A tool turn
#: that fails the loop passes its call's ``lease`` too (NULL for an LLM turn,
#: or a tool job that holds none): the call must still be that lease's.
END_TURN = (
    "WITH ended AS (UPDATE solidloop_loops SET status = %(to)s::varchar, "
    f"error_message = %(error_message)s, {EXIT_SET} WHERE id = %(loop_id)s AND {OWNED} "
    "AND (%(lease)s::uuid IS NULL OR EXISTS (SELECT 1 FROM solidloop_tool_calls "
    "WHERE id = %(call_id)s AND lease_token = %(lease)s)) RETURNING id), "
    # A tool turn's call gives its lease up with the loop: a resume claims it
    # at once, rather than wait for the lease to lapse.
    "released AS (UPDATE solidloop_tool_calls SET lease_token = NULL, leased_until = NULL, "
    "lease_holder = NULL, updated_at = now() WHERE id = %(call_id)s "
    "AND lease_token = %(lease)s AND EXISTS (SELECT 1 FROM ended)), "
    f"hidden AS ({hide_shells('SELECT id FROM ended')}), "
    f"{llm_event('ended')} "
    "SELECT id FROM ended")

#: A claimed LLM turn given back to the queue (the worker is stopping, or the
#: database failed before the request), if the generation is still the
#: writer's; its shells hidden. The caller enqueues the turn's job with it.
REQUEUE_TURN = (
    f"WITH requeued AS (UPDATE solidloop_loops SET {REQUEUE_SET} "
    f"WHERE id = %(loop_id)s AND {OWNED} RETURNING id), "
    f"hidden AS ({hide_shells('SELECT id FROM requeued')}) "
    "SELECT id FROM requeued")

#: A turn a rate limit deferred to its slot, if the generation is still the
#: writer's: queued again (its job is the caller's, due at the slot), its shells
#: hidden, the deferral counted, and the reservation it holds kept for its LLM
#: step (``slot``: limits/admission.py); the wire event of a request the
#: provider refused with a long wait recorded (none before a request: its
#: ``payload`` and ``event_id`` are NULL). No row when the fence failed.
DEFER_FOR_CAPACITY = (
    f"WITH deferred AS (UPDATE solidloop_loops SET {REQUEUE_SET}, "
    "capacity_deferrals = capacity_deferrals + 1, capacity_slot = %(slot)s "
    f"WHERE id = %(loop_id)s AND {OWNED} RETURNING id), "
    f"hidden AS ({hide_shells('SELECT id FROM deferred')}), "
    f"{llm_event('deferred')} "
    "SELECT id FROM deferred")

#: The reservation a deferred turn holds, taken by the generation that will
#: send its request: cleared and returned as it was, so it is used once (a turn
#: that dies after taking it reserves again when it runs again). No row when
#: the generation moved on.
TAKE_CAPACITY_SLOT = (
    "UPDATE solidloop_loops AS l SET capacity_slot = NULL FROM (SELECT id, capacity_slot "
    "FROM solidloop_loops WHERE id = %(loop_id)s FOR UPDATE) AS held "
    f"WHERE l.id = held.id AND {OWNED} RETURNING held.capacity_slot")

#: A turn whose provider is out (unreachable, or answering 429/502/503/504
#: after the request's own retries) deferred, if the generation is still the
#: writer's and the outage began less than ``max_wait`` seconds ago: queued
#: again (its job is the caller's, due later), its shells hidden, its wire
#: event recorded, the outage's start kept and its attempts counted. No row
#: when the fence failed or the outage has lasted too long (the caller then
#: ends the turn failed).
DEFER_TURN = (
    f"WITH deferred AS (UPDATE solidloop_loops SET {REQUEUE_SET}, "
    "provider_wait_since = coalesce(provider_wait_since, now()), "
    "provider_wait_attempts = provider_wait_attempts + 1, "
    "provider_wait_error = %(error_message)s "
    f"WHERE id = %(loop_id)s AND {OWNED} "
    "AND coalesce(provider_wait_since, now()) > now() - make_interval(secs => %(max_wait)s) "
    "AND provider_wait_attempts < coalesce(%(max_attempts)s::int, provider_wait_attempts + 1) "
    "RETURNING id, provider_wait_since, provider_wait_attempts), "
    f"hidden AS ({hide_shells('SELECT id FROM deferred')}), "
    f"{llm_event('deferred')} "
    "SELECT * FROM deferred")

#: A middleware's own fenced transition (``ctx.transition``): from one of
#: ``from`` to ``to`` on the writer's generation. Leaving for completed,
#: failed, paused or queued clears the generation and the lease; a terminal
#: status stamps ``finished_at``; ``completed`` clears the error.
TRANSITION = (
    "UPDATE solidloop_loops SET status = %(to)s::varchar, "
    f"execution_token = CASE WHEN %(to)s::varchar IN ({COMPLETED}, {FAILED}, {PAUSED}, {QUEUED}) "
    "THEN NULL ELSE execution_token END, "
    f"lease_expires_at = CASE WHEN %(to)s::varchar IN ({COMPLETED}, {FAILED}, {PAUSED}, {QUEUED}) "
    "THEN NULL ELSE lease_expires_at END, "
    f"lease_holder = CASE WHEN %(to)s::varchar IN ({COMPLETED}, {FAILED}, {PAUSED}, {QUEUED}) "
    "THEN NULL ELSE lease_holder END, "
    f"queued_at = CASE WHEN %(to)s::varchar = {QUEUED} THEN now() ELSE queued_at END, "
    f"finished_at = CASE WHEN %(to)s::varchar IN {TERMINAL} THEN now() ELSE finished_at END, "
    f"error_message = CASE WHEN %(to)s::varchar = {COMPLETED} THEN NULL ELSE error_message END, "
    "updated_at = now() "
    "WHERE id = %(loop_id)s AND status = ANY(%(from)s::text[]) AND execution_token = %(token)s "
    "RETURNING id")

#: The turn's ``llm_request`` event, recorded just before its request is sent
#: (its redacted request; no response, no duration yet: pending), fenced on the
#: generation under the loop row's lock (``FOR SHARE``: a claim or an exit of
#: another writer waits for it, and it for them). The write that ends the turn
#: answers it in a row of its own (``llm_event``'s ``answered``). No row when the loop
#: is no longer the writer's. ``watched``: whether someone watches the loop
#: (its streaming turn then flushes fast from the start), read under the same lock.
RECORD_REQUEST = (
    "WITH owner AS (SELECT id, observed OR coalesce(watched_until > now(), false) AS watched "
    f"FROM solidloop_loops WHERE id = %(loop_id)s AND {OWNED} FOR SHARE), "
    "recorded AS (INSERT INTO solidloop_events (loop_id, message_id, kind, payload) "
    "SELECT id, %(shell_id)s::bigint, 'llm_request', %(payload)s::jsonb FROM owner "
    "RETURNING id, created_at) "
    "SELECT recorded.id, recorded.created_at, owner.watched FROM recorded, owner")
