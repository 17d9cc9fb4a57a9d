"""Every read of loops, messages, tool calls and MCP sessions that the turns, the
CLI, the Agent facade and (later) the admin and MCP server need.

Nothing here writes or commits; a caller that must not hold a snapshot open
(a turn about to make a network call) ends its own read transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, bindparam, func, literal_column, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from .._typing import SessionLike, real_session
from ..dbapi import driver_connection
from ..llm.types import ChatMessage, ToolCallRequest
from ..models import Loop, McpSession, Message, ToolCall
from ..models.loop import LoopStatus
from . import sql
from .store.transaction import run_alone

#: Keys of a message's metadata that its dialect gets back next turn.
PROVIDER_META_KEYS = ("anthropic_blocks", "gemini_parts", "responses_items", "responses_id")


#: A loop by id, the row whole (a job's first read).
GET_LOOP = "SELECT * FROM solidloop_loops WHERE id = %(loop_id)s"


def owns(loop: Loop | None, execution_token: uuid.UUID | None) -> bool:
    """Whether ``execution_token``'s generation still owns the running loop, as
    ``loop`` was read (the write that follows re-checks it under the lock)."""
    return (loop is not None and loop.status == LoopStatus.RUNNING
            and execution_token is not None and loop.execution_token == execution_token)


def get_loop(session: SessionLike, loop_id: int, *, alone: bool = False) -> Loop | None:
    """The loop, as ``session.get`` gives it. A loop the session does not hold
    (the usual case: a job's first read) is read with a plain ``SELECT *`` and
    loaded as :func:`row_object` loads a row, without the ORM's query
    machinery; anything the session holds, or has pending, goes through
    ``session.get`` itself. ``alone``: the caller needs no transaction around
    the read (its next write is a statement of its own), so a session holding
    nothing reads in autocommit, with no ``BEGIN`` to end later
    (loops/store/transaction.run_alone)."""
    real = real_session(session)
    if identity_key(Loop, loop_id) in real.identity_map or real.new or real.dirty \
            or real.deleted:
        return session.get(Loop, loop_id)
    row, _ = run_alone(session, GET_LOOP, {"loop_id": loop_id}, sole=alone)
    return row_object(session, Loop, row) if row is not None else None


def get_tool_call(session: SessionLike, tool_call_id: int) -> ToolCall | None:
    return session.get(ToolCall, tool_call_id)


_RowLayout = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]
_ROW_LAYOUTS: dict[type[Any], _RowLayout] = {}


def _row_layout(model: type[Any]) -> _RowLayout:
    """A model's (attribute, column) pairs and its primary key's columns."""
    layout = _ROW_LAYOUTS.get(model)
    if layout is None:
        mapper = sa_inspect(model)
        layout = _ROW_LAYOUTS[model] = (
            tuple((prop.key, prop.columns[0].name) for prop in mapper.column_attrs),
            tuple(column.name for column in mapper.primary_key))
    return layout


def row_object(session: SessionLike, model: type[Any], row: Mapping[str, Any]) -> Any:
    """The ``model`` object of a row the caller has just written and read back
    whole (``RETURNING *``), put in ``session`` as persistent and unchanged, so
    the next read of it is the identity map's, with no ``SELECT``. Only for a
    row as the database now holds it (runtime/inline.py carries the rows an
    adopted step starts from)."""
    real = real_session(session)
    columns, primary_key = _row_layout(model)
    existing = real.identity_map.get(identity_key(model, tuple(row[c] for c in primary_key)))
    if existing is not None:
        for key, column in columns:
            set_committed_value(existing, key, row[column])
        return existing
    # Built as a load builds it: the values are the object's committed state
    # (no constructor, no change history), then attached as persistent.
    obj = sa_inspect(model).class_manager.new_instance()
    obj.__dict__.update((key, row[column]) for key, column in columns)
    make_transient_to_detached(obj)
    real.add(obj)
    return obj


def get_tool_call_and_loop(session: SessionLike, tool_call_id: int,
                           ) -> tuple[ToolCall | None, Loop | None]:
    """A tool call and its loop: from the identity map when both are loaded
    there (rows an adopted step carries), else in one round trip."""
    real = real_session(session)
    call = real.identity_map.get(identity_key(ToolCall, tool_call_id))
    if call is not None and not sa_inspect(call).expired_attributes:
        loop = real.identity_map.get(identity_key(Loop, call.loop_id))
        if loop is not None and not sa_inspect(loop).expired_attributes:
            return call, loop
    row = session.execute(
        select(ToolCall, Loop).join(Loop, Loop.id == ToolCall.loop_id)
        .where(ToolCall.id == tool_call_id)
    ).one_or_none()
    return (row[0], row[1]) if row is not None else (None, None)


def is_owned(session: SessionLike, loop_id: int, token: uuid.UUID) -> bool:
    """True while ``token``'s generation still owns the running loop (no lock)."""
    row = session.execute(
        select(Loop.status, Loop.execution_token).where(Loop.id == loop_id)
    ).one_or_none()
    return row is not None and row.status == LoopStatus.RUNNING \
        and row.execution_token == token


def owned_among(session: SessionLike, turns: Sequence[tuple[int, uuid.UUID]]) -> set[Any]:
    """Of ``turns`` (loop id, token), those still owning their running loop, in one read."""
    rows = session.execute(select(Loop.id, Loop.execution_token).where(
        Loop.id.in_([t[0] for t in turns]), Loop.status == LoopStatus.RUNNING)).all()
    return {(row.id, row.execution_token) for row in rows} & set(turns)


def run_elapsed_seconds(session: SessionLike, loop_id: int) -> float | None:
    """Seconds since this run's first claim, by the database clock."""
    elapsed = session.scalar(
        select(func.extract("epoch", func.now() - Loop.run_started_at)).where(Loop.id == loop_id)
    )
    return None if elapsed is None else float(elapsed)


def unresolved_tool_calls(session: SessionLike, loop_id: int) -> list[ToolCall]:
    """Tool calls of the newest assistant turn that have no tool message yet."""
    last_assistant = session.scalar(
        select(Message.id)
        .where(Message.loop_id == loop_id, Message.role == "assistant",
               Message.status == "completed")
        .order_by(Message.id.desc())
        .limit(1)
    )
    if last_assistant is None:
        return []
    return list(session.scalars(
        select(ToolCall)
        .where(ToolCall.message_id == last_assistant, ToolCall.response_message_id.is_(None))
        .order_by(ToolCall.position)
    ))


def tool_snapshots(session: SessionLike, loop_id: int) -> dict[str, Any]:
    """The tools each remote server listed for this loop, by server name."""
    return {row.server_name: row.tools for row in session.scalars(
        select(McpSession).where(McpSession.loop_id == loop_id))}


def mcp_session_state(session: SessionLike, loop_id: int,
                      server_name: str) -> dict[str, Any] | None:
    """The stored MCP session of the loop's server (to resume, not re-initialize)."""
    stored = session.scalars(
        select(McpSession).where(McpSession.loop_id == loop_id,
                                 McpSession.server_name == server_name)
    ).first()
    return dict(stored.session_state) if stored is not None else None


def messages(session: SessionLike, loop_id: int, *,
             include_hidden: bool = False) -> list[Message]:
    query = select(Message).where(Message.loop_id == loop_id)
    if not include_hidden:
        query = query.where(Message.is_hidden.is_(False))
    return list(session.scalars(query.order_by(Message.id)))


def final_answer(session: SessionLike, loop_id: int) -> str | None:
    """The text of the loop's last visible, completed assistant message."""
    return session.scalars(
        select(Message.content).where(Message.loop_id == loop_id, Message.role == "assistant",
                                      Message.is_hidden.is_(False),
                                      Message.status == "completed")
        .order_by(Message.id.desc()).limit(1)).first()


def tool_calls(session: SessionLike, loop_id: int) -> list[ToolCall]:
    return list(session.scalars(
        select(ToolCall).where(ToolCall.loop_id == loop_id).order_by(ToolCall.id)))


def history(session: SessionLike, loop_id: int) -> list[ChatMessage]:
    """The visible, completed history in the provider-neutral shape a dialect renders.

    Read as plain rows on the driver connection (every LLM turn reads its whole
    conversation, and ORM entities cost several times more per row), inside
    the session's transaction, after flushing what the session holds."""
    session.flush()
    return history_from_rows(driver_connection(session).execute(sql.HISTORY, {"loop_id": loop_id}))


def history_from_rows(rows: Iterable[Sequence[Any]]) -> list[ChatMessage]:
    """The history from its rows (loops/sql.HISTORY_ROWS, in HISTORY_ORDER)."""
    calls_by_message: dict[int, list[tuple[str, str, str]]] = {}
    answered: dict[int, tuple[str, str]] = {}
    result = []
    for is_call, row_id, role, content, reasoning, meta, ref, name, arguments_raw, _ in rows:
        if is_call:  # the calls come first: the messages below name them
            wire_id = content or f"call_{row_id}"
            calls_by_message.setdefault(ref, []).append((wire_id, name, arguments_raw or ""))
            answered[row_id] = (wire_id, name)
            continue
        tool_call_id = ref
        meta = meta or {}
        if role == "assistant":
            result.append(ChatMessage(
                role="assistant",
                content=content,
                reasoning=reasoning,
                meta={k: meta[k] for k in PROVIDER_META_KEYS if k in meta}, message_id=row_id,
                tool_calls=[ToolCallRequest(*call) for call in calls_by_message.get(row_id, [])],
            ))
        elif role == "tool":
            wire_id, name = answered.get(tool_call_id or -1, (None, None))
            result.append(ChatMessage(role="tool", content=content, tool_call_id=wire_id, name=name,
                                      is_error=bool(meta.get("is_error")), message_id=row_id))
        else:  # marks the stack reads: a validation error sent back, a pin (compaction)
            result.append(ChatMessage(role, content, message_id=row_id, meta={
                key: meta[key] for key in ("output_retry", "pinned") if key in meta}))
    return result


@dataclass(frozen=True)
class ToolCallState:
    """Where a tool call stands, for status and the admin."""

    #: answered | executed (result recorded, answer pending) | running (a live
    #: lease) | stalled (its lease lapsed: the reaper takes it over) | queued (a
    #: job waits for it) | awaiting_approval | awaiting_result (a decision or a
    #: result has yet to come) | waiting (nothing holds it yet: sequential
    #: mode, or a paused loop)
    state: str
    holder: str | None = None
    leased_until: datetime | None = None


_TOOL_JOBS = text(
    "SELECT (message->'args'->>0)::bigint FROM solidloop_jobs "
    "WHERE loop_id = :loop_id AND actor_name = 'solidloop.tool_call' "
    "AND state IN ('queued', 'running')"
)


def tool_call_states(session: SessionLike, loop_id: int) -> dict[int, ToolCallState]:
    """The state of each of the loop's tool calls, by id, on the database clock."""
    now = session.scalar(select(func.now()))
    with_jobs = set(session.execute(_TOOL_JOBS, {"loop_id": loop_id}).scalars())
    states = {}
    for call in tool_calls(session, loop_id):
        if call.response_message_id is not None:
            state = ToolCallState("answered")
        elif call.executed_at is not None:
            state = ToolCallState("executed")
        elif call.waits_for is not None and call.decision is None:
            state = ToolCallState(f"awaiting_{call.waits_for}")
        elif call.lease_token is not None and call.leased_until is not None:
            live = now is None or call.leased_until >= now
            state = ToolCallState("running" if live else "stalled", call.lease_holder,
                                  call.leased_until)
        elif call.id in with_jobs:
            state = ToolCallState("queued")
        else:
            state = ToolCallState("waiting")
        states[call.id] = state
    return states


@dataclass(frozen=True)
class LoopFilter:
    """Filters of a loop listing; every field is optional."""

    statuses: Sequence[str] = ()
    agent: str | None = None
    since: datetime | None = None
    failed_only: bool = False


def list_loops(session: SessionLike, filters: LoopFilter = LoopFilter(), *,
               limit: int = 50, before_id: int | None = None) -> list[Loop]:
    """Loops newest first, with keyset pagination (``before_id``: the last id of
    the previous page), never an OFFSET or a COUNT over the whole table."""
    query = select(Loop)
    statuses = list(filters.statuses)
    if filters.failed_only:
        statuses = ["failed"]
    if statuses:
        query = query.where(Loop.status.in_(statuses))
    if filters.agent:
        query = query.where(Loop.agent_name == filters.agent)
    if filters.since is not None:
        query = query.where(Loop.created_at >= filters.since)
    if before_id is not None:
        query = query.where(Loop.id < before_id)
    return list(session.scalars(query.order_by(Loop.id.desc()).limit(limit)))


# -- the admin's reads: search, bulk selection, dashboard aggregates -----------------
#
# Everything below serves flask_solidloop/admin. The listing never
# counts an unfiltered table: pages are keyset on the primary key, and a count
# (for a bulk action's confirmation) is capped. Windows "since T" are turned
# into an id boundary by a binary search on the primary key (ids grow with
# creation time), so "the last hour" reads the newest rows of a 10M-row table
# by range instead of scanning it for a timestamp that has no index.

#: Failure classes of a failed loop, from its ``error_message``. Checked in order; the first
#: match wins. Code errors come first so a ``TypeError`` whose text mentions "timeout" is not
#: mislabelled infra: a bug in the agent is not a flaky network, whatever its message says.
#: Patterns are POSIX regexes PostgreSQL (``~*``) and Python ``re`` (IGNORECASE) read alike.
FAILURE_CLASSES: tuple[tuple[str, str], ...] = (
    ("output_invalid", r"^OutputInvalidError"),  # never matched its schema: llm/output.py
    ("agent", r"^(TypeError|KeyError|AttributeError|NameError|ValueError|IndexError|"
              r"AssertionError|RuntimeError|NotImplementedError|ZeroDivisionError|"
              r"UnknownAgentError|AgentDefinitionError|ToolDefinitionError|"
              r"InvalidArgumentError|SetupError|NotInitializedError|UnknownToolError|"
              r"UnknownMiddlewareError):"),
    ("operator", r"^(force stopped|stopped|frozen)|by (an )?operator"),
    ("budget_exceeded", r"^BudgetExceededError"),
    ("limit", r"^LimitExceededError"),
    # An OAuth-protected MCP server with no usable token: a person must sign in
    # (at the first turn's listing, or a tool call's: "tool call N: McpAuthError").
    ("auth:oauth", r"^(tool call [0-9]+: )?McpAuthError"),
    ("infra:http", r"^ProviderHTTPError|HTTP [1-5][0-9][0-9]"),
    ("infra:timeout", r"timeout|timed out"),
    ("infra:connect", r"^McpTransportError|connect(ion)? ?(error|refused|reset|failed)|"
                      r"ConnectError|RemoteProtocolError|disconnect"),
    ("infra:parse", r"^Provider(Response|Answer)Error|JSONDecodeError|parse|malformed"),
)
#: Classes a paused loop carries too: a reached budget pauses the loop (it
#: resumes with a raised budget) rather than failing it.
PAUSING_CLASSES: tuple[str, ...] = ("budget_exceeded",)
#: What a failed loop matching none of the patterns is.
DEFAULT_FAILURE_CLASS = "agent"
FAILURE_CLASS_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys([name for name, _ in FAILURE_CLASSES] + [DEFAULT_FAILURE_CLASS]))


def classify_failure(error_message: str | None) -> str:
    """The failure class of an error text (the same rules as :func:`failure_class_sql`)."""
    import re

    message = (error_message or "").strip()
    for name, pattern in FAILURE_CLASSES:
        if re.search(pattern, message, re.IGNORECASE):
            return name
    return DEFAULT_FAILURE_CLASS


def failure_class_sql() -> Any:
    """A SQL expression giving a loop's failure class (evaluate it on failed loops)."""
    from sqlalchemy import case, literal

    return case(*[(Loop.error_message.regexp_match(pattern, "i"), literal(name))
                  for name, pattern in FAILURE_CLASSES], else_=literal(DEFAULT_FAILURE_CLASS))


@dataclass(frozen=True)
class LoopSearch:
    """The admin's loop filters; every field is optional and they combine with AND.

    ``text`` matches message content (case-insensitive substring); ``state`` is
    JSON containment on the loop's ``state`` (``state @> :state``); ``max_id``
    freezes a set (a bulk action acts on the loops that existed when it was
    confirmed, not on ones created since)."""

    statuses: tuple[str, ...] = ()
    agent: str | None = None
    failure: str | None = None
    subject_type: str | None = None
    subject_id: str | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    text: str | None = None
    state: dict[str, Any] | None = None
    max_id: int | None = None

    @property
    def empty(self) -> bool:
        return not (self.statuses or self.agent or self.failure or self.subject_type
                    or self.subject_id or self.created_from or self.created_to or self.text
                    or self.state)


def _escape_like(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _search_query(search: LoopSearch, columns: Any = None) -> Any:
    from sqlalchemy import exists

    query = select(columns if columns is not None else Loop)
    statuses = list(search.statuses)
    if search.failure:
        statuses = ["failed", "paused"] if search.failure in PAUSING_CLASSES else ["failed"]
        query = query.where(failure_class_sql() == search.failure)
    if statuses:
        query = query.where(Loop.status.in_(statuses))
    if search.agent:
        query = query.where(Loop.agent_name == search.agent)
    if search.subject_type:
        query = query.where(Loop.subject_type == search.subject_type)
    if search.subject_id:
        query = query.where(Loop.subject_id == search.subject_id)
    if search.created_from is not None:
        query = query.where(Loop.created_at >= search.created_from)
    if search.created_to is not None:
        query = query.where(Loop.created_at < search.created_to)
    if search.state:
        query = query.where(Loop.state.contains(search.state))
    if search.max_id is not None:
        query = query.where(Loop.id <= search.max_id)
    if search.text:
        query = query.where(exists().where(
            Message.loop_id == Loop.id,
            Message.content.ilike(f"%{_escape_like(search.text)}%", escape="\\")))
    return query


def search_loops(session: SessionLike, search: LoopSearch = LoopSearch(), *,
                 limit: int = 50, before_id: int | None = None) -> list[Loop]:
    """Loops matching ``search``, newest first, keyset-paginated on the id
    (``before_id``: the last id of the previous page). No OFFSET, no COUNT."""
    query = _search_query(search)
    if before_id is not None:
        query = query.where(Loop.id < before_id)
    return list(session.scalars(query.order_by(Loop.id.desc()).limit(limit)))


def search_loop_ids(session: SessionLike, search: LoopSearch, *, limit: int,
                    before_id: int | None = None) -> list[int]:
    """One batch of matching loop ids, newest first (a bulk action walks these)."""
    query = _search_query(search, Loop.id)
    if before_id is not None:
        query = query.where(Loop.id < before_id)
    return list(session.scalars(query.order_by(Loop.id.desc()).limit(limit)))


def count_loops(session: SessionLike, search: LoopSearch, *, cap: int) -> int:
    """How many loops match, counting at most ``cap + 1`` rows (so a confirmation
    page can say "more than cap" without counting a million)."""
    inner = _search_query(search, Loop.id).limit(cap + 1).subquery()
    return int(session.scalar(select(func.count()).select_from(inner)) or 0)


def newest_loop_id(session: SessionLike) -> int | None:
    return session.scalar(select(func.max(Loop.id)))


def loop_agents(session: SessionLike, limit: int = 200) -> list[str]:
    """Distinct agent names, by a loose index scan (cheap on any table size)."""
    found = session.execute(text(
        "WITH RECURSIVE names AS ("
        " (SELECT agent_name FROM solidloop_loops ORDER BY agent_name LIMIT 1)"
        " UNION ALL"
        " SELECT (SELECT l.agent_name FROM solidloop_loops l WHERE l.agent_name > n.agent_name"
        "         ORDER BY l.agent_name LIMIT 1) FROM names n WHERE n.agent_name IS NOT NULL)"
        " SELECT agent_name FROM names WHERE agent_name IS NOT NULL LIMIT :limit"
    ), {"limit": limit}).scalars()
    return list(found)


def waiting_calls(session: SessionLike) -> dict[str, int]:
    """Tool calls waiting for a decision (``approval``) or a result (``result``),
    by what they wait for (the awaiting index covers exactly these rows)."""
    rows = session.execute(
        select(ToolCall.waits_for, func.count())
        .where(ToolCall.waits_for.is_not(None), ToolCall.decision.is_(None))
        .group_by(ToolCall.waits_for))
    return {str(kind): int(count) for kind, count in rows}


def first_id_since(session: SessionLike, table: str, since: datetime) -> int | None:
    """The smallest id of ``table`` created at or after ``since``, by a binary
    search on the primary key (ids grow with ``created_at``); None if none is."""
    bounds = session.execute(text(f"SELECT min(id), max(id) FROM {table}")).one()
    low, high = bounds
    if high is None:
        return None
    probe = text(f"SELECT id, created_at FROM {table} WHERE id >= :id ORDER BY id LIMIT 1")
    last = session.execute(probe, {"id": high}).one()
    if last.created_at < since:
        return None
    best = int(high)
    while low <= high:
        middle = (low + high) // 2
        row = session.execute(probe, {"id": middle}).one()  # exists: best >= middle
        if row.created_at >= since:
            best = min(best, int(row.id))
            high = middle - 1
        else:
            low = int(row.id) + 1
    return best


@dataclass(frozen=True)
class Window:
    """Turns, tokens and cost of the LLM turns completed in one time window."""

    label: str
    turns: int
    input_tokens: int
    output_tokens: int
    cost: Any


@dataclass(frozen=True)
class QueueDepth:
    queue_name: str
    queued: int
    running: int
    oldest_queued_at: datetime | None


@dataclass(frozen=True)
class Dashboard:
    by_status: dict[str, int]
    windows: list[Window]
    failures: dict[str, int]
    failures_window: str
    queues: list[QueueDepth]
    dead_jobs: int
    now: datetime
    #: Statuses whose count is the planner's estimate (past stats.STATUS_CAP).
    estimated: frozenset[str] = frozenset()


def dashboard(session: SessionLike) -> Dashboard:
    """The admin dashboard's numbers, none of which grows with history: status
    counts capped and estimated above the cap, turns and failures from the
    charts' rollup plus the minutes past its mark (loops/stats.py)."""
    from datetime import timedelta

    from . import stats

    now: datetime = session.execute(select(func.now())).scalar_one()
    counts = stats.status_counts(session)
    windows = []
    for label, since in (("last hour", now - timedelta(hours=1)),
                         ("last day", now - timedelta(days=1))):
        sums = stats.window(session, since, now)
        windows.append(Window(label, sums.llm_turns, sums.input_tokens, sums.output_tokens,
                              sums.cost if sums.llm_turns else None))
    queues = [QueueDepth(row.queue_name, int(row.queued), int(row.running), row.oldest)
              for row in session.execute(text(
                  "SELECT queue_name, count(*) FILTER (WHERE state = 'queued') AS queued,"
                  " count(*) FILTER (WHERE state = 'running') AS running,"
                  " min(created_at) FILTER (WHERE state = 'queued') AS oldest"
                  " FROM solidloop_jobs WHERE state IN ('queued', 'running')"
                  " GROUP BY queue_name ORDER BY queue_name"))]
    dead = int(session.scalar(text("SELECT count(*) FROM solidloop_jobs WHERE state = 'dead'"))
               or 0)
    return Dashboard(by_status=counts.counts, windows=windows, failures=sums.failures,
                     failures_window="loops that failed in the last day", queues=queues,
                     dead_jobs=dead, now=now, estimated=counts.estimated)


def events(session: SessionLike, loop_id: int, limit: int = 500) -> list[Any]:
    """The loop's wire log (already redacted when written), oldest first."""
    from ..models import Event

    return list(session.scalars(
        select(Event).where(Event.loop_id == loop_id).order_by(Event.id).limit(limit)))


def mcp_sessions(session: SessionLike, loop_id: int) -> list[McpSession]:
    return list(session.scalars(
        select(McpSession).where(McpSession.loop_id == loop_id).order_by(McpSession.id)))


@dataclass(frozen=True)
class LiveMessage:
    """What the live stream needs of one message: its text so far and where it stands."""

    id: int
    role: str
    status: str
    is_hidden: bool
    content: str


def live_messages(session: SessionLike, loop_id: int, *,
                  after_id: int | None = None) -> list[LiveMessage]:
    """The loop's messages from ``after_id`` on (inclusive), with their content."""
    query = select(Message.id, Message.role, Message.status, Message.is_hidden,
                   Message.content).where(Message.loop_id == loop_id)
    if after_id is not None:
        query = query.where(Message.id >= after_id)
    return [LiveMessage(r.id, r.role, r.status, r.is_hidden, r.content or "")
            for r in session.execute(query.order_by(Message.id))]


def loop_version(session: SessionLike, loop_id: int) -> tuple[Any, ...] | None:
    """A cheap fingerprint of a loop's visible state: it changes when the status,
    a message or a tool call does (the live stream's poll fallback)."""
    row = session.execute(text(
        "SELECT l.status, l.updated_at, l.step_count,"
        " (SELECT max(id) FROM solidloop_messages m WHERE m.loop_id = l.id) AS last_message,"
        " (SELECT max(updated_at) FROM solidloop_tool_calls t WHERE t.loop_id = l.id) AS calls"
        " FROM solidloop_loops l WHERE l.id = :id"), {"id": loop_id}).one_or_none()
    return None if row is None else tuple(row)


def is_observed(session: SessionLike, loop_id: int) -> bool:
    """Whether someone watches the loop live (its partials then flush more often)."""
    return bool(session.scalar(select(Loop.observed).where(Loop.id == loop_id)))


def search_loops_bounded(session: SessionLike, search: LoopSearch, *, limit: int,
                         before_id: int | None = None, window: int = 2000,
                         budget_seconds: float = 0.15) -> tuple[list[Loop], int | None]:
    """:func:`search_loops` for filters no index serves (text in messages, JSON
    containment, a failure class, a date range on a huge table): walks the ids
    newest first in windows of ``window`` until ``limit`` rows match or the time
    budget is spent. Returns the rows and, when the budget ran out first, the id
    to continue below (the page says how far it searched); None when done."""
    import time

    top = before_id if before_id is not None else (newest_loop_id(session) or 0) + 1
    bottom = session.scalar(select(func.min(Loop.id))) or 0
    rows: list[Loop] = []
    started = time.monotonic()
    while top > bottom and len(rows) < limit:
        low = max(top - window, bottom)
        query = _search_query(search).where(Loop.id < top, Loop.id >= low)
        rows += session.scalars(query.order_by(Loop.id.desc()).limit(limit - len(rows)))
        top = low
        if time.monotonic() - started > budget_seconds and len(rows) < limit:
            return rows, (top if top > bottom else None)
    return rows, None


def inbound_sessions(session: SessionLike, *, limit: int,
                     before: tuple[datetime, str] | None = None) -> list[Any]:
    """Outside MCP clients' sessions, newest first; keyset on (created_at, id)."""
    from ..models import McpInboundSession as S

    query = select(S)
    if before is not None:
        query = query.where(func.row(S.created_at, S.id) < func.row(*before))
    return list(session.scalars(query.order_by(S.created_at.desc(), S.id.desc()).limit(limit)))


# Inbound MCP events spelled as their partial indexes (ix_solidloop_events_mcp_inbound
# and ..._session) spell them: literals, not bound parameters, so the planner can
# match the indexes under a generic plan too (psycopg prepares a statement that
# a connection runs five times, and PostgreSQL may then plan it generically).
_INBOUND_EVENT = text("solidloop_events.kind = 'mcp_inbound'")
_inbound_session_id = literal_column("solidloop_events.payload ->> 'session_id'", Text())


def inbound_requests(session: SessionLike, *, limit: int, session_id: str | None = None,
                     before_id: int | None = None) -> list[Any]:
    """Inbound MCP requests (events of kind ``mcp_inbound``, redacted as stored),
    newest first, optionally of one session; keyset on the event id."""
    from ..models import Event

    query = select(Event).where(_INBOUND_EVENT)
    if session_id is not None:
        query = query.where(_inbound_session_id == bindparam("session_id", session_id))
    if before_id is not None:
        query = query.where(Event.id < before_id)
    return list(session.scalars(query.order_by(Event.id.desc()).limit(limit)))
