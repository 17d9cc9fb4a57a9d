"""The warning, at enqueue, about a host queue that no live worker consumes.

A job on a queue nobody consumes sits ``queued`` forever and nothing says so.
The classic case is a queue first named inside a view (``solidloop.queue("x")``
in a request handler): worker processes never run that view, so they never
declare the queue, and a worker consumes only the queues it declared. After a
job is enqueued on one of the host's queues (any but solidloop's own
``solidloop_*``, whose absence a loop's status already shows), this middleware
looks the queue up among the queues live workers registered in the worker
registry (queue/middleware/worker_registry.py), and when none consumes it logs
one WARNING naming the fix.

Cheap by construction: one query reads every live worker's queues at once and
answers for every queue for :data:`REFRESH_SECONDS`, so the enqueues in between
cost a set lookup and no query; and each queue is warned about once per
process (per app), after which it is never looked up again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import dramatiq
import psycopg

from ...config import RESERVED_QUEUE_PREFIX
from ...errors import BrokerUnavailableError
from .worker_registry import live_queues

logger = logging.getLogger("flask_solidloop.jobs")

#: Seconds one read of the live workers' queues answers for (a worker started
#: since is seen at the next read; heartbeats are 10 s apart by default anyway).
REFRESH_SECONDS = 30.0


class UnconsumedQueueWarningMiddleware(dramatiq.Middleware):
    """Logs, once per queue, that a host job went to a queue no live worker consumes."""

    def __init__(self, *, heartbeat: float, refresh: float = REFRESH_SECONDS) -> None:
        self.heartbeat = float(heartbeat)
        self.refresh = float(refresh)
        self._lock = threading.Lock()
        #: None until a read succeeded: no answer is better than a false warning.
        self._consumed: frozenset[str] | None = None
        self._read_at: float | None = None
        self._warned: set[str] = set()
        #: How many times the worker registry was read (tests count them).
        self.reads = 0

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: Any) -> None:
        queue = message.queue_name
        if queue.startswith(RESERVED_QUEUE_PREFIX) or queue in self._warned:
            return
        consumed = self._live_queues(broker)
        if consumed is None or queue in consumed:
            return
        with self._lock:
            if queue in self._warned:
                return
            self._warned.add(queue)
        logger.warning(
            "no live worker consumes queue %r (the worker registry lists none), so its jobs "
            "wait there until one does: start `flask solidloop worker` (it consumes 'default' "
            "and every queue declared at import) or add `-Q %s`; a queue first named inside "
            "a view is not declared in workers, so declare it at import with "
            "solidloop.queue(%r). Logged once per process", queue, queue, queue)

    def _live_queues(self, broker: Any) -> frozenset[str] | None:
        """The live workers' queues, read at most once per ``refresh`` seconds
        (None when the registry cannot be read: the enqueue is not disturbed)."""
        now = time.monotonic()
        with self._lock:
            if self._read_at is not None and now - self._read_at < self.refresh:
                return self._consumed
            # Claimed before the read, so concurrent enqueues do not read too.
            self._read_at = now
        try:
            with broker.pool.connection() as conn:
                consumed = frozenset(live_queues(conn, interval=self.heartbeat))
        except (psycopg.Error, BrokerUnavailableError) as exc:
            logger.debug("could not read the worker registry (%s); no check this time", exc)
            return None
        with self._lock:
            self._consumed = consumed
            self.reads += 1
        return consumed
