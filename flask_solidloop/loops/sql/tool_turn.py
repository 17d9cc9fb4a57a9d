"""The tool turn's statements: a call's claim and lease, its outcome (its result
recorded, its answer written, the next LLM turn claimed), and the MCP session
its server keeps."""

from __future__ import annotations

from .parts import (
    AWAITING,
    CLAIM_RETURNING,
    CLAIM_SET,
    HISTORY_ROWS,
    OWNED,
    REQUEUE_SET,
    RUNNING,
    SHELL_SELECTED,
    WAITING,
    history_json,
    shell_part,
    tool_event,
)

# -- the tool turn --------------------------------------------------------------------

#: A delivered tool job's claim of its call: under the loop row lock and the
#: generation fence, a fresh lease on an unexecuted call nobody holds (or whose
#: lease lapsed); or, for a job the reaper queued with the lease it minted
#: (``reaper_lease``), that lease, if it is still the call's. Either way the
#: lease runs from the claim: a reaper's lease may have all but run out while
#: its job waited in the queue, and left as it was, the next reap would take
#: the call over again from the live worker that just claimed it (a second run
#: with no fault behind it). A call that awaits a decision or a result is never
#: claimed. The call's new lease columns come back.
CLAIM_CALL = (
    f"WITH owner AS (SELECT id FROM solidloop_loops WHERE id = %(loop_id)s AND {OWNED} "
    "FOR UPDATE) "
    "UPDATE solidloop_tool_calls "
    "SET lease_token = coalesce(%(reaper_lease)s::uuid, %(lease)s::uuid), "
    "lease_holder = %(holder)s, updated_at = now(), leased_until = now() + %(ttl)s "
    "WHERE id = %(call_id)s AND executed_at IS NULL AND EXISTS (SELECT 1 FROM owner) "
    f"AND NOT ({AWAITING}) AND CASE WHEN %(reaper_lease)s::uuid IS NULL "
    "THEN lease_token IS NULL OR leased_until < now() "
    "ELSE lease_token = %(reaper_lease)s END "
    "RETURNING lease_token, lease_holder, leased_until, updated_at")

#: The next call of a sequential line, leased to this thread (adopted) in the
#: commit that answers its predecessor: compare-and-set on an unleased,
#: unexecuted call. Its row comes back whole.
ADOPT_CALL = (
    "UPDATE solidloop_tool_calls SET lease_token = %(lease)s, lease_holder = %(holder)s, "
    "leased_until = now() + %(ttl)s, updated_at = now() "
    f"WHERE id = %(call_id)s AND executed_at IS NULL AND lease_token IS NULL "
    f"AND NOT ({AWAITING}) RETURNING *")

#: An adopted call this thread will not run after all: its lease released, if
#: it is still that lease and the tool has not run (the loop row locked first).
#: The caller enqueues the call's job with it.
RELEASE_CALL = (
    "WITH owner AS (SELECT id FROM solidloop_loops WHERE id = %(loop_id)s FOR UPDATE) "
    "UPDATE solidloop_tool_calls SET lease_token = NULL, leased_until = NULL, "
    "lease_holder = NULL, updated_at = now() "
    "WHERE id = %(call_id)s AND lease_token = %(lease)s AND executed_at IS NULL "
    "AND EXISTS (SELECT 1 FROM owner) RETURNING id")

#: Both rows a tool call's outcome writes, locked in order: PostgreSQL locks a
#: joined row's tables in the order ``FOR UPDATE OF`` names them.
LOCK_CALL = (
    "SELECT 1 FROM solidloop_loops l JOIN solidloop_tool_calls c ON c.loop_id = l.id "
    "WHERE l.id = %(loop_id)s AND c.id = %(call_id)s FOR UPDATE OF l, c")

#: The calls of the answered call's message still unanswered, this one aside.
_UNANSWERED_BESIDE = ("FROM solidloop_tool_calls s WHERE s.message_id = %(message_id)s "
                      "AND s.response_message_id IS NULL AND s.id <> %(call_id)s")
#: What a call's outcome sets to record its canonical result (its lease stays
#: until its answer: a paused loop's call is recorded and answered later).
_RESULT_SET = (
    "result = %(result)s, is_success = %(is_success)s, error_kind = %(error_kind)s, "
    "executed_at = now(), duration_ms = %(duration_ms)s, "
    "metadata = coalesce(%(meta)s, metadata), ")
#: What a call's outcome sets when it answers the call: the answer, and the
#: lease released.
_ANSWER_SET = (
    "response_message_id = coalesce((SELECT id FROM answer), response_message_id), "
    "lease_token = CASE WHEN (SELECT answered FROM ok) THEN NULL ELSE lease_token END, "
    "lease_holder = CASE WHEN (SELECT answered FROM ok) THEN NULL ELSE lease_holder END, "
    "leased_until = CASE WHEN (SELECT answered FROM ok) THEN NULL ELSE leased_until END, ")


def _tool_outcome(record: bool, answer: bool, adopt: bool = False) -> str:
    """A tool call's outcome: its canonical result recorded (``record``), its
    tool message written (``answer``), or both in one statement.

    The checks, in the ``ok`` part, all here: the call is this job's, by its
    lease (``lease``) or, for a job that holds none, by the loop's generation
    (``token``); a result is recorded once (the call is not executed yet); a
    statement run alone (``alone``: without :data:`LOCK_CALL` first) is for a
    call without siblings. The answer is written while the loop runs and the
    call is unanswered; when it is the message's last, the next LLM turn is
    claimed for this thread (``adopt``; with its shell and its history as for
    :data:`CLAIM_TURN`) or the loop is requeued (its job is the caller's). Each
    of those two is its own text, so the hot one (adopting) plans only what it
    runs. When what is left unanswered only awaits decisions or results (in
    ``sequential`` mode: when the head of the line awaits one), the loop
    waits.

    Run alone, the statement's snapshot is taken before it waits for the row
    locks. The locked rows are read as they are now (``FOR UPDATE`` and
    ``UPDATE`` follow a row to its newest version), and the only other rows it
    reads are the siblings' answers (a call alone has none; which calls a
    message has never changes) and the history, whose writers all take the
    loop row first and, while this call is leased and unanswered, move the
    loop out of ``running`` or answer this call (then nothing is answered
    here). A call with siblings runs it after :data:`LOCK_CALL`, so its
    snapshot starts with both locks held and sees every sibling answered
    before; otherwise two siblings answered at once could each miss the
    other's answer, and neither claim the next turn.

    It returns one row: what the checks read (``solidloop_status``,
    ``solidloop_token``, ``solidloop_lease``, ``solidloop_executed``,
    ``solidloop_siblings``), whether it answered (``solidloop_answered``, NULL
    when the checks failed), the siblings still unanswered in order
    (``solidloop_remaining``), those that await (``solidloop_waiting``),
    whether the loop now waits (``solidloop_waited``), and whether it requeued
    (``solidloop_requeued``) or the claimed loop row with its shell and history
    (all NULL when no claim was made)."""
    answered = (f"status = {RUNNING} AND response_message_id IS NULL" if answer else "false")
    parts = [
        "WITH locked AS (SELECT l.status, l.execution_token, c.lease_token, "
        "c.executed_at IS NOT NULL AS executed, c.response_message_id, "
        "EXISTS (SELECT 1 FROM solidloop_tool_calls s WHERE s.message_id = c.message_id "
        "AND s.id <> c.id) AS siblings "
        "FROM solidloop_loops l JOIN solidloop_tool_calls c ON c.loop_id = l.id "
        "WHERE l.id = %(loop_id)s AND c.id = %(call_id)s FOR UPDATE OF l, c)",
        f"ok AS (SELECT {answered} AS answered FROM locked "
        "WHERE CASE WHEN %(lease)s::uuid IS NULL "
        f"THEN {OWNED} ELSE lease_token = %(lease)s END "
        + ("AND NOT executed " if record else "")
        + "AND NOT (%(alone)s AND siblings))",
    ]
    if answer:
        parts.append(
            "answer AS (INSERT INTO solidloop_messages (loop_id, role, content, tool_call_id, "
            "metadata) SELECT %(loop_id)s::bigint, 'tool', %(content)s::text, %(call_id)s::bigint, "
            "%(message_meta)s::jsonb "
            "FROM ok WHERE ok.answered RETURNING id, content, metadata, tool_call_id)")
    parts.append(
        "recorded AS (UPDATE solidloop_tool_calls SET "
        + (_RESULT_SET if record else "") + (_ANSWER_SET if answer else "")
        + "updated_at = now() WHERE id = %(call_id)s AND EXISTS (SELECT 1 FROM ok))")
    if record:
        parts.append(f"event AS ({tool_event('ok')})")
    selected = [
        "locked.status AS solidloop_status", "locked.execution_token AS solidloop_token",
        "locked.lease_token AS solidloop_lease", "locked.executed AS solidloop_executed",
        "locked.siblings AS solidloop_siblings",
        "(SELECT answered FROM ok) AS solidloop_answered"]
    if not answer:
        return (f"{', '.join(parts)} SELECT {', '.join(selected)} "
                "FROM (SELECT 1) AS one LEFT JOIN locked ON true")
    # The siblings still unanswered, and those of them that await a decision
    # or a result, read once (and only for a call that has siblings): the last
    # answer is the one that leaves none; one that leaves only awaiting calls
    # (or, in sequential mode, an awaiting call at the head of the line) leaves
    # the loop waiting.
    last = "(SELECT answered FROM ok) AND cardinality((SELECT ids FROM rest)) = 0"
    waits = ("(SELECT answered FROM ok) AND (SELECT cardinality(ids) > 0 AND ("
             "cardinality(ids) = cardinality(waiting) OR (%(sequential)s AND ids[1] = waiting[1])"
             ") FROM rest)")
    parts += [
        "rest AS (SELECT CASE WHEN siblings "
        f"THEN ARRAY(SELECT s.id {_UNANSWERED_BESIDE} ORDER BY s.position) "
        "ELSE '{}'::bigint[] END AS ids, CASE WHEN siblings "
        f"THEN ARRAY(SELECT s.id {_UNANSWERED_BESIDE} AND s.waits_for IS NOT NULL "
        "AND s.decision IS NULL ORDER BY s.position) "
        "ELSE '{}'::bigint[] END AS waiting FROM locked)",
        f"waited AS (UPDATE solidloop_loops SET status = {WAITING}, updated_at = now() "
        f"WHERE id = %(loop_id)s AND status = {RUNNING} AND {waits} RETURNING id)"]
    selected += ["(SELECT ids FROM rest) AS solidloop_remaining",
                 "(SELECT waiting FROM rest) AS solidloop_waiting",
                 "EXISTS (SELECT 1 FROM waited) AS solidloop_waited"]
    if not adopt:
        parts.append(f"requeued AS (UPDATE solidloop_loops SET {REQUEUE_SET} "
                     f"WHERE id = %(loop_id)s AND {last} RETURNING id)")
        selected.append("EXISTS (SELECT 1 FROM requeued) AS solidloop_requeued")
        return (f"{', '.join(parts)} SELECT {', '.join(selected)} FROM (SELECT 1) AS one "
                "LEFT JOIN locked ON true")
    parts += [
        f"claim AS (UPDATE solidloop_loops SET {CLAIM_SET} WHERE id = %(loop_id)s "
        f"AND {last} {CLAIM_RETURNING})",
        # The shell is made from the answer's row too, so its id is drawn after
        # the answer's: a conversation is ordered by message id, and the parts
        # of one statement otherwise run in no given order.
        shell_part("claim, answer"),
    ]
    # The history as the statement began, and the answer it adds.
    history = history_json(
        f"{HISTORY_ROWS} UNION ALL SELECT false, a.id, 'tool', a.content, NULL, a.metadata, "
        "a.tool_call_id, NULL, NULL, a.id FROM answer a")
    selected += [
        "claim.*", SHELL_SELECTED,
        f"CASE WHEN %(read_history)s AND claim.id IS NOT NULL THEN {history} END "
        "AS solidloop_history"]
    return (f"{', '.join(parts)} SELECT {', '.join(selected)} FROM (SELECT 1) AS one "
            "LEFT JOIN locked ON true LEFT JOIN claim ON true LEFT JOIN shell ON true")


#: By (record, answer, adopt): the checkpoint alone, the answer alone (a call
#: whose result was recorded before), or both; an answer claims the next turn
#: for its thread (``adopt``) or requeues the loop.
TOOL_OUTCOME = {(record, answer, adopt): _tool_outcome(record, answer, adopt)
                for record, answer, adopt in (
                    (True, False, False), (False, True, False), (False, True, True),
                    (True, True, False), (True, True, True))}


#: The stored MCP session of the loop's server, kept current.
STORE_MCP_SESSION = (
    "UPDATE solidloop_mcp_sessions SET session_state = %(session_state)s, updated_at = now() "
    "WHERE loop_id = %(loop_id)s AND server_name IS NOT DISTINCT FROM %(server)s")
