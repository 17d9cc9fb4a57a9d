"""The janitor: retention for the tables that grow without bound.

On by default (decision 0019): every table below has a retention, each
settable, and ``None`` keeps that table's rows forever. Deletes run in batches
of ``SOLIDLOOP_JANITOR_BATCH_SIZE``, each its own short transaction, so a sweep
never holds one long lock on a table being written to. Idempotent and safe to
run from several processes at once (a batch that loses a race simply deletes
fewer rows). Worker processes sweep every ``SOLIDLOOP_JANITOR_INTERVAL``
seconds (:func:`prune_if_due`).

* ``solidloop_events`` older than ``SOLIDLOOP_EVENT_RETENTION`` (30 days)
* ``solidloop_jobs`` in state ``done`` finished longer ago than
  ``SOLIDLOOP_FINISHED_JOB_RETENTION`` (7 days)
* ``solidloop_host_jobs`` (RQ-style job records) that ended and are past their
  ``expires_at``, which each job's ``result_ttl`` / ``failure_ttl`` set when it
  ended, and ``solidloop_results`` (the dramatiq Results backend) past theirs
* ``solidloop_mcp_inbound_sessions`` (outside MCP clients' sessions with an
  MCP server blueprint) created longer ago than
  ``SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION`` (a day), live or not (clients
  often never send DELETE), together with their ``mcp_inbound`` events
* ``solidloop_workers`` rows of workers stopped or silent longer than
  ``SOLIDLOOP_WORKER_RETENTION`` (each worker's heartbeat prunes them too)
* ended loops (``completed``, ``failed``) that ended longer ago than
  ``SOLIDLOOP_LOOP_RETENTION`` (None by default: kept forever), with their
  messages, tool calls, wire-log and stream events, after the host's
  ``on_loop_archive`` hooks have seen each one, ``SOLIDLOOP_LOOP_PURGE_BATCH_SIZE``
  loops per transaction (:func:`purge_loops`; the statements and the rule of
  what holds a loop back are the loop store's: loops/store/retention.py,
  docs/decisions/0030-loop-retention.md)

Never deleted, whatever their age: a loop that has not ended (any status but
``completed`` and ``failed``), and its events and jobs (a loop waiting weeks
for an approval keeps its wire log); an ended loop that a queued or running
job or a leased tool call still needs; queued and running jobs, dead-lettered jobs
(someone has to look at them), and RQ-style jobs that have not ended or whose
TTL has not passed, with their deliveries in ``solidloop_jobs`` (the record
reads its args from them). Those rules are in the statements themselves, so no sweep
can race the engine into deleting what a live loop may still read.

Each sweep, successful or not, ends with one upsert of the ``prune`` row of
solidloop_maintenance_runs (maintenance/runs.py), which the admin shows;
:func:`preview` (``flask solidloop prune --dry-run``) counts without deleting
and records nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import text

from ..config import Config
from ..loops import store
from ..models.loop import TERMINAL_STATUSES
from ..queue import sql
from ..state import SolidLoopState
from . import runs

logger = logging.getLogger("flask_solidloop.janitor")

#: A worker skips its sweep when any process finished one within this share of
#: the interval: with many workers the cluster still sweeps about once per
#: interval, and each skip costs one indexed read.
_DUE_SHARE = 0.9

# A loop's events and jobs may go only once it is in a terminal status
# (completed, failed). Every other status (init, queued, running, waiting,
# paused) is a loop that may still be written to, or read back by the engine
# or an operator.
_ENDED = ", ".join(f"'{status}'" for status in TERMINAL_STATUSES)


def _loop_not_ended(alias: str) -> str:
    """Whether the loop of row ``alias`` (its ``loop_id``, NULL for rows of no
    loop) still lives. Spelled once so every rule that touches loop rows
    guards them the same way."""
    return (f"EXISTS (SELECT 1 FROM solidloop_loops AS l WHERE l.id = {alias}.loop_id "
            f"AND l.status NOT IN ({_ENDED}))")


def runs_in_workers(config: Config) -> bool:
    """Whether worker processes run the janitor: unless
    ``SOLIDLOOP_JANITOR_INTERVAL`` is 0."""
    return config.janitor_interval > 0


def _cutoff(seconds: int) -> str:
    """``now()`` less ``seconds``, written into the statement rather than passed
    as a parameter: a generic plan (what a statement psycopg has prepared may
    get) cannot see a parameter's value, and would walk the events' primary key
    from its first row to learn that nothing is old enough, at every sweep. The
    seconds are a validated Config integer, never input."""
    return f"now() - make_interval(secs => {int(seconds)})"


# The rows each rule would delete, without a limit. A sweep deletes them in
# batches by key (``_delete``); a preview counts them (``_count``).
#
# ``key = ANY(ARRAY(...))``, not ``key IN (...)``: the batch's keys are
# computed first and deleted by primary key. With ``IN``, a generic plan
# hash-joins the batch against a sequential scan of the whole table, once per
# batch.
def _old_events(seconds: int) -> str:
    return f"""
    SELECT e.id FROM solidloop_events AS e
    WHERE e.created_at < {_cutoff(seconds)} AND NOT {_loop_not_ended("e")}"""


# An RQ-style job record past its TTL. ``expires_at`` is set when a job ends;
# the status guard keeps a job that was requeued (or is otherwise live again)
# whatever a stale expiry says. Never NULL (NULL expires_at: kept forever), so
# it can be negated.
_HOST_JOB_EXPIRED = ("h.expires_at IS NOT NULL AND h.expires_at < now() "
                     "AND h.status IN ('finished', 'failed', 'canceled')")


def _old_done_jobs(seconds: int) -> str:
    # A delivery of an RQ-style job whose record is kept stays too: the record
    # reads its args, attempts and start time from it (jobs/rq.py). A record
    # that this sweep deletes (past its TTL) does not hold its delivery back,
    # so a preview counts what one sweep deletes.
    return f"""
    SELECT j.id FROM solidloop_jobs AS j
    WHERE j.state = 'done' AND j.finished_at < {_cutoff(seconds)}
      AND NOT {_loop_not_ended("j")}
      AND (j.actor_name <> '{sql.HOST_JOB_ACTOR}' OR NOT EXISTS (
          SELECT 1 FROM solidloop_host_jobs AS h
          WHERE h.message_id = j.message_id AND NOT ({_HOST_JOB_EXPIRED})))"""


_EXPIRED_HOST_JOBS = f"""
    SELECT h.id FROM solidloop_host_jobs AS h WHERE {_HOST_JOB_EXPIRED}"""
_EXPIRED_RESULTS = """
    SELECT r.key FROM solidloop_results AS r WHERE r.expires_at < now()"""
_OLD_SPEND = """
    SELECT s.id FROM solidloop_spend AS s WHERE s.at < now() - :age"""
_OLD_INBOUND_SESSIONS = """
    SELECT s.id FROM solidloop_mcp_inbound_sessions AS s WHERE s.created_at < now() - :age"""


def _delete(table: str, alias: str, key: str, candidates: str) -> str:
    """One batch of ``candidates`` (selecting ``alias.key`` from ``table``) deleted."""
    return (f"DELETE FROM {table} WHERE {key} = ANY(ARRAY({candidates}\n"
            f"    ORDER BY {alias}.{key} LIMIT :batch FOR UPDATE OF {alias} SKIP LOCKED))")


def _count(candidates: str) -> str:
    return f"SELECT count(*) FROM ({candidates}) AS candidates"


def prune_events_sql(seconds: int) -> str:
    """One batch of the events rule (tests read its plan)."""
    return _delete("solidloop_events", "e", "id", _old_events(seconds))


def prune_jobs_sql(seconds: int) -> str:
    """One batch of the done-jobs rule (tests read its plan)."""
    return _delete("solidloop_jobs", "j", "id", _old_done_jobs(seconds))


_PRUNE_HOST_JOBS = _delete("solidloop_host_jobs", "h", "id", _EXPIRED_HOST_JOBS)
_PRUNE_RESULTS = _delete("solidloop_results", "r", "key", _EXPIRED_RESULTS)
_PRUNE_SPEND = _delete("solidloop_spend", "s", "id", _OLD_SPEND)


def spend_retention(config: Config) -> int:
    """How long a subject's ledger rows stay: SOLIDLOOP_SPEND_RETENTION, and
    never less than the subject budget's window (a row inside it still counts)."""
    window = config.subject_budget.window if config.subject_budget is not None else 0
    return int(max(config.spend_retention, window))

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
    """Rows deleted (or, from :func:`preview`, that a sweep would delete), per table."""

    events: int = 0
    jobs: int = 0
    host_jobs: int = 0
    results: int = 0
    inbound_sessions: int = 0
    workers: int = 0
    spend: int = 0
    #: Ended loops deleted, each with all its rows.
    loops: int = 0
    #: Loops an ``on_loop_archive`` hook kept by raising (not a count of rows).
    loops_kept: int = 0
    duration_ms: float = 0.0

    def counts(self) -> dict[str, int]:
        """Rows per table (what the pass's record stores)."""
        return {name: value for name, value in vars(self).items()
                if name not in ("duration_ms", "loops_kept")}

    @property
    def pruned(self) -> int:
        return sum(self.counts().values())


@dataclass(frozen=True)
class Rule:
    """What one of the report's tables loses, in words, for ``prune --dry-run``."""

    #: The :class:`PruneReport` field.
    name: str
    #: The rows that go, or why none do (a retention of None).
    goes: str


def _days(seconds: float) -> str:
    if seconds % 86400 == 0:
        days = int(seconds // 86400)
        return "1 day" if days == 1 else f"{days} days"
    if seconds % 3600 == 0:
        hours = int(seconds // 3600)
        return "1 hour" if hours == 1 else f"{hours} hours"
    return f"{seconds:g} s"


def rules(config: Config) -> list[Rule]:
    """Each table's rule under ``config``, in the report's order."""
    def kept(key: str, seconds: int | None, goes: str) -> str:
        if seconds is None:
            return f"none: {key} is None (kept forever)"
        return goes.format(age=_days(seconds)) + f" ({key})"

    return [
        Rule("events", kept("SOLIDLOOP_EVENT_RETENTION", config.event_retention,
                            "wire-log events older than {age}, of ended loops or of none")),
        Rule("jobs", kept("SOLIDLOOP_FINISHED_JOB_RETENTION", config.finished_job_retention,
                          "done jobs finished more than {age} ago, of ended loops or of none")),
        Rule("host_jobs", "RQ-style jobs that ended and are past their result_ttl / "
                          "failure_ttl"),
        Rule("results", "dramatiq results past their expiry"),
        Rule("inbound_sessions", kept("SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION",
                                      config.mcp_inbound_session_retention,
                                      "inbound MCP sessions created more than {age} ago, "
                                      "with their events")),
        Rule("workers", f"worker rows stopped or silent for more than "
                        f"{_days(config.worker_retention)} (SOLIDLOOP_WORKER_RETENTION)"),
        Rule("spend", f"subjects' ledger rows older than {_days(spend_retention(config))} "
                      "(SOLIDLOOP_SPEND_RETENTION, at least the subject budget's window)"),
        Rule("loops", kept("SOLIDLOOP_LOOP_RETENTION", config.loop_retention,
                           "loops that ended more than {age} ago, with their messages, "
                           "tool calls and events")),
    ]


#: What no sweep deletes, whatever the settings (``prune --dry-run`` says it).
NEVER_DELETED = ("loops not yet ended (init, queued, running, waiting, paused) and their "
                 "events and jobs, ended loops with a queued or running job or a leased "
                 "tool call, queued and running jobs, dead-lettered jobs, RQ-style jobs "
                 "not yet ended or inside their TTL, and their deliveries")


def _age(seconds: int) -> dict[str, object]:
    return {"age": timedelta(seconds=seconds)}


def _prune(state: SolidLoopState, query: str, params: dict[str, object], *,
           counted: bool = False) -> int:
    session = state.db.session
    batch = state.config.janitor_batch_size
    params = {**params, "batch": batch}
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


@dataclass
class LoopPurge:
    """What :func:`purge_loops` did in one pass."""

    deleted: int = 0
    #: ``(loop id, error)`` of the loops an ``on_loop_archive`` hook kept.
    kept: list[tuple[int, BaseException]] = field(default_factory=list)


def purge_loops(state: SolidLoopState, retention: int | None = None) -> LoopPurge:
    """Delete the loops that ended longer than ``retention`` seconds ago
    (default SOLIDLOOP_LOOP_RETENTION; None there: nothing), a batch of
    SOLIDLOOP_LOOP_PURGE_BATCH_SIZE per transaction, oldest first, each after
    the host's ``on_loop_archive`` hooks. A loop a hook keeps is passed over
    (the pass's cursor moves on) and tried again at the next pass; the pass
    logs them in one line."""
    seconds = state.config.loop_retention if retention is None else retention
    purge = LoopPurge()
    if seconds is None:
        return purge
    hooks = tuple(state.extension.loop_archive_hooks)
    age = timedelta(seconds=seconds)
    batch = state.config.loop_purge_batch_size
    cursor = store.retention.START
    session = state.db.session
    while True:
        try:
            done = store.purge_ended_loops(session, age=age, batch=batch, after=cursor,
                                           hooks=hooks)
        except Exception:
            session.rollback()
            raise
        purge.deleted += done.deleted
        purge.kept += done.kept
        cursor = done.cursor
        if done.taken < batch:
            break
    if purge.kept:
        loop_id, error = purge.kept[0]
        logger.warning("on_loop_archive raised for %d loop(s) this pass, which were kept "
                       "and are tried again at the next pass (first: loop %s: %s: %s)",
                       len(purge.kept), loop_id, type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "")
    return purge


def prune(state: SolidLoopState) -> PruneReport:
    """One janitor sweep over every table with a retention."""
    started = time.perf_counter()
    report = PruneReport()
    config = state.config
    try:
        if config.event_retention is not None:
            report.events = _prune(state, prune_events_sql(config.event_retention), {})
        if config.finished_job_retention is not None:
            report.jobs = _prune(state, prune_jobs_sql(config.finished_job_retention), {})
        report.host_jobs = _prune(state, _PRUNE_HOST_JOBS, {})
        report.results = _prune(state, _PRUNE_RESULTS, {})
        if config.mcp_inbound_session_retention is not None:
            report.inbound_sessions = _prune(
                state, _PRUNE_INBOUND_SESSIONS, _age(config.mcp_inbound_session_retention),
                counted=True)
        report.workers = _prune_workers(state)
        report.spend = _prune(state, _PRUNE_SPEND, _age(spend_retention(config)))
        if config.loop_retention is not None:
            purge = purge_loops(state)
            report.loops, report.loops_kept = purge.deleted, len(purge.kept)
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
                "result(s), %d inbound MCP session(s), %d worker row(s), %d ledger "
                "row(s) and %d ended loop(s) in %.1f ms", report.events, report.jobs,
                report.host_jobs, report.results, report.inbound_sessions, report.workers,
                report.spend, report.loops, report.duration_ms)
    return report


def preview(state: SolidLoopState) -> PruneReport:
    """What :func:`prune` would delete now, counted in one read-only transaction:
    nothing is deleted and no pass is recorded."""
    started = time.perf_counter()
    config = state.config
    session = state.db.session

    def count(candidates: str, params: dict[str, object]) -> int:
        return int(session.execute(text(_count(candidates)), params).scalar_one())

    report = PruneReport()
    try:
        if config.event_retention is not None:
            report.events = count(_old_events(config.event_retention), {})
        if config.finished_job_retention is not None:
            report.jobs = count(_old_done_jobs(config.finished_job_retention), {})
        report.host_jobs = count(_EXPIRED_HOST_JOBS, {})
        report.results = count(_EXPIRED_RESULTS, {})
        if config.mcp_inbound_session_retention is not None:
            report.inbound_sessions = count(_OLD_INBOUND_SESSIONS,
                                            _age(config.mcp_inbound_session_retention))
        report.spend = count(_OLD_SPEND, _age(spend_retention(config)))
        if config.loop_retention is not None:
            report.loops = store.count_ended_loops(
                session, age=timedelta(seconds=config.loop_retention))
        cursor = session.connection().connection.cursor()
        try:
            cursor.execute(sql.WORKER_PRUNE_COUNT, {"age": config.worker_retention})
            (workers,) = cursor.fetchone() or (0,)
            report.workers = int(workers)
        finally:
            cursor.close()
    finally:
        session.rollback()
    report.duration_ms = (time.perf_counter() - started) * 1000
    return report


def prune_if_due(state: SolidLoopState) -> PruneReport | None:
    """A worker's periodic sweep: :func:`prune`, unless some process (a worker, the
    CLI, the maintenance actor) finished one successfully within most of
    ``SOLIDLOOP_JANITOR_INTERVAL``. None when skipped."""
    if runs.finished_within(state, "prune", _DUE_SHARE * state.config.janitor_interval):
        logger.debug("janitor: a sweep finished recently; skipping this one")
        return None
    return prune(state)
