"""Every statement that writes loop state, and the reads those writes embed,
each named once (the broker's statements are in queue/sql.py).

Only loops/store/ runs these (loops/queries.py runs the history read). A fence
is written here, once, and every statement that needs it is composed from it
below, at import; nothing composes SQL at run time. Optional parts of a fused
statement are switched by a boolean parameter (``WHERE %(open_shell)s``, ``CASE
WHEN %(read_history)s THEN ...``): the statement stays one text, prepared once
per connection, and PostgreSQL skips a part whose switch is off (a gated
``INSERT ... SELECT`` inserts nothing; a subquery in a ``CASE`` arm not taken
never runs). tests/unit/loop_sql.txt holds every statement as rendered, so a
change to one shows in review (tests/unit/test_loop_sql.py).

Parameters, with one meaning everywhere: ``loop_id``; ``call_id`` (a tool
call's row id); ``token`` (the generation the writer holds); ``new_token`` and
``ttl`` and ``holder`` (a claim: the new generation, the lease's length, the
worker process); ``lease`` (a tool call's lease); ``shell_id``; ``message_id``
(the assistant message whose calls are answered).

Lock order, everywhere: the loop row first, then a tool call's.
"""

from __future__ import annotations

from ..models import Message, ToolCall
from ..models.loop import LoopStatus
from ..queue import sql as jobs_sql


def _quoted(status: LoopStatus) -> str:
    return f"'{status.value}'"


QUEUED = _quoted(LoopStatus.QUEUED)
RUNNING = _quoted(LoopStatus.RUNNING)
PAUSED = _quoted(LoopStatus.PAUSED)
COMPLETED = _quoted(LoopStatus.COMPLETED)
FAILED = _quoted(LoopStatus.FAILED)
TERMINAL = f"({COMPLETED}, {FAILED})"

#: The NOTIFY channel the admin's live stream LISTENs on (admin/live.py); the
#: payload is ``<loop_id>:<message_id>``. NOTIFY is transactional: it is
#: delivered when, and only if, the write it announces commits.
LIVE_CHANNEL = "solidloop_live"

#: Candidates one heal handles per pass.
HEAL_BATCH = 500


# -- fences and shared parts ---------------------------------------------------------

#: The generation fence: the loop runs under the writer's generation.
OWNED = f"status = {RUNNING} AND execution_token = %(token)s"

#: What claiming an LLM turn writes on the loop row: a new generation and an
#: LLM lease, stamped by the database clock (never a worker's).
_CLAIM_SET = (
    f"status = {RUNNING}, execution_token = %(new_token)s, "
    "lease_expires_at = now() + %(ttl)s, lease_holder = %(holder)s, "
    "started_at = coalesce(started_at, now()), "
    "run_started_at = coalesce(run_started_at, now()), updated_at = now()")
#: A claim returns the loop's row whole, and the run's elapsed seconds.
_CLAIM_RETURNING = "RETURNING *, extract(epoch FROM now() - run_started_at) AS run_elapsed"

#: A loop queued for its next LLM turn (its job is the caller's, in the same commit).
REQUEUE_SET = (
    f"status = {QUEUED}, queued_at = now(), execution_token = NULL, "
    "lease_expires_at = NULL, lease_holder = NULL, updated_at = now()")

#: What leaving ``running`` (or ``queued``) writes besides the new status.
_EXIT_SET = (
    "execution_token = NULL, lease_expires_at = NULL, lease_holder = NULL, "
    f"finished_at = CASE WHEN %(to)s::varchar IN {TERMINAL} THEN now() ELSE finished_at END, "
    "updated_at = now()")


#: A shell failed and hidden: its partial never enters the history.
_HIDDEN_SET = "status = 'failed', is_hidden = true, updated_at = now()"


def _hide_shells(loops: str) -> str:
    """Fail and hide the ``processing`` shells of the loops ``loops`` selects."""
    return (f"UPDATE solidloop_messages SET {_HIDDEN_SET} "
            f"WHERE loop_id IN ({loops}) AND status = 'processing'")


SHELL_COLUMNS = tuple(column.name for column in Message.__table__.columns)
CALL_COLUMNS = tuple(column.name for column in ToolCall.__table__.columns)
#: A shell written by a statement that claims its turn, as ``shell_<column>``.
_SHELL_SELECTED = ", ".join(f'shell.{column} AS "shell_{column}"' for column in SHELL_COLUMNS)


def _insert_shell(loop: str) -> str:
    """A turn's hidden ``processing`` assistant message (its shell), one per row
    of the loop ``loop`` names, from the ``FROM`` and ``WHERE`` that follow."""
    return ("INSERT INTO solidloop_messages (loop_id, role, content, status, is_hidden) "
            f"SELECT {loop}, 'assistant', '', 'processing', true")


def _shell(sources: str) -> str:
    """The ``shell`` part of a statement whose ``claim`` part claimed a turn: the
    turn's shell, when ``%(open_shell)s``."""
    return f"shell AS ({_insert_shell('claim.id')} FROM {sources} WHERE %(open_shell)s RETURNING *)"


def _llm_event(source: str) -> str:
    """A turn's ``llm_request`` wire event, one row per row of ``source``; none
    when ``%(payload)s`` is NULL (the turn has no wire record)."""
    return ("INSERT INTO solidloop_events (loop_id, message_id, kind, status_code, "
            "duration_ms, error, payload) SELECT %(loop_id)s::bigint, %(shell_id)s::bigint, "
            "'llm_request', %(status_code)s::integer, %(duration_ms)s::float8, %(error)s::text, "
            f"%(payload)s::jsonb FROM {source} WHERE %(payload)s::jsonb IS NOT NULL")


def _tool_event(source: str) -> str:
    """A call's ``tool_call`` wire event, one row per row of ``source``."""
    return ("INSERT INTO solidloop_events (loop_id, tool_call_id, kind, duration_ms, error, "
            "payload) SELECT %(loop_id)s::bigint, %(call_id)s::bigint, 'tool_call', "
            f"%(duration_ms)s::float8, %(error)s::text, %(payload)s::jsonb FROM {source}")


# -- the history (read by loops/queries.py, and by the claims below) --------------------

#: The rows of a loop's history: its tool calls first (they name the messages
#: that asked for them), then its visible, completed messages, each as
#: (is_call, id, role, text, reasoning, metadata, ref, name, arguments_raw,
#: sort_key), read in :data:`HISTORY_ORDER` (loops/queries.history_from_rows).
HISTORY_ROWS = (
    "SELECT true AS is_call, id, NULL AS role, call_id AS text, NULL AS reasoning, "
    "NULL::jsonb AS metadata, message_id AS ref, name, arguments_raw, position AS sort_key "
    "FROM solidloop_tool_calls WHERE loop_id = %(loop_id)s "
    "UNION ALL "
    "SELECT false, id, role, content, reasoning, metadata, tool_call_id, NULL, NULL, id "
    "FROM solidloop_messages "
    "WHERE loop_id = %(loop_id)s AND NOT is_hidden AND status = 'completed'")
HISTORY_ORDER = "is_call DESC, sort_key"
#: A loop's history (loops/queries.history).
HISTORY = f"{HISTORY_ROWS} ORDER BY {HISTORY_ORDER}"


def _history_json(rows: str) -> str:
    """``rows`` as one JSON array in :data:`HISTORY_ORDER`: the history read by a
    statement along with its own writes."""
    return ("(SELECT json_agg(json_build_array(h.is_call, h.id, h.role, h.text, h.reasoning, "
            "h.metadata, h.ref, h.name, h.arguments_raw, h.sort_key) "
            f"ORDER BY {HISTORY_ORDER}) FROM ({rows}) AS h)")


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
    f"claim AS (UPDATE solidloop_loops SET {_CLAIM_SET} WHERE id = %(loop_id)s "
    f"AND status = {QUEUED} AND xmin = (SELECT xmin FROM seen) {_CLAIM_RETURNING}), "
    "job AS ({} RETURNING id), ".format(
        jobs_sql.MARK_DONE_WHEN.format(condition="AND EXISTS (SELECT 1 FROM claim)"))
    + f"{_shell('claim')} "
    f"SELECT claim.*, {_SHELL_SELECTED}, CASE WHEN %(read_history)s "
    f"THEN {_history_json(HISTORY_ROWS)} END AS solidloop_history "
    "FROM claim LEFT JOIN shell ON true")

#: A turn's shell on its own (a stack that runs host middlewares between its
#: initialization and its request), fenced on the generation under the row lock.
OPEN_SHELL = (f"{_insert_shell('id')} FROM solidloop_loops "
              f"WHERE id = %(loop_id)s AND {OWNED} FOR UPDATE RETURNING *")

#: A streaming turn's text so far, onto its still-hidden shell, announced to
#: the admin's live stream.
RECORD_PARTIAL = (
    "WITH partial AS (UPDATE solidloop_messages SET content = %(content)s, "
    "reasoning = %(reasoning)s, updated_at = now() "
    "WHERE id = %(shell_id)s AND status = 'processing' RETURNING loop_id, id) "
    f"SELECT pg_notify('{LIVE_CHANNEL}', loop_id::text || ':' || id::text) FROM partial")

#: The tools a remote server listed for the loop for the first time (the first
#: writer wins).
RECORD_SNAPSHOT = (
    "INSERT INTO solidloop_mcp_sessions (loop_id, server_name, tools, session_state) "
    "VALUES (%(loop_id)s, %(server)s, %(tools)s, %(session_state)s) "
    "ON CONFLICT (loop_id, server_name) DO NOTHING")

def _finish_turn(with_calls: bool) -> str:
    """The turn's end, one statement: the fenced loop update (the row lock and
    the fence at once), the shell finalized with usage and cost, and the wire
    event (none when ``payload`` is NULL). The other parts write only when the
    fence matched. Without calls the loop completes; with them (``with_calls``:
    each column an array parameter, in order; the first leased to this thread
    when ``lease`` is set: an adopted call) it enters its tool phase under the
    same generation, and the statement returns the calls' ids in order
    (``solidloop_call_ids``) and the first call's row (``call_<column>``), which
    an adopted call's step starts from. Two texts rather than one with a
    switch: the turn's end is a statement of every turn, and each text then
    plans only the parts it runs."""
    completes = "" if with_calls else (
        f"status = {COMPLETED}, execution_token = NULL, finished_at = now(), "
        "error_message = NULL, ")
    parts = [
        "fenced AS (UPDATE solidloop_loops SET step_count = step_count + 1, "
        "lease_holder = NULL, lease_expires_at = NULL, updated_at = now(), "
        "input_tokens = input_tokens + coalesce(%(input_tokens)s::bigint, 0), "
        "output_tokens = output_tokens + coalesce(%(output_tokens)s::bigint, 0), "
        f"{completes}cost = cost + coalesce(%(cost)s::numeric, 0) "
        f"WHERE id = %(loop_id)s AND {OWNED} "
        f"RETURNING *, pg_notify('{LIVE_CHANNEL}', %(live)s))",
        "shell AS (UPDATE solidloop_messages SET content = %(content)s, "
        "reasoning = %(reasoning)s, finish_reason = %(finish_reason)s, status = 'completed', "
        "is_hidden = false, completed_at = now(), metadata = %(message_meta)s, "
        "usage = coalesce(%(usage)s, usage), cost = coalesce(%(message_cost)s, cost), "
        "updated_at = now() WHERE id = %(shell_id)s AND EXISTS (SELECT 1 FROM fenced))",
        f"event AS ({_llm_event('fenced')})",
    ]
    if not with_calls:
        return f"WITH {', '.join(parts)} SELECT * FROM fenced"
    parts.append(
        "calls AS (INSERT INTO solidloop_tool_calls (loop_id, message_id, position, call_id, "
        "name, server_name, tool_name, arguments_raw, arguments, metadata, lease_token, "
        "lease_holder, leased_until) SELECT fenced.id, %(shell_id)s, c.n - 1, c.call_id, "
        "c.name, c.server_name, c.tool_name, c.arguments_raw, c.arguments, c.metadata, "
        "CASE WHEN c.n = 1 THEN %(lease)s::uuid END, "
        "CASE WHEN c.n = 1 AND %(lease)s::uuid IS NOT NULL THEN %(holder)s END, "
        "CASE WHEN c.n = 1 AND %(lease)s::uuid IS NOT NULL THEN now() + %(ttl)s::interval END "
        "FROM fenced, unnest(%(call_ids)s::varchar[], %(call_names)s::varchar[], "
        "%(call_servers)s::varchar[], %(call_tools)s::varchar[], %(call_raws)s::text[], "
        "%(call_arguments)s::jsonb[], %(call_metas)s::jsonb[]) WITH ORDINALITY "
        "AS c(call_id, name, server_name, tool_name, arguments_raw, arguments, metadata, n) "
        "RETURNING *)")
    first = ", ".join(f'first.{column} AS "call_{column}"' for column in CALL_COLUMNS)
    return (f"WITH {', '.join(parts)} SELECT fenced.*, "
            "ARRAY(SELECT id FROM calls ORDER BY position) AS solidloop_call_ids, "
            f"{first} FROM fenced, (SELECT * FROM calls ORDER BY position LIMIT 1) AS first")


#: By whether the turn ends with tool calls.
FINISH_TURN = {with_calls: _finish_turn(with_calls) for with_calls in (False, True)}

#: A running loop leaves ``running`` on the writer's generation: a limit
#: pauses it, an error fails it (``to``). Its shells are failed and hidden, and
#: the turn's wire event recorded (none when ``payload`` is NULL). A tool turn
#: that fails the loop passes its call's ``lease`` too (NULL for an LLM turn,
#: or a tool job that holds none): the call must still be that lease's.
END_TURN = (
    "WITH ended AS (UPDATE solidloop_loops SET status = %(to)s::varchar, "
    f"error_message = %(error_message)s, {_EXIT_SET} WHERE id = %(loop_id)s AND {OWNED} "
    "AND (%(lease)s::uuid IS NULL OR EXISTS (SELECT 1 FROM solidloop_tool_calls "
    "WHERE id = %(call_id)s AND lease_token = %(lease)s)) RETURNING id), "
    f"hidden AS ({_hide_shells('SELECT id FROM ended')}), "
    f"event AS ({_llm_event('ended')}) "
    "SELECT id FROM ended")

#: A claimed LLM turn given back to the queue (the worker is stopping, or the
#: database failed before the request), if the generation is still the
#: writer's; its shells hidden. The caller enqueues the turn's job with it.
REQUEUE_TURN = (
    f"WITH requeued AS (UPDATE solidloop_loops SET {REQUEUE_SET} "
    f"WHERE id = %(loop_id)s AND {OWNED} RETURNING id), "
    f"hidden AS ({_hide_shells('SELECT id FROM requeued')}) "
    "SELECT id FROM requeued")

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


# -- the tool turn --------------------------------------------------------------------

#: A delivered tool job's claim of its call: under the loop row lock and the
#: generation fence, a fresh lease on an unexecuted call nobody holds (or whose
#: lease lapsed); or, for a job the reaper queued with the lease it minted
#: (``reaper_lease``), that lease, if it is still the call's. The call's new
#: lease columns come back.
CLAIM_CALL = (
    f"WITH owner AS (SELECT id FROM solidloop_loops WHERE id = %(loop_id)s AND {OWNED} "
    "FOR UPDATE) "
    "UPDATE solidloop_tool_calls "
    "SET lease_token = coalesce(%(reaper_lease)s::uuid, %(lease)s::uuid), "
    "lease_holder = %(holder)s, updated_at = now(), "
    "leased_until = CASE WHEN %(reaper_lease)s::uuid IS NULL THEN now() + %(ttl)s "
    "ELSE leased_until END "
    "WHERE id = %(call_id)s AND executed_at IS NULL AND EXISTS (SELECT 1 FROM owner) "
    "AND CASE WHEN %(reaper_lease)s::uuid IS NULL "
    "THEN lease_token IS NULL OR leased_until < now() "
    "ELSE lease_token = %(reaper_lease)s END "
    "RETURNING lease_token, lease_holder, leased_until, updated_at")

#: The next call of a sequential line, leased to this thread (adopted) in the
#: commit that answers its predecessor: compare-and-set on an unleased,
#: unexecuted call. Its row comes back whole.
ADOPT_CALL = (
    "UPDATE solidloop_tool_calls SET lease_token = %(lease)s, lease_holder = %(holder)s, "
    "leased_until = now() + %(ttl)s, updated_at = now() "
    "WHERE id = %(call_id)s AND executed_at IS NULL AND lease_token IS NULL RETURNING *")

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
    runs.

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
    (``solidloop_remaining``), and whether it requeued (``solidloop_requeued``)
    or the claimed loop row with its shell and history (all NULL when no claim
    was made)."""
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
        parts.append(f"event AS ({_tool_event('ok')})")
    selected = [
        "locked.status AS solidloop_status", "locked.execution_token AS solidloop_token",
        "locked.lease_token AS solidloop_lease", "locked.executed AS solidloop_executed",
        "locked.siblings AS solidloop_siblings",
        "(SELECT answered FROM ok) AS solidloop_answered"]
    if not answer:
        return (f"{', '.join(parts)} SELECT {', '.join(selected)} "
                "FROM (SELECT 1) AS one LEFT JOIN locked ON true")
    # The siblings still unanswered, read once (and only for a call that has
    # siblings): the last answer is the one that leaves none.
    last = "(SELECT answered FROM ok) AND cardinality((SELECT ids FROM rest)) = 0"
    parts.append(
        "rest AS (SELECT CASE WHEN (SELECT siblings FROM locked) "
        f"THEN ARRAY(SELECT s.id {_UNANSWERED_BESIDE} ORDER BY s.position) "
        "ELSE '{}'::bigint[] END AS ids)")
    selected.append("(SELECT ids FROM rest) AS solidloop_remaining")
    if not adopt:
        parts.append(f"requeued AS (UPDATE solidloop_loops SET {REQUEUE_SET} "
                     f"WHERE id = %(loop_id)s AND {last} RETURNING id)")
        selected.append("EXISTS (SELECT 1 FROM requeued) AS solidloop_requeued")
        return (f"{', '.join(parts)} SELECT {', '.join(selected)} FROM (SELECT 1) AS one "
                "LEFT JOIN locked ON true")
    parts += [
        f"claim AS (UPDATE solidloop_loops SET {_CLAIM_SET} WHERE id = %(loop_id)s "
        f"AND {last} {_CLAIM_RETURNING})",
        # The shell is made from the answer's row too, so its id is drawn after
        # the answer's: a conversation is ordered by message id, and the parts
        # of one statement otherwise run in no given order.
        _shell("claim, answer"),
    ]
    # The history as the statement began, and the answer it adds.
    history = _history_json(
        f"{HISTORY_ROWS} UNION ALL SELECT false, a.id, 'tool', a.content, NULL, a.metadata, "
        "a.tool_call_id, NULL, NULL, a.id FROM answer a")
    selected += [
        "claim.*", _SHELL_SELECTED,
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


# -- the host's commands ---------------------------------------------------------------

#: A host-driven exit (pause, stop, force stop, freeze) from one of ``from`` to
#: ``to``, with no fence (the host outranks any generation): the error text
#: when ``error_message`` is given, the loop frozen when ``freeze``, its shells
#: hidden, and, when ``revoke_leases``, its unexecuted calls' leases revoked
#: (their workers' results will not be recorded).
LEAVE = (
    "WITH left_ AS (UPDATE solidloop_loops SET status = %(to)s::varchar, "
    "error_message = coalesce(%(error_message)s, error_message), "
    f"frozen = frozen OR %(freeze)s, {_EXIT_SET} "
    "WHERE id = %(loop_id)s AND status = ANY(%(from)s::text[]) RETURNING id), "
    f"hidden AS ({_hide_shells('SELECT id FROM left_')}), "
    "revoked AS (UPDATE solidloop_tool_calls SET lease_token = NULL, leased_until = NULL, "
    "updated_at = now() WHERE loop_id IN (SELECT id FROM left_) AND %(revoke_leases)s "
    "AND executed_at IS NULL) "
    "SELECT id FROM left_")

#: The frozen flag of a loop that stays where it is (paused, init); or lifted.
SET_FROZEN = ("UPDATE solidloop_loops SET frozen = %(frozen)s, updated_at = now() "
              "WHERE id = %(loop_id)s AND frozen <> %(frozen)s RETURNING id")

#: Whether someone watches the loop live (the admin).
SET_OBSERVED = ("UPDATE solidloop_loops SET observed = %(observed)s, updated_at = now() "
                "WHERE id = %(loop_id)s AND observed <> %(observed)s RETURNING id")

#: The loop's shells, failed and hidden (a resume starts clean).
HIDE_SHELLS = _hide_shells("%(loop_id)s")

#: What a resume resets: limits apply per run, and the next claim starts the clock.
_RESUME_SET = ("error_message = NULL, finished_at = NULL, run_started_at = NULL, "
               "run_step_base = step_count")
#: A resumed loop queued for its next LLM turn (the caller enqueues its job).
RESUME_TO_TURN = f"UPDATE solidloop_loops SET {REQUEUE_SET}, {_RESUME_SET} WHERE id = %(loop_id)s"
#: A resumed loop back in its tool phase under a new generation (the caller
#: enqueues the calls' jobs).
RESUME_TO_CALLS = (
    f"UPDATE solidloop_loops SET status = {RUNNING}, execution_token = %(new_token)s, "
    f"lease_expires_at = NULL, lease_holder = NULL, updated_at = now(), {_RESUME_SET} "
    "WHERE id = %(loop_id)s")

#: Of a resumed tool phase's calls (``call_ids``, in order): each one's id and
#: whether a live worker still runs it (it answers under the new generation
#: itself); every other unexecuted call's lease is revoked, for a new job.
REVOKE_IDLE_LEASES = (
    "WITH calls AS (SELECT id, position, executed_at IS NULL AND lease_token IS NOT NULL "
    "AND leased_until > now() AS live FROM solidloop_tool_calls "
    "WHERE id = ANY(%(call_ids)s::bigint[])), "
    "revoked AS (UPDATE solidloop_tool_calls t SET lease_token = NULL, leased_until = NULL, "
    "lease_holder = NULL, updated_at = now() FROM calls "
    "WHERE t.id = calls.id AND NOT calls.live AND t.executed_at IS NULL) "
    "SELECT id, live FROM calls ORDER BY position")

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


# -- the reaper's repairs ----------------------------------------------------------------
#
# Each selects its candidates with FOR UPDATE SKIP LOCKED and changes them in
# the same statement, so reapers racing on one loop resolve to one repair; the
# caller enqueues the jobs each repair implies in the same commit.

#: A loop has a live job.
_LIVE_JOB = ("EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = l.id "
             "AND j.state IN ('queued', 'running'))")
#: A job is already queued for the call (a reclaim waiting behind a backlog): it
#: adopts or re-claims the lease when it runs, so minting another would churn.
_LIVE_CALL_JOB = ("EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = t.loop_id "
                  "AND j.state IN ('queued', 'running') "
                  "AND j.actor_name = 'solidloop.tool_call' "
                  "AND j.message->'args'->>0 = t.id::text)")

#: Running loops whose LLM lease expired.
EXPIRED_LLM = (
    f"SELECT l.id FROM solidloop_loops l WHERE l.status = {RUNNING} "
    "AND l.lease_expires_at < now() ORDER BY l.lease_expires_at "
    f"LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")
#: Tool phases with nothing left to answer and no live job.
STUCK_TOOL_PHASE = (
    f"SELECT l.id FROM solidloop_loops l WHERE l.status = {RUNNING} "
    "AND l.lease_expires_at IS NULL "
    "AND l.updated_at < now() - make_interval(secs => %(grace)s) "
    "AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls t WHERE t.loop_id = l.id "
    f"AND t.response_message_id IS NULL) AND NOT {_LIVE_JOB} "
    f"LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")
#: Queued loops with no live job (a dead-lettered one, say).
STUCK_QUEUED = (
    f"SELECT l.id FROM solidloop_loops l WHERE l.status = {QUEUED} "
    "AND l.queued_at < now() - make_interval(secs => %(grace)s) "
    f"AND NOT {_LIVE_JOB} LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")


def _requeue_picked(picked: str) -> str:
    """Requeue the loops ``picked`` selects (their generation rotated away, their
    shells hidden) and return their ids."""
    return (f"WITH picked AS ({picked}), "
            f"requeued AS (UPDATE solidloop_loops l SET {REQUEUE_SET} FROM picked "
            "WHERE l.id = picked.id RETURNING l.id), "
            f"hidden AS ({_hide_shells('SELECT id FROM requeued')}) "
            "SELECT id FROM requeued")


#: Expired LLM leases: the turn goes back to the queue.
HEAL_EXPIRED_LLM = _requeue_picked(EXPIRED_LLM)
#: A tool phase with nothing left to answer: the next LLM turn.
HEAL_STUCK_TOOL_PHASE = _requeue_picked(STUCK_TOOL_PHASE)
#: Queued loops with no live job: touched (their age starts over) for a new job.
HEAL_STUCK_QUEUED = (
    f"WITH picked AS ({STUCK_QUEUED}) "
    "UPDATE solidloop_loops l SET updated_at = now(), queued_at = now() FROM picked "
    "WHERE l.id = picked.id RETURNING l.id")
#: Unexecuted calls whose lease lapsed while their loop runs: a fresh lease
#: (compare-and-set on the old one) for a new job, so healthy siblings are not
#: fenced. Returns each call's id, loop, new lease and the loop's generation.
HEAL_STALLED_TOOLS = (
    "WITH picked AS (SELECT t.id, t.lease_token, t.loop_id, l.execution_token "
    "FROM solidloop_tool_calls t JOIN solidloop_loops l ON l.id = t.loop_id "
    "WHERE t.response_message_id IS NULL AND t.executed_at IS NULL "
    "AND t.lease_token IS NOT NULL AND t.leased_until < now() "
    f"AND l.status = {RUNNING} AND NOT {_LIVE_CALL_JOB} "
    f"ORDER BY t.leased_until LIMIT {HEAL_BATCH} FOR UPDATE OF l SKIP LOCKED), "
    "minted AS (UPDATE solidloop_tool_calls t SET lease_token = gen_random_uuid(), "
    "lease_holder = NULL, updated_at = now(), leased_until = now() + %(ttl)s "
    "FROM picked WHERE t.id = picked.id AND t.lease_token = picked.lease_token "
    "AND t.executed_at IS NULL RETURNING t.id, t.lease_token) "
    "SELECT minted.id, picked.loop_id, minted.lease_token, picked.execution_token "
    "FROM minted JOIN picked ON picked.id = minted.id ORDER BY minted.id")
#: Calls of a running tool phase that nobody holds (no lease, or executed and
#: waiting for its answer) while the loop has no live job at all: their job was
#: lost. A sibling running under a live lease means the phase is in hand (in
#: sequential mode the calls behind the head wait for it by design).
DROPPED_TOOLS = (
    "SELECT t.id, t.loop_id, l.execution_token "
    "FROM solidloop_tool_calls t JOIN solidloop_loops l ON l.id = t.loop_id "
    "WHERE t.response_message_id IS NULL "
    "AND (t.lease_token IS NULL OR t.executed_at IS NOT NULL) "
    f"AND l.status = {RUNNING} AND l.lease_expires_at IS NULL "
    "AND t.updated_at < now() - make_interval(secs => %(grace)s) "
    f"AND NOT {_LIVE_JOB} "
    "AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls s WHERE s.loop_id = t.loop_id "
    "AND s.response_message_id IS NULL AND s.executed_at IS NULL "
    "AND s.lease_token IS NOT NULL AND s.leased_until >= now()) "
    f"ORDER BY t.loop_id, t.position LIMIT {HEAL_BATCH} FOR UPDATE OF l SKIP LOCKED")
#: A dropped call about to get a new job: its age starts over.
TOUCH_CALLS = ("UPDATE solidloop_tool_calls SET updated_at = now() "
               "WHERE id = ANY(%(call_ids)s::bigint[])")
#: ``processing`` shells of loops that are not running: failed and hidden.
HEAL_ORPHAN_SHELLS = (
    f"UPDATE solidloop_messages m SET {_HIDDEN_SET} "
    "WHERE m.id IN (SELECT m2.id FROM solidloop_messages m2 "
    "JOIN solidloop_loops l ON l.id = m2.loop_id "
    f"WHERE m2.status = 'processing' AND l.status <> {RUNNING} LIMIT {HEAL_BATCH}) "
    "RETURNING m.id")

#: Every statement of this module by name (tests render and prepare each).
STATEMENTS: dict[str, str] = {
    name: value for name, value in list(globals().items())
    if name.isupper() and isinstance(value, str) and (
        "SELECT" in value or "UPDATE" in value or "INSERT" in value)
    and not name.startswith("_") and name not in ("HISTORY_ROWS",)
} | {f"FINISH_TURN[with_calls={c}]": text for c, text in FINISH_TURN.items()} | {
    f"TOOL_OUTCOME[record={r}, answer={a}, adopt={d}]": text
    for (r, a, d), text in TOOL_OUTCOME.items()}
