"""dramatiq middleware of the Postgres broker's workers, one per file."""

from .app_context import AppContextMiddleware
from .current_job import CurrentJobMiddleware
from .lease_renewer import LeaseRenewerMiddleware
from .log_redaction import LogRedactionMiddleware
from .periodic import PeriodicTaskMiddleware

__all__ = [
    "AppContextMiddleware",
    "CurrentJobMiddleware",
    "LeaseRenewerMiddleware",
    "LogRedactionMiddleware",
    "PeriodicTaskMiddleware",
]
