"""An MCP server run as a child process over stdio: the ``command=`` transport.

:class:`StdioTransport` implements :class:`~flask_solidloop.mcp.transport.McpTransport`
with the official MCP SDK (``mcp.client.stdio.stdio_client`` under ``mcp.Client``)::

    fs = StdioTransport(["mcp-server-filesystem", "/srv/docs"], timeout=30)
    fs.list_tools()                                   # MCP tool dicts
    fs.call_tool("read_text_file", {"path": "/srv/docs/a.md"},
                 meta={"solidloop/idempotencyKey": "solidloop:tool_call:42"})

Kept sessions (the default)
---------------------------
A server runs as a long-lived child of the worker process: the first call
starts it (negotiating with ``mode="auto"``: a ``server/discover`` probe,
falling back to the ``initialize`` handshake) and later calls reuse its
session, a few milliseconds each instead of the server's start-up (a few
hundred milliseconds for a Node server, one to two seconds for a Python one).
The children live in a pool on the process portal
(:func:`flask_solidloop.mcp.bridge.run_sync`), keyed by command + ``env`` +
``cwd``: every transport, and every thread, of the process with the same key
shares one child and one session, with several requests in flight at once
(the SDK matches answers to requests by id). ``concurrent=False`` gives each
calling thread a child of its own, for servers that cannot serve two requests
at a time. The calling thread waits on the portal, so a dramatiq time limit
still reaches it within ~0.1 s.

* A child that exits (crash, OOM kill, SIGKILL) fails the calls in flight with
  ``kind="protocol"``; the next call starts a new child.
* A call past its ``timeout`` is abandoned (the SDK sends
  ``notifications/cancelled``) and the child gets a ``ping``: one that answers
  is only slow at that tool and stays; one that does not is hung and is
  stopped, so the next call starts afresh. A call interrupted in its thread
  (a time limit) gets the same check in the background.
* :func:`stop_kept_servers` stops every child of the process; the worker calls
  it at shutdown (a dramatiq middleware), and the portal's shutdown (``atexit``)
  does as the fallback. The pool belongs to the process portal, so a forked
  process never talks to its parent's children: it starts its own.
* What a server keeps in memory lives as long as its child: it does not survive
  the worker process's death (or a restart after a crash or a hang), and each
  worker process has its own child, so state is never shared between
  processes. Keep state a tool must not lose outside the server process.

``stateless=True`` spawns a process per call instead: start, negotiate, one
request, shut down, as one coroutine on the portal. Nothing lives between
calls; the price is the server's start-up on every call.

Shutdown of a child is the SDK's, per the MCP lifecycle: close the server's
stdin, give it 2 s to exit, SIGTERM its process group, 2 s more, SIGKILL. The
server runs in a session of its own, so the whole tree goes, children
included. A spawn-per-call exchange runs that sequence also when the call
fails, times out or is cancelled (it is shielded from the cancellation), so a
``timeout`` error is raised about ``timeout + 4`` seconds after the call began
at the latest, with no process left behind; a kept child that is stopped for
a hang is waited for the same way.

Environment
-----------
The child does **not** inherit the worker's environment, which holds database
URLs and provider API keys. It gets the SDK's allowlist (``HOME``, ``LOGNAME``,
``PATH``, ``SHELL``, ``TERM``, ``USER``), plus ``LANG``, ``LC_ALL`` and
``LC_CTYPE`` when set (so the server decodes text the way the host does), with
``env=`` merged over the lot. Anything else a server needs - its own API token,
say - goes in ``env=``. ``PATH`` is the one used to find the command, so an
``env={"PATH": ...}`` override changes where it is looked up.

Errors
------
Infrastructure failures raise :class:`~flask_solidloop.errors.McpTransportError`
(ExceptionGroups from the SDK's task groups are unwrapped first):

* ``spawn`` - the command does not exist, is not executable, or ``cwd`` is not a
  directory. The message names the command and what to check.
* ``timeout`` - no answer within ``timeout`` seconds (start-up included); the
  process is stopped as described above.
* ``protocol`` - the process exited or closed stdout before answering (a kept
  child that died with calls in flight, too), wrote a
  line to stdout that is not a JSON-RPC message, answered with a result that
  does not fit the schema, or refused the handshake / ``tools/list``.
  A malformed stdout line fails the call at once: the MCP stdio rules forbid
  anything but JSON-RPC there (logs belong on stderr), and waiting it out would
  turn a clear protocol error into a timeout. Blank lines are tolerated.

Messages name the server and the command line, and end with the tail of the
server's stderr when it wrote any (a kept child's stderr file is emptied
whenever it passes 1 MiB) - the fastest way to see why it died. Values
passed in ``env=`` (tokens, typically) are masked wherever they would appear;
keep secrets in ``env=`` rather than in the command line.

A tool-level failure is a result, as the transport contract requires: the server
answering ``isError: true``, and also a JSON-RPC error response to ``tools/call``
(an unknown tool or invalid arguments, which the model can correct), which
becomes ``ToolResult.error("MCP error <code>: <message>")``.

``call_tool`` sends the ``CallToolRequest`` itself rather than going through
``Client.call_tool``, whose output-schema check would first run a ``tools/list``
of its own on every fresh connection.

Design notes: docs/decisions/0042-kept-stdio-sessions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar, cast

import anyio
import mcp_types as types
import pydantic
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.session import ClientSession, IncomingMessage
from mcp.client.stdio import stdio_client
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

from flask_solidloop.errors import InvalidArgumentError, McpTransportError

from . import bridge, sdk
from .toolset import ToolResult

__all__ = ["StdioTransport", "stop_kept_servers"]

logger = logging.getLogger("flask_solidloop.mcp")

_T = TypeVar("_T")

#: Locale variables passed through on top of the SDK's own allowlist.
_LOCALE_VARS = ("LANG", "LC_ALL", "LC_CTYPE")
#: ``env=`` values at least this long are masked in messages (shorter ones are
#: flags like "1" or "true" and would mask half the text).
_MIN_MASKED_LEN = 6
_MASK = "***"
_MAX_COMMAND_CHARS = 300
_MAX_LINE_EXCERPT = 160
_STDERR_TAIL_BYTES = 4096
_STDERR_TAIL_CHARS = 600
#: The SDK's worst-case shutdown after the deadline (writer flush 0.5 s, stdin
#: close 2 s, SIGTERM 2 s, reap after SIGKILL 2 s), rounded up.
_TEARDOWN_BOUND = 7.0
#: Extra wait the bridge allows beyond the exchange's own bounds (a safety net).
_BRIDGE_SLACK = 10.0
#: How long a kept child has to answer the ping that follows a timed-out call.
_PING_BOUND = 5.0
#: A kept child's stderr file is emptied when it grows past this.
_STDERR_CAP = 1 << 20
#: Where the process portal keeps the pool of kept children.
_POOL_KEY = "stdio_children"


@dataclass(frozen=True)
class _Key:
    """What makes two calls share a kept child: command, env, cwd (and thread)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str | None
    thread: int | None


class _Child:
    """One kept server process. Its owner task (``StdioTransport._serve``) runs on
    the portal loop; everything here is touched only on that loop."""

    def __init__(self) -> None:
        self.session: ClientSession | None = None
        self.ready = anyio.Event()
        self.stop = anyio.Event()    # set: the owner task shuts the child down
        self.ended = anyio.Event()   # set: its stdout ended or carried garbage
        self.done = anyio.Event()    # set: the process is gone (owner task finished)
        self.open_error: BaseException | None = None
        self.bad_output: str | None = None
        self.task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[bool]] = set()
        # Kept open for the child's life (closed by the pool): no `with` block fits.
        self.errlog: IO[str] = tempfile.TemporaryFile(  # noqa: SIM115
            mode="w+", encoding="utf-8", errors="replace")
        with contextlib.suppress(ImportError, OSError):
            import fcntl  # POSIX: appends stay at the end after the file is emptied

            fd = self.errlog.fileno()
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)

    @property
    def alive(self) -> bool:
        return self.session is not None and not self.stop.is_set() and not self.done.is_set()

    async def stopped(self, bound: float) -> None:
        """Stop the child and wait up to ``bound`` seconds for its process to be gone."""
        self.stop.set()
        with anyio.move_on_after(bound):
            await self.done.wait()

    async def check_health(self, bound: float) -> bool:
        """Ping the child; stop it when it does not answer within ``bound`` seconds."""
        if self.alive and self.session is not None:
            with anyio.move_on_after(bound):
                try:
                    await self.session.send_ping()
                    return True
                except Exception:
                    pass
        self.stop.set()
        return False

    def spawn_check(self, bound: float) -> None:
        task = asyncio.get_running_loop().create_task(self.check_health(bound))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def stderr_tail(self) -> str:
        return _stderr_tail(self.errlog)

    def trim_stderr(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            fd = self.errlog.fileno()
            if os.fstat(fd).st_size > _STDERR_CAP:
                os.ftruncate(fd, 0)

    def close_log(self) -> None:
        with contextlib.suppress(OSError):
            self.errlog.close()


@dataclass
class _StartFailure:
    """Why a kept child could not be started (the caller raises it)."""

    kind: str
    message: str
    stderr: str
    cause: BaseException | None = None


class _Pool:
    """The process's kept children, by key; lives in the process portal's state."""

    def __init__(self) -> None:
        self.children: dict[_Key, _Child] = {}
        self._locks: dict[_Key, asyncio.Lock] = {}

    async def acquire(self, key: _Key, transport: StdioTransport,
                      deadline: float) -> _Child | _StartFailure:
        """The key's live child, started first when there is none (or it died);
        what went wrong when it could not be started."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        child: _Child | None = None
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            async with lock:
                old = self.children.get(key)
                if old is not None and old.alive:
                    return old
                if old is not None and not old.ready.is_set() and not old.stop.is_set():
                    child = old  # still starting (the call that started it gave up): wait
                else:
                    if old is not None:
                        self._retire(key, old)
                    # Registered at once: a caller that gives up (an interrupted thread)
                    # leaves a child the next call uses and stop_kept_servers() stops.
                    child = _Child()
                    self.children[key] = child
                    child.task = asyncio.get_running_loop().create_task(transport._serve(child))
                await child.ready.wait()
                if child.open_error is None and child.alive:
                    return child
                self._retire(key, child, close_log=False)  # its stderr is read below
        stderr = child.stderr_tail() if child is not None else ""
        if child is None or not child.ready.is_set():
            if child is not None and child.task is not None:
                self._retire(key, child, close_log=False)
                child.task.cancel()  # the SDK's shutdown is shielded: the process goes
                await child.stopped(_TEARDOWN_BOUND)
                stderr = child.stderr_tail()
                child.close_log()
            return _StartFailure(
                "timeout",
                f"no answer to the handshake within {transport.timeout:g} s; "
                "the server process was stopped",
                stderr,
            )
        await child.stopped(_TEARDOWN_BOUND)
        stderr = child.stderr_tail()
        child.close_log()
        if child.bad_output is not None:
            return _StartFailure("protocol", child.bad_output, stderr, child.open_error)
        failure = child.open_error or ConnectionError("the server exited during the handshake")
        kind, message = transport._classify(failure, _Attempt())
        return _StartFailure(kind, message, stderr, child.open_error)

    def _retire(self, key: _Key, child: _Child, *, close_log: bool = True) -> None:
        """Forget a dead (or failed) child; its stderr file closes once it is gone."""
        if self.children.get(key) is child:
            del self.children[key]
        child.stop.set()
        if not close_log:
            return
        if child.done.is_set() or child.task is None:
            child.close_log()
        else:
            child.task.add_done_callback(lambda _task: child.close_log())

    async def aclose(self, bound: float = 10.0) -> int:
        """Stop every child and wait (up to ``bound`` s) for their processes to go."""
        children = list(self.children.values())
        self.children.clear()
        for child in children:
            child.stop.set()
        with anyio.move_on_after(bound):
            for child in children:
                await child.done.wait()
        for child in children:
            if child.done.is_set():
                child.close_log()
        return len(children)


def _pool() -> _Pool:
    """The pool of the running process portal (call on the portal loop)."""
    portal = bridge.get_portal()
    pool = portal.state.get(_POOL_KEY)
    if pool is None:
        pool = _Pool()
        portal.state[_POOL_KEY] = pool
        portal.add_finalizer(pool.aclose)
    return cast("_Pool", pool)


def stop_kept_servers(timeout: float = 10.0) -> int:
    """Stop every kept stdio server of this process and wait for them to exit;
    the number stopped. The worker calls it at shutdown; a later call starts new ones."""
    portal = bridge.get_portal()
    pool = portal.state.get(_POOL_KEY)
    if pool is None or not portal.running:
        return 0
    try:
        return bridge.run_sync(lambda: cast("_Pool", pool).aclose(timeout), timeout + 5.0)
    except Exception:
        logger.warning("stopping the kept stdio MCP servers failed", exc_info=True)
        return 0


@contextlib.asynccontextmanager
async def _watched(streams: Any, child: _Child,
                   transport: StdioTransport) -> AsyncIterator[Any]:
    """The SDK's stdio streams with a relay in between that notices the end of the
    child's stdout (its death) and garbage on it, which ends the session too."""
    async with streams as (read_stream, write_stream):
        send, receive = anyio.create_memory_object_stream[Any](0)

        async def relay() -> None:
            try:
                async for item in read_stream:
                    if isinstance(item, Exception):
                        if _is_blank_line(item):
                            continue
                        child.bad_output = transport._describe_bad_output(item)
                        return
                    await send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                child.ended.set()
                child.stop.set()
                await send.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            try:
                yield receive, write_stream
            finally:
                tg.cancel_scope.cancel()


@dataclass
class _Attempt:
    """What one spawn-per-call exchange got up to, for the error message."""

    phase: str = "the handshake"
    bad_output: str | None = None
    done: bool = False
    result: Any = None


class StdioTransport:
    """Talk to an MCP server that runs as a child process over stdin/stdout.

    ``command`` is the argv (a list) or a command line split with
    :func:`shlex.split`. ``env`` is merged over a minimal inherited
    environment (see the module docs), ``cwd`` is the server's working
    directory, ``timeout`` bounds each call (start-up included), and
    ``server_name`` labels errors (default: the command's base name).
    ``stateless=True`` spawns a process per call instead of keeping one;
    ``concurrent=False`` keeps one per calling thread instead of one per
    process (see the module docs).
    """

    def __init__(
        self,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
        server_name: str | None = None,
        stateless: bool = False,
        concurrent: bool = True,
    ) -> None:
        argv = shlex.split(command) if isinstance(command, str) else command
        if not isinstance(argv, list | tuple) or not argv:
            raise InvalidArgumentError(
                "StdioTransport needs a command: a non-empty argv list or string")
        if not all(isinstance(arg, str) for arg in argv) or not argv[0]:
            raise InvalidArgumentError(
                f"StdioTransport command must be non-empty strings, got {argv!r}")
        if any("\0" in arg for arg in argv):
            raise InvalidArgumentError("StdioTransport command must not contain NUL characters")
        if env is not None and not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise InvalidArgumentError("StdioTransport env must be a dict of str to str")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise InvalidArgumentError(
                f"StdioTransport timeout must be a positive number, got {timeout!r}")
        self.argv: list[str] = list(argv)
        self.env: dict[str, str] = dict(env or {})
        self.cwd: str | None = os.fspath(cwd) if cwd is not None else None
        self.timeout = float(timeout)
        self.server_name = server_name or os.path.basename(self.argv[0]) or self.argv[0]
        self.stateless = bool(stateless)
        self.concurrent = bool(concurrent)

    def __repr__(self) -> str:
        return f"<StdioTransport {self.server_name!r} command={self._command_text()}>"

    # -- McpTransport -------------------------------------------------------------

    def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP tool dicts (every page of the listing)."""
        return cast("list[dict[str, Any]]", self._run("tools/list", sdk.list_all_tools))

    def call_tool(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, Any] | None = None,
    ) -> ToolResult:
        """Call tool ``name``; ``meta`` travels as the request's ``_meta``."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"tool name must be a non-empty string, got {name!r}")
        try:
            request = types.CallToolRequest(
                params=types.CallToolRequestParams(
                    name=name,
                    arguments=arguments if arguments is not None else {},
                    _meta=meta,  # type: ignore[arg-type]  # validated right here
                )
            )
        except pydantic.ValidationError as exc:
            raise InvalidArgumentError(
                f"cannot build a tools/call request for {name!r}: {exc}") from exc

        async def op(session: ClientSession) -> dict[str, Any]:
            try:
                result = await session.send_request(request, types.CallToolResult)
            except MCPError as exc:
                if exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                    raise
                # A JSON-RPC error answer (unknown tool, invalid arguments): the model
                # can act on it, so it is a tool result, not an infrastructure failure.
                return ToolResult.error(f"MCP error {exc.code}: {exc.message}").to_mcp()
            return result.model_dump(by_alias=True, mode="json", exclude_none=True)

        return ToolResult.from_mcp(self._run("tools/call", op))

    def session_state(self) -> dict[str, Any]:
        """Nothing to persist: a stdio session cannot be resumed elsewhere. Always ``{}``."""
        return {}

    def close(self) -> None:
        """Nothing to release: a kept child belongs to the process, not to the
        transport (:func:`stop_kept_servers` stops them)."""

    # -- one exchange ---------------------------------------------------------------

    def _run(self, method: str, op: Callable[[ClientSession], Awaitable[_T]]) -> _T:
        started = time.perf_counter()
        outcome = "failed"
        try:
            # The exchange bounds itself (timeout, then the shielded teardown);
            # the bridge's wait is a safety net against a teardown that hangs.
            if self.stateless:
                result = bridge.run_sync(
                    lambda: self._exchange(method, op),
                    self.timeout + _TEARDOWN_BOUND + _BRIDGE_SLACK,
                )
            else:
                key = self._key()
                result = bridge.run_sync(
                    lambda: self._kept_exchange(key, method, op),
                    self.timeout + _PING_BOUND + _TEARDOWN_BOUND + _BRIDGE_SLACK,
                )
            outcome = "ok"
            return result
        except TimeoutError as exc:
            raise self._error(
                "timeout",
                f"no answer to {method} within {self.timeout:g} s, and the server process "
                "did not stop in time either",
                "",
            ) from exc
        finally:
            logger.debug(
                "stdio MCP %s %s on %r (%s): %s in %.0f ms",
                self.server_name, method, self._command_text(),
                "spawned" if self.stateless else "kept", outcome,
                (time.perf_counter() - started) * 1000,
            )

    async def _exchange(self, method: str, op: Callable[[ClientSession], Awaitable[_T]]) -> _T:
        attempt = _Attempt()
        abort = anyio.CancelScope()

        async def on_message(message: IncomingMessage) -> None:
            if not isinstance(message, Exception) or _is_blank_line(message):
                return
            if attempt.bad_output is None:
                attempt.bad_output = self._describe_bad_output(message)
            abort.cancel()

        params = StdioServerParameters(
            command=self.argv[0], args=self.argv[1:], env=self._child_env(), cwd=self.cwd
        )
        with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as errlog:
            failure: Exception | None = None
            try:
                with anyio.move_on_after(self.timeout) as deadline, abort:
                    transport = stdio_client(params, errlog=cast("Any", errlog))
                    async with Client(
                        transport,
                        mode="auto",
                        cache=None,
                        message_handler=on_message,
                        client_info=sdk.CLIENT_INFO,
                    ) as client:
                        attempt.phase = method
                        attempt.result = await op(client.session)
                        attempt.done = True
            except Exception as exc:  # an ExceptionGroup from the SDK's task groups, mostly
                failure = exc
            if attempt.done:
                if failure is not None:  # the answer arrived; only the teardown broke
                    logger.warning(
                        "stdio MCP server %r: error while shutting down after %s: %r",
                        self.server_name, method, failure,
                    )
                return cast("_T", attempt.result)
            stderr = self._stderr_tail(errlog)
            if attempt.bad_output is not None:
                raise self._error("protocol", attempt.bad_output, stderr) from failure
            if failure is not None:
                kind, message = self._classify(failure, attempt)
                raise self._error(kind, message, stderr) from failure
            if deadline.cancelled_caught:
                raise self._error(
                    "timeout",
                    f"no answer to {attempt.phase} within {self.timeout:g} s; "
                    "the server process was stopped",
                    stderr,
                )
            raise self._error(  # pragma: no cover - every exit path above returns or raises
                "protocol", f"the exchange ended without an answer to {attempt.phase}", stderr
            )


    # -- a kept child --------------------------------------------------------------

    def _key(self) -> _Key:
        return _Key(
            argv=tuple(self.argv),
            env=tuple(sorted(self.env.items())),
            cwd=self.cwd,
            thread=None if self.concurrent else threading.get_ident(),
        )

    async def _kept_exchange(
        self, key: _Key, method: str, op: Callable[[ClientSession], Awaitable[_T]]
    ) -> _T:
        """One request in the kept child's session (started first when there is none)."""
        deadline = anyio.current_time() + self.timeout
        child = await _pool().acquire(key, self, deadline)
        if isinstance(child, _StartFailure):
            raise self._error(child.kind, child.message, child.stderr) from child.cause
        assert child.session is not None
        finished = False
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as scope:
                result = await op(child.session)
                finished = True
                return result
            if scope.cancelled_caught:
                finished = True  # checked here, not again in the background
                kept = await child.check_health(min(_PING_BOUND, self.timeout))
                if kept:
                    message = (f"no answer to {method} within {self.timeout:g} s; the server "
                               "still answers pings, so it was kept (the call was cancelled)")
                else:
                    message = (f"no answer to {method} within {self.timeout:g} s, nor to a "
                               "ping after it; the server process was stopped (the next call "
                               "starts a new one)")
                    await child.stopped(_TEARDOWN_BOUND)
                raise self._error("timeout", message, child.stderr_tail())
            raise self._error(  # pragma: no cover - the scope either returned or timed out
                "protocol", f"the exchange ended without an answer to {method}", "")
        except McpTransportError:
            raise
        except Exception as exc:
            # The relay marks a dead child (or garbage on its stdout) before the
            # session fails the calls in flight, so this says why the call failed.
            died = child.ended.is_set()
            child.stop.set()  # a fresh child for the next call, whatever went wrong
            if child.bad_output is not None:
                raise self._error("protocol", child.bad_output, child.stderr_tail()) from exc
            attempt = _Attempt(phase=method)
            kind, message = self._classify(exc, attempt)
            if died and kind == "protocol":
                message = (f"the server process exited (or closed its stdout) during {method}; "
                           "the next call starts a new one")
            raise self._error(kind, message, child.stderr_tail()) from exc
        finally:
            if not finished and not child.stop.is_set():
                # Cancelled from outside (the waiting thread was interrupted): check
                # in the background that the server is not hung on the abandoned call.
                child.spawn_check(min(_PING_BOUND, self.timeout))
            child.trim_stderr()

    async def _serve(self, child: _Child) -> None:
        """The task that starts the child, keeps its session open and stops it (same task)."""
        params = StdioServerParameters(
            command=self.argv[0], args=self.argv[1:], env=self._child_env(), cwd=self.cwd
        )
        try:
            async with Client(
                _watched(stdio_client(params, errlog=cast("Any", child.errlog)), child, self),
                mode="auto",
                cache=None,
                client_info=sdk.CLIENT_INFO,
            ) as client:
                child.session = client.session
                child.ready.set()
                await child.stop.wait()
        except BaseException as exc:
            if not child.ready.is_set():
                child.open_error = exc
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            if child.ready.is_set() and not isinstance(exc, Exception):
                raise
        finally:
            child.stop.set()
            child.ready.set()
            child.done.set()
            logger.debug("stdio MCP server %r (%s) stopped", self.server_name,
                         self._command_text())

    # -- environment ----------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        """Locale variables of ours, ``env=`` over them; the SDK adds its allowlist below."""
        base = {k: os.environ[k] for k in _LOCALE_VARS if os.environ.get(k)}
        return base | self.env

    # -- errors ---------------------------------------------------------------------

    def _classify(self, failure: BaseException, attempt: _Attempt) -> tuple[str, str]:
        leaf = _pick_leaf(failure)
        phase = attempt.phase
        if isinstance(leaf, TimeoutError):  # before OSError: TimeoutError is one
            return "timeout", f"no answer to {phase} within {self.timeout:g} s"
        if isinstance(leaf, OSError) and not isinstance(leaf, ConnectionError):
            return "spawn", self._spawn_message(leaf)
        if isinstance(leaf, MCPError):
            if leaf.code == REQUEST_TIMEOUT:
                return "timeout", f"no answer to {phase} within {self.timeout:g} s"
            if leaf.code == CONNECTION_CLOSED:
                return "protocol", (
                    f"the server closed its stdout before answering {phase} "
                    "(did the process exit? see its stderr)"
                )
            return "protocol", f"the server answered {phase} with error {leaf.code}: {leaf.message}"
        if isinstance(leaf, pydantic.ValidationError):
            return "protocol", (
                f"the server's answer to {phase} is not a valid MCP result: "
                f"{_first_line(str(leaf))}"
            )
        if isinstance(leaf, anyio.BrokenResourceError | anyio.ClosedResourceError | EOFError):
            return "protocol", f"the connection to the server broke during {phase}"
        return "protocol", f"{phase} failed: {type(leaf).__name__}: {leaf}"

    def _spawn_message(self, exc: OSError) -> str:
        program = self.argv[0]
        if self.cwd is not None and not os.path.isdir(self.cwd):
            return f"cannot start it: the working directory {self.cwd!r} does not exist"
        if isinstance(exc, FileNotFoundError):
            path = self._child_env().get("PATH", os.environ.get("PATH", ""))
            if os.sep not in program and shutil.which(program, path=path) is None:
                return (
                    f"cannot start it: command {program!r} not found on PATH; "
                    "is it installed? Install it, add its directory to PATH "
                    "(or env={'PATH': ...}), or give its absolute path"
                )
            return (
                f"cannot start it: {program!r} does not exist, or the interpreter "
                "named on its #! line does not; check the path"
            )
        if isinstance(exc, PermissionError):
            return f"cannot start it: {program!r} is not executable (permission denied)"
        return f"cannot start it: {type(exc).__name__}: {exc.strerror or exc}"

    def _error(self, kind: str, message: str, stderr: str) -> McpTransportError:
        text = f"{message}; command: {self._command_text()}"
        if stderr:
            text += f"; server stderr (tail): {stderr}"
        return McpTransportError(kind, self._mask(text), server=self.server_name)

    def _describe_bad_output(self, exc: Exception) -> str:
        excerpt: Any = None
        if isinstance(exc, pydantic.ValidationError):
            errors = exc.errors(include_url=False)
            if errors:
                excerpt = errors[0].get("input")
        if excerpt is None:
            return f"the server wrote something that is not JSON-RPC to stdout: {exc}"
        if not isinstance(excerpt, str):
            excerpt = json.dumps(excerpt, default=str)
        if len(excerpt) > _MAX_LINE_EXCERPT:
            excerpt = excerpt[: _MAX_LINE_EXCERPT - 3] + "..."
        return (
            f"the server wrote a line to stdout that is not a JSON-RPC message: {excerpt!r} "
            "(stdout is reserved for MCP messages; logs belong on stderr)"
        )

    def _stderr_tail(self, errlog: IO[str]) -> str:
        return _stderr_tail(errlog)

    def _command_text(self) -> str:
        text = shlex.join(self.argv)
        if len(text) > _MAX_COMMAND_CHARS:
            text = text[: _MAX_COMMAND_CHARS - 3] + "..."
        return self._mask(text)

    def _mask(self, text: str) -> str:
        for value in sorted(self.env.values(), key=len, reverse=True):
            if len(value) >= _MIN_MASKED_LEN:
                text = text.replace(value, _MASK)
        return text


# --------------------------------------------------------------------------- helpers


def _is_blank_line(exc: Exception) -> bool:
    if not isinstance(exc, pydantic.ValidationError):
        return False
    errors = exc.errors(include_url=False)
    value = errors[0].get("input") if errors else None
    return isinstance(value, str) and not value.strip()


def _pick_leaf(exc: BaseException) -> BaseException:
    """The most telling exception inside (possibly nested) ExceptionGroups."""
    leaves = [
        leaf for leaf in sdk.exception_leaves(exc)
        if not isinstance(leaf, anyio.get_cancelled_exc_class())
    ] or [exc]
    for wanted in (TimeoutError, OSError, MCPError, pydantic.ValidationError):
        for leaf in leaves:
            if isinstance(leaf, wanted):
                return leaf
    return leaves[0]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _stderr_tail(errlog: IO[str]) -> str:
    """The last lines of a server's stderr file, joined with `` | ``."""
    try:
        errlog.flush()
        fd = errlog.fileno()
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _STDERR_TAIL_BYTES, max(0, size - _STDERR_TAIL_BYTES))
    except (OSError, ValueError):
        return ""
    text = " | ".join(
        line.strip() for line in raw.decode("utf-8", "replace").splitlines() if line.strip()
    )
    if len(text) > _STDERR_TAIL_CHARS:
        text = "..." + text[-(_STDERR_TAIL_CHARS - 3):]
    return text
