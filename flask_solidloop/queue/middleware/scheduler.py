"""Run the periodic-job scheduler tick in a thread of every worker process.

The tick itself (flask_solidloop.jobs.periodic) decides what is due and
claims each period with a conditional upsert, so running it in every process
enqueues one job per period, not one per process. This middleware only owns
the thread: started when a worker process boots, if anything is scheduled;
stopped when it shuts down. A tick that raises is logged and retried on the
next round; it never takes the worker down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import dramatiq

logger = logging.getLogger("flask_solidloop.periodic")

#: Ceiling on a wait between ticks, and the wait after a failed tick.
MAX_WAIT = 1.0


class SchedulerMiddleware(dramatiq.Middleware):
    """``tick()`` returns the seconds until it wants to run again."""

    def __init__(self, tick: Callable[[], float], has_schedules: Callable[[], bool]) -> None:
        self.tick = tick
        self.has_schedules = has_schedules
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        if not self.has_schedules():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="solidloop-scheduler",
                                        daemon=True)
        self._thread.start()

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.tick()
            except Exception:
                logger.exception("the periodic-job scheduler tick failed; retrying")
                wait = MAX_WAIT
            self._stop.wait(max(0.01, min(wait, MAX_WAIT)))
