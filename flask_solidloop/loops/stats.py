"""The admin charts' figures: what one minute of work sums to, read from the
loops' own rows, and the rolled-up minutes and hours read back.

:func:`source_figures` sums, per minute and agent, the LLM turns (assistant
messages by ``completed_at``: tokens from ``usage``, cost, latency from the
turn's ``metrics.duration_ms``), tool turns (tool answers by ``created_at``)
and failed loops (by ``finished_at``, classed as the loop list classes them).
maintenance/rollup.py writes those sums into ``solidloop_turn_stats``; the
admin reads them back (:func:`series`, :func:`window`) and adds the minutes
the rollup has not reached yet from the source, so a figure is never stale by
more than the time it takes to read those few minutes.

Latency is kept as counts in fixed log-spaced buckets (four per doubling,
10 ms to about an hour): summing two periods is adding their counts, and a
percentile read from them is off by at most half a bucket (about 9 %).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, text

from .._typing import SessionLike
from ..models.loop import ALL_STATUSES
from .queries import failure_class_sql, first_id_since

#: Upper bounds of the latency buckets (ms): 10 ms times 2**(i/4), to about an hour.
LATENCY_BOUNDS_MS: tuple[float, ...] = tuple(10.0 * 2 ** (i / 4) for i in range(75))
#: Counts per histogram: below the first bound, between each pair, above the last.
BUCKETS = len(LATENCY_BOUNDS_MS) + 1
#: The agent name of the hour rows that sum every agent's.
ALL_AGENTS = ""
MINUTE = 60
HOUR = 3600
#: The longest a turn may take from its shell to its answer and still be
#: counted: the source scan starts at messages created this long before the
#: minutes it sums (ids grow with created_at; answers land by completed_at).
TURN_SPAN = timedelta(hours=1)
#: The chart ranges: name -> hours.
RANGES = {"24h": 24, "7d": 24 * 7}
#: Loop statuses counted exactly up to this many; above it, estimated.
STATUS_CAP = 10_000


@dataclass
class Figures:
    """The sums of one period (and one agent, or all)."""

    llm_turns: int = 0
    tool_turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)
    latency: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    failures: dict[str, int] = field(default_factory=dict)

    def add(self, other: Figures) -> Figures:
        self.llm_turns += other.llm_turns
        self.tool_turns += other.tool_turns
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cost += other.cost
        for i, n in enumerate(other.latency[:BUCKETS]):
            self.latency[i] += n
        for cls, n in other.failures.items():
            self.failures[cls] = self.failures.get(cls, 0) + n
        return self

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def percentile(self, q: float) -> float | None:
        return percentile(self.latency, q)


def bucket_of(ms: float) -> int:
    """The bucket a latency falls in (as PostgreSQL's ``width_bucket`` places it)."""
    low, high = 0, len(LATENCY_BOUNDS_MS)
    while low < high:
        middle = (low + high) // 2
        if ms < LATENCY_BOUNDS_MS[middle]:
            high = middle
        else:
            low = middle + 1
    return low


def bucket_value(index: int) -> float:
    """The value a bucket stands for: the geometric middle of its bounds (the
    first and last, open on one side, stand for their one bound)."""
    if index <= 0:
        return LATENCY_BOUNDS_MS[0]
    if index >= len(LATENCY_BOUNDS_MS):
        return LATENCY_BOUNDS_MS[-1]
    return math.sqrt(LATENCY_BOUNDS_MS[index - 1] * LATENCY_BOUNDS_MS[index])


def percentile(latency: Iterable[int], q: float) -> float | None:
    """The ``q`` quantile (0..1, nearest rank) of a histogram; None when empty."""
    counts = list(latency)
    total = sum(counts)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return bucket_value(index)
    return bucket_value(len(counts) - 1)  # not reached: seen ends at total


# -- the source: the loops' own rows ---------------------------------------------

# A fork copies its source's messages with their old completed_at (and no usage
# or cost) into rows created later: completed_at before created_at marks them,
# so a fork never counts a turn twice.
_LLM_TURNS = text("""
SELECT l.agent_name, date_trunc('minute', m.completed_at) AS minute,
       width_bucket(coalesce((m.metadata->'metrics'->>'duration_ms')::float8,
                             extract(epoch FROM m.completed_at - m.created_at) * 1000),
                    CAST(:bounds AS float8[])) AS bucket,
       count(*) AS turns,
       sum(coalesce((m.usage->>'input_tokens')::bigint,
                    (m.usage->>'prompt_tokens')::bigint, 0)) AS input_tokens,
       sum(coalesce((m.usage->>'output_tokens')::bigint,
                    (m.usage->>'completion_tokens')::bigint, 0)) AS output_tokens,
       coalesce(sum(m.cost), 0) AS cost
  FROM solidloop_messages AS m JOIN solidloop_loops AS l ON l.id = m.loop_id
 WHERE m.id >= :first AND m.role = 'assistant' AND m.status = 'completed'
   AND m.completed_at >= :since AND m.completed_at < :until
   AND m.created_at <= m.completed_at
 GROUP BY 1, 2, 3""")

_TOOL_TURNS = text("""
SELECT l.agent_name, date_trunc('minute', m.created_at) AS minute, count(*) AS turns
  FROM solidloop_messages AS m JOIN solidloop_loops AS l ON l.id = m.loop_id
 WHERE m.id >= :first AND m.role = 'tool'
   AND m.created_at >= :since AND m.created_at < :until
   AND (m.completed_at IS NULL OR m.created_at <= m.completed_at)
 GROUP BY 1, 2""")


def source_figures(session: SessionLike, since: datetime,
                   until: datetime) -> dict[tuple[datetime, str], Figures]:
    """Per (minute, agent), what the loops' rows say happened in [since, until)."""
    from ..models import Loop

    found: dict[tuple[datetime, str], Figures] = {}

    def at(minute: datetime, agent: str) -> Figures:
        return found.setdefault((minute, agent), Figures())

    first = first_id_since(session, "solidloop_messages", since - TURN_SPAN)
    if first is not None:
        # Messages created from ``until`` on answered later: an upper bound on
        # the ids, so summing an old hour does not walk every newer message.
        last = first_id_since(session, "solidloop_messages", until)
        bound = "" if last is None else " AND m.id < :last"
        params = {"first": first, "last": last, "since": since, "until": until,
                  "bounds": list(LATENCY_BOUNDS_MS)}
        turns, tools = (text(q.text.replace(" GROUP BY", bound + " GROUP BY", 1))
                        for q in (_LLM_TURNS, _TOOL_TURNS))
        for row in session.execute(turns, params):
            figures = at(row.minute, row.agent_name)
            figures.llm_turns += int(row.turns)
            figures.input_tokens += int(row.input_tokens or 0)
            figures.output_tokens += int(row.output_tokens or 0)
            figures.cost += Decimal(row.cost or 0)
            figures.latency[int(row.bucket)] += int(row.turns)
        for row in session.execute(tools, params):
            at(row.minute, row.agent_name).tool_turns += int(row.turns)
    # The ended-loops index (finished_at, id WHERE status IN completed, failed).
    cls = failure_class_sql().label("cls")
    minute = func.date_trunc("minute", Loop.finished_at).label("minute")
    for row in session.execute(
        select(Loop.agent_name, minute, cls, func.count().label("n"))
        .where(Loop.status.in_(("completed", "failed")), Loop.status == "failed",
               Loop.finished_at >= since, Loop.finished_at < until)
        .group_by(Loop.agent_name, minute, cls)
    ):
        figures = at(row.minute, row.agent_name)
        figures.failures[row.cls] = figures.failures.get(row.cls, 0) + int(row.n)
    return found


# -- the rollup's rows, read back ------------------------------------------------

_ROWS = text("""
SELECT starts_at, agent_name, llm_turns, tool_turns, input_tokens, output_tokens, cost,
       latency, failures
  FROM solidloop_turn_stats
 WHERE span_seconds = :span AND starts_at >= :since AND starts_at < :until""")


def rolled_rows(session: SessionLike, span: int, since: datetime, until: datetime,
                agent: str | None = None) -> dict[tuple[datetime, str], Figures]:
    """Rows of ``span`` seconds starting in [since, until), one agent's or all."""
    query = _ROWS if agent is None else text(_ROWS.text + " AND agent_name = :agent")
    found = {}
    for row in session.execute(query, {"span": span, "since": since, "until": until,
                                       "agent": agent}):
        latency = list(row.latency or [])
        found[(row.starts_at, row.agent_name)] = Figures(
            int(row.llm_turns), int(row.tool_turns), int(row.input_tokens),
            int(row.output_tokens), Decimal(row.cost or 0),
            (latency + [0] * BUCKETS)[:BUCKETS], {k: int(v) for k, v in row.failures.items()})
    return found


def rolled_to(session: SessionLike, name: str = "turn_stats") -> datetime | None:
    """Up to which minute the rollup has gone; None before its first pass."""
    return session.execute(text("SELECT rolled_to FROM solidloop_rollup_marks "
                                "WHERE name = :name"), {"name": name}).scalar_one_or_none()


@dataclass(frozen=True)
class Series:
    """One chart range: a point per hour, oldest first, and the range's total."""

    range: str
    agent: str | None
    hours: list[datetime]
    points: list[Figures]
    total: Figures
    #: Up to where the rollup had gone (the rest came from the loops' rows).
    rolled_to: datetime | None
    now: datetime


def _with_tail(session: SessionLike, since: datetime, now: datetime, mark: datetime | None,
               agent: str | None) -> dict[tuple[datetime, str], Figures]:
    """The minutes from the rollup's mark (or ``since``) to now, from the source."""
    start = max(since, mark) if mark is not None else since
    if start >= now:
        return {}
    # One page asks for the same tail several times (two windows, a series):
    # read it once per transaction (now() is the transaction's start).
    memo = session.info.setdefault("solidloop_stats_tail", {})
    if (start, now) not in memo:
        memo.clear()
        memo[(start, now)] = source_figures(session, start, now)
    found = memo[(start, now)]
    return {k: v for k, v in found.items() if agent is None or k[1] == agent}


def series(session: SessionLike, range_name: str, agent: str | None = None) -> Series:
    """Hourly figures over ``range_name`` (a key of :data:`RANGES`), every
    agent's or one's: the rolled-up hours (every minute before the mark), and
    the minutes from the mark on, from the source."""
    hours = RANGES[range_name]
    now: datetime = session.execute(select(func.now())).scalar_one()
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(hours=hours)
    mark = rolled_to(session)
    by_hour = {h: Figures() for h in (start + timedelta(hours=i) for i in range(hours))}
    rows = rolled_rows(session, HOUR, start, end, ALL_AGENTS if agent is None else agent)
    for (hour, _), figures in rows.items():
        if hour in by_hour:
            by_hour[hour].add(figures)
    for (minute, _), figures in _with_tail(session, start, now, mark, agent).items():
        hour = minute.replace(minute=0, second=0, microsecond=0)
        if hour in by_hour:
            by_hour[hour].add(figures)
    total = Figures()
    for figures in by_hour.values():
        total.add(figures)
    return Series(range_name, agent, list(by_hour), list(by_hour.values()), total, mark, now)


def window(session: SessionLike, since: datetime, now: datetime) -> Figures:
    """Every agent's sums since ``since`` (the dashboard's last hour and day):
    rolled-up minutes before the mark, the source after it."""
    mark = rolled_to(session)
    total = Figures()
    if mark is not None and mark > since:
        row = session.execute(text(
            "SELECT coalesce(sum(llm_turns), 0) AS llm_turns,"
            " coalesce(sum(tool_turns), 0) AS tool_turns,"
            " coalesce(sum(input_tokens), 0) AS input_tokens,"
            " coalesce(sum(output_tokens), 0) AS output_tokens, coalesce(sum(cost), 0) AS cost"
            " FROM solidloop_turn_stats WHERE span_seconds = 60"
            " AND starts_at >= :since AND starts_at < :mark"),
            {"since": since, "mark": mark}).one()
        total.add(Figures(int(row.llm_turns), int(row.tool_turns), int(row.input_tokens),
                          int(row.output_tokens), Decimal(row.cost)))
        for cls, n in session.execute(text(
            "SELECT f.key, sum(f.value::bigint) FROM solidloop_turn_stats AS s,"
            " jsonb_each_text(s.failures) AS f WHERE s.span_seconds = 60"
            " AND s.starts_at >= :since AND s.starts_at < :mark AND s.failures <> '{}'"
            " GROUP BY f.key"), {"since": since, "mark": mark}):
            total.failures[cls] = int(n)
    for figures in _with_tail(session, since, now, mark, None).values():
        total.add(figures)
    return total


@dataclass(frozen=True)
class StatusCounts:
    """Loops per status: exact up to :data:`STATUS_CAP`, estimated above it."""

    counts: dict[str, int]
    estimated: frozenset[str]


def status_counts(session: SessionLike, cap: int = STATUS_CAP) -> StatusCounts:
    """Each status counted on the status index, at most ``cap + 1`` entries
    each; a status past the cap is estimated from the planner's statistics
    (rows in the table times the status's share), and counted exactly only
    when the table has never been analyzed."""
    counted: dict[str, int] = {row[0]: int(row[1]) for row in session.execute(text(
        "SELECT s.status, (SELECT count(*) FROM (SELECT 1 FROM solidloop_loops AS l"
        " WHERE l.status = s.status LIMIT :cap) AS x)"
        " FROM unnest(CAST(:statuses AS text[])) AS s(status)"),
        {"cap": cap + 1, "statuses": list(ALL_STATUSES)})}
    over = [s for s, n in counted.items() if n > cap]
    estimated: set[str] = set()
    if over:
        row = session.execute(text(
            "SELECT c.reltuples, s.most_common_vals::text AS vals, s.most_common_freqs AS freqs"
            " FROM pg_class AS c LEFT JOIN pg_stats AS s ON s.tablename = 'solidloop_loops'"
            " AND s.attname = 'status' AND s.schemaname = current_schema()"
            " WHERE c.oid = to_regclass('solidloop_loops')")).one_or_none()
        shares = _shares(row)
        for status in over:
            share = shares.get(status)
            if share is not None and row is not None and row.reltuples > 0:
                counted[status] = max(cap + 1, round(row.reltuples * share))
                estimated.add(status)
            else:
                counted[status] = int(session.scalar(text(
                    "SELECT count(*) FROM solidloop_loops WHERE status = :s"), {"s": status}))
    return StatusCounts({s: int(n) for s, n in counted.items() if n}, frozenset(estimated))


def _shares(row: Any) -> dict[str, float]:
    if row is None or row.vals is None or row.freqs is None:
        return {}
    values = row.vals.strip("{}").split(",")
    return {v.strip('"'): float(f) for v, f in zip(values, row.freqs, strict=False)}
