"""Which job the current worker thread is running, so an actor can mark it done.

An actor that changes loop state calls :func:`mark_current_job_done` inside
the same transaction: if that transaction commits, the job is done even if the
worker dies a microsecond later; if it rolls back, the job stays claimed and is
acknowledged (or redelivered) by the broker as usual. The thread-local is set
by :class:`~flask_solidloop.queue.middleware.current_job.CurrentJobMiddleware`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..dbapi import execute_on
from . import sql as jobs_sql

_local = threading.local()


@dataclass(frozen=True)
class CurrentJob:
    job_id: int
    lease_token: Any
    attempts: int


def current_job() -> CurrentJob | None:
    return getattr(_local, "job", None)


def set_current_job(job: CurrentJob | None) -> None:
    _local.job = job
    _local.committed_done = None


def save_current_job() -> tuple[CurrentJob | None, int | None]:
    """The thread's job and whether it committed it done, to restore after running
    another job in the same thread (inline continuation)."""
    return current_job(), getattr(_local, "committed_done", None)


def restore_current_job(saved: tuple[CurrentJob | None, int | None]) -> None:
    _local.job, _local.committed_done = saved


def note_current_job_done() -> None:
    """The transaction that marked the running job done has committed: its row is
    ``done`` already, and the acknowledgement after the actor returns would
    match nothing (see CurrentJobMiddleware)."""
    job = current_job()
    if job is not None:
        _local.committed_done = job.job_id


def job_done_committed(job_id: int) -> bool:
    """Whether this thread committed job ``job_id`` done inside the actor."""
    return getattr(_local, "committed_done", None) == job_id


def mark_current_job_done(connection: Any) -> bool:
    """Mark the running job done on ``connection`` (inside the caller's transaction).

    Returns False when the thread is not running a Postgres-brokered job (for
    example a test calling an actor function directly).
    """
    job = current_job()
    if job is None:
        return False
    execute_on(connection, jobs_sql.MARK_DONE, (job.job_id, job.lease_token))
    return True


def current_job_done_params() -> tuple[dict[str, Any], bool]:
    """The parameters of :data:`~.sql.MARK_DONE_WHEN` for the running job, and
    whether the statement's commit leaves it done (what
    :func:`mark_current_job_done` returns). The parameters are NULL, matching
    no row, when there is no job."""
    job = current_job()
    if job is None:
        return {"job_id": None, "job_lease": None}, False
    return {"job_id": job.job_id, "job_lease": job.lease_token}, True
