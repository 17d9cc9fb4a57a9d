"""A span per host job (dramatiq actors and RQ-style jobs), under the trace
context the job was enqueued in (docs/decisions/0033-tracing.md).

On enqueue, a host job's message carries the ``traceparent`` of the span
current then (a traced request's, or the job's that enqueued it); the worker
runs it inside a ``CONSUMER`` span that is a child of it, so what the job
does (a loop it starts, a job it enqueues) joins the same trace. solidloop's
own actors are traced by their turns (runtime/traced.py) and carry their
loop's context (queue/dispatch.py). Nothing happens while tracing is off.
"""

from __future__ import annotations

import threading
from typing import Any

import dramatiq

from ...telemetry import tracing
from .. import sql as jobs_sql

_local = threading.local()


def is_host_job(actor_name: str) -> bool:
    """Whether ``actor_name`` is the host's: its own actor, or an RQ-style job."""
    return actor_name == jobs_sql.HOST_JOB_ACTOR or not actor_name.startswith("solidloop.")


class TracingMiddleware(dramatiq.Middleware):
    """Carries the current trace context in host jobs and runs each in a span."""

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: Any) -> None:
        if "traceparent" not in message.options and is_host_job(message.actor_name):
            traceparent = tracing.current_traceparent()
            if traceparent is not None:
                message.options["traceparent"] = traceparent

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if not is_host_job(message.actor_name):
            return
        # An RQ-style job is named by its function's import path (its first argument).
        name = message.args[0] if message.actor_name == jobs_sql.HOST_JOB_ACTOR \
            and message.args else message.actor_name
        _local.job = tracing.start_job(
            f"process {name}", message.options.get("traceparent"),
            attributes={"messaging.system": "solidloop",
                        "messaging.operation.type": "process",
                        "messaging.destination.name": message.queue_name,
                        "messaging.message.id": message.message_id,
                        "solidloop.job.actor": message.actor_name,
                        "solidloop.job.id": message.options.get("solidloop_job")})

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *,
                              result: Any = None,
                              exception: BaseException | None = None) -> None:
        job, _local.job = getattr(_local, "job", None), None
        tracing.end_job(job, exception)

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        job, _local.job = getattr(_local, "job", None), None
        tracing.end_job(job, None)
