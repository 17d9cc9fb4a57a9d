"""The record of maintenance passes: owns ``solidloop_maintenance_runs``.

:func:`record` upserts one task's row (``reap``, ``prune``) at the end of each
pass, in the reaper's and the janitor's own code, so every way a pass runs is
covered: a worker's periodic thread, the maintenance actor, the CLI. It is
one statement in its own short transaction, after the pass has committed (or
rolled back) its own work. Recording is best effort: a pass that worked is
never turned into a failure because its record could not be written (say the
host has not run migration 0008 yet), and a failed pass's exception is
re-raised as it was, whatever happens to its record. :func:`last_runs` reads
the rows for the admin dashboard, :func:`finished_within` for the workers'
janitor deciding whether a sweep is due.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from sqlalchemy import select, text

from .._typing import SessionLike
from ..leases import worker_identity
from ..models import MaintenanceRun
from ..state import SolidLoopState
from ..urls import redact_urls_in

logger = logging.getLogger("flask_solidloop.maintenance")

#: The longest error text kept (the start of it: class and message).
MAX_ERROR = 2000

# Timestamps on the database clock, like everything the admin compares with
# now(): the pass started ``duration`` before the statement ran.
_UPSERT = text("""
INSERT INTO solidloop_maintenance_runs AS r
       (task, last_started_at, last_finished_at, duration_ms, last_ok, total, counts,
        last_error, last_error_at, holder, passes, updated_at)
VALUES (:task, statement_timestamp() - make_interval(secs => :duration_ms / 1000.0),
        statement_timestamp(), :duration_ms, :ok, :total, CAST(:counts AS jsonb),
        :error, CASE WHEN :ok THEN NULL ELSE statement_timestamp() END, :holder, 1,
        statement_timestamp())
ON CONFLICT (task) DO UPDATE SET
       last_started_at = EXCLUDED.last_started_at,
       last_finished_at = EXCLUDED.last_finished_at,
       duration_ms = EXCLUDED.duration_ms,
       last_ok = EXCLUDED.last_ok,
       total = EXCLUDED.total,
       counts = EXCLUDED.counts,
       last_error = CASE WHEN EXCLUDED.last_ok THEN r.last_error ELSE EXCLUDED.last_error END,
       last_error_at = CASE WHEN EXCLUDED.last_ok THEN r.last_error_at
                            ELSE EXCLUDED.last_error_at END,
       holder = EXCLUDED.holder,
       passes = r.passes + 1,
       updated_at = EXCLUDED.updated_at
""")

# A diagnostic row: its commit need not wait for the WAL flush (a crash may
# lose the last pass's record, never anything the pass did).
_ASYNC_COMMIT = text("SET LOCAL synchronous_commit = off")

#: Tasks whose record could not be written, so the warning is logged once per
#: process and task, not every two seconds.
_warned: set[str] = set()


def error_text(exc: BaseException) -> str:
    """What a failed pass records: class and message, URLs redacted, bounded."""
    message = f"{type(exc).__name__}: {exc}".strip()
    return redact_urls_in(message)[:MAX_ERROR]


def record(state: SolidLoopState, task: str, *, duration_ms: float, total: int,
           counts: Mapping[str, int], error: BaseException | None = None) -> bool:
    """Upsert ``task``'s row for the pass that just ended; True when written.

    Runs on the state's session, in the transaction the pass left open (the
    reaper's repairs that found nothing leave their reads to it, so an idle
    pass is one transaction) or a new one; commits at once. Never raises (see
    the module docstring)."""
    session = state.db.session
    params = {"task": task, "duration_ms": float(duration_ms), "ok": error is None,
              "total": int(total), "counts": json.dumps(dict(counts), sort_keys=True),
              "error": error_text(error) if error is not None else None,
              "holder": worker_identity()[:200]}
    try:
        session.execute(_ASYNC_COMMIT)
        session.execute(_UPSERT, params)
        session.commit()
    except Exception:
        try:
            session.rollback()
        except Exception:
            logger.debug("rollback after a failed %s record failed too", task, exc_info=True)
        if task not in _warned:
            _warned.add(task)
            logger.warning("could not record the %s pass in solidloop_maintenance_runs "
                           "(has `flask solidloop db upgrade` run?)", task, exc_info=True)
        else:
            logger.debug("could not record the %s pass", task, exc_info=True)
        return False
    _warned.discard(task)
    return True


_FINISHED_WITHIN = text("""
SELECT EXISTS (SELECT 1 FROM solidloop_maintenance_runs
               WHERE task = :task AND last_ok
                 AND last_finished_at > statement_timestamp() - make_interval(secs => :seconds))
""")


def finished_within(state: SolidLoopState, task: str, seconds: float) -> bool:
    """Whether some process finished a successful ``task`` pass in the last
    ``seconds`` (database clock). False when that cannot be read (say migration
    0008 has not run), so a caller deciding whether to run a pass runs it."""
    session = state.db.session
    try:
        recent = bool(session.execute(_FINISHED_WITHIN,
                                      {"task": task, "seconds": float(seconds)}).scalar_one())
        session.rollback()
    except Exception:
        try:
            session.rollback()
        except Exception:
            logger.debug("rollback after a failed %s read failed too", task, exc_info=True)
        logger.debug("could not read the last %s pass", task, exc_info=True)
        return False
    return recent


def last_runs(session: SessionLike) -> dict[str, MaintenanceRun]:
    """Every task's row, by task name (an absent task has never recorded a pass)."""
    return {row.task: row for row in session.scalars(select(MaintenanceRun))}
