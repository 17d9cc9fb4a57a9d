"""The janitor: retention for the tables that grow without bound.

Off by default: silently deleting a host's audit trail on upgrade would be the
wrong default. Each kind of row has its own opt-in setting. Deletes run in
batches of ``SOLIDLOOP_JANITOR_BATCH_SIZE``, each its own short transaction,
so a sweep never holds one long lock on a table being written to. Idempotent
and safe to run from several processes at once (a batch that loses a race
simply deletes fewer rows).

* ``solidloop_events`` older than ``SOLIDLOOP_EVENT_RETENTION``
* ``solidloop_jobs`` in state ``done`` finished longer ago than
  ``SOLIDLOOP_FINISHED_JOB_RETENTION`` (dead-lettered jobs are kept: someone
  has to look at them)
* ``solidloop_host_jobs`` (RQ-style job records) past their ``expires_at``,
  which each job's ``result_ttl`` / ``failure_ttl`` set when it ended, and
  ``solidloop_results`` (the dramatiq Results backend) past theirs. These are
  always pruned: the TTL is the retention the host asked for, as in RQ.
* ``solidloop_mcp_inbound_sessions`` (outside MCP clients' sessions with an
  MCP server blueprint) created longer ago than
  ``SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION``, live or not (clients often
  never send DELETE), together with their ``mcp_inbound`` events.
* ``solidloop_workers`` rows of workers stopped or silent longer than
  ``SOLIDLOOP_WORKER_RETENTION`` (on by default: a registry row is not an audit
  trail; each worker's heartbeat prunes them too).

Each sweep, successful or not, ends with one upsert of the ``prune`` row of
solidloop_maintenance_runs (maintenance/runs.py), which the admin shows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import text

from ..config import Config
from ..queue import sql
from ..state import SolidLoopState
from . import runs

logger = logging.getLogger("flask_solidloop.janitor")

#: How often worker processes run the janitor when a retention setting turns it on.
JANITOR_INTERVAL = 300.0


def runs_in_workers(config: Config) -> bool:
    """Whether worker processes run the janitor (every :data:`JANITOR_INTERVAL`
    seconds): only when a retention setting asks for it."""
    return bool(config.event_retention or config.finished_job_retention
                or config.mcp_inbound_session_retention)

# ``id = ANY(ARRAY(...))``, not ``id IN (...)``: the batch's ids are computed
# first and deleted by primary key. With ``IN``, a generic plan (what a
# statement psycopg has prepared may get) hash-joins the batch against a
# sequential scan of the whole table, once per batch.
_PRUNE_EVENTS = """
DELETE FROM solidloop_events WHERE id = ANY(ARRAY(
    SELECT id FROM solidloop_events WHERE created_at < now() - :age
    ORDER BY id LIMIT :batch FOR UPDATE SKIP LOCKED))
"""
_PRUNE_JOBS = """
DELETE FROM solidloop_jobs WHERE id = ANY(ARRAY(
    SELECT id FROM solidloop_jobs WHERE state = 'done' AND finished_at < now() - :age
    ORDER BY id LIMIT :batch FOR UPDATE SKIP LOCKED))
"""

_PRUNE_HOST_JOBS = """
DELETE FROM solidloop_host_jobs WHERE id IN (
    SELECT id FROM solidloop_host_jobs WHERE expires_at < now()
    ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)
"""
_PRUNE_RESULTS = """
DELETE FROM solidloop_results WHERE key IN (
    SELECT key FROM solidloop_results WHERE expires_at < now()
    ORDER BY expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)
"""

# One batch of old inbound sessions and, in the same statement, the wire-log
# events that name them (their session id is in the payload).
_PRUNE_INBOUND_SESSIONS = """
WITH gone AS (
    DELETE FROM solidloop_mcp_inbound_sessions WHERE id IN (
        SELECT id FROM solidloop_mcp_inbound_sessions WHERE created_at < now() - :age
        ORDER BY created_at LIMIT :batch FOR UPDATE SKIP LOCKED)
    RETURNING id
), events AS (
    DELETE FROM solidloop_events
    WHERE kind = 'mcp_inbound' AND payload->>'session_id' IN (SELECT id FROM gone)
)
SELECT count(*) FROM gone
"""


@dataclass
class PruneReport:
    events: int = 0
    jobs: int = 0
    host_jobs: int = 0
    results: int = 0
    inbound_sessions: int = 0
    workers: int = 0
    duration_ms: float = 0.0

    def counts(self) -> dict[str, int]:
        """Rows deleted, per table (what the pass's record stores)."""
        return {name: value for name, value in vars(self).items() if name != "duration_ms"}

    @property
    def pruned(self) -> int:
        return sum(self.counts().values())


def _prune(state: SolidLoopState, query: str, seconds: int | None, *,
           counted: bool = False) -> int:
    session = state.db.session
    batch = state.config.janitor_batch_size
    params: dict[str, object] = {"batch": batch}
    if seconds is not None:
        params["age"] = timedelta(seconds=seconds)
    total = 0
    while True:
        result = session.execute(text(query), params)
        # A statement that deletes in a CTE reports its count as a row.
        deleted = result.scalar_one() if counted else result.rowcount  # type: ignore[attr-defined]
        session.commit()
        total += deleted
        if deleted < batch:
            return total


def _prune_workers(state: SolidLoopState) -> int:
    session = state.db.session
    cursor = session.connection().connection.cursor()
    try:
        cursor.execute(sql.WORKER_PRUNE, {"age": state.config.worker_retention})
        deleted = cursor.rowcount
    finally:
        cursor.close()
    session.commit()
    return deleted


def prune(state: SolidLoopState) -> PruneReport:
    """One janitor sweep over every table with a retention setting."""
    started = time.perf_counter()
    report = PruneReport()
    config = state.config
    try:
        if config.event_retention:
            report.events = _prune(state, _PRUNE_EVENTS, config.event_retention)
        if config.finished_job_retention:
            report.jobs = _prune(state, _PRUNE_JOBS, config.finished_job_retention)
        report.host_jobs = _prune(state, _PRUNE_HOST_JOBS, None)
        report.results = _prune(state, _PRUNE_RESULTS, None)
        if config.mcp_inbound_session_retention:
            report.inbound_sessions = _prune(state, _PRUNE_INBOUND_SESSIONS,
                                             config.mcp_inbound_session_retention, counted=True)
        report.workers = _prune_workers(state)
    except Exception as exc:
        state.db.session.rollback()
        report.duration_ms = (time.perf_counter() - started) * 1000
        runs.record(state, "prune", duration_ms=report.duration_ms, total=report.pruned,
                    counts=report.counts(), error=exc)
        raise
    report.duration_ms = (time.perf_counter() - started) * 1000
    state.last_pruned_at = time.time()
    runs.record(state, "prune", duration_ms=report.duration_ms, total=report.pruned,
                counts=report.counts())
    logger.info("janitor pruned %d event(s), %d job(s), %d expired host job(s), %d "
                "result(s), %d inbound MCP session(s) and %d worker row(s) in %.1f ms",
                report.events, report.jobs, report.host_jobs, report.results,
                report.inbound_sessions, report.workers, report.duration_ms)
    return report
