"""Which job the current worker thread is running, so an actor can mark it done.

An actor that changes loop state calls :func:`mark_current_job_done` inside
the same transaction: if that transaction commits, the job is done even if the
worker dies a microsecond later; if it rolls back, the job stays claimed and is
acknowledged (or redelivered) by the broker as usual.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import dramatiq

from .broker import PostgresMessageProxy, execute_on

_local = threading.local()

_MARK_DONE = (
    "UPDATE solidloop_jobs SET state = 'done', finished_at = now(), lease_until = NULL "
    "WHERE id = %s AND lease_token = %s AND state = 'running'"
)


@dataclass(frozen=True)
class CurrentJob:
    job_id: int
    lease_token: Any
    attempts: int


def current_job() -> CurrentJob | None:
    return getattr(_local, "job", None)


def mark_current_job_done(connection: Any) -> bool:
    """Mark the running job done on ``connection`` (inside the caller's transaction).

    Returns False when the thread is not running a Postgres-brokered job (for
    example a test calling an actor function directly).
    """
    job = current_job()
    if job is None:
        return False
    execute_on(connection, _MARK_DONE, (job.job_id, job.lease_token))
    return True


class CurrentJobMiddleware(dramatiq.Middleware):
    """Publishes the job row of the message being processed to the worker thread."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if isinstance(message, PostgresMessageProxy):
            _local.job = CurrentJob(message.job_id, message.lease_token, message.attempts)
        else:
            _local.job = None

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        _local.job = None

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        _local.job = None
