"""The rollup: sums each minute's LLM turns, tool turns, tokens, cost, turn
latency and failed loops into ``solidloop_turn_stats``, for the admin charts
(docs/decisions/0047-admin-charts.md).

One pass walks from the mark (``solidloop_rollup_marks``: every minute before
it is in) to the last complete minute, an hour at a time. Each hour is one
transaction that locks the mark row, recomputes its minutes from the loops'
rows (loops/stats.source_figures), *replaces* their minute rows, recomputes
the hour rows those minutes fall in from the minute rows, and moves the mark:

* a rerun never double counts: rows are replaced, never incremented;
* a crash anywhere rolls the hour back whole, mark included: the next pass
  redoes it;
* concurrent passes (two leaders for a moment, the CLI beside a worker) queue
  on the mark's row lock and write the same rows;
* each pass starts :data:`SETTLE` before the mark, so a turn whose commit
  landed after its minute was rolled up is counted by the next pass.

The first pass starts :data:`BACKFILL` back (the longest chart). The pass also
deletes rows older than ``SOLIDLOOP_ROLLUP_RETENTION``. The fleet's leading
worker runs it every ``SOLIDLOOP_ROLLUP_INTERVAL`` seconds; ``flask solidloop
rollup`` runs it by hand. Each pass records itself (task ``rollup``) in
solidloop_maintenance_runs.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text

from .._typing import SessionLike
from ..loops import stats
from ..state import SolidLoopState
from . import runs

logger = logging.getLogger("flask_solidloop.rollup")

#: The mark's name in solidloop_rollup_marks.
MARK = "turn_stats"
#: Each pass recomputes this much before the mark (turns that committed late).
SETTLE = timedelta(minutes=5)
#: Minutes recomputed per transaction.
CHUNK = timedelta(hours=1)
#: Where the first pass starts: the longest chart range back.
BACKFILL = timedelta(days=7)

_LOCK_MARK = text("SELECT rolled_to FROM solidloop_rollup_marks WHERE name = :name FOR UPDATE")
_FIRST_MARK = text(
    "INSERT INTO solidloop_rollup_marks (name, rolled_to) VALUES (:name, :at) "
    "ON CONFLICT (name) DO NOTHING")
_MOVE_MARK = text("UPDATE solidloop_rollup_marks SET rolled_to = :at, updated_at = now() "
                  "WHERE name = :name")
_DELETE = text("DELETE FROM solidloop_turn_stats WHERE span_seconds = :span "
               "AND starts_at >= :since AND starts_at < :until")
_INSERT = text(
    "INSERT INTO solidloop_turn_stats (span_seconds, starts_at, agent_name, llm_turns, "
    "tool_turns, input_tokens, output_tokens, cost, latency, failures) VALUES (:span, "
    ":starts_at, :agent_name, :llm_turns, :tool_turns, :input_tokens, :output_tokens, :cost, "
    "CAST(:latency AS integer[]), CAST(:failures AS jsonb))")


@dataclass
class RollupReport:
    """What one pass did."""

    chunks: int = 0
    minute_rows: int = 0
    hour_rows: int = 0
    pruned: int = 0
    rolled_to: datetime | None = None

    def counts(self) -> dict[str, int]:
        return {"chunks": self.chunks, "minute_rows": self.minute_rows,
                "hour_rows": self.hour_rows, "pruned": self.pruned}


def _hour(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


def _insert(session: SessionLike, span: int,
            rows: dict[tuple[datetime, str], stats.Figures]) -> int:
    params = [{"span": span, "starts_at": at, "agent_name": agent,
               "llm_turns": f.llm_turns, "tool_turns": f.tool_turns,
               "input_tokens": f.input_tokens, "output_tokens": f.output_tokens,
               "cost": f.cost, "latency": f.latency,
               "failures": json.dumps(f.failures, sort_keys=True)}
              for (at, agent), f in sorted(rows.items())]
    if params:
        session.execute(_INSERT, params)
    return len(params)


def write_minutes(session: SessionLike, since: datetime, until: datetime) -> int:
    """Replace the minute rows of [since, until) with the source's sums."""
    found = stats.source_figures(session, since, until)
    session.execute(_DELETE, {"span": stats.MINUTE, "since": since, "until": until})
    return _insert(session, stats.MINUTE, found)


def write_hours(session: SessionLike, since: datetime, until: datetime) -> int:
    """Replace the hour rows of the hours [since, until) with the sums of their
    minute rows, per agent and for all agents (:data:`stats.ALL_AGENTS`)."""
    minutes = stats.rolled_rows(session, stats.MINUTE, since, until)
    hours: dict[tuple[datetime, str], stats.Figures] = {}
    for (minute, agent), figures in minutes.items():
        hours.setdefault((_hour(minute), agent), stats.Figures()).add(figures)
        hours.setdefault((_hour(minute), stats.ALL_AGENTS), stats.Figures()).add(figures)
    session.execute(_DELETE, {"span": stats.HOUR, "since": since, "until": until})
    return _insert(session, stats.HOUR, hours)


def _one_chunk(session: SessionLike, end: datetime, report: RollupReport) -> bool:
    """Roll up the next hour after the mark, up to ``end``, in one transaction;
    False when the mark has reached ``end``."""
    mark = session.execute(_LOCK_MARK, {"name": MARK}).scalar_one_or_none()
    if mark is None:
        session.execute(_FIRST_MARK, {"name": MARK, "at": _hour(end - BACKFILL)})
        mark = session.execute(_LOCK_MARK, {"name": MARK}).scalar_one()
    report.rolled_to = mark
    if mark >= end:
        session.rollback()
        return False
    since = mark - SETTLE if report.chunks == 0 else mark
    until = min(mark + CHUNK, end)
    report.minute_rows += write_minutes(session, since, until)
    report.hour_rows += write_hours(session, _hour(since),
                                    _hour(until - timedelta(microseconds=1)) + timedelta(hours=1))
    session.execute(_MOVE_MARK, {"name": MARK, "at": until})
    session.commit()
    report.chunks += 1
    report.rolled_to = until
    return True


def prune_stats(session: SessionLike, retention: int | None) -> int:
    """Delete rows that started longer than ``retention`` seconds ago."""
    if retention is None:
        return 0
    result: Any = session.execute(text(
        "DELETE FROM solidloop_turn_stats WHERE starts_at < now() - make_interval(secs => :s)"),
        {"s": int(retention)})
    deleted = result.rowcount
    session.commit()
    return int(deleted or 0)


def rollup(state: SolidLoopState, *, until: datetime | None = None) -> RollupReport:
    """One pass: every complete minute from the mark to ``until`` (default: the
    current minute's start), then the retention. Records itself; re-raises."""
    session = state.db.session
    report = RollupReport()
    started = time.monotonic()
    try:
        if until is None:
            now: datetime = session.execute(select(func.now())).scalar_one()
            until = now.replace(second=0, microsecond=0)
        while _one_chunk(session, until, report):
            pass
        report.pruned = prune_stats(session, state.config.rollup_retention)
    except Exception as exc:
        session.rollback()
        runs.record(state, "rollup", duration_ms=(time.monotonic() - started) * 1000,
                    total=report.minute_rows, counts=report.counts(), error=exc)
        raise
    runs.record(state, "rollup", duration_ms=(time.monotonic() - started) * 1000,
                total=report.minute_rows, counts=report.counts())
    logger.info("rollup: %s chunk(s), %s minute row(s), %s hour row(s), %s pruned; "
                "rolled to %s", report.chunks, report.minute_rows, report.hour_rows,
                report.pruned, report.rolled_to)
    return report
