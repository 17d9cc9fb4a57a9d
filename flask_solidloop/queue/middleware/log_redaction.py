"""Keep credentials out of every log line a worker process writes."""

from __future__ import annotations

import logging
from typing import Any

import dramatiq

from ...urls import install_log_redaction


class LogRedactionMiddleware(dramatiq.Middleware):
    """At worker boot, once dramatiq has set up its log handlers, attach the URL
    redacting filter to them, so every record (ours, the SDK's, tracebacks)
    passes it, whichever logger wrote it."""

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        install_log_redaction(*logging.getLogger().handlers)
