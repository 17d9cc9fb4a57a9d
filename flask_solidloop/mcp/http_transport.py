"""``HttpTransport``: the McpTransport for a Streamable HTTP MCP server (``url=``).

Built on the official MCP SDK (``mcp`` 2.3, whose HTTP layer is ``httpx2``) and
bridged to synchronous worker threads by :mod:`flask_solidloop.mcp.bridge`::

    transport = HttpTransport("https://tools.example.com/mcp", api_token="...")
    transport.list_tools()
    result = transport.call_tool("search", {"q": "tea"},
                                 meta={"solidloop/idempotencyKey": "solidloop:tool_call:42"})
    state = transport.session_state()      # persist per loop and server
    ...
    later = HttpTransport(url, api_token="...", session_state=state)   # other process

How it behaves
--------------
* **One session per transport, kept open.** The session lives on the process
  portal's event loop, so consecutive calls reuse it (and its keep-alive
  connection) instead of reconnecting. All transports of a process share one
  ``ssl.SSLContext`` and one ``httpx2.AsyncClient`` (connection pool, proxy
  settings from the environment); each transport's own headers (``api_token``
  becomes ``Authorization: Bearer``) ride on a thin per-transport client.
* **Protocol era negotiated once.** ``mode="auto"`` lets the SDK probe
  ``server/discover`` on first contact and fall back to the ``initialize``
  handshake. The outcome goes into :meth:`session_state` (and a per-process
  memo keyed by URL), so later transports adopt it without probing:
  a 2026-07-28 server is adopted with no round trip at all, and a
  handshake-era session is resumed by its ``Mcp-Session-Id``.
  ``mode="legacy"`` or ``mode="2026-07-28"`` pin the era.
* **No hidden requests.** :meth:`call_tool` sends the ``tools/call`` request
  through the session directly, so the SDK's implicit ``tools/list`` (done to
  validate output schemas the first time it sees a tool name) never happens.
  ``meta`` is sent as the request's ``_meta``. The client never opens the
  optional standalone GET stream (it is answered locally with 405, which the
  SDK treats as "server offers none"): solidloop takes no server-initiated
  requests, and each such stream would pin a connection and a server worker.
* **Session loss.** When a handshake-era server answers 404 for our session
  (expired, server restarted), or 400 with a message that says the session is
  unknown or invalid (``server-everything``: "Bad Request: No valid session ID
  provided"), the transport initializes a new session once and retries the
  request; a second failure raises ``kind="session"`` naming the HTTP status
  and the server's own message. Either way the lost session id is forgotten:
  re-read :meth:`session_state` after calls, it then holds the new session, or
  none, so a loop that stores it starts afresh on its next call.
* **Failures** raise :class:`~flask_solidloop.errors.McpTransportError`
  (ExceptionGroups unwrapped; messages name the URL, never credentials):
  ``connect`` (refused, DNS, connection lost), ``timeout`` (no answer within
  ``timeout`` seconds, handshake and request each), ``auth`` (HTTP 401/403,
  including the bare 401 the SDK reports only as a generic error), ``http``
  (5xx and other unexpected statuses), ``protocol`` (not JSON-RPC, not MCP, a
  JSON-RPC error other than invalid-params), ``session`` (see above, or the
  transport was closed). A JSON-RPC ``-32602`` (unknown tool, bad arguments)
  comes back as an error :class:`ToolResult` the model can correct, like
  ``isError: true``.
* :meth:`close` ends the session (``DELETE`` for handshake-era sessions) and
  is idempotent; ``close(end_session=False)`` only releases local resources so
  the persisted state can resume the session elsewhere.

``mcp`` is needed for ``url=`` servers; in-process toolsets do not need it.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import logging
import re
import ssl
import threading
import urllib.parse
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
import httpx2
import mcp_types as types
from mcp.client.client import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from flask_solidloop.errors import InvalidArgumentError, McpTransportError
from flask_solidloop.mcp import bridge, sdk
from flask_solidloop.mcp.toolset import ToolResult
from flask_solidloop.urls import redact_url

__all__ = ["HttpTransport"]

logger = logging.getLogger("flask_solidloop.mcp")

T = TypeVar("T")

_SESSION_HEADER = "mcp-session-id"
_VERSION_HEADER = "mcp-protocol-version"
_METHOD_HEADER = "mcp-method"
_CLOSE_TIMEOUT = 10.0
#: Extra wait the bridge allows beyond the transport's own timeouts (a safety net).
_BRIDGE_SLACK = 10.0

# --------------------------------------------------------------------------- shared HTTP


_ssl_context: ssl.SSLContext | None = None
_ssl_lock = threading.Lock()


def shared_ssl_context() -> ssl.SSLContext:
    """The process's one client SSL context (building one costs ~20 ms).

    Honours ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` like httpx2 does.
    """
    global _ssl_context
    if _ssl_context is None:
        with _ssl_lock:
            if _ssl_context is None:
                _ssl_context = httpx2.create_ssl_context(trust_env=True)
    return _ssl_context


def _shared_client() -> httpx2.AsyncClient:
    """The portal loop's shared client: connection pool, TLS, environment proxies."""
    portal = bridge.get_portal()
    client = portal.state.get("http_client")
    if client is None:
        client = httpx2.AsyncClient(
            verify=shared_ssl_context(),
            timeout=None,  # each request carries the timeout of the transport that sent it
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=True,
        )
        portal.state["http_client"] = client
        portal.add_finalizer(client.aclose)
    return client


# --------------------------------------------------------------------------- HTTP events


@dataclass
class _HttpEvent:
    """One HTTP exchange of a session, as seen below the SDK."""

    method: str
    rpc_method: str | None
    session_id: str | None
    status: int | None = None
    error: BaseException | None = None
    json_body: bool = False
    seq: int = 0
    #: The start of the body of a 400/404 answered to a request in a session
    #: (it says whether the server forgot the session).
    body: str | None = None


#: The events of the request being made; the SDK runs each POST in a copy of the
#: sending task's context, so the list set by the caller collects its own POSTs.
_CALL_EVENTS: contextvars.ContextVar[list[_HttpEvent] | None] = contextvars.ContextVar(
    "solidloop_mcp_http_events", default=None
)


class _Relay(httpx2.AsyncBaseTransport):
    """The per-transport client's "transport": forwards to the shared client, records outcomes.

    Recording is how failures the SDK flattens get classified: it reports a
    bare 401 or a 503 as the same generic JSON-RPC error, and a refused
    connection in an open session only as "Connection closed".
    """

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "GET" and "last-event-id" not in request.headers:
            # The optional standalone SSE stream for server-initiated messages:
            # not wanted (see the module docstring). 405 means "none offered".
            # GETs with Last-Event-ID resume a POST's response stream and go out.
            return httpx2.Response(405, request=request)
        event = _HttpEvent(
            method=request.method,
            rpc_method=request.headers.get(_METHOD_HEADER),
            session_id=request.headers.get(_SESSION_HEADER),
        )
        self._conn.record(event)
        try:
            response = await _shared_client().send(request, stream=True)
        except BaseException as exc:
            event.error = exc
            raise
        event.status = response.status_code
        event.json_body = response.headers.get("content-type", "").lower().startswith(
            "application/json"
        )
        if response.status_code in (400, 404) and event.session_id:
            # Small error bodies; read here (the SDK reads them again from the cache).
            event.body = _short((await response.aread()).decode("utf-8", "replace"), 500)
        session_id = response.headers.get(_SESSION_HEADER)
        if session_id and response.status_code < 300:
            self._conn.session_id = session_id
        return response


# --------------------------------------------------------------------------- connection


@dataclass
class _Plan:
    """How to open a session: resume a handshake-era one, or let the SDK Client connect."""

    resume: bool
    mode: str = "auto"
    discover: types.DiscoverResult | None = None
    state: dict[str, Any] = field(default_factory=dict)


class _Connection:
    """One open session, owned by a task on the portal loop (entered and exited there)."""

    def __init__(self, generation: int, plan: _Plan) -> None:
        self.generation = generation
        self.plan = plan
        self.session: ClientSession | None = None
        self.http: httpx2.AsyncClient | None = None
        self.era = ""
        self.protocol_version: str | None = None
        self.session_id: str | None = None
        self.server_info: dict[str, Any] | None = None
        self.capabilities: dict[str, Any] | None = None
        self.discover: dict[str, Any] | None = None
        self.events: collections.deque[_HttpEvent] = collections.deque(maxlen=64)
        self.seq = 0
        self.connect_events: list[_HttpEvent] = []
        self.ready = anyio.Event()
        self.closing = anyio.Event()
        self.done = anyio.Event()
        self.open_error: BaseException | None = None
        self.failure: BaseException | None = None
        self.end_session = False
        self.task: asyncio.Task[None] | None = None

    def record(self, event: _HttpEvent) -> None:
        self.seq += 1
        event.seq = self.seq
        self.events.append(event)
        call_events = _CALL_EVENTS.get()
        if call_events is not None:
            call_events.append(event)

    @property
    def alive(self) -> bool:
        return (
            self.session is not None
            and self.failure is None
            and not self.done.is_set()
            and not self.closing.is_set()
        )


# --------------------------------------------------------------------------- transport

#: URL -> what first contact learned (era, protocol version, discover result).
_remembered: dict[str, dict[str, Any]] = {}


class HttpTransport:
    """An :class:`~flask_solidloop.mcp.transport.McpTransport` for a Streamable HTTP server.

    Args:
        url: the MCP endpoint, e.g. ``https://tools.example.com/mcp``.
        headers: extra HTTP headers sent with every request.
        api_token: sent as ``Authorization: Bearer <api_token>``.
        timeout: seconds allowed for the session handshake and for each request.
        mode: ``"auto"`` (probe once, then remember), ``"legacy"`` (initialize
            handshake) or a modern protocol version such as ``"2026-07-28"``.
        session_state: a dict from :meth:`session_state`, to resume that session.
        server_name: how error messages name the server (default: the URL).
    """

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        api_token: str | None = None,
        timeout: float = 60.0,
        mode: str = "auto",
        session_state: dict[str, Any] | None = None,
        server_name: str | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgumentError(
                f"an MCP server URL must start with http:// or https://, got {url!r}")
        if mode not in ("auto", "legacy") and mode not in MODERN_PROTOCOL_VERSIONS:
            choices = ", ".join(repr(m) for m in ("auto", "legacy", *MODERN_PROTOCOL_VERSIONS))
            raise InvalidArgumentError(f"mode must be one of {choices}, got {mode!r}")
        if not timeout or timeout <= 0:
            raise InvalidArgumentError(
                f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url
        self.mode = mode
        self.timeout = float(timeout)
        self.server_name = server_name
        self._display_url = _display_url(url)
        self._headers = {str(k): str(v) for k, v in (headers or {}).items()}
        if api_token:
            self._headers["Authorization"] = f"Bearer {api_token}"
        self._state: dict[str, Any] = _valid_state(session_state, url)
        self._conn: _Connection | None = None
        self._lock: tuple[int, asyncio.Lock] | None = None
        self._closed = False

    def __repr__(self) -> str:
        era = self._state.get("era", "unknown era")
        return f"<HttpTransport {self._display_url} {era}>"

    # -- McpTransport ---------------------------------------------------------------

    def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP tool dicts (all pages)."""
        return self._run(self._alist_tools)

    def call_tool(self, name: str, arguments: dict[str, Any], *,
                  meta: dict[str, Any] | None = None) -> ToolResult:
        """Call one tool; ``meta`` goes into the request's ``_meta``."""
        return self._run(lambda: self._acall_tool(name, arguments, meta))

    def session_state(self) -> dict[str, Any]:
        """Era, protocol version, session id and server info, to resume elsewhere ({} before
        first contact). JSON-serialisable; holds no credentials."""
        return dict(self._state)

    def close(self, *, end_session: bool = True) -> None:
        """End the session (DELETE for handshake-era sessions) and release it. Idempotent.

        ``end_session=False`` keeps the server-side session alive so the
        persisted :meth:`session_state` can resume it.
        """
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        self._conn = None
        session_id = self._state.get("session_id")
        if conn is None and not (end_session and session_id):
            return
        if conn is not None and conn.generation != bridge.generation():
            conn = None  # belongs to a loop that no longer exists (fork, shutdown)
            if not (end_session and session_id):
                return
        try:
            bridge.run_sync(lambda: self._aclose(conn, end_session), _CLOSE_TIMEOUT + 2)
        except Exception:
            logger.debug("closing the MCP session at %s failed", self._display_url, exc_info=True)
        if end_session:
            self._state.pop("session_id", None)

    def __enter__(self) -> HttpTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- sync -> async ------------------------------------------------------------

    def _run(self, factory: Callable[[], Awaitable[T]]) -> T:
        if self._closed:
            raise McpTransportError(
                "session", f"the transport for {self._display_url} was closed; build a new one",
                server=self.server_name,
            )
        # The coroutine enforces `timeout` per phase; the bridge's wait is a safety net.
        try:
            return bridge.run_sync(factory, 2 * self.timeout + _BRIDGE_SLACK)
        except TimeoutError as exc:
            raise self._error("timeout", self._timeout_message("the request")) from exc

    # -- operations ---------------------------------------------------------------

    async def _alist_tools(self) -> list[dict[str, Any]]:
        return await self._request(sdk.list_all_tools, "tools/list")

    async def _acall_tool(self, name: str, arguments: dict[str, Any],
                          meta: dict[str, Any] | None) -> ToolResult:
        request = types.CallToolRequest(
            params=types.CallToolRequestParams(
                name=name,
                arguments=dict(arguments or {}),
                _meta=cast(types.RequestParamsMeta, dict(meta)) if meta else None,
            )
        )

        async def send(session: ClientSession) -> types.CallToolResult:
            return await session.send_request(
                request, types.CallToolResult, request_read_timeout_seconds=self.timeout
            )

        async def op(session: ClientSession) -> ToolResult:
            try:
                try:
                    result = await send(session)
                except MCPError as exc:
                    if exc.code != HEADER_MISMATCH or session.protocol_version not in (
                        MODERN_PROTOCOL_VERSIONS
                    ):
                        raise
                    # 2026-07-28: the server wants Mcp-Param-* headers derived from the
                    # tool's listing; list once (the session absorbs it) and resend.
                    await session.list_tools()
                    result = await send(session)
            except MCPError as exc:
                if exc.code == INVALID_PARAMS and _answered_by_server(_CALL_EVENTS.get()):
                    return ToolResult.error(
                        f"the MCP server rejected the call to {name!r}: {exc.error.message}"
                    )
                raise
            return ToolResult.from_mcp(result.model_dump(by_alias=True, mode="json",
                                                         exclude_none=True))

        return await self._request(op, f"tools/call {name!r}")

    async def _request(self, op: Callable[[ClientSession], Awaitable[T]], what: str) -> T:
        """Run ``op`` in the open session; re-initialize once if the session was lost."""
        for attempt in (1, 2):
            conn = await self._connected()
            assert conn.session is not None
            events: list[_HttpEvent] = []
            token = _CALL_EVENTS.set(events)
            first_seq = conn.seq
            try:
                with anyio.fail_after(self.timeout):
                    return await op(conn.session)
            except Exception as exc:
                if not events:  # the SDK did not run our POST in our context: use the log
                    events = [e for e in conn.events if e.seq > first_seq]
                error = self._classify(exc, events, conn, what)
                if (attempt == 1 and self.mode == "auto" and error.kind == "protocol"
                        and _era_rejected(exc, events, conn.era)):
                    # Learned from state or the process memo, and now refused: the
                    # server changed eras. The request was not executed; probe again.
                    logger.info("MCP server at %s refused the %s protocol era; probing again",
                                self._display_url, conn.era)
                    self._forget_era()
                    await self._drop(conn, forget_session=True)
                    continue
                if error.kind == "session" and conn.era == "legacy":
                    # Unknown/expired session: forget it; the next attempt initializes.
                    await self._drop(conn, forget_session=True)
                    if attempt == 1:
                        logger.info("MCP session at %s was lost; initializing a new one",
                                    self._display_url)
                        continue
                    raise self._error(
                        "session",
                        f"{_without_server(error)} (again, right after a new session was "
                        "initialized); check the server's session handling (several replicas "
                        "without shared sessions?)",
                    ) from exc
                if error.kind in ("connect", "protocol") or not conn.alive:
                    await self._drop(conn, forget_session=False)
                raise error from exc
            finally:
                _CALL_EVENTS.reset(token)
        # Unreachable: a second attempt never continues. Said as an error, not assumed.
        raise self._error("protocol", f"{what}: no answer after two attempts")  # pragma: no cover

    # -- the session ----------------------------------------------------------------

    def _loop_lock(self) -> asyncio.Lock:
        gen = bridge.generation()
        if self._lock is None or self._lock[0] != gen:
            self._lock = (gen, asyncio.Lock())
        return self._lock[1]

    async def _connected(self) -> _Connection:
        if self._closed:
            raise self._error("session", f"the transport for {self._display_url} was closed")
        async with self._loop_lock():
            gen = bridge.generation()
            conn = self._conn
            if conn is not None and conn.generation == gen and conn.alive:
                return conn
            if conn is not None and conn.generation == gen:
                await self._drop(conn, forget_session=False)
            self._conn = None
            plan = self._plan()
            conn = _Connection(gen, plan)
            conn.task = asyncio.get_running_loop().create_task(self._own(conn))
            try:
                with anyio.fail_after(self.timeout):
                    await conn.ready.wait()
            except TimeoutError as exc:
                conn.task.cancel()
                raise self._error(
                    "timeout", self._timeout_message("the session handshake")
                ) from exc
            if conn.open_error is not None:
                raise self._classify(conn.open_error, conn.connect_events, conn,
                                     "the session handshake") from conn.open_error
            self._conn = conn
            self._remember(conn)
            return conn

    def _plan(self) -> _Plan:
        state = self._state or _remembered.get(self.url, {})
        era = state.get("era")
        version = state.get("protocol_version")
        if self.mode == "legacy" or (self.mode == "auto" and era == "legacy"):
            if era == "legacy" and state.get("session_id") and version in (
                HANDSHAKE_PROTOCOL_VERSIONS
            ):
                return _Plan(resume=True, state=state)
            return _Plan(resume=False, mode="legacy")
        if self.mode in MODERN_PROTOCOL_VERSIONS:
            discover = _discover_from(state) if version == self.mode else None
            return _Plan(resume=False, mode=self.mode, discover=discover)
        if era == "modern" and version in MODERN_PROTOCOL_VERSIONS:
            return _Plan(resume=False, mode=version, discover=_discover_from(state))
        return _Plan(resume=False, mode="auto")

    async def _own(self, conn: _Connection) -> None:
        """The task that enters the session, keeps it open, and exits it (same task)."""
        _CALL_EVENTS.set(conn.connect_events)
        try:
            async with AsyncExitStack() as stack:
                await self._open(stack, conn)
                conn.ready.set()
                await conn.closing.wait()
                if conn.end_session:
                    await self._delete_session(conn.http, conn.session_id, conn.protocol_version)
        except BaseException as exc:
            if not conn.ready.is_set():
                conn.open_error = exc
            else:
                conn.failure = exc
                if not isinstance(exc, asyncio.CancelledError):
                    logger.debug("MCP session at %s ended with an error", self._display_url,
                                 exc_info=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            conn.ready.set()
            conn.done.set()

    async def _open(self, stack: AsyncExitStack, conn: _Connection) -> None:
        plan = conn.plan
        headers = dict(self._headers)
        if plan.resume:
            headers[_SESSION_HEADER] = plan.state["session_id"]
            conn.session_id = plan.state["session_id"]
        http = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(self.timeout, connect=min(self.timeout, 15.0),
                                   read=self.timeout + 5.0),
            transport=_Relay(conn),
            trust_env=False,  # the shared client applies the environment's proxy settings
        )
        conn.http = http
        stack.push_async_callback(http.aclose)
        streams = streamable_http_client(self.url, http_client=http, terminate_on_close=False)
        if plan.resume:
            read_stream, write_stream = await stack.enter_async_context(streams)
            session = ClientSession(read_stream, write_stream, client_info=sdk.CLIENT_INFO)
            await stack.enter_async_context(session)
            state = plan.state
            session.adopt(types.InitializeResult(
                protocol_version=state["protocol_version"],
                capabilities=types.ServerCapabilities.model_validate(
                    state.get("capabilities") or {}),
                server_info=types.Implementation.model_validate(
                    state.get("server_info") or {"name": "unknown", "version": ""}
                ),
            ))
        else:
            client = Client(streams, mode=plan.mode, prior_discover=plan.discover, cache=None,
                            client_info=sdk.CLIENT_INFO)
            await stack.enter_async_context(client)
            session = client.session
        conn.session = session
        conn.protocol_version = session.protocol_version
        conn.era = "modern" if session.protocol_version in MODERN_PROTOCOL_VERSIONS else "legacy"
        if session.server_info is not None:
            conn.server_info = session.server_info.model_dump(by_alias=True, mode="json",
                                                              exclude_none=True)
        if session.server_capabilities is not None:
            conn.capabilities = session.server_capabilities.model_dump(
                by_alias=True, mode="json", exclude_none=True)
        if session.discover_result is not None:
            conn.discover = session.discover_result.model_dump(by_alias=True, mode="json",
                                                               exclude_none=True)
        if conn.era == "modern":
            conn.session_id = None

    def _forget_era(self) -> None:
        self._state = {}
        _remembered.pop(self.url, None)

    async def _drop(self, conn: _Connection, *, forget_session: bool) -> None:
        """Close a connection locally (no DELETE); optionally forget its session id."""
        if self._conn is conn:
            self._conn = None
        if forget_session:
            self._state.pop("session_id", None)
            memo = _remembered.get(self.url)
            if memo is not None:
                memo.pop("session_id", None)
        conn.closing.set()
        with anyio.move_on_after(2.0):
            await conn.done.wait()

    async def _aclose(self, conn: _Connection | None, end_session: bool) -> None:
        if conn is not None:
            conn.end_session = end_session and conn.era == "legacy"
            conn.closing.set()
            with anyio.move_on_after(_CLOSE_TIMEOUT):
                await conn.done.wait()
            return
        # Built from state and closed before any call: end that session anyway.
        if self._state.get("era") == "legacy":
            headers = dict(self._headers)
            async with httpx2.AsyncClient(headers=headers, verify=shared_ssl_context(),
                                          timeout=min(self.timeout, _CLOSE_TIMEOUT)) as http:
                await self._delete_session(http, self._state.get("session_id"),
                                           self._state.get("protocol_version"))

    async def _delete_session(self, http: httpx2.AsyncClient | None, session_id: str | None,
                              version: str | None) -> None:
        if http is None or not session_id:
            return
        headers = {_SESSION_HEADER: session_id}
        if version:
            headers[_VERSION_HEADER] = version
        try:
            with anyio.fail_after(min(self.timeout, _CLOSE_TIMEOUT)):
                response = await http.request("DELETE", self.url, headers=headers)
            if response.status_code not in (200, 202, 204, 404, 405):
                logger.info("ending the MCP session at %s answered HTTP %s",
                            self._display_url, response.status_code)
        except Exception as exc:
            logger.info("could not end the MCP session at %s: %s", self._display_url, exc)

    def _remember(self, conn: _Connection) -> None:
        state: dict[str, Any] = {
            "transport": "streamable-http",
            # Stored in the database: the URL without userinfo or query (credentials).
            "url": self._display_url,
            "era": conn.era,
            "protocol_version": conn.protocol_version,
        }
        if conn.session_id:
            state["session_id"] = conn.session_id
        if conn.server_info is not None:
            state["server_info"] = conn.server_info
        if conn.capabilities is not None:
            state["capabilities"] = conn.capabilities
        if conn.discover is not None:
            state["discover"] = conn.discover
        self._state = state
        # A probe that failed for a transient reason (5xx, network) also makes the
        # SDK fall back to the handshake: do not let that verdict stick for others.
        probe_failed = any(
            e.rpc_method == "server/discover" and (e.error is not None or (e.status or 0) >= 500)
            for e in conn.connect_events
        )
        if not probe_failed:
            memo = {k: v for k, v in state.items() if k != "session_id"}
            _remembered[self.url] = memo

    # -- errors -------------------------------------------------------------------

    def _error(self, kind: str, message: str) -> McpTransportError:
        return McpTransportError(kind, message, server=self.server_name)

    def _timeout_message(self, what: str) -> str:
        return (
            f"the MCP server at {self._display_url} did not answer {what} within "
            f"{self.timeout:g} s; check that the server is healthy, or raise its timeout"
        )

    def _classify(self, exc: BaseException, events: list[_HttpEvent], conn: _Connection,
                  what: str) -> McpTransportError:
        """Turn whatever the SDK raised (plus what the relay saw) into McpTransportError."""
        url = self._display_url
        leaves = sdk.exception_leaves(exc)
        failed = [e for e in events if e.error is not None or (e.status or 0) >= 400]
        # What the HTTP layer saw is the most precise account.
        for event in failed:
            if event.error is not None:
                error = event.error
                if isinstance(error, httpx2.ConnectTimeout):
                    return self._error("connect", f"timed out connecting to the MCP server at "
                                       f"{url}; check that it is reachable from this host")
                if isinstance(error, httpx2.TimeoutException):
                    return self._error("timeout", self._timeout_message(what))
                if isinstance(error, httpx2.NetworkError):
                    return self._error("connect", _connect_message(url, error))
        for event in failed:
            status = event.status or 0
            if status in (401, 403):
                reason = ("refused the credentials" if status == 401
                          else "accepted the credentials but denies access")
                return self._error(
                    "auth",
                    f"the MCP server at {url} {reason} (HTTP {status} to {what}); check the "
                    "api_token / Authorization header configured for this server",
                )
            if event.session_id and conn.era != "modern" and (
                    status == 404 or (status == 400 and _says_session_lost(event.body))):
                said = _server_message(event.body)
                return self._error(
                    "session",
                    f"the MCP server at {url} does not know our session (HTTP {status}"
                    f"{': ' + said if said else ''}); it expired or the server restarted",
                )
            if status == 404:
                return self._error("http", f"the MCP server at {url} answered HTTP 404 to {what}; "
                                   "check the URL path of the MCP endpoint")
            if status >= 500 or not event.json_body:
                return self._error("http", f"the MCP server at {url} answered HTTP {status} to "
                                   f"{what}; check the server's logs and health")
        for leaf in leaves:
            if isinstance(leaf, TimeoutError):
                return self._error("timeout", self._timeout_message(what))
            if isinstance(leaf, httpx2.TimeoutException):
                return self._error("timeout", self._timeout_message(what))
            if isinstance(leaf, httpx2.NetworkError | OSError):
                return self._error("connect", _connect_message(url, leaf))
        for leaf in leaves:
            if isinstance(leaf, MCPError):
                code, message = leaf.code, leaf.error.message
                if code == REQUEST_TIMEOUT:
                    return self._error("timeout", self._timeout_message(what))
                if code == CONNECTION_CLOSED:
                    return self._error(
                        "connect", f"the connection to the MCP server at {url} closed during "
                        f"{what}; check that the server is running")
                if code == PARSE_ERROR or (code == INVALID_REQUEST and "content type" in message):
                    return self._error(
                        "protocol", f"the MCP server at {url} answered {what} with something "
                        f"that is not JSON-RPC ({_short(message)}); check that the URL points "
                        "at a Streamable HTTP MCP endpoint")
                return self._error(
                    "protocol", f"the MCP server at {url} answered {what} with JSON-RPC error "
                    f"{code}: {_short(message)}")
            if isinstance(leaf, ValidationError):
                return self._error(
                    "protocol", f"the MCP server at {url} answered {what} with a result that is "
                    f"not valid MCP ({leaf.error_count()} validation errors); check the server's "
                    "MCP version")
            if isinstance(leaf, httpx2.HTTPError):
                return self._error("http", f"HTTP error talking to the MCP server at {url}: "
                                   f"{_short(str(leaf))}")
        first = leaves[0] if leaves else exc
        return self._error(
            "protocol", f"talking to the MCP server at {url} failed during {what}: "
            f"{type(first).__name__}: {_short(str(first))}")


# --------------------------------------------------------------------------- helpers


def _answered_by_server(events: list[_HttpEvent] | None) -> bool:
    """True when the JSON-RPC error is the server's own answer, not one the SDK made up
    for a failed exchange (the last POST came back 2xx, or with a JSON body)."""
    if not events:
        return False
    last = events[-1]
    return last.error is None and last.status is not None and (
        last.status < 300 or last.json_body)


def _era_rejected(exc: BaseException, events: list[_HttpEvent], era: str) -> bool:
    """Did the server refuse the protocol era we assumed (it changed since we learned it)?"""
    if any(isinstance(leaf, MCPError) and leaf.code == UNSUPPORTED_PROTOCOL_VERSION
           for leaf in sdk.exception_leaves(exc)):
        return True
    # A handshake-era server answers a 2026-07-28 request (no session id) with 400.
    return era == "modern" and any(e.status == 400 for e in events)


_SESSION_LOST = re.compile(
    r"session.{0,40}\b(invalid|unknown|not found|expired|terminated|missing)\b"
    r"|\b(no valid|invalid|unknown|expired|missing)\b.{0,20}session", re.IGNORECASE | re.DOTALL)


def _says_session_lost(body: str | None) -> bool:
    """Does an HTTP 400's body say the server does not know our session?"""
    return bool(body) and _SESSION_LOST.search(_server_message(body) or "") is not None


def _server_message(body: str | None) -> str:
    """The server's own words in an error body: a JSON-RPC error's message, or the text."""
    if not body:
        return ""
    try:
        payload = json.loads(body)
    except ValueError:
        return _short(body)
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return _short(error["message"])
    return _short(body)


def _without_server(error: McpTransportError) -> str:
    """An error's text without the ``server: `` prefix its constructor added."""
    text = str(error)
    prefix = f"{error.server}: " if error.server else ""
    return text[len(prefix):] if prefix and text.startswith(prefix) else text


def _connect_message(url: str, error: BaseException) -> str:
    detail = _short(str(error)) or type(error).__name__
    return (
        f"cannot connect to the MCP server at {url} ({detail}); "
        "check that it is running and that the host, port and path are right"
    )


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _display_url(url: str) -> str:
    """The URL as messages and the stored session show it: without userinfo, query
    or fragment (they may carry credentials; the stored session needs neither)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port else host
        return redact_url(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")))
    except ValueError:
        return "<invalid URL>"


def _valid_state(state: dict[str, Any] | None, url: str) -> dict[str, Any]:
    """A usable copy of a persisted session_state, or {} (other URL, unknown era, junk)."""
    if not isinstance(state, dict) or not state:
        return {}
    if state.get("url") not in (None, url, _display_url(url)):
        return {}
    era, version = state.get("era"), state.get("protocol_version")
    if era == "legacy" and version in HANDSHAKE_PROTOCOL_VERSIONS:
        return dict(state)
    if era == "modern" and version in MODERN_PROTOCOL_VERSIONS:
        return dict(state)
    return {}


def _discover_from(state: dict[str, Any]) -> types.DiscoverResult | None:
    raw = state.get("discover")
    if not isinstance(raw, dict):
        return None
    try:
        return types.DiscoverResult.model_validate(raw)
    except ValidationError:
        return None
