"""What the loop statements share: the statuses as SQL, the generation fence,
the fragments several statements are composed from, and the history read."""

from __future__ import annotations

from ...models import Message, ToolCall
from ...models.loop import LoopStatus


def _quoted(status: LoopStatus) -> str:
    return f"'{status.value}'"


QUEUED = _quoted(LoopStatus.QUEUED)
RUNNING = _quoted(LoopStatus.RUNNING)
PAUSED = _quoted(LoopStatus.PAUSED)
WAITING = _quoted(LoopStatus.WAITING)
COMPLETED = _quoted(LoopStatus.COMPLETED)
FAILED = _quoted(LoopStatus.FAILED)
TERMINAL = f"({COMPLETED}, {FAILED})"

#: Candidates one heal handles per pass.
HEAL_BATCH = 500


# -- fences and shared parts ---------------------------------------------------------

#: The generation fence: the loop runs under the writer's generation.
OWNED = f"status = {RUNNING} AND execution_token = %(token)s"
#: A tool call that waits for a decision or a result it has not had yet.
AWAITING = "waits_for IS NOT NULL AND decision IS NULL"

#: What claiming an LLM turn writes on the loop row: a new generation and an
#: LLM lease, stamped by the database clock (never a worker's).
CLAIM_SET = (
    f"status = {RUNNING}, execution_token = %(new_token)s, "
    "lease_expires_at = now() + %(ttl)s, lease_holder = %(holder)s, "
    "started_at = coalesce(started_at, now()), "
    "run_started_at = coalesce(run_started_at, now()), updated_at = now()")
#: A claim returns the loop's row whole, and the run's elapsed seconds.
CLAIM_RETURNING = "RETURNING *, extract(epoch FROM now() - run_started_at) AS run_elapsed"

#: What ends a provider outage's hold on a loop (a turn's end, a resume).
PROVIDER_WAIT_CLEARED = ("provider_wait_since = NULL, provider_wait_attempts = 0, "
                         "provider_wait_error = NULL")

#: A loop queued for its next LLM turn (its job is the caller's, in the same commit).
REQUEUE_SET = (
    f"status = {QUEUED}, queued_at = now(), execution_token = NULL, "
    "lease_expires_at = NULL, lease_holder = NULL, updated_at = now()")

#: What leaving ``running`` (or ``queued``) writes besides the new status.
EXIT_SET = (
    "execution_token = NULL, lease_expires_at = NULL, lease_holder = NULL, "
    f"finished_at = CASE WHEN %(to)s::varchar IN {TERMINAL} THEN now() ELSE finished_at END, "
    "updated_at = now()")


#: A shell failed and hidden: its partial never enters the history.
HIDDEN_SET = "status = 'failed', is_hidden = true, updated_at = now()"


def hide_shells(loops: str) -> str:
    """Fail and hide the ``processing`` shells of the loops ``loops`` selects."""
    return (f"UPDATE solidloop_messages SET {HIDDEN_SET} "
            f"WHERE loop_id IN ({loops}) AND status = 'processing'")


SHELL_COLUMNS = tuple(column.name for column in Message.__table__.columns)
CALL_COLUMNS = tuple(column.name for column in ToolCall.__table__.columns)
#: A shell written by a statement that claims its turn, as ``shell_<column>``.
SHELL_SELECTED = ", ".join(f'shell.{column} AS "shell_{column}"' for column in SHELL_COLUMNS)


def insert_shell(loop: str) -> str:
    """A turn's hidden ``processing`` assistant message (its shell), one per row
    of the loop ``loop`` names, from the ``FROM`` and ``WHERE`` that follow."""
    return ("INSERT INTO solidloop_messages (loop_id, role, content, status, is_hidden) "
            f"SELECT {loop}, 'assistant', '', 'processing', true")


def shell_part(sources: str) -> str:
    """The ``shell`` part of a statement whose ``claim`` part claimed a turn: the
    turn's shell, when ``%(open_shell)s``."""
    return f"shell AS ({insert_shell('claim.id')} FROM {sources} WHERE %(open_shell)s RETURNING *)"


def llm_event(source: str) -> str:
    """A turn's ``llm_request`` wire event, written once per row of ``source``
    (the fenced write that ends the turn), as two parts: ``event`` inserts it
    whole (none when ``%(payload)s`` is NULL: the turn has no wire record),
    when the turn recorded no request before sending it (``%(event_id)s``
    NULL: a stack whose own step made the request); ``answered`` answers the
    row recorded before the request (:data:`RECORD_REQUEST`) with a row of
    ``solidloop_llm_answers``: the response, the attempts and the timings
    (``%(answer)s``; NULL when there is none: the record keeps its request
    alone), the status, the error, and the duration (without one, the
    database's time since the request was recorded). The request's row is
    not written again (an update would write the whole request a second
    time: migration 0027). A request answered already (or inserted whole,
    with its duration) is left as it is."""
    return (
        "event AS (INSERT INTO solidloop_events (loop_id, message_id, kind, status_code, "
        "duration_ms, error, payload) SELECT %(loop_id)s::bigint, %(shell_id)s::bigint, "
        "'llm_request', %(status_code)s::integer, %(duration_ms)s::float8, %(error)s::text, "
        f"%(payload)s::jsonb FROM {source} WHERE %(payload)s::jsonb IS NOT NULL "
        "AND %(event_id)s::bigint IS NULL), "
        "answered AS (INSERT INTO solidloop_llm_answers (event_id, status_code, duration_ms, "
        "error, answer) SELECT r.id, %(status_code)s::integer, coalesce(%(duration_ms)s::float8, "
        "1000 * extract(epoch FROM clock_timestamp() - r.created_at)), %(error)s::text, "
        "coalesce(%(answer)s::jsonb, '{}'::jsonb) FROM solidloop_events r "
        "WHERE r.id = %(event_id)s::bigint AND r.duration_ms IS NULL "
        f"AND EXISTS (SELECT 1 FROM {source}) ON CONFLICT (event_id) DO NOTHING)")


def request_pending(event: str) -> str:
    """The condition on an ``llm_request`` row (alias ``event``) recorded before
    its request was sent and not answered yet: no duration of its own (every
    row inserted whole has one: the send path times every request, failed
    ones too) and no answer (:func:`llm_event`)."""
    return (f"{event}.duration_ms IS NULL AND NOT EXISTS "
            f"(SELECT 1 FROM solidloop_llm_answers a WHERE a.event_id = {event}.id)")


def tool_event(source: str, loop: str = "%(loop_id)s::bigint") -> str:
    """A call's ``tool_call`` wire event, one row per row of ``source`` (``loop``:
    the loop's id, a parameter unless a column of ``source`` names it)."""
    return ("INSERT INTO solidloop_events (loop_id, tool_call_id, kind, duration_ms, error, "
            f"payload) SELECT {loop}, %(call_id)s::bigint, 'tool_call', "
            f"%(duration_ms)s::float8, %(error)s::text, %(payload)s::jsonb FROM {source}")


# -- the history (read by loops/queries.py, and by the claims below) --------------------

#: The rows of a loop's history: its tool calls first (they name the messages
#: that asked for them), then its visible, completed messages that no summary
#: replaced, each as (is_call, id, role, text, reasoning, metadata, ref, name,
#: arguments_raw, sort_key), read in :data:`HISTORY_ORDER`
#: (loops/queries.history_from_rows). A summary sorts where the first message
#: it replaced sat (its metadata's ``sorts_at``: pipeline/compaction.py); the
#: calls of replaced messages come back too, and name no message read.
HISTORY_ROWS = (
    "SELECT true AS is_call, id, NULL AS role, call_id AS text, NULL AS reasoning, "
    "NULL::jsonb AS metadata, message_id AS ref, name, arguments_raw, position AS sort_key "
    "FROM solidloop_tool_calls WHERE loop_id = %(loop_id)s "
    "UNION ALL "
    "SELECT false, id, role, content, reasoning, metadata, tool_call_id, NULL, NULL, "
    "CASE WHEN kind = 'summary' THEN coalesce((metadata->>'sorts_at')::bigint, id) ELSE id END "
    "FROM solidloop_messages WHERE loop_id = %(loop_id)s AND NOT is_hidden "
    "AND status = 'completed' AND compacted_by IS NULL")
HISTORY_ORDER = "is_call DESC, sort_key"
#: A loop's history (loops/queries.history).
HISTORY = f"{HISTORY_ROWS} ORDER BY {HISTORY_ORDER}"


#: Text (bytes) up to which a claim carries the history it read as one JSON
#: value; a longer one is read as rows afterwards (loops/queries.history): as
#: JSON, a client holds it three times at once (the result, its text, its
#: objects), as rows twice, and then once.
HISTORY_INLINE_BYTES = 256_000


def history_json(rows: str) -> str:
    """``rows`` as one JSON array in :data:`HISTORY_ORDER`: the history read by a
    statement along with its own writes; NULL when its text passes
    :data:`HISTORY_INLINE_BYTES` (the caller then reads it as rows). The size
    comes from the values' headers (``octet_length`` does not detoast)."""
    size = ("(SELECT coalesce(sum(coalesce(octet_length(s.text), 0) "
            "+ coalesce(octet_length(s.reasoning), 0) "
            f"+ coalesce(octet_length(s.arguments_raw), 0)), 0) FROM ({rows}) AS s)")
    return (f"CASE WHEN {size} <= {HISTORY_INLINE_BYTES} THEN "
            "(SELECT coalesce(json_agg(json_build_array(h.is_call, h.id, h.role, h.text, "
            "h.reasoning, h.metadata, h.ref, h.name, h.arguments_raw, h.sort_key) "
            f"ORDER BY {HISTORY_ORDER}), '[]'::json) FROM ({rows}) AS h) END")
