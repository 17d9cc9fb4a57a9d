"""Publish the job row of the message being processed to the worker thread."""

from __future__ import annotations

from typing import Any

import dramatiq

from ..broker import PostgresMessageProxy
from ..current_job import CurrentJob, job_done_committed, set_current_job


class CurrentJobMiddleware(dramatiq.Middleware):
    """Sets :func:`~flask_solidloop.queue.current_job.current_job` for each message."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if isinstance(message, PostgresMessageProxy):
            set_current_job(CurrentJob(message.job_id, message.lease_token, message.attempts))
        else:
            set_current_job(None)

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        if isinstance(message, PostgresMessageProxy) and job_done_committed(message.job_id):
            # Its row is done already, in the actor's own transaction: no ack needed.
            message.done_in_transaction = True
        set_current_job(None)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        set_current_job(None)
