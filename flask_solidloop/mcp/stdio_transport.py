"""An MCP server run as a child process over stdio: the ``command=`` transport.

:class:`StdioTransport` implements :class:`~flask_solidloop.mcp.transport.McpTransport`
with the official MCP SDK (``mcp.client.stdio.stdio_client`` under ``mcp.Client``)::

    fs = StdioTransport(["mcp-server-filesystem", "/srv/docs"], timeout=30)
    fs.list_tools()                                   # MCP tool dicts
    fs.call_tool("read_text_file", {"path": "/srv/docs/a.md"},
                 meta={"solidloop/idempotencyKey": "solidloop:tool_call:42"})

Spawn per call
--------------
Every :meth:`~StdioTransport.list_tools` and :meth:`~StdioTransport.call_tool`
starts the process, negotiates (``mode="auto"``: a ``server/discover`` probe,
falling back to the ``initialize`` handshake), sends one request and shuts the
process down again, as one coroutine on the process portal
(:func:`flask_solidloop.mcp.bridge.run_sync`) while the calling thread waits.
Nothing lives between calls, so the transport is stateless (``session_state()``
is ``{}``), safe to share between threads, and ``close()`` has nothing to
release. Waiting on the portal rather than inside a loop of its own keeps the
calling thread interruptible: a dramatiq time limit reaches it within ~0.1 s,
and the exchange is cancelled, which stops the process as below.
The price is the server's start-up on every call: a few hundred milliseconds for
a Node server, one to two seconds for a Python one (tests/test_mcp_stdio_transport.py
prints the figures measured on the machine it runs on).

Shutdown is the SDK's, per the MCP lifecycle: close the server's stdin, give it
2 s to exit, SIGTERM its process group, 2 s more, SIGKILL. The server runs in a
session of its own, so the whole tree goes, children included. That sequence
also runs when the call fails, times out or is cancelled (it is shielded from
the cancellation), so a ``timeout`` error is raised about ``timeout + 4`` seconds
after the call began at the latest (``timeout + 2`` for a server that obeys
SIGTERM), with no process left behind.

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
* ``protocol`` - the process exited or closed stdout before answering, wrote a
  line to stdout that is not a JSON-RPC message, answered with a result that
  does not fit the schema, or refused the handshake / ``tools/list``.
  A malformed stdout line fails the call at once: the MCP stdio rules forbid
  anything but JSON-RPC there (logs belong on stderr), and waiting it out would
  turn a clear protocol error into a timeout. Blank lines are tolerated.

Messages name the server and the command line, and end with the tail of the
server's stderr when it wrote any - the fastest way to see why it died. Values
passed in ``env=`` (tokens, typically) are masked wherever they would appear;
keep secrets in ``env=`` rather than in the command line.

A tool-level failure is a result, as the transport contract requires: the server
answering ``isError: true``, and also a JSON-RPC error response to ``tools/call``
(an unknown tool or invalid arguments, which the model can correct), which
becomes ``ToolResult.error("MCP error <code>: <message>")``.

``call_tool`` sends the ``CallToolRequest`` itself rather than going through
``Client.call_tool``, whose output-schema check would first run a ``tools/list``
of its own on every fresh connection.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
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

__all__ = ["StdioTransport"]

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
    directory, ``timeout`` bounds each call from spawn to answer, and
    ``server_name`` labels errors (default: the command's base name).
    """

    def __init__(
        self,
        command: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
        server_name: str | None = None,
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
        """Spawn-per-call keeps no session: always ``{}``."""
        return {}

    def close(self) -> None:
        """Nothing to release: no process outlives a call."""

    # -- one exchange ---------------------------------------------------------------

    def _run(self, method: str, op: Callable[[ClientSession], Awaitable[_T]]) -> _T:
        started = time.perf_counter()
        outcome = "failed"
        try:
            # The exchange bounds itself (timeout, then the shielded teardown);
            # the bridge's wait is a safety net against a teardown that hangs.
            result = bridge.run_sync(
                lambda: self._exchange(method, op),
                self.timeout + _TEARDOWN_BOUND + _BRIDGE_SLACK,
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
                "stdio MCP %s %s on %r: %s in %.0f ms",
                self.server_name, method, self._command_text(), outcome,
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

