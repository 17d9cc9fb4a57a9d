"""The threads in-process tools run on: a call's timeout, and the quarantine of
tools that never return.

A tool from an in-process toolset is plain Python: nothing can interrupt it.
So the worker thread does not run it; it hands the call to a tool thread of
this process's pool and waits at most the call's timeout. A call that
returns in time gives its thread back to the pool. One that does not is
**abandoned**: the worker thread answers the call with a timeout error and
serves its next job, while the tool's thread is **quarantined**: it is
never given work again, and leaves the pool for good if the tool ever
returns. The pool then starts a fresh thread for the next call, so the
worker never runs short of threads however many tools hang.

Quarantined threads still hold what their tools hold (memory, sockets). Past
``quarantine_limit`` of them in one process, the process asks to be
restarted (``on_limit``, which the worker installs: dramatiq's own restart
of its worker processes), which is the only way to reclaim them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from flask import Flask

from ..errors import SolidLoopError

logger = logging.getLogger("flask_solidloop.tools")

T = TypeVar("T")

#: Idle threads kept for the next calls; more are started when all are busy.
IDLE_THREADS = 32


class ToolTimeoutError(SolidLoopError):  # an internal signal: the tool stack answers it
    """The call did not return within its timeout; its thread was quarantined."""

    def __init__(self, timeout: float, quarantined: int) -> None:
        super().__init__(f"no result within {timeout:g}s")
        self.timeout = timeout
        #: Threads of this process quarantined now, this one included.
        self.quarantined = quarantined


class _Call:
    """One call handed to a tool thread, and its outcome."""

    def __init__(self, fn: Callable[[], Any], app: Flask | None,
                 on_abandoned_return: Callable[[], None] | None = None) -> None:
        self.fn = fn
        self.app = app
        self.on_abandoned_return = on_abandoned_return
        #: Held until the call has run: a bare lock is the cheapest hand-off back
        #: (an Event is a Condition over one, several times the cost per call).
        self.finished = threading.Lock()
        self.finished.acquire()
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        #: Set (under the pool's lock) when its caller stopped waiting.
        self.abandoned = False

    def run(self) -> None:
        try:
            if self.app is None:
                self.value = self.fn()
            else:
                # The tool sees the app as on the worker's thread, with a
                # database session of its own (removed when its context ends).
                with self.app.app_context():
                    self.value = self.fn()
        except BaseException as exc:  # handed to the waiting caller, whatever it is
            self.error = exc


class ToolThreads:
    """A process's pool of tool threads (one per process: :func:`pool`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Call]] = []
        self._started = 0
        #: Threads whose tool never returned, in this process now.
        self.quarantined = 0
        #: Quarantined threads this process tolerates; past it, ``on_limit`` runs once.
        self.quarantine_limit = 8
        #: Called once when ``quarantined`` reaches ``quarantine_limit``.
        self.on_limit: Callable[[int], None] | None = None
        self._limit_reported = False

    def run(self, fn: Callable[[], T], *, timeout: float, app: Flask | None = None,
            on_abandoned_return: Callable[[], None] | None = None) -> T:
        """``fn()`` on a tool thread, its value or its exception; ToolTimeoutError
        when it has not returned after ``timeout`` seconds (the thread is then
        quarantined, and ``fn`` goes on running there unobserved; should it
        ever return, ``on_abandoned_return`` runs there: what it held is
        nobody's now)."""
        call = _Call(fn, app, on_abandoned_return)
        report, quarantined = False, 0
        inbox = self._take()
        inbox.put(call)
        if not call.finished.acquire(timeout=timeout):
            with self._lock:
                if not call.done:
                    call.abandoned = True
                    self.quarantined += 1
                    quarantined = self.quarantined
                    report = (quarantined >= self.quarantine_limit
                              and not self._limit_reported)
                    self._limit_reported = self._limit_reported or report
            if call.abandoned:
                if report and self.on_limit is not None:
                    self.on_limit(quarantined)
                raise ToolTimeoutError(timeout, quarantined)
        self._give_back(inbox)
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[no-any-return]

    def _take(self) -> queue.SimpleQueue[_Call]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self._started += 1
            number = self._started
        inbox: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        # A daemon: a thread stuck in a tool must never keep the process alive.
        threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                         name=f"solidloop-tool-{number}").start()
        return inbox

    def _give_back(self, inbox: queue.SimpleQueue[_Call]) -> None:
        with self._lock:
            if len(self._idle) < IDLE_THREADS:
                self._idle.append(inbox)
                return
        inbox.put(_STOP)

    def _serve(self, inbox: queue.SimpleQueue[_Call]) -> None:
        while True:
            call = inbox.get()
            if call is _STOP:
                return
            call.run()
            with self._lock:
                call.done = True
                call.finished.release()
                if not call.abandoned:
                    continue
                # Its caller gave up on it: the thread leaves the pool.
                self.quarantined -= 1
            if call.on_abandoned_return is not None:
                call.on_abandoned_return()
            logger.warning("an abandoned tool returned at last on %s; the thread leaves "
                           "quarantine (%d still quarantined in this process)",
                           threading.current_thread().name, self.quarantined)
            return


_STOP = _Call(lambda: None, None)
_POOL = ToolThreads()


def pool() -> ToolThreads:
    """This process's pool of tool threads."""
    return _POOL
