"""The MCP server: :class:`MCPEmulator`, its configuration (tools, failures,
sessions) and each request's path through it: the endpoint, Host/Origin and token
checks, the POSTed message (a failure drawn, then the stateless or the handshake
era), GET and DELETE, and the served methods (``initialize``, ``ping``,
``server/discover``, ``tools/list``, ``tools/call``)."""

# Latency: as in the LLM emulator, accepted sockets get TCP_NODELAY and each response body is
# produced as one bytes object written at once, so the Nagle + delayed-ACK stall cannot
# appear (werkzeug also answers "Connection: close", so every request is a fresh
# connection). Measured on the development machine while it was loaded (2 CPUs, load
# average ~8): handling a tools/call takes 0.6-2 ms inside the server; a raw httpx round
# trip 3-9 ms; an SDK Client call 8-25 ms, dominated by the client and the shared GIL when
# client and emulator run in one process. Body reads never stalled (<= 12 ms, scheduler
# noise, never the ~40 ms delayed-ACK signature).

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

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

from ...errors import InvalidArgumentError
from .._local_server import LocalServer, Response, parse_json, read_request
from .failures import FAILURE_OPTIONS, make_failure, malformed, status_failure, unauthorized
from .protocol import (
    dumps,
    error_payload,
    hostname,
    json_response,
    media_types,
    meta_version,
    params_of,
    rpc_error,
    session_not_found,
    text_response,
)
from .tools import check_arguments, error_result, make_tool, normalise_result
from .types import SESSION_HEADER, Failure, Handler, RecordedCall, RecordedRequest, Session, Tool

logger = logging.getLogger(__name__)

_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_SERVED_METHODS = frozenset({"ping", "server/discover", "tools/list", "tools/call"})


class MCPEmulator(LocalServer[RecordedRequest]):
    """A scriptable MCP server (Streamable HTTP) on a real socket. See the package docstring."""

    FAILURE_KINDS = tuple(FAILURE_OPTIONS)

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
            raise InvalidArgumentError("path must start with '/'")
        super().__init__(host, port)
        self.token = token
        self.server_name = server_name
        self.server_version = server_version
        self.instructions = instructions
        self.path = path.rstrip("/") or "/"
        self.stateless = stateless
        self.sse = sse
        self._tools: dict[str, Tool] = {}
        self._failures: list[Failure] = []
        self._calls: list[RecordedCall] = []
        self._sessions: dict[str, Session] = {}

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
        """Register (or replace) tool ``name``; see the package docstring for result shapes.

        ``result``: the answer to every call. ``handler(arguments, meta)``: computes the
        answer per call (mutually exclusive with ``result``). Neither: echo the arguments.
        ``output_schema``: advertised; clients then require ``structuredContent``.
        """
        tool = make_tool(
            name, description=description, input_schema=input_schema, result=result,
            handler=handler, output_schema=output_schema, annotations=annotations,
        )
        with self._lock:
            self._tools[name] = tool

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
        failure = make_failure(kind, times, method, tool, options)
        with self._lock:
            self._failures.append(failure)

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

    # ---- HTTP ------------------------------------------------------------------------

    def _internal_error(self, environ: dict[str, Any], exc: Exception) -> Response:
        return rpc_error(500, None, INTERNAL_ERROR, f"MCPEmulator internal error: {exc!r}")

    def _handle(self, environ: dict[str, Any]) -> Response:
        incoming = read_request(environ)
        parsed, json_error = parse_json(incoming.body)
        parse_ok = bool(incoming.body.strip()) and json_error is None
        rpc_method = parsed.get("method") if isinstance(parsed, dict) else None
        record = RecordedRequest(
            incoming.method, incoming.path, incoming.headers, parsed, incoming.body,
            rpc_method if isinstance(rpc_method, str) else None, incoming.query,
        )
        with self._lock:
            self._requests.append(record)
        response = self._respond(record, parse_ok)
        with self._lock:
            record.status = response.status
        return response

    def _respond(self, req: RecordedRequest, parse_ok: bool) -> Response:
        if (req.path.rstrip("/") or "/") != self.path:
            return text_response(404, f"Not Found: the MCP endpoint is {self.path}")
        denied = self._check_host_and_origin(req.headers) or self._check_token(req.headers)
        if denied is not None:
            return denied
        if req.method == "POST":
            return self._post(req, parse_ok)
        if req.method == "GET":
            return self._get(req)
        if req.method == "DELETE":
            return self._delete(req)
        return rpc_error(
            405, None, INVALID_REQUEST, "Method Not Allowed", headers={"Allow": "GET, POST, DELETE"}
        )

    def _check_host_and_origin(self, headers: dict[str, str]) -> Response | None:
        allowed = set(_LOOPBACK_HOSTS)
        allowed.add(self.host.strip("[]").lower())
        host = hostname(headers.get("host", ""))
        if host not in allowed:
            return text_response(421, "Invalid Host header")
        origin = headers.get("origin")
        if origin is not None and hostname(origin) not in allowed:
            return text_response(403, "Invalid Origin header")
        return None

    def _check_token(self, headers: dict[str, str]) -> Response | None:
        if self.token is None:
            return None
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credentials.strip() == self.token:
            return None
        return unauthorized(bool(credentials))

    # ---- POST ------------------------------------------------------------------------

    def _post(self, req: RecordedRequest, parse_ok: bool) -> Response:
        accepted = media_types(req.headers.get("accept", ""))
        if not accepted & {"application/json", "application/*", "*/*"}:
            return rpc_error(
                406, None, INVALID_REQUEST, "Not Acceptable: Client must accept application/json"
            )
        content_type = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return rpc_error(
                415, None, INVALID_REQUEST,
                "Unsupported Media Type: Content-Type must be application/json",
            )
        if not parse_ok:
            return rpc_error(400, None, PARSE_ERROR, "Parse error")
        if isinstance(req.json, list):
            return rpc_error(400, None, INVALID_REQUEST, "JSON-RPC batches are not supported")
        try:
            message = jsonrpc_message_adapter.validate_python(req.json, by_name=False)
        except ValidationError:
            return rpc_error(
                400, None, INVALID_REQUEST,
                "Body must be a single JSON-RPC request, notification or response object",
            )

        failure = self._take_failure(message) if isinstance(message, JSONRPCRequest) else None
        if failure is not None:
            if failure.kind == "status":
                return status_failure(failure.options)
            if failure.kind == "session_lost":
                session_id = req.headers.get(SESSION_HEADER)
                if session_id is not None:
                    self.drop_session(session_id)
                return rpc_error(404, None, INVALID_REQUEST, failure.options["message"])
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
            return malformed(failure.options, response)
        return response

    def _take_failure(self, message: JSONRPCRequest) -> Failure | None:
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

    def _is_stateless_era(self, headers: dict[str, str], message: JSONRPCMessage) -> bool:
        version = headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None:
            return version not in HANDSHAKE_PROTOCOL_VERSIONS
        return meta_version(params_of(message)) is not None

    def _answer(self, req: RecordedRequest, payload: dict[str, Any], status: int = 200,
                headers: dict[str, str] | None = None) -> Response:
        """A JSON-RPC answer: JSON, or one SSE frame when ``sse`` is on and accepted."""
        accepted = media_types(req.headers.get("accept", ""))
        if self.sse and status == 200 and accepted & {"text/event-stream", "text/*", "*/*"}:
            frame = b"event: message\ndata: " + dumps(payload) + b"\n\n"
            sse_headers = {"Cache-Control": "no-cache, no-transform", **(headers or {})}
            return Response(status, frame, "text/event-stream", sse_headers)
        return json_response(status, payload, headers)

    # ---- the stateless (2026-07-28) era -----------------------------------------------

    def _post_stateless(
        self, req: RecordedRequest, message: JSONRPCMessage, injected_error: str | None
    ) -> Response:
        request_id = message.id if isinstance(message, JSONRPCRequest) else None
        header_version = req.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if not self.stateless:
            requested = header_version or meta_version(params_of(message)) or ""
            return rpc_error(
                400, request_id, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": requested},
            )
        if isinstance(message, JSONRPCNotification):
            rejection = unsupported_protocol_version_rejection(header_version or "")
            if rejection is not None:
                return self._rejection(rejection, None)
            return Response(202, b"", None)
        if not isinstance(message, JSONRPCRequest):
            return rpc_error(
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
    def _rejection(rejection: InboundLadderRejection, request_id: Any) -> Response:
        return rpc_error(
            ERROR_CODE_HTTP_STATUS.get(rejection.code, 400), request_id,
            rejection.code, rejection.message, rejection.data,
        )

    # ---- the handshake era -----------------------------------------------------------

    def _post_handshake(
        self, req: RecordedRequest, message: JSONRPCMessage, injected_error: str | None
    ) -> Response:
        session_id = req.headers.get(SESSION_HEADER)
        if isinstance(message, JSONRPCRequest) and message.method == "initialize":
            if session_id is not None and session_id not in self.sessions:
                return session_not_found()
            return self._initialize(req, message, session_id)
        if session_id is None:
            return rpc_error(400, None, INVALID_REQUEST, "Bad Request: Missing session ID")
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            return session_not_found()
        session_headers = {"Mcp-Session-Id": session.id}
        version = req.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None and version != session.protocol_version:
            return rpc_error(
                400, None, INVALID_REQUEST,
                f"Bad Request: MCP-Protocol-Version {version!r} does not match the negotiated "
                f"version {session.protocol_version!r}",
                headers=session_headers,
            )
        if isinstance(message, JSONRPCNotification):
            if message.method == "notifications/initialized":
                with self._lock:
                    session.initialized = True
            return Response(202, b"", None, session_headers)
        if not isinstance(message, JSONRPCRequest):  # a response to a server request
            return Response(202, b"", None, session_headers)
        payload = self._dispatch(message, session.protocol_version, session.id, injected_error)
        return self._answer(req, payload, 200, session_headers)

    def _initialize(
        self, req: RecordedRequest, message: JSONRPCRequest, session_id: str | None
    ) -> Response:
        params = message.params or {}
        requested = params.get("protocolVersion")
        version = (requested if requested in HANDSHAKE_PROTOCOL_VERSIONS
                   else LATEST_HANDSHAKE_VERSION)
        try:
            request = mcp_methods.parse_client_request("initialize", version, params)
        except ValidationError as exc:
            return self._answer(req, error_payload(
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
                session = Session(uuid.uuid4().hex, version, client_info)
                self._sessions[session.id] = session
            else:  # re-initializing a live session re-negotiates it
                session.protocol_version, session.client_info = version, client_info
                session.initialized = False
        payload = {"jsonrpc": "2.0", "id": message.id, "result": wire}
        return self._answer(req, payload, 200, {"Mcp-Session-Id": session.id})

    def _get(self, req: RecordedRequest) -> Response:
        session_id = req.headers.get(SESSION_HEADER)
        if session_id is not None and session_id not in self.sessions:
            return session_not_found()
        # No standalone SSE stream: the spec lets a server answer GET with 405.
        return Response(405, b"", None, {"Allow": "POST, DELETE"})

    def _delete(self, req: RecordedRequest) -> Response:
        session_id = req.headers.get(SESSION_HEADER)
        if session_id is None:
            return rpc_error(
                405, None, INVALID_REQUEST, "Method Not Allowed: no session to terminate",
                headers={"Allow": "GET, POST"},
            )
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return session_not_found()
        return Response(200, b"", None)

    # ---- methods ---------------------------------------------------------------------

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
            return error_payload(message.id, METHOD_NOT_FOUND, "Method not found", method)
        try:
            request = mcp_methods.parse_client_request(method, version, params)
        except KeyError:  # not defined at this version (server/discover in the handshake era)
            return error_payload(message.id, METHOD_NOT_FOUND, "Method not found", method)
        except ValidationError as exc:
            return error_payload(
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
                return error_payload(message.id, exc.code, exc.message, exc.data)

        dumped = (result.model_dump(by_alias=True, mode="json", exclude_none=True)
                  if isinstance(result, BaseModel) else dict(result))
        if modern:
            dumped.setdefault("resultType", "complete")
        try:
            wire = mcp_methods.serialize_server_result(method, version, dumped)
        except ValidationError as exc:
            logger.warning("MCPEmulator: invalid %s result at %s: %s", method, version, exc)
            return error_payload(
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
            return error_result(injected_error)
        arguments = copy.deepcopy(request.params.arguments or {})
        raw_meta = raw_params.get("_meta")
        meta = copy.deepcopy(dict(raw_meta)) if isinstance(raw_meta, Mapping) else {}
        problem = check_arguments(tool.input_schema, arguments)
        if problem is not None:
            return error_result(problem)
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
                return error_result(f"Error executing tool {name}: {type(exc).__name__}: {exc}")
        try:
            return normalise_result(value)
        except (TypeError, ValidationError) as exc:
            raise MCPError(
                INTERNAL_ERROR, f"Tool {name} returned an invalid result: {exc}"
            ) from exc
