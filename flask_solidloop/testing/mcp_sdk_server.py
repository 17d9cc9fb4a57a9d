"""A real Streamable HTTP MCP server, built with the MCP SDK's own server classes.

:class:`McpSdkServer` serves an :class:`mcp.server.mcpserver.MCPServer` through
uvicorn on 127.0.0.1, in a background thread, so tests (ours and yours) can
point an MCP client at a genuine SDK server without monkeypatching anything::

    with McpSdkServer(token="s3cret") as server:
        transport = HttpTransport(server.url, api_token="s3cret")
        transport.call_tool("add", {"a": 2, "b": 3})
        assert server.count("tools/call") == 1

It needs the ``mcp`` package (and the uvicorn/starlette it brings along).

Tools
-----
``echo(text)``
    returns ``text``.
``add(a, b)``
    returns ``a + b`` as structured output (``{"result": ...}``, with an outputSchema).
``slow(seconds)``
    sleeps, then returns ``"slept <seconds>"``.
``fail(message)``
    answers ``isError: true`` with ``message``.
``record_meta(note="")``
    stores the request's ``_meta`` in :attr:`McpSdkServer.received_meta` and returns
    it as JSON text.

Pass ``tools=[callable, ...]`` to add your own (any function MCPServer accepts).

What the wrapper around the SDK app adds
-----------------------------------------
* **A request log**: every HTTP request to the endpoint is recorded as a
  :class:`RecordedRequest` (HTTP method, JSON-RPC method, tool name,
  ``Mcp-Session-Id``, ``MCP-Protocol-Version``, status); see :meth:`count`.
* **Bearer auth** (``token=``): a request without ``Authorization: Bearer <token>``
  gets a bare ``401`` with ``WWW-Authenticate: Bearer`` and no body, as many
  gateways send it.
* **Era forcing** (``era=``): the SDK server speaks both protocol eras on one
  endpoint. ``era="legacy"`` makes it behave like a pre-2026 server (a
  ``server/discover`` probe or any 2026-07-28 request is refused with ``400``
  and a JSON-RPC error, so clients fall back to ``initialize``);
  ``era="modern"`` refuses the ``initialize`` handshake with ``-32022``
  naming the modern versions. ``"both"`` (default) is the SDK as it is.
  Assigning :attr:`McpSdkServer.era` while it runs simulates a server upgrade.
* **Faults** (:meth:`fault_next`): answer the next matching request with a
  status (``503`` ...) or a body that is not JSON-RPC.
* **Session loss** (:meth:`restart`): stop and start the server on the same
  port with a fresh session manager, so every ``Mcp-Session-Id`` issued
  before answers ``404``.

Run it standalone (for benchmarks in another process)::

    python -m flask_solidloop.testing.mcp_sdk_server --port 8765 [--token T] [--era legacy]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from ..errors import InvalidArgumentError, SetupError

__all__ = ["McpSdkServer", "RecordedRequest"]

_SESSION_HEADER = "mcp-session-id"
_VERSION_HEADER = "mcp-protocol-version"


@dataclass
class RecordedRequest:
    """One HTTP request the server received on its MCP endpoint."""

    http_method: str
    rpc_method: str | None = None
    tool: str | None = None
    session_id: str | None = None
    protocol_version: str | None = None
    authorization: str | None = None
    status: int | None = None
    body: Any = field(default=None, repr=False)


@dataclass
class _Fault:
    kind: str
    method: str | None
    status: int
    times: int


def _build_mcp_server(name: str, extra_tools: Iterable[Callable[..., Any]],
                      received_meta: list[dict[str, Any]]) -> MCPServer:
    # MCPServer() calls logging.basicConfig(): keep the host's root logger as it was.
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        server = MCPServer(name, version="1.0", log_level="WARNING")
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers

    @server.tool(description="Return the text unchanged.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="Sleep for the given number of seconds, then answer.")
    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(description="Always fail with the given message (isError: true).")
    def fail(message: str = "this tool always fails") -> str:
        raise ToolError(message)

    @server.tool(description="Return (and record) the request's _meta.", structured_output=False)
    def record_meta(ctx: Context, note: str = "") -> str:
        meta = dict(ctx.request_context.meta or {})
        received_meta.append(meta)
        return json.dumps(meta, sort_keys=True, default=str)

    for tool in extra_tools:
        server.add_tool(tool)
    return server


class McpSdkServer:
    """An SDK-built Streamable HTTP MCP server on 127.0.0.1 (background thread).

    Args:
        token: require ``Authorization: Bearer <token>`` (bare 401 otherwise).
        era: ``"both"`` (the SDK default), ``"legacy"`` or ``"modern"``.
        json_response: answer POSTs with ``application/json`` instead of SSE.
        stateless: serve handshake-era clients without sessions.
        tools: extra tool functions to register.
        port: 0 picks a free port (kept across :meth:`restart`).
        path: the endpoint path (default ``/mcp``).
        name: the server name advertised to clients.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        era: str = "both",
        json_response: bool = False,
        stateless: bool = False,
        tools: Iterable[Callable[..., Any]] = (),
        port: int = 0,
        path: str = "/mcp",
        name: str = "solidloop-test",
    ) -> None:
        if era not in ("both", "legacy", "modern"):
            raise InvalidArgumentError(f"era must be 'both', 'legacy' or 'modern', got {era!r}")
        self.token = token
        self.era = era
        self.json_response = json_response
        self.stateless = stateless
        self.path = path
        self.name = name
        self.host = "127.0.0.1"
        self.port = port
        self.requests: list[RecordedRequest] = []
        self.received_meta: list[dict[str, Any]] = []
        self._extra_tools = list(tools)
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._mcp: Any = None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """The endpoint URL, e.g. ``http://127.0.0.1:43211/mcp``."""
        return f"http://{self.host}:{self.port}{self.path}"

    def start(self, timeout: float = 10.0) -> McpSdkServer:
        """Bind, start serving in a daemon thread, and wait until it accepts requests."""
        import uvicorn

        if self._thread is not None:
            return self
        if self._mcp is None:
            self._mcp = _build_mcp_server(self.name, self._extra_tools, self.received_meta)
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only
        # when their proto says TCP; without it every response waits ~40 ms (Nagle +
        # delayed ACK) for its last chunk.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        # A new app means a new StreamableHTTPSessionManager (it runs once only).
        sdk_app = self._mcp.streamable_http_app(
            streamable_http_path=self.path,
            json_response=self.json_response,
            stateless_http=self.stateless,
            host=self.host,
        )
        config = uvicorn.Config(
            self._wrap(sdk_app),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="mcp-sdk-server", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise SetupError(f"the MCP test server on {self.url} did not start")
            time.sleep(0.005)
        self._uvicorn = server
        self._thread = thread
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (idempotent). Open sessions are dropped."""
        server, thread = self._uvicorn, self._thread
        self._uvicorn = self._thread = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)

    def restart(self) -> None:
        """Stop and start on the same port: every session issued before answers 404."""
        self.stop()
        self.start()

    def __enter__(self) -> McpSdkServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- inspection and faults ---------------------------------------------------

    def count(self, rpc_method: str | None = None, *, http_method: str | None = None) -> int:
        """How many recorded requests match (JSON-RPC method and/or HTTP method)."""
        with self._lock:
            return sum(
                1 for r in self.requests
                if (rpc_method is None or r.rpc_method == rpc_method)
                and (http_method is None or r.http_method == http_method)
            )

    def rpc_methods(self) -> list[str | None]:
        """The JSON-RPC method of every recorded POST, in order."""
        with self._lock:
            return [r.rpc_method for r in self.requests if r.http_method == "POST"]

    def reset_log(self) -> None:
        """Forget recorded requests and received ``_meta``."""
        with self._lock:
            self.requests.clear()
            self.received_meta.clear()

    def fault_next(self, kind: str, *, status: int = 503, method: str | None = None,
                   times: int = 1) -> None:
        """Answer the next ``times`` matching POSTs with a fault.

        ``kind``: ``"status"`` (that HTTP status, plain-text body), ``"malformed"``
        (200 ``application/json`` whose body is not JSON-RPC) or ``"stale_session"``
        (400 with the JSON-RPC error some servers send for a session they do not
        know: "Bad Request: No valid session ID provided"). ``method`` limits it
        to one JSON-RPC method (e.g. ``"tools/call"``).
        """
        if kind not in ("status", "malformed", "stale_session"):
            raise InvalidArgumentError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._faults.append(_Fault(kind, method, status, times))

    # -- the ASGI wrapper ------------------------------------------------------

    def _take_fault(self, rpc_method: str | None) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.method is None or fault.method == rpc_method:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def _wrap(self, app: Any) -> Any:
        server = self

        async def wrapper(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"].rstrip("/") != server.path.rstrip("/"):
                await app(scope, receive, send)
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope["headers"]}
            record = RecordedRequest(
                http_method=scope["method"],
                session_id=headers.get(_SESSION_HEADER),
                protocol_version=headers.get(_VERSION_HEADER),
                authorization=headers.get("authorization"),
            )
            body = b""
            if scope["method"] == "POST":
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                with contextlib.suppress(ValueError):
                    payload = json.loads(body)
                    record.body = payload
                    if isinstance(payload, dict):
                        record.rpc_method = payload.get("method")
                        params = payload.get("params") or {}
                        if record.rpc_method == "tools/call" and isinstance(params, dict):
                            record.tool = params.get("name")
            with server._lock:
                server.requests.append(record)

            async def send_watch(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    record.status = message["status"]
                await send(message)

            if server.token is not None and headers.get("authorization") != (
                f"Bearer {server.token}"
            ):
                await _respond(send_watch, 401, b"", [(b"www-authenticate", b"Bearer")])
                return

            version = record.protocol_version
            is_modern = version is not None and version in MODERN_PROTOCOL_VERSIONS
            is_discover = record.rpc_method == "server/discover"
            if server.era == "legacy" and (is_modern or is_discover) and scope["method"] == "POST":
                await _respond_jsonrpc_error(send_watch, 400, record.body, -32600,
                                             "Bad Request: Missing session ID")
                return
            if server.era == "modern" and scope["method"] == "POST" and (
                record.rpc_method == "initialize"
                or (not is_modern and (version is None or version in HANDSHAKE_PROTOCOL_VERSIONS)
                    and not is_discover)
            ):
                await _respond_jsonrpc_error(
                    send_watch, 400, record.body, -32022, "Unsupported protocol version",
                    data={"supported": list(MODERN_PROTOCOL_VERSIONS),
                          "requested": version or "2025-03-26"},
                )
                return

            if scope["method"] == "POST":
                fault = server._take_fault(record.rpc_method)
                if fault is not None:
                    if fault.kind == "status":
                        await _respond(send_watch, fault.status, b"injected fault",
                                       [(b"content-type", b"text/plain")])
                    elif fault.kind == "stale_session":
                        await _respond_jsonrpc_error(
                            send_watch, 400, record.body, -32000,
                            "Bad Request: No valid session ID provided")
                    else:
                        await _respond(send_watch, 200, b'{"this is": "not JSON-RPC"}',
                                       [(b"content-type", b"application/json")])
                    return

            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await app(scope, replay if scope["method"] == "POST" else receive, send_watch)

        return wrapper


async def _respond(send: Any, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _respond_jsonrpc_error(send: Any, status: int, request: Any, code: int, message: str,
                                 data: Any = None) -> None:
    request_id = request.get("id") if isinstance(request, dict) else None
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    body = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()
    await _respond(send, status, body, [(b"content-type", b"application/json")])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the SDK-built MCP test server.")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token", default=None)
    parser.add_argument("--era", default="both", choices=["both", "legacy", "modern"])
    parser.add_argument("--json-response", action="store_true")
    args = parser.parse_args(argv)
    server = McpSdkServer(port=args.port, token=args.token, era=args.era,
                          json_response=args.json_response).start()
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
