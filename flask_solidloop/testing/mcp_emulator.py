"""A scriptable MCP server speaking Streamable HTTP on 127.0.0.1, for tests.

:class:`MCPEmulator` is a real server on a real socket (werkzeug, one daemon thread per
connection), so an MCP client's whole HTTP stack is exercised: the official SDK's
``mcp.Client`` connects to :attr:`MCPEmulator.url` unchanged. Messages are parsed and
results shaped with the SDK's own protocol types (``mcp.types.jsonrpc_message_adapter``,
``mcp.types.methods.parse_client_request`` / ``serialize_server_result``,
``mcp.shared.inbound.classify_inbound_request``), so what the emulator sends is what the
SDK's schemas allow for the negotiated protocol version. Nothing is monkeypatched.

Two protocol eras are served on one endpoint (``POST {path}``, default ``/mcp``):

* Handshake era (2024-11-05 .. 2025-11-25): ``initialize`` opens a session and the answer
  carries ``Mcp-Session-Id``; every later request must send it (missing: 400; unknown,
  expired or deleted: 404). ``MCP-Protocol-Version`` may be absent; when present it must
  equal the negotiated version (else 400). Notifications and posted responses get 202 with
  no body. ``DELETE`` ends a session (200; unknown: 404; no session header: 405); ``GET``
  is answered 405 (404 for an unknown session), which the spec allows for a server that
  offers no standalone SSE stream. JSON-RPC errors come with HTTP 200. ``initialize`` with
  an unknown ``Mcp-Session-Id`` is 404, as from the SDK's own server: a client must drop
  the old id before it re-initializes. Sessions live until DELETE, a ``session_lost``
  failure, :meth:`MCPEmulator.drop_session` or :meth:`MCPEmulator.reset` (no TTL).
* Stateless era (2026-07-28, ``stateless=True``, the default): no session. A request is
  routed here when its ``MCP-Protocol-Version`` header is not a handshake version, or when
  ``params._meta`` carries ``io.modelcontextprotocol/protocolVersion``. The envelope and the
  routing headers (``Mcp-Method``, ``Mcp-Name``, ``Mcp-Param-*``) are checked by the SDK's
  validation ladder; ``server/discover`` answers; JSON-RPC errors use the SDK's status
  table (400 / 404); results get ``resultType`` and the ``serverInfo`` ``_meta`` stamp.
  With ``stateless=False`` such requests get ``-32022`` naming only handshake versions, so
  ``mcp.Client(url)`` (``mode="auto"``) falls back to ``initialize``.

Served methods: ``initialize``, ``ping`` (handshake era), ``server/discover`` (stateless
era), ``tools/list`` and ``tools/call``. Anything else is ``-32601``. Batches are refused.
Answers are JSON; with ``sse=True`` a request whose ``Accept`` names ``text/event-stream``
gets its answer as one ``event: message`` SSE frame instead.

Tools::

    with MCPEmulator(token="s3cret") as mcp:
        mcp.tool("greet", input_schema={"type": "object",
                                        "properties": {"name": {"type": "string"}}},
                 handler=lambda args, meta: f"Hello {args['name']}!")
        mcp.tool("weather", result={"city": "Paris", "temp_c": 21},
                 output_schema={"type": "object"})
        ...  # point the client at mcp.url, with "Authorization: Bearer s3cret"

A result (scripted, or returned by a handler) is a ``str`` (one text block), a ``dict``
that looks like a ``CallToolResult`` (a ``content`` list, and only the keys ``content``,
``structuredContent``, ``isError``, ``_meta``, ``resultType``: sent as given), any other
``dict`` (``structuredContent`` plus the same JSON as a text block), or an
``mcp.types.CallToolResult``. A handler is called as ``handler(arguments, meta)``, ``meta``
being the request's ``params._meta`` (``{}`` when absent; the idempotency key and, in the
stateless era, the reserved ``io.modelcontextprotocol/*`` keys travel there). An exception
raised by a handler becomes an ``isError: true`` result naming it; raise ``mcp.MCPError`` for
a JSON-RPC error instead. Arguments are checked against ``input_schema`` (when
``jsonschema`` is importable; a mismatch is an ``isError`` result and the tool does not run).
A tool without ``result`` or ``handler`` echoes its arguments as JSON text.

Failures (:meth:`MCPEmulator.fail_next`) are consumed by POSTed JSON-RPC *requests* (not by
notifications, GET or DELETE), after the Host/Origin and token checks, in the order
queued; ``method=`` / ``tool=`` restrict which requests a failure applies to::

    mcp.fail_next("status", status=503, retry_after=2)   # no JSON-RPC body
    mcp.fail_next("session_lost")                        # 404; the session is gone
    mcp.fail_next("slow", seconds=0.5, method="tools/call")
    mcp.fail_next("is_error", message="quota exceeded")  # next tools/call: isError result
    mcp.fail_next("malformed")                           # 200 with a body that is not JSON-RPC

``malformed`` replaces the answer after the request was processed (a tool call ran, an
``initialize`` opened a session the client never learns about); ``status`` and
``session_lost`` answer before anything runs; ``slow`` delays, then answers normally.

Every request is recorded (:attr:`MCPEmulator.requests`, headers lower-cased), and every
tool run too (:attr:`MCPEmulator.calls`): a tool that ran is a tool whose side effects
happened, whatever became of its answer.

Security: the ``Host`` header must name a loopback host (``localhost``, ``127.0.0.1``,
``::1``, or the bound host), else 421; an ``Origin`` header, when sent, must too, else 403
(the spec's DNS-rebinding rule). With ``token`` set, every request needs
``Authorization: Bearer <token>``, else 401 with ``WWW-Authenticate: Bearer`` and an
OAuth-style JSON body (not JSON-RPC), as real servers answer.
"""

# Latency: as in llm_emulator.py, accepted sockets get TCP_NODELAY and each response body is
# produced as one bytes object written at once, so the Nagle + delayed-ACK stall cannot
# appear (werkzeug also answers "Connection: close", so every request is a fresh
# connection). Measured on the development machine while it was loaded (2 CPUs, load
# average ~8): handling a tools/call takes 0.6-2 ms inside the server; a raw httpx round
# trip 3-9 ms; an SDK Client call 8-25 ms, dominated by the client and the shared GIL when
# client and emulator run in one process. Body reads never stalled (<= 12 ms, scheduler
# noise, never the ~40 ms delayed-ACK signature).

from __future__ import annotations

import copy
import http
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import mcp.types as mcp_types
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    MCP_PROTOCOL_VERSION_HEADER,
    InboundLadderRejection,
    classify_inbound_request,
    unsupported_protocol_version_rejection,
    validate_mcp_param_headers,
)
from mcp.types import methods as mcp_methods
from mcp.types.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    jsonrpc_message_adapter,
)
from mcp.types.version import (
    HANDSHAKE_PROTOCOL_VERSIONS,
    LATEST_HANDSHAKE_VERSION,
    MODERN_PROTOCOL_VERSIONS,
)
from pydantic import BaseModel, ValidationError
from werkzeug.serving import BaseWSGIServer

from ._local_server import LocalServer

__all__ = ["MCPEmulator", "RecordedCall", "RecordedRequest"]

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], dict[str, Any]], Any]

SESSION_HEADER = "mcp-session-id"
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_RESULT_KEYS = frozenset({"content", "structuredContent", "isError", "_meta", "resultType"})
_MALFORMED_DEFAULT = b'{"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "te'
_SERVED_METHODS = frozenset({"ping", "server/discover", "tools/list", "tools/call"})

_REQUIRED = object()
#: failure kind -> {option: default}; ``_REQUIRED`` marks options without a default.
_FAILURE_OPTIONS: dict[str, dict[str, Any]] = {
    "status": {
        "status": _REQUIRED, "body": None, "headers": None, "content_type": None,
        "retry_after": None,
    },
    "session_lost": {"message": "Session not found"},
    "slow": {"seconds": 1.0},
    "is_error": {"message": "Tool failed (injected by MCPEmulator.fail_next)."},
    "malformed": {"body": None, "status": 200, "content_type": "application/json"},
}


# --------------------------------------------------------------------------- data types


@dataclass
class RecordedRequest:
    """One HTTP request as the emulator received it (``status`` is filled once answered)."""

    method: str  # HTTP method
    path: str
    headers: dict[str, str]  # lower-case keys
    json: Any  # parsed body, or None if empty/not JSON
    body: str  # raw body, decoded as UTF-8 (invalid bytes replaced)
    rpc_method: str | None  # the JSON-RPC "method" of the body, if any
    query: str = ""
    status: int | None = None  # HTTP status of the answer

    @property
    def session_id(self) -> str | None:
        return self.headers.get(SESSION_HEADER)

    @property
    def rpc_id(self) -> Any:
        return self.json.get("id") if isinstance(self.json, dict) else None


@dataclass(frozen=True)
class RecordedCall:
    """One tool run: a ``tools/call`` that reached a registered tool's result or handler."""

    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any]  # the request's params._meta ({} when absent)
    session_id: str | None  # None in the stateless era
    protocol_version: str


@dataclass
class _Tool:
    definition: dict[str, Any]  # the tools/list entry, wire-shaped
    input_schema: dict[str, Any]
    result: Any = None
    handler: Handler | None = None


@dataclass
class _Session:
    id: str
    protocol_version: str
    client_info: dict[str, Any] | None
    created: float = field(default_factory=time.monotonic)
    initialized: bool = False  # notifications/initialized received


@dataclass
class _Failure:
    kind: str
    options: dict[str, Any]
    remaining: int
    method: str | None
    tool: str | None


@dataclass
class _Response:
    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Response:
    return _Response(status, _dumps(payload), "application/json", dict(headers or {}))


def _rpc_error(
    status: int, request_id: Any, code: int, message: str, data: Any = None,
    headers: dict[str, str] | None = None,
) -> _Response:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return _json_response(status, {"jsonrpc": "2.0", "id": request_id, "error": error}, headers)


def _session_not_found() -> _Response:
    return _rpc_error(404, None, INVALID_REQUEST, "Not Found: unknown or expired session")


def _text_response(status: int, text: str, headers: dict[str, str] | None = None) -> _Response:
    return _Response(status, text.encode("utf-8"), "text/plain; charset=utf-8", dict(headers or {}))


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Status"


def _media_types(header: str) -> set[str]:
    return {part.split(";")[0].strip().lower() for part in header.split(",") if part.strip()}


def _hostname(value: str) -> str | None:
    """The host name of a ``Host`` header value or an origin, lower-case, without brackets."""
    target = value if "://" in value else "//" + value
    try:
        return urlsplit(target).hostname
    except ValueError:
        return None


def _is_full_result(value: Mapping[str, Any]) -> bool:
    return isinstance(value.get("content"), list) and set(value) <= _RESULT_KEYS


def _normalise_result(value: Any) -> dict[str, Any]:
    """A tool's result in any accepted shape -> a CallToolResult wire dict (validated)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True, mode="json", exclude_none=True)
    if isinstance(value, str):
        data: dict[str, Any] = {"content": [{"type": "text", "text": value}]}
    elif isinstance(value, Mapping):
        if _is_full_result(value):
            data = dict(value)
        else:
            structured = dict(value)
            data = {
                "content": [{"type": "text", "text": json.dumps(structured, ensure_ascii=False)}],
                "structuredContent": structured,
            }
    else:
        raise TypeError(
            "a tool result must be a str, a dict or an mcp.types.CallToolResult, "
            f"not {type(value).__name__}"
        )
    model = mcp_types.CallToolResult.model_validate(data, by_name=False)
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def _error_result(message: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": message}], "isError": True}


def _check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A message describing why ``arguments`` do not match ``schema``, or None."""
    try:
        from jsonschema import exceptions as jsonschema_exceptions
        from jsonschema.validators import validator_for
    except ImportError:  # pragma: no cover - jsonschema comes with the mcp SDK
        return None
    try:
        validator = validator_for(schema)(schema)
        error = jsonschema_exceptions.best_match(validator.iter_errors(arguments))
    except Exception as exc:  # an unusable schema must not take the server down
        logger.warning("MCPEmulator: could not validate arguments: %r", exc)
        return None
    return None if error is None else f"Input validation error: {error.message}"


def _params_of(message: JSONRPCMessage) -> dict[str, Any] | None:
    return message.params if isinstance(message, JSONRPCRequest | JSONRPCNotification) else None


def _meta_version(params: Any) -> str | None:
    """The stateless-era envelope's protocol version, if ``params._meta`` carries one."""
    if not isinstance(params, Mapping):
        return None
    meta = params.get("_meta")
    if not isinstance(meta, Mapping):
        return None
    version = meta.get(mcp_types.PROTOCOL_VERSION_META_KEY)
    return version if isinstance(version, str) else None


# --------------------------------------------------------------------------- the emulator


class MCPEmulator(LocalServer[RecordedRequest]):
    """A scriptable MCP server (Streamable HTTP) on a real socket. See the module docstring."""

    FAILURE_KINDS = tuple(_FAILURE_OPTIONS)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        server_name: str = "emulator",
        server_version: str = "1.0.0",
        instructions: str | None = None,
        path: str = "/mcp",
        stateless: bool = True,
        sse: bool = False,
    ) -> None:
        if not path.startswith("/"):
            raise ValueError("path must start with '/'")
        self.host = host
        self.port = port
        self.token = token
        self.server_name = server_name
        self.server_version = server_version
        self.instructions = instructions
        self.path = path.rstrip("/") or "/"
        self.stateless = stateless
        self.sse = sse
        self._lock = threading.Lock()
        self._tools: dict[str, _Tool] = {}
        self._failures: list[_Failure] = []
        self._requests: list[RecordedRequest] = []
        self._calls: list[RecordedCall] = []
        self._sessions: dict[str, _Session] = {}
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The MCP endpoint, e.g. ``http://127.0.0.1:54321/mcp``."""
        return self.base_url + self.path

    # ---- configuration ---------------------------------------------------------------

    def tool(
        self,
        name: str,
        *,
        description: str = "",
        input_schema: dict[str, Any] | None = None,
        result: Any = None,
        handler: Handler | None = None,
        output_schema: dict[str, Any] | None = None,
        annotations: dict[str, Any] | None = None,
    ) -> None:
        """Register (or replace) tool ``name``; see the module docstring for result shapes.

        ``result``: the answer to every call. ``handler(arguments, meta)``: computes the
        answer per call (mutually exclusive with ``result``). Neither: echo the arguments.
        ``output_schema``: advertised; clients then require ``structuredContent``.
        """
        if not TOOL_NAME_RE.match(name):
            raise ValueError(f"invalid MCP tool name {name!r}: must match {TOOL_NAME_RE.pattern}")
        if result is not None and handler is not None:
            raise TypeError("pass result or handler, not both")
        if handler is not None and not callable(handler):
            raise TypeError("handler must be callable")
        if result is not None:
            _normalise_result(result)  # fail in the test, not in the server thread
        schema = copy.deepcopy(input_schema) if input_schema is not None else {
            "type": "object", "properties": {},
        }
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ValueError('input_schema must be a JSON Schema object with "type": "object"')
        wire: dict[str, Any] = {"name": name, "inputSchema": schema}
        if description:
            wire["description"] = description
        if output_schema is not None:
            wire["outputSchema"] = copy.deepcopy(output_schema)
        if annotations is not None:
            wire["annotations"] = copy.deepcopy(annotations)
        definition = mcp_types.Tool.model_validate(wire, by_name=False).model_dump(
            by_alias=True, mode="json", exclude_none=True
        )
        with self._lock:
            self._tools[name] = _Tool(definition, schema, copy.deepcopy(result), handler)

    def remove_tool(self, name: str) -> None:
        """Forget tool ``name`` (later calls get ``-32602 Unknown tool``)."""
        with self._lock:
            self._tools.pop(name, None)

    def fail_next(
        self,
        kind: str,
        times: int = 1,
        *,
        method: str | None = None,
        tool: str | None = None,
        **options: Any,
    ) -> None:
        """Make the next ``times`` matching JSON-RPC requests fail with ``kind``.

        Kinds and options (defaults in brackets):

        * ``"status"``: answer ``status`` (required) with ``body`` [a short text, or an
          OAuth-style JSON for 401] (str: text/plain; dict/list: JSON; bytes: verbatim),
          ``content_type``, ``headers``, ``retry_after`` (-> ``Retry-After``). Nothing runs.
        * ``"session_lost"``: the request's session is forgotten and the answer is 404, as
          when a session expired; the client must ``initialize`` again. ``message``. (In
          the stateless era there is no session: the request just gets the 404.)
        * ``"slow"``: sleep ``seconds`` [1.0] before handling the request.
        * ``"is_error"``: the next ``tools/call`` answers ``isError: true`` with
          ``message``; the tool does not run.
        * ``"malformed"``: the request is handled, then answered with ``body`` [truncated
          JSON] (``status`` [200], ``content_type`` [application/json]).

        ``method``: only requests with this JSON-RPC method match (e.g. ``"tools/call"``);
        ``tool``: only ``tools/call`` requests for this tool match.
        """
        if kind not in _FAILURE_OPTIONS:
            raise ValueError(
                f"unknown failure kind {kind!r}; known: {', '.join(_FAILURE_OPTIONS)}"
            )
        if not isinstance(times, int) or times < 1:
            raise ValueError("times must be an int >= 1")
        allowed = _FAILURE_OPTIONS[kind]
        unknown = set(options) - set(allowed)
        if unknown:
            raise TypeError(
                f"failure {kind!r} got unexpected option(s) {sorted(unknown)}; "
                f"allowed: {sorted(allowed)}"
            )
        merged = {**allowed, **options}
        missing = [name for name, value in merged.items() if value is _REQUIRED]
        if missing:
            raise TypeError(f"failure {kind!r} requires option(s) {missing}")
        if kind == "status" and not (
            isinstance(merged["status"], int) and 100 <= merged["status"] <= 599
        ):
            raise ValueError("status must be an int HTTP status")
        if kind == "slow" and (
            not isinstance(merged["seconds"], int | float) or merged["seconds"] < 0
        ):
            raise ValueError("seconds must be a number >= 0")
        with self._lock:
            self._failures.append(_Failure(kind, merged, times, method, tool))

    @property
    def calls(self) -> list[RecordedCall]:
        """Every tool run so far, in order (a snapshot list)."""
        with self._lock:
            return list(self._calls)

    @property
    def sessions(self) -> list[str]:
        """The ids of the live handshake-era sessions."""
        with self._lock:
            return list(self._sessions)

    def session_protocol_version(self, session_id: str) -> str | None:
        """The protocol version negotiated in session ``session_id`` (None if not live)."""
        with self._lock:
            session = self._sessions.get(session_id)
            return session.protocol_version if session else None

    def drop_session(self, session_id: str | None = None) -> None:
        """End one session (or all of them) server-side, as when it expires."""
        with self._lock:
            if session_id is None:
                self._sessions.clear()
            else:
                self._sessions.pop(session_id, None)

    def reset(self) -> None:
        """Forget tools, queued failures, recorded requests and calls, and all sessions."""
        with self._lock:
            self._tools.clear()
            self._failures.clear()
            self._requests.clear()
            self._calls.clear()
            self._sessions.clear()

    # ---- HTTP plumbing ---------------------------------------------------------------

    def _wsgi_app(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        try:
            response = self._handle(environ)
        except Exception as exc:  # never let a bug here turn into a dropped connection
            logger.exception("MCPEmulator: error while handling request")
            response = _rpc_error(500, None, INTERNAL_ERROR, f"MCPEmulator internal error: {exc!r}")
        headers = dict(response.headers)
        if response.content_type is not None:
            headers["Content-Type"] = response.content_type
        headers["Content-Length"] = str(len(response.body))
        start_response(f"{response.status} {_reason(response.status)}", list(headers.items()))
        return [response.body]  # a single write

    def _handle(self, environ: dict[str, Any]) -> _Response:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO", "") or "/"
        query = environ.get("QUERY_STRING", "") or ""
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        stream = environ["wsgi.input"]
        if length > 0:
            raw = stream.read(length)
        elif environ.get("wsgi.input_terminated"):
            raw = stream.read()
        else:
            raw = b""
        body = raw.decode("utf-8", errors="replace")
        headers = {
            key[5:].replace("_", "-").lower(): value
            for key, value in environ.items()
            if key.startswith("HTTP_")
        }
        for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(key):
                headers[key.replace("_", "-").lower()] = environ[key]
        parsed: Any = None
        parse_ok = False
        if body.strip():
            try:
                parsed = json.loads(body)
                parse_ok = True
            except ValueError:
                pass
        rpc_method = parsed.get("method") if isinstance(parsed, dict) else None
        record = RecordedRequest(
            method, path, headers, parsed, body,
            rpc_method if isinstance(rpc_method, str) else None, query,
        )
        with self._lock:
            self._requests.append(record)
        response = self._respond(record, parse_ok)
        with self._lock:
            record.status = response.status
        return response

    def _respond(self, req: RecordedRequest, parse_ok: bool) -> _Response:
        if (req.path.rstrip("/") or "/") != self.path:
            return _text_response(404, f"Not Found: the MCP endpoint is {self.path}")
        denied = self._check_host_and_origin(req.headers) or self._check_token(req.headers)
        if denied is not None:
            return denied
        if req.method == "POST":
            return self._post(req, parse_ok)
        if req.method == "GET":
            return self._get(req)
        if req.method == "DELETE":
            return self._delete(req)
        return _rpc_error(
            405, None, INVALID_REQUEST, "Method Not Allowed", headers={"Allow": "GET, POST, DELETE"}
        )

    def _check_host_and_origin(self, headers: dict[str, str]) -> _Response | None:
        allowed = set(_LOOPBACK_HOSTS)
        allowed.add(self.host.strip("[]").lower())
        host = _hostname(headers.get("host", ""))
        if host not in allowed:
            return _text_response(421, "Invalid Host header")
        origin = headers.get("origin")
        if origin is not None and _hostname(origin) not in allowed:
            return _text_response(403, "Invalid Origin header")
        return None

    def _check_token(self, headers: dict[str, str]) -> _Response | None:
        if self.token is None:
            return None
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credentials.strip() == self.token:
            return None
        return self._unauthorized(bool(credentials))

    @staticmethod
    def _unauthorized(wrong_token: bool = True, body: Any = None) -> _Response:
        challenge = 'Bearer realm="MCPEmulator"'
        if wrong_token:
            challenge += ', error="invalid_token"'
        payload = body if body is not None else {
            "error": "invalid_token",
            "error_description": "Missing or invalid bearer token.",
        }
        return _json_response(401, payload, {"WWW-Authenticate": challenge})

    # ---- POST ------------------------------------------------------------------------

    def _post(self, req: RecordedRequest, parse_ok: bool) -> _Response:
        accepted = _media_types(req.headers.get("accept", ""))
        if not accepted & {"application/json", "application/*", "*/*"}:
            return _rpc_error(
                406, None, INVALID_REQUEST, "Not Acceptable: Client must accept application/json"
            )
        content_type = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return _rpc_error(
                415, None, INVALID_REQUEST,
                "Unsupported Media Type: Content-Type must be application/json",
            )
        if not parse_ok:
            return _rpc_error(400, None, PARSE_ERROR, "Parse error")
        if isinstance(req.json, list):
            return _rpc_error(400, None, INVALID_REQUEST, "JSON-RPC batches are not supported")
        try:
            message = jsonrpc_message_adapter.validate_python(req.json, by_name=False)
        except ValidationError:
            return _rpc_error(
                400, None, INVALID_REQUEST,
                "Body must be a single JSON-RPC request, notification or response object",
            )

        failure = self._take_failure(message) if isinstance(message, JSONRPCRequest) else None
        if failure is not None:
            if failure.kind == "status":
                return self._status_failure(failure.options)
            if failure.kind == "session_lost":
                session_id = req.headers.get(SESSION_HEADER)
                if session_id is not None:
                    self.drop_session(session_id)
                return _rpc_error(404, None, INVALID_REQUEST, failure.options["message"])
            if failure.kind == "slow":
                time.sleep(failure.options["seconds"])
        injected_error = (
            failure.options["message"] if failure is not None and failure.kind == "is_error"
            else None
        )

        if self._is_stateless_era(req.headers, message):
            response = self._post_stateless(req, message, injected_error)
        else:
            response = self._post_handshake(req, message, injected_error)

        if failure is not None and failure.kind == "malformed":
            options = failure.options
            body = options["body"]
            if body is None:
                body = _MALFORMED_DEFAULT
            elif isinstance(body, str):
                body = body.encode("utf-8")
            keep = {k: v for k, v in response.headers.items() if k.lower() == SESSION_HEADER}
            return _Response(options["status"], body, options["content_type"], keep)
        return response

    def _take_failure(self, message: JSONRPCRequest) -> _Failure | None:
        tool_name = (message.params or {}).get("name") if message.method == "tools/call" else None
        with self._lock:
            for index, failure in enumerate(self._failures):
                if failure.method is not None and failure.method != message.method:
                    continue
                if failure.tool is not None and failure.tool != tool_name:
                    continue
                if failure.kind == "is_error" and message.method != "tools/call":
                    continue
                failure.remaining -= 1
                if failure.remaining <= 0:
                    del self._failures[index]
                return failure
        return None

    def _status_failure(self, options: dict[str, Any]) -> _Response:
        status: int = options["status"]
        headers = dict(options["headers"] or {})
        if options["retry_after"] is not None:
            headers["Retry-After"] = str(options["retry_after"])
        body = options["body"]
        if status == 401 and (body is None or isinstance(body, dict)):
            response = self._unauthorized(True, body)
            response.headers.update(headers)
            return response
        if body is None:
            response = _text_response(
                status, f"{status} {_reason(status)} (injected by MCPEmulator.fail_next)", headers
            )
        elif isinstance(body, bytes):
            response = _Response(status, body, "application/octet-stream", headers)
        elif isinstance(body, str):
            response = _text_response(status, body, headers)
        else:
            response = _json_response(status, body, headers)
        if options["content_type"] is not None:
            response.content_type = options["content_type"]
        return response

    def _is_stateless_era(self, headers: dict[str, str], message: JSONRPCMessage) -> bool:
        version = headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None:
            return version not in HANDSHAKE_PROTOCOL_VERSIONS
        return _meta_version(_params_of(message)) is not None

    def _answer(self, req: RecordedRequest, payload: dict[str, Any], status: int = 200,
                headers: dict[str, str] | None = None) -> _Response:
        """A JSON-RPC answer: JSON, or one SSE frame when ``sse`` is on and accepted."""
        accepted = _media_types(req.headers.get("accept", ""))
        if self.sse and status == 200 and accepted & {"text/event-stream", "text/*", "*/*"}:
            frame = b"event: message\ndata: " + _dumps(payload) + b"\n\n"
            sse_headers = {"Cache-Control": "no-cache, no-transform", **(headers or {})}
            return _Response(status, frame, "text/event-stream", sse_headers)
        return _json_response(status, payload, headers)

    # ---- the stateless (2026-07-28) era -----------------------------------------------

    def _post_stateless(
        self, req: RecordedRequest, message: JSONRPCMessage, injected_error: str | None
    ) -> _Response:
        request_id = message.id if isinstance(message, JSONRPCRequest) else None
        header_version = req.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if not self.stateless:
            requested = header_version or _meta_version(_params_of(message)) or ""
            return _rpc_error(
                400, request_id, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": requested},
            )
        if isinstance(message, JSONRPCNotification):
            rejection = unsupported_protocol_version_rejection(header_version or "")
            if rejection is not None:
                return self._rejection(rejection, None)
            return _Response(202, b"", None)
        if not isinstance(message, JSONRPCRequest):
            return _rpc_error(
                400, None, INVALID_REQUEST,
                "Body must be a single JSON-RPC request or notification object",
            )
        verdict = classify_inbound_request(req.json, headers=req.headers)
        if isinstance(verdict, InboundLadderRejection):
            return self._rejection(verdict, request_id)
        if message.method == "tools/call":
            params = message.params or {}
            name = params.get("name")
            with self._lock:
                tool = self._tools.get(name) if isinstance(name, str) else None
            arguments = params.get("arguments")
            if tool is not None and isinstance(arguments, Mapping):
                mismatch = validate_mcp_param_headers(tool.input_schema, arguments, req.headers)
                if mismatch is not None:
                    return self._rejection(mismatch, request_id)
        payload = self._dispatch(message, verdict.protocol_version, None, injected_error)
        status = 200
        if "error" in payload:
            status = ERROR_CODE_HTTP_STATUS.get(payload["error"]["code"], 200)
        return self._answer(req, payload, status)

    @staticmethod
    def _rejection(rejection: InboundLadderRejection, request_id: Any) -> _Response:
        return _rpc_error(
            ERROR_CODE_HTTP_STATUS.get(rejection.code, 400), request_id,
            rejection.code, rejection.message, rejection.data,
        )

    # ---- the handshake era -----------------------------------------------------------

    def _post_handshake(
        self, req: RecordedRequest, message: JSONRPCMessage, injected_error: str | None
    ) -> _Response:
        session_id = req.headers.get(SESSION_HEADER)
        if isinstance(message, JSONRPCRequest) and message.method == "initialize":
            if session_id is not None and session_id not in self.sessions:
                return _session_not_found()
            return self._initialize(req, message, session_id)
        if session_id is None:
            return _rpc_error(400, None, INVALID_REQUEST, "Bad Request: Missing session ID")
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            return _session_not_found()
        session_headers = {"Mcp-Session-Id": session.id}
        version = req.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None and version != session.protocol_version:
            return _rpc_error(
                400, None, INVALID_REQUEST,
                f"Bad Request: MCP-Protocol-Version {version!r} does not match the negotiated "
                f"version {session.protocol_version!r}",
                headers=session_headers,
            )
        if isinstance(message, JSONRPCNotification):
            if message.method == "notifications/initialized":
                with self._lock:
                    session.initialized = True
            return _Response(202, b"", None, session_headers)
        if not isinstance(message, JSONRPCRequest):  # a response to a server request
            return _Response(202, b"", None, session_headers)
        payload = self._dispatch(message, session.protocol_version, session.id, injected_error)
        return self._answer(req, payload, 200, session_headers)

    def _initialize(
        self, req: RecordedRequest, message: JSONRPCRequest, session_id: str | None
    ) -> _Response:
        params = message.params or {}
        requested = params.get("protocolVersion")
        version = (requested if requested in HANDSHAKE_PROTOCOL_VERSIONS
                   else LATEST_HANDSHAKE_VERSION)
        try:
            request = mcp_methods.parse_client_request("initialize", version, params)
        except ValidationError as exc:
            return self._answer(req, self._error_payload(
                message.id, INVALID_PARAMS, "Invalid request parameters", str(exc)
            ))
        assert isinstance(request, mcp_types.InitializeRequest)
        client_info = request.params.client_info.model_dump(
            by_alias=True, mode="json", exclude_none=True
        )
        result = mcp_types.InitializeResult(
            protocol_version=version,
            capabilities=mcp_types.ServerCapabilities(
                tools=mcp_types.ToolsCapability(list_changed=False)
            ),
            server_info=mcp_types.Implementation(
                name=self.server_name, version=self.server_version
            ),
            instructions=self.instructions,
        )
        wire = mcp_methods.serialize_server_result(
            "initialize", version, result.model_dump(by_alias=True, mode="json", exclude_none=True)
        )
        with self._lock:
            session = self._sessions.get(session_id) if session_id else None
            if session is None:
                session = _Session(uuid.uuid4().hex, version, client_info)
                self._sessions[session.id] = session
            else:  # re-initializing a live session re-negotiates it
                session.protocol_version, session.client_info = version, client_info
                session.initialized = False
        payload = {"jsonrpc": "2.0", "id": message.id, "result": wire}
        return self._answer(req, payload, 200, {"Mcp-Session-Id": session.id})

    def _get(self, req: RecordedRequest) -> _Response:
        session_id = req.headers.get(SESSION_HEADER)
        if session_id is not None and session_id not in self.sessions:
            return _session_not_found()
        # No standalone SSE stream: the spec lets a server answer GET with 405.
        return _Response(405, b"", None, {"Allow": "POST, DELETE"})

    def _delete(self, req: RecordedRequest) -> _Response:
        session_id = req.headers.get(SESSION_HEADER)
        if session_id is None:
            return _rpc_error(
                405, None, INVALID_REQUEST, "Method Not Allowed: no session to terminate",
                headers={"Allow": "GET, POST"},
            )
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return _session_not_found()
        return _Response(200, b"", None)

    # ---- methods ---------------------------------------------------------------------

    @staticmethod
    def _error_payload(request_id: Any, code: int, message: str, data: Any = None
                       ) -> dict[str, Any]:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        return {"jsonrpc": "2.0", "id": request_id, "error": error}

    def _dispatch(
        self,
        message: JSONRPCRequest,
        version: str,
        session_id: str | None,
        injected_error: str | None,
    ) -> dict[str, Any]:
        """A JSON-RPC response (result or error) for ``message`` at protocol ``version``."""
        method, params = message.method, message.params
        if method not in _SERVED_METHODS:
            return self._error_payload(message.id, METHOD_NOT_FOUND, "Method not found", method)
        try:
            request = mcp_methods.parse_client_request(method, version, params)
        except KeyError:  # not defined at this version (server/discover in the handshake era)
            return self._error_payload(message.id, METHOD_NOT_FOUND, "Method not found", method)
        except ValidationError as exc:
            return self._error_payload(
                message.id, INVALID_PARAMS, "Invalid request parameters", str(exc)
            )

        modern = version in MODERN_PROTOCOL_VERSIONS
        result: BaseModel | dict[str, Any]
        if method == "ping":
            result = {}
        elif method == "server/discover":
            result = mcp_types.DiscoverResult(
                supported_versions=list(MODERN_PROTOCOL_VERSIONS),
                capabilities=mcp_types.ServerCapabilities(
                    tools=mcp_types.ToolsCapability(list_changed=False)
                ),
                instructions=self.instructions,
            )
        elif method == "tools/list":
            with self._lock:
                tools = [copy.deepcopy(t.definition) for t in self._tools.values()]
            result = mcp_types.ListToolsResult.model_validate({"tools": tools}, by_name=False)
        else:
            assert isinstance(request, mcp_types.CallToolRequest)
            try:
                result = self._call_tool(request, params or {}, version, session_id,
                                         injected_error)
            except MCPError as exc:
                return self._error_payload(message.id, exc.code, exc.message, exc.data)

        dumped = (result.model_dump(by_alias=True, mode="json", exclude_none=True)
                  if isinstance(result, BaseModel) else dict(result))
        if modern:
            dumped.setdefault("resultType", "complete")
        try:
            wire = mcp_methods.serialize_server_result(method, version, dumped)
        except ValidationError as exc:
            logger.warning("MCPEmulator: invalid %s result at %s: %s", method, version, exc)
            return self._error_payload(
                message.id, INTERNAL_ERROR, f"Tool returned an invalid result: {exc}"
            )
        if modern:
            meta = wire.get("_meta")
            stamp = {"name": self.server_name, "version": self.server_version}
            if meta is None:
                wire["_meta"] = {mcp_types.SERVER_INFO_META_KEY: stamp}
            elif isinstance(meta, dict) and meta.get(mcp_types.SERVER_INFO_META_KEY) is None:
                wire["_meta"] = {**meta, mcp_types.SERVER_INFO_META_KEY: stamp}
        return {"jsonrpc": "2.0", "id": message.id, "result": wire}

    def _call_tool(
        self,
        request: mcp_types.CallToolRequest,
        raw_params: dict[str, Any],
        version: str,
        session_id: str | None,
        injected_error: str | None,
    ) -> dict[str, Any]:
        name = request.params.name
        with self._lock:
            tool = self._tools.get(name)
        if tool is None:
            raise MCPError(INVALID_PARAMS, f"Unknown tool: {name}")
        if injected_error is not None:
            return _error_result(injected_error)
        arguments = copy.deepcopy(request.params.arguments or {})
        raw_meta = raw_params.get("_meta")
        meta = copy.deepcopy(dict(raw_meta)) if isinstance(raw_meta, Mapping) else {}
        problem = _check_arguments(tool.input_schema, arguments)
        if problem is not None:
            return _error_result(problem)
        with self._lock:
            self._calls.append(RecordedCall(name, copy.deepcopy(arguments), copy.deepcopy(meta),
                                            session_id, version))
        if tool.handler is None:
            value = copy.deepcopy(tool.result) if tool.result is not None else json.dumps(arguments)
        else:
            try:
                value = tool.handler(arguments, meta)
            except MCPError:
                raise
            except Exception as exc:
                logger.debug("MCPEmulator: tool %s raised %r", name, exc)
                return _error_result(f"Error executing tool {name}: {type(exc).__name__}: {exc}")
        try:
            return _normalise_result(value)
        except (TypeError, ValidationError) as exc:
            raise MCPError(
                INTERNAL_ERROR, f"Tool {name} returned an invalid result: {exc}"
            ) from exc
