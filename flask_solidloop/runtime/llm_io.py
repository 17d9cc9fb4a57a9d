"""How a worker process waits on its LLM calls (SOLIDLOOP_LLM_IO), and the
async mode's machinery (docs/decisions/0027-llm-io.md).

This module owns, per worker process: the per-origin pool size of the LLM
clients (:func:`pool_limits_for`, set at boot by :class:`LlmIoMiddleware`),
and in async mode the :class:`AsyncLlmIo`: the process's I/O loop
(llm/aio.py), the commit threads that end handed-off turns and write their
streamed text, the watcher that aborts the exchanges of turns no longer
theirs, and the in-flight ceiling.

The path of a handed-off turn: a turn thread claims and renders it and puts
its request on record (runtime/turns.py, pipeline/llm_stack.py), then
NetworkCalling raises :class:`~..pipeline.llm_stack.HandedOff`;
``run_llm_turn`` gives it to :meth:`AsyncLlmIo.hand` and returns to dramatiq
for other jobs. The turn's job was marked done in its claim's transaction,
and its lease stays registered with the process's renewer, so a process that
dies mid-exchange leaves a lapsing lease for the reaper, as a thread would.
When the exchange ends, the turn's ``finish`` runs on a commit thread: the
same error handling, store transitions and fence as on a thread, then the
lease registration is released. A turn's tasks (its coalesced partial-text
flushes, then its end) run in order, one at a time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq

from ..errors import AbortedError
from ..llm import client as llm_client
from ..llm.aio import IoLoop
from ..llm.client import PoolLimits
from ..loops import queries, store
from ..pipeline.context import LlmContext
from ..pipeline.llm_stack import HandedOff, PartialWriter
from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.llm_io")

_STATE_KEY = "runtime.llm_io"
#: Seconds between two checks that the in-flight turns are still owned (a
#: pause or stop lands within about this long).
ABORT_CHECK_SECONDS = 1.0
#: How long a worker that stops gracefully waits for its in-flight exchanges
#: to end before it leaves the rest to their leases (and the reaper).
ASYNC_DRAIN_SECONDS = 30.0
#: The connections per origin a process has at least (the old fixed cap).
MIN_CONNECTIONS = 100


def pool_limits_for(state: SolidLoopState, threads: int) -> PoolLimits:
    """The per-origin pool of a worker process with ``threads`` worker threads:
    SOLIDLOOP_LLM_MAX_CONNECTIONS, else the process's concurrency (its
    threads, or its async in-flight ceiling), at least 100."""
    config = state.config
    if config.llm_max_connections is not None:
        size = config.llm_max_connections
    else:
        concurrency = max(threads, config.llm_io_max_inflight if config.llm_io == "async"
                          else 0)
        size = max(MIN_CONNECTIONS, concurrency)
    return PoolLimits(max_connections=size, max_keepalive=size)


def current(state: SolidLoopState) -> AsyncLlmIo | None:
    """This process's async I/O, when it runs in async mode (a worker started it)."""
    io: AsyncLlmIo | None = state.extras.get(_STATE_KEY)
    return io


@dataclass(eq=False)
class Flight:
    """One handed-off turn, from its hand-off to the end of its finish."""

    ctx: LlmContext
    finish: Callable[[BaseException | None], None]
    future: concurrent.futures.Future[Any] | None = None
    #: Set by the watcher: the turn is no longer this generation's.
    aborted: bool = False
    tasks: collections.deque[Callable[[], None]] = field(default_factory=collections.deque)
    busy: bool = False
    flush_pending: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> tuple[int, uuid.UUID]:
        return (self.ctx.loop_id, self.ctx.execution_token)

    def should_abort(self) -> bool:
        """Non-blocking (called on the I/O loop): the watcher's view."""
        return self.aborted


class AsyncLlmIo:
    """A worker process's async LLM I/O: one I/O loop, ``commit_threads``
    commit threads, one watcher, at most ``max_inflight`` exchanges."""

    def __init__(self, state: SolidLoopState, limits: PoolLimits) -> None:
        config = state.config
        self.state = state
        self.io = IoLoop(limits)
        self.max_inflight = config.llm_io_max_inflight
        self.slots = threading.BoundedSemaphore(self.max_inflight)
        self.commit = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.llm_io_commit_threads, thread_name_prefix="solidloop-llm-commit",
            initializer=self._enter_app)
        self.flights: set[Flight] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        #: The most exchanges in flight at once so far (for benchmarks).
        self.peak_inflight = 0

    def _enter_app(self) -> None:
        # A commit thread keeps an app context for its life: its scoped session
        # is its own, removed after each task.
        self.state.app.app_context().push()

    def start(self) -> AsyncLlmIo:
        self.io.start()
        self._watcher = threading.Thread(target=self._watch, name="solidloop-llm-watcher",
                                         daemon=True)
        self._watcher.start()
        return self

    # -- hand-off -------------------------------------------------------------------

    def hand(self, handoff: HandedOff, finish: Callable[[BaseException | None], None]) -> None:
        """Send a handed-off turn's request on the I/O loop; ``finish(error)``
        runs on a commit thread once the exchange is over. Waits (on the turn
        thread, holding no connection) while the process is at its ceiling."""
        ctx = handoff.ctx
        self.slots.acquire()
        flight = Flight(ctx=ctx, finish=finish)
        if ctx.partial is not None:
            ctx.partial.defer = lambda writer: self._flush_later(flight, writer)
        with self._lock:
            self.flights.add(flight)
            self.peak_inflight = max(self.peak_inflight, len(self.flights))
        try:
            flight.future = self.io.submit(lambda: self._exchange(flight, handoff))
        except BaseException:
            self._landed(flight)
            raise
        flight.future.add_done_callback(lambda future: self._over(flight, future))

    async def _exchange(self, flight: Flight, handoff: HandedOff) -> None:
        request = handoff.request
        await request.send_async(flight.ctx, self.io.client(request.url), flight.should_abort)

    def _over(self, flight: Flight, future: concurrent.futures.Future[Any]) -> None:
        error: BaseException | None
        if future.cancelled():
            error = AbortedError("the loop was paused or stopped while its request was in "
                                 "flight")
        else:
            error = future.exception()
        self._enqueue(flight, lambda: self._end(flight, error))

    def _end(self, flight: Flight, error: BaseException | None) -> None:
        try:
            flight.finish(error)
        finally:
            self._landed(flight)

    def _landed(self, flight: Flight) -> None:
        with self._lock:
            if flight not in self.flights:
                return
            self.flights.discard(flight)
        self.slots.release()

    # -- commit threads ---------------------------------------------------------------

    def _flush_later(self, flight: Flight, writer: PartialWriter) -> None:
        """A due flush of streamed text (called on the I/O loop): one pending
        per turn, which writes all the text so far when it runs."""
        if flight.flush_pending:
            return
        flight.flush_pending = True

        def flush() -> None:
            flight.flush_pending = False
            writer.flush()

        self._enqueue(flight, flush)

    def _enqueue(self, flight: Flight, task: Callable[[], None]) -> None:
        """Run ``task`` on a commit thread after the turn's earlier tasks."""
        with flight.lock:
            flight.tasks.append(task)
            if flight.busy:
                return
            flight.busy = True
        self.commit.submit(self._drain, flight)

    def _drain(self, flight: Flight) -> None:
        session = self.state.db.session
        while True:
            with flight.lock:
                if not flight.tasks:
                    flight.busy = False
                    return
                task = flight.tasks.popleft()
            try:
                task()
            except Exception:
                logger.exception("loop %s: a commit task failed", flight.ctx.loop_id)
            finally:
                try:
                    session.remove()
                except Exception:  # a broken connection: the pool replaces it
                    logger.debug("session.remove() failed", exc_info=True)

    # -- aborts -----------------------------------------------------------------------

    def _watch(self) -> None:
        with self.state.app.app_context():
            while not self._stopping.wait(ABORT_CHECK_SECONDS):
                try:
                    self._check_owners()
                except Exception as exc:
                    # Unknown: the exchanges go on (every write of their turns is
                    # fenced whatever this says).
                    logger.warning("could not check the in-flight turns' owners: %s", exc)
                finally:
                    self.state.db.session.remove()

    def _check_owners(self) -> None:
        with self._lock:
            flights = [f for f in self.flights if not f.aborted]
        if not flights:
            return
        lost = [f for f in flights if f.ctx.lease is not None and f.ctx.lease.lost()]
        owned = queries.owned_among(self.state.db.session, [f.key for f in flights])
        store.end_transaction(self.state.db.session)
        lost += [f for f in flights if f.key not in owned and f not in lost]
        for flight in lost:
            if flight.future is not None and not flight.future.done():
                flight.aborted = True
                flight.future.cancel()

    # -- life -------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self.flights)

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the exchanges in flight to end;
        the number still in flight."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.inflight

    def stop(self) -> None:
        self._stopping.set()
        self.io.stop()
        self.commit.shutdown(wait=True, cancel_futures=False)


class LlmIoMiddleware(dramatiq.Middleware):
    """Sizes the process's LLM connection pools at worker boot and, in async
    mode, runs the process's :class:`AsyncLlmIo` from boot to shutdown.

    Added before the lease renewer's middleware: a stopping worker drains its
    in-flight exchanges while their leases are still renewed."""

    def __init__(self, state: SolidLoopState) -> None:
        self.state = state

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        limits = pool_limits_for(self.state, int(getattr(worker, "worker_threads", 1)))
        llm_client.configure_pool(limits)
        if self.state.config.llm_io == "async":
            self.state.extras[_STATE_KEY] = AsyncLlmIo(self.state, limits).start()
            logger.info("LLM I/O: async, up to %d calls in flight, %d connections per origin",
                        self.state.config.llm_io_max_inflight, limits.max_connections)

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        io: AsyncLlmIo | None = self.state.extras.pop(_STATE_KEY, None)
        if io is None:
            return
        left = io.drain(ASYNC_DRAIN_SECONDS)
        if left:
            logger.warning("%d LLM calls still in flight at shutdown: left to their leases "
                           "(the reaper queues their turns again)", left)
        io.stop()
