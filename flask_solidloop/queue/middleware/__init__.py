"""dramatiq middleware of the Postgres broker's workers, one per file."""

from .app_context import AppContextMiddleware
from .current_job import CurrentJobMiddleware
from .host_jobs import HostJobMiddleware
from .lease_renewer import LeaseRenewerMiddleware
from .log_redaction import LogRedactionMiddleware
from .periodic import PeriodicTaskMiddleware
from .queue_consumers import UnconsumedQueueWarningMiddleware
from .scheduler import SchedulerMiddleware
from .tracing import TracingMiddleware
from .worker_registry import WorkerRegistryMiddleware

__all__ = [
    "AppContextMiddleware",
    "CurrentJobMiddleware",
    "HostJobMiddleware",
    "LeaseRenewerMiddleware",
    "LogRedactionMiddleware",
    "PeriodicTaskMiddleware",
    "SchedulerMiddleware",
    "TracingMiddleware",
    "UnconsumedQueueWarningMiddleware",
    "WorkerRegistryMiddleware",
]
