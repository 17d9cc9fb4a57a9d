"""The async bridge: every place flask_solidloop runs a coroutine from synchronous code.

A dramatiq worker thread (or a Flask request thread) is synchronous; the MCP
SDK is async (anyio), and a tool may be an ``async def``. This module is the
one crossing between the two, with two ways across:

* :func:`run_sync` runs a coroutine on **the process portal**: one event loop
  per process in a daemon thread, shared by every thread. The MCP transports
  use it (``HttpTransport`` keeps its sessions open there, ``StdioTransport``
  its kept servers' sessions and its spawn-per-call exchanges)::

      from flask_solidloop.mcp.bridge import run_sync

      result = run_sync(lambda: session.list_tools(), timeout=30)

* :func:`run_isolated` runs a coroutine on **an event loop of its own**,
  closed when it returns. ``Toolset`` uses it for ``async def`` tools: user
  code may block the loop or keep loop-bound state, and on the shared loop it
  would stall the process's MCP I/O and serialise every worker thread's tools.

Why a long-lived loop for the transports rather than ``anyio.run()`` per
call: MCP sessions, connection pools and TLS connections are bound to the loop
that opened them, so only a loop that outlives the call can keep them open
between tool calls. Measured on loopback: 4-9 ms for a call in an open session
against 7-32 ms for connect + call + close on a fresh loop (more against a
remote TLS server); entering the portal costs 0.1 ms. And a thread waiting on
the portal can be interrupted promptly (below), which a thread blocked inside
its own loop cannot. The measurements and trade-offs are in
docs/decisions/0008-mcp-sync-bridge.md.

Rules:

* Pass a **factory** (``lambda: coro(...)``), not a coroutine object: the
  coroutine is created on the loop that runs it, and a call that never starts
  (timeout, shutdown) leaves no "never awaited" warning behind.
* The coroutine sees the **caller's context variables** (a copy, as asyncio
  gives every task): a Flask app context, a logging context.
* ``timeout`` bounds the wait. When it passes, or when the waiting thread is
  interrupted (KeyboardInterrupt, dramatiq's TimeLimitExceeded, any exception
  injected into the thread), the coroutine's task is **cancelled** and the
  exception propagates; a timeout raises
  :class:`~flask_solidloop.errors.WaitTimeoutError` (a :class:`TimeoutError`). The waiting
  thread polls in short slices, so an asynchronous exception reaches it
  within ~0.1 s even though it is blocked.
* The portal is process-local. After ``fork()`` the child gets a fresh portal
  on first use (the parent's loop thread does not exist in the child); state
  bound to the old loop must be rebuilt (see :func:`generation`).
* Calling :func:`run_sync` from the portal thread itself would deadlock and
  raises :class:`~flask_solidloop.errors.SetupError` (a :class:`RuntimeError`)
  instead; async code should ``await`` directly.
* :func:`shutdown` cancels whatever still runs on the loop, stops it and joins
  the thread. A later :func:`run_sync` starts a new portal. It is registered
  with :mod:`atexit`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..errors import SetupError, WaitTimeoutError

__all__ = [
    "Portal", "generation", "get_portal", "run_isolated", "run_sync", "shutdown", "wait_future",
]

logger = logging.getLogger("flask_solidloop.mcp")

T = TypeVar("T")

#: How long a blocked caller waits before re-checking (lets async exceptions in).
_POLL_SLICE = 0.1
#: How long shutdown() lets cancelled tasks unwind before closing the loop.
_SHUTDOWN_GRACE = 5.0

_generations = itertools.count(1)


class Portal:
    """An asyncio event loop in a daemon thread that other threads submit coroutines to.

    Thread-safe. Use the process singleton from :func:`get_portal` unless you
    need a loop of your own (tests, benchmarks, :func:`run_isolated`).
    """

    def __init__(self, name: str = "solidloop-mcp-portal") -> None:
        self.generation = next(_generations)
        self.pid = os.getpid()
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: per-loop singletons (the shared HTTP client...); only touched on the loop.
        self.state: dict[str, Any] = {}
        self._finalizers: list[Callable[[], Awaitable[Any]]] = []

    # -- lifecycle ----------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started on first use)."""
        return self._ensure_started()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._closed

    def in_portal_thread(self) -> bool:
        """True when called from the portal's own loop thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            return loop
        with self._lock:
            if self._closed:
                raise SetupError("this MCP portal was shut down; use get_portal() for a new one")
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                return self._loop
            started = threading.Event()
            loop = asyncio.new_event_loop()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                try:
                    loop.run_forever()
                finally:
                    _finish_loop(loop, self._finalizers)

            thread = threading.Thread(target=run, name=self._name, daemon=True)
            thread.start()
            started.wait()
            self._loop, self._thread = loop, thread
            return loop

    def shutdown(self, timeout: float = _SHUTDOWN_GRACE) -> None:
        """Cancel everything still running, stop the loop and join its thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None or os.getpid() != self.pid:
            return
        if thread is threading.current_thread():
            loop.call_soon(loop.stop)
            return
        if thread.is_alive() and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)

    def add_finalizer(self, coro_factory: Callable[[], Awaitable[Any]]) -> None:
        """Run ``coro_factory()`` on the loop when it shuts down, after its tasks are cancelled."""
        self._finalizers.append(coro_factory)

    # -- calls ------------------------------------------------------------------

    def submit(self, coro_factory: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Schedule ``coro_factory()`` on the loop; returns a concurrent Future."""
        loop = self._ensure_started()
        # run_coroutine_threadsafe() schedules from this thread, so the task runs
        # in a copy of this thread's context variables (a Flask app context...).
        return asyncio.run_coroutine_threadsafe(_awaiting(coro_factory), loop)

    def call(self, coro_factory: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``coro_factory()`` on the loop and block until it finishes.

        Raises whatever the coroutine raised; :class:`WaitTimeoutError` when
        ``timeout`` seconds pass first (the task is cancelled). Any exception
        delivered to the waiting thread also cancels the task, then propagates.
        """
        if self.in_portal_thread():
            raise SetupError(
                "run_sync() was called from the MCP portal's own event loop thread, which "
                "would deadlock; await the coroutine directly instead"
            )
        future = self.submit(coro_factory)
        return wait_future(future, timeout)


def wait_future(future: concurrent.futures.Future[T], timeout: float | None) -> T:
    """Block on ``future`` in short slices; cancel it on timeout or interruption."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                future.cancel()
                raise WaitTimeoutError(f"no result within {timeout} s")
            slice_ = _POLL_SLICE if remaining is None else min(_POLL_SLICE, remaining)
            try:
                return future.result(slice_)
            except concurrent.futures.TimeoutError:
                continue
    except BaseException:
        # Timeout, or an exception injected into this thread (KeyboardInterrupt,
        # dramatiq's TimeLimitExceeded...): stop the work we no longer wait for.
        future.cancel()
        raise


def _finish_loop(loop: asyncio.AbstractEventLoop,
                 finalizers: list[Callable[[], Awaitable[Any]]]) -> None:
    """Cancel leftover tasks, let them unwind, run finalizers, close the loop (loop thread)."""

    async def finalize() -> None:
        for factory in finalizers:
            try:
                await factory()
            except Exception:
                logger.debug("MCP portal finalizer failed", exc_info=True)

    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(BaseException):
                loop.run_until_complete(asyncio.wait_for(gathered, _SHUTDOWN_GRACE))
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.wait_for(finalize(), _SHUTDOWN_GRACE))
        with contextlib.suppress(BaseException):
            loop.run_until_complete(loop.shutdown_asyncgens())
        # As asyncio.run() does: a one-shot loop whose coroutine used run_in_executor
        # would otherwise leave its executor's threads behind, one pool per call.
        with contextlib.suppress(BaseException):
            loop.run_until_complete(
                asyncio.wait_for(loop.shutdown_default_executor(), _SHUTDOWN_GRACE))
    finally:
        loop.close()


# --------------------------------------------------------------------------- singleton

_portal: Portal | None = None
_portal_lock = threading.Lock()


def get_portal() -> Portal:
    """The process's portal, started on first use (a fresh one after fork or shutdown)."""
    global _portal
    portal = _portal
    if portal is not None and portal.pid == os.getpid() and not portal._closed:
        return portal
    with _portal_lock:
        portal = _portal
        if portal is None or portal.pid != os.getpid() or portal._closed:
            portal = Portal()
            _portal = portal
        return portal


def generation() -> int:
    """An id of the current process portal; changes after fork or shutdown.

    Objects that cache loop-bound state (sessions, HTTP clients) compare it to
    know their state belongs to a loop that no longer exists.
    """
    return get_portal().generation


def run_sync(coro_factory: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
    """Run ``coro_factory()`` on the process portal and wait (see :meth:`Portal.call`)."""
    return get_portal().call(coro_factory, timeout)


def run_isolated(coro_factory: Callable[[], Awaitable[T]]) -> T:
    """Run ``coro_factory()`` on an event loop of its own, closed when it finishes.

    For coroutines that must not share the portal's loop (user code, which may
    block or keep loop-bound state). With no loop running in this thread, the
    loop runs here, with ``asyncio.run``: same thread, same thread-locals. If
    this thread already runs a loop (the caller is async code that called
    synchronous code), a one-shot :class:`Portal` runs the coroutine and this
    thread waits as for :func:`run_sync`: interruptibly, cancelling the task
    when interrupted. There is no timeout; the coroutine bounds itself.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaiting(coro_factory))
    portal = Portal(name="solidloop-isolated-loop")
    try:
        return portal.call(coro_factory)
    finally:
        portal.shutdown()


async def _awaiting(coro_factory: Callable[[], Awaitable[T]]) -> T:
    # asyncio.run() takes a coroutine only; a factory may return any awaitable.
    return await coro_factory()


def shutdown(timeout: float = _SHUTDOWN_GRACE) -> None:
    """Stop the process portal (idempotent); the next :func:`run_sync` starts a new one."""
    global _portal
    with _portal_lock:
        portal, _portal = _portal, None
    if portal is not None:
        portal.shutdown(timeout)


def _after_fork_in_child() -> None:
    # The loop thread does not exist in the child: forget the portal without
    # touching its loop (its sockets are the parent's). The lock may have been
    # held by another thread at fork time, so it is replaced too.
    global _portal, _portal_lock
    _portal = None
    _portal_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown, 2.0)
