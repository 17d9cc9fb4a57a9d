"""Streamable HTTP for the MCP server blueprint: the HTTP glue, written by hand.

This module owns one Flask view per blueprint and what it does with a request
before and after :func:`.protocol.dispatch`: Host/Origin checks, the body limit,
authentication (the host's ``auth`` or :class:`.oauth.OAuthResource`),
``Accept`` and ``Content-Type``, JSON-RPC framing (the SDK's
``jsonrpc_message_adapter``), the era of the request (2026-07-28's envelope,
checked with ``classify_inbound_request``, or a handshake-era session kept in
PostgreSQL), the HTTP status of each answer, SSE framing when notifications
ride along, and one wire-log event per request.

Why not the SDK's ASGI app behind a2wsgi: its handshake-era GET stream pins a
WSGI worker thread for the life of a session, and its sessions live in one
process's memory (docs/decisions/0011-mcp-server-blueprint.md). Here a GET is
answered 405 (the spec lets a server decline the stream), every response is
complete when the view returns, and any process can serve any request.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flask import Request, Response, current_app, request
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    InboundLadderRejection,
    classify_inbound_request,
    find_duplicated_routing_header,
    unsupported_protocol_version_rejection,
    validate_mcp_param_headers,
)
from mcp_types import PROTOCOL_VERSION_META_KEY, JSONRPCNotification, JSONRPCRequest
from mcp_types.jsonrpc import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from .._typing import real_session
from ..errors import McpTokenRefusedError
from ..state import get_state
from . import security, tasks, wirelog
from . import store as inbound
from .oauth import OAuthResource
from .protocol import McpError, Served, ServerSpec, dispatch, negotiate

__all__ = ["McpEndpoint"]

logger = logging.getLogger("flask_solidloop.mcp_server")

SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"
#: A handshake-era request after initialize without the version header speaks this.
DEFAULT_HANDSHAKE_VERSION = "2025-03-26"
JSON = "application/json"
SSE = "text/event-stream"

Auth = Callable[[str | None, Request], Any]


@dataclass
class _Exchange:
    """What the wire log records of one request, filled in as the view goes."""

    started: float
    token: str | None = None
    principal_label: str | None = None
    session_id: str | None = None
    method: str | None = None
    tool: str | None = None
    era: str | None = None
    body: str | None = None
    error: str | None = None


class McpEndpoint:
    """The view behind one ``solidloop.mcp_blueprint(...)``."""

    def __init__(self, spec: ServerSpec, *, auth: Auth | None,
                 allowed_hosts: tuple[str, ...] | None,
                 allowed_origins: tuple[str, ...] | None,
                 principal_label: Callable[[Any], str] | None = None,
                 oauth: OAuthResource | None = None) -> None:
        self.spec = spec
        self.auth = auth
        self.oauth = oauth
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins
        self.label_of = principal_label

    # -- the view ------------------------------------------------------------------

    def __call__(self) -> Response:
        exchange = _Exchange(started=time.perf_counter())
        try:
            response = self._handle(exchange)
        except Exception as exc:  # a bug of ours or of the host's auth: a clean 500
            logger.exception("MCP server %r: request failed", self.spec.name)
            exchange.error = f"{type(exc).__name__}: {security.scrub(str(exc), exchange.token)}"
            response = _jsonrpc_error(None, McpError(INTERNAL_ERROR, "Internal error"), 500)
        self._record(exchange, response)
        return response

    def _handle(self, ex: _Exchange) -> Response:
        hosts, origins = self._allow_lists()
        if not security.host_allowed(request.headers.get("Host"), hosts):
            ex.error = "Host header not allowed"
            return _plain("Invalid Host header", 421)
        if not security.origin_allowed(request.headers.get("Origin"), origins):
            ex.error = "Origin header not allowed"
            return _plain("Invalid Origin header", 403)
        if request.method == "GET":
            # No server-to-client stream: it would pin a worker thread per client.
            return Response(status=405, headers={"Allow": "POST, DELETE"})
        if request.method not in ("POST", "DELETE"):
            return Response(status=405, headers={"Allow": "POST, DELETE"})

        limit = get_state().config.mcp_max_request_body
        if request.content_length is not None and request.content_length > limit:
            ex.error = f"body of {request.content_length} bytes over the {limit}-byte limit"
            return _plain(f"Request body too large (limit {limit} bytes)", 413)

        ex.token = security.bearer_token(request.headers)
        if self.oauth is not None:
            try:
                principal = self.oauth.authenticate(ex.token)
            except McpTokenRefusedError as refused:
                ex.error = (f"not authenticated: {refused.error or 'no token'}: "
                            f"{refused.description}")
                return self.oauth.refusal(refused if ex.token else None)
        else:
            assert self.auth is not None
            principal = self.auth(ex.token, request)
        if principal is None:
            ex.error = "not authenticated"
            return Response(json.dumps({"error": "unauthorized",
                                        "error_description": "a valid bearer token is required"}),
                            status=401, mimetype=JSON,
                            headers={"WWW-Authenticate": 'Bearer realm="mcp"'})
        ex.principal_label = self._label(principal, ex.token)

        if request.method == "DELETE":
            return self._delete(ex)

        content_type = (request.headers.get("Content-Type") or "").strip().lower()
        if not content_type.startswith(JSON):
            ex.error = f"Content-Type {content_type or '(none)'}"
            return _plain("Unsupported Media Type: send Content-Type: application/json", 415)
        has_json, has_sse = _accepts(request.headers.get("Accept", ""))
        if not (has_json and has_sse):
            ex.error = f"Accept {request.headers.get('Accept', '(none)')}"
            return _plain("Not Acceptable: Accept must list application/json and "
                          "text/event-stream", 406)

        raw = request.stream.read(limit + 1) if request.content_length is None else (
            request.get_data(cache=False))
        if len(raw) > limit:
            ex.error = f"body over the {limit}-byte limit"
            return _plain(f"Request body too large (limit {limit} bytes)", 413)
        ex.body = security.scrub(raw.decode("utf-8", "replace"), ex.token)
        try:
            decoded = json.loads(raw)
        except (ValueError, RecursionError):
            ex.error = "malformed JSON"
            return _jsonrpc_error(None, McpError(PARSE_ERROR, "Parse error"), 400)
        if isinstance(decoded, list):
            ex.error = "JSON-RPC batch"
            return _jsonrpc_error(None, McpError(
                INVALID_REQUEST, "JSON-RPC batches are not supported: send one message per POST"),
                400)
        if not isinstance(decoded, dict):
            ex.error = "not a JSON-RPC message"
            return _jsonrpc_error(None, _invalid_body(), 400)
        method = decoded.get("method")
        ex.method = method if isinstance(method, str) else None

        if _is_modern(decoded, request.headers.get(VERSION_HEADER)):
            ex.era = "2026-07-28"
            return self._modern(ex, decoded, principal)
        ex.era = "handshake"
        return self._handshake(ex, decoded, principal)

    # -- the handshake era -----------------------------------------------------------------

    def _handshake(self, ex: _Exchange, decoded: dict[str, Any], principal: Any) -> Response:
        is_request = "id" in decoded and "method" in decoded
        if is_request:
            try:
                req = JSONRPCRequest.model_validate(decoded)
            except ValidationError:
                return _jsonrpc_error(None, _invalid_body(), 400)
        elif "method" in decoded:
            try:
                JSONRPCNotification.model_validate(decoded)
            except ValidationError:
                return _jsonrpc_error(None, _invalid_body(), 400)
        elif not ("id" in decoded and ("result" in decoded or "error" in decoded)):
            return _jsonrpc_error(None, _invalid_body(), 400)

        session = get_state().db.session
        if is_request and req.method == "initialize":
            if request.headers.get(SESSION_HEADER):
                ex.error = "initialize inside a session"
                return _jsonrpc_error(req.id, McpError(
                    INVALID_REQUEST, "initialize must not carry Mcp-Session-Id: start a new "
                    "session without it"), 400)
            served = dispatch(self.spec, "initialize", req.params, version="2025-11-25",
                              request_id=req.id, principal=principal)
            if served.error is not None:
                return _jsonrpc_error(req.id, served.error, 400)
            params = req.params or {}
            session_id = secrets.token_urlsafe(32)
            client_info = params.get("clientInfo")
            inbound.create_session(
                session, session_id=session_id, server_name=self.spec.name,
                principal_label=ex.principal_label or "", client_info=(
                    client_info if isinstance(client_info, dict) else {}),
                protocol_version=negotiate(params.get("protocolVersion")),
            )
            ex.session_id = session_id
            response = _jsonrpc_result(req.id, served)
            response.headers[SESSION_HEADER] = session_id
            return response

        session_id = (request.headers.get(SESSION_HEADER) or "").strip()
        if not session_id:
            ex.error = "no Mcp-Session-Id"
            return _jsonrpc_error(decoded.get("id") if is_request else None, McpError(
                INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required (send "
                "initialize first to get one)"), 400)
        ex.session_id = session_id[:64]
        header_version = (request.headers.get(VERSION_HEADER) or "").strip()
        version = header_version or DEFAULT_HANDSHAKE_VERSION
        if version not in HANDSHAKE_PROTOCOL_VERSIONS:
            ex.error = f"unsupported protocol version {version!r}"
            return _jsonrpc_error(decoded.get("id") if is_request else None, McpError(
                INVALID_REQUEST, f"Bad Request: unsupported protocol version {version!r}",
                {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": version}), 400)
        stored = inbound.touch_session(
            session, session_id=ex.session_id, server_name=self.spec.name,
            principal_label=ex.principal_label or "")
        if stored is None:
            ex.error = "unknown or terminated session"
            return _jsonrpc_error(decoded.get("id") if is_request else None, McpError(
                INVALID_REQUEST, "Session not found: initialize a new session"), 404)
        if not is_request:
            return Response(status=202)
        served = dispatch(self.spec, req.method, req.params, version=version,
                          request_id=req.id, principal=principal, session=real_session(session))
        ex.tool = served.tool
        if served.error is not None:
            return _jsonrpc_error(req.id, served.error, 200)
        return _jsonrpc_result(req.id, served)

    def _delete(self, ex: _Exchange) -> Response:
        ex.method = "DELETE"
        session_id = (request.headers.get(SESSION_HEADER) or "").strip()
        if not session_id:
            ex.error = "DELETE without Mcp-Session-Id"
            return _plain("Bad Request: Mcp-Session-Id header is required", 400)
        ex.session_id = session_id[:64]
        ended = inbound.terminate_session(
            get_state().db.session, session_id=ex.session_id, server_name=self.spec.name,
            principal_label=ex.principal_label or "")
        if not ended:
            ex.error = "unknown or terminated session"
            return _plain("Session not found", 404)
        return Response(status=200)

    # -- 2026-07-28 ------------------------------------------------------------------------

    def _modern(self, ex: _Exchange, decoded: dict[str, Any], principal: Any) -> Response:
        headers = {name.lower(): value.strip() for name, value in request.headers.items()}
        if "id" not in decoded:
            try:
                JSONRPCNotification.model_validate(decoded)
            except ValidationError:
                return _jsonrpc_error(None, _invalid_body(), 400)
            rejection = unsupported_protocol_version_rejection(
                headers.get(VERSION_HEADER.lower(), ""))
            if rejection is not None:
                return _rejection(None, rejection, ex)
            return Response(status=202)
        try:
            req = JSONRPCRequest.model_validate(decoded)
        except ValidationError:
            return _jsonrpc_error(None, _invalid_body(), 400)
        duplicated = find_duplicated_routing_header(
            (name, value) for name, value in request.headers.items())
        if duplicated is not None:
            return _rejection(req.id, InboundLadderRejection(
                code=HEADER_MISMATCH, message=f"{duplicated} header appears more than once"), ex)
        verdict = classify_inbound_request(decoded, headers=headers)
        if isinstance(verdict, InboundLadderRejection):
            return _rejection(req.id, verdict, ex)
        if req.method in tasks.TASK_METHODS and self.spec.tasks is not None:
            mismatch = tasks.name_header_mismatch(req.params, headers)
            if mismatch is not None:
                return _rejection(req.id, mismatch, ex)
        if req.method == "tools/call":
            params = req.params or {}
            name = params.get("name")
            arguments = params.get("arguments")
            schema = self.spec.input_schema(name) if isinstance(name, str) else None
            if schema is not None and isinstance(arguments, dict | type(None)):
                mismatch = validate_mcp_param_headers(schema, arguments or {}, headers)
                if mismatch is not None:
                    return _rejection(req.id, mismatch, ex)
        served = dispatch(self.spec, req.method, req.params, version=verdict.protocol_version,
                          request_id=req.id, principal=principal,
                          session=real_session(get_state().db.session))
        ex.tool = served.tool
        if served.error is not None:
            ex.error = served.error.message
            return _jsonrpc_error(req.id, served.error,
                                  ERROR_CODE_HTTP_STATUS.get(served.error.code, 200))
        return _jsonrpc_result(req.id, served)

    # -- helpers -----------------------------------------------------------------------------

    def _allow_lists(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.allowed_hosts is not None and self.allowed_origins is not None:
            return self.allowed_hosts, self.allowed_origins
        hosts = list(security.DEFAULT_ALLOWED_HOSTS)
        origins = list(security.DEFAULT_ALLOWED_ORIGINS)
        server_name = current_app.config.get("SERVER_NAME")
        if server_name:
            hosts.append(server_name)
            origins += [f"http://{server_name}", f"https://{server_name}"]
        if self.oauth is not None:  # the host of the resource URL clients are told to use
            hosts.append(urlsplit(self.oauth.resource).netloc)
        return (self.allowed_hosts if self.allowed_hosts is not None else tuple(hosts),
                self.allowed_origins if self.allowed_origins is not None else tuple(origins))

    def _label(self, principal: Any, token: str | None) -> str:
        if self.label_of is not None:
            label = str(self.label_of(principal))
            return security.scrub(label, token)[:200]
        return security.principal_label(principal, token)

    def _record(self, ex: _Exchange, response: Response) -> None:
        """One event row per request, written off the request path (.wirelog); a
        failure to write it never fails the request."""
        duration_ms = (time.perf_counter() - ex.started) * 1000
        try:
            body = response.get_data(as_text=True) if not response.is_streamed else None
            payload = {
                "server": self.spec.name, "era": ex.era, "method": ex.method, "tool": ex.tool,
                "principal": ex.principal_label, "session_id": ex.session_id,
                "request": {
                    "http_method": request.method,
                    "headers": security.redact_headers(request.headers.items(), ex.token),
                    "body": ex.body,
                },
                "response": {"body": security.scrub(body, ex.token) if body else None},
            }
            wirelog.enqueue(current_app._get_current_object(), {  # type: ignore[attr-defined]
                "payload": payload, "status_code": response.status_code,
                "duration_ms": duration_ms, "error": ex.error})
        except Exception:
            logger.exception("MCP server %r: could not record the wire-log event", self.spec.name)


# --------------------------------------------------------------------------- framing


def _is_modern(decoded: dict[str, Any], version_header: str | None) -> bool:
    """A 2026-07-28 request names a modern version in its header or carries the
    envelope's version key (the SDK's own routing rule, mcp.server.runner)."""
    if version_header is not None and version_header.strip() in MODERN_PROTOCOL_VERSIONS:
        return True
    params = decoded.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    if isinstance(meta, dict) and PROTOCOL_VERSION_META_KEY in meta:
        return True
    # A version no era knows, on a request that is not initialize: the modern
    # ladder answers it with -32022 and the list of versions we speak.
    return (version_header is not None and version_header.strip() != ""
            and version_header.strip() not in HANDSHAKE_PROTOCOL_VERSIONS
            and decoded.get("method") != "initialize" and "id" in decoded
            and not _has_session_header())


def _has_session_header() -> bool:
    return bool(request.headers.get(SESSION_HEADER))


def _accepts(accept: str) -> tuple[bool, bool]:
    """(accepts JSON, accepts SSE), with the RFC 7231 wildcards (as the SDK reads it)."""
    kinds = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    wildcard = "*/*" in kinds
    return (wildcard or any(k in (JSON, "application/*") for k in kinds),
            wildcard or any(k in (SSE, "text/*") for k in kinds))


def _invalid_body() -> McpError:
    return McpError(INVALID_REQUEST,
                    "Body must be a single JSON-RPC request, notification or response object")


def _plain(text: str, status: int) -> Response:
    return Response(text, status=status, mimetype="text/plain")


def _jsonrpc_error(request_id: Any, error: McpError, status: int) -> Response:
    body = {"jsonrpc": "2.0", "id": request_id, "error": error.to_error()}
    return Response(json.dumps(body, separators=(",", ":")), status=status, mimetype=JSON)


def _rejection(request_id: Any, rejection: InboundLadderRejection, ex: _Exchange) -> Response:
    ex.error = rejection.message
    error = McpError(rejection.code, rejection.message, rejection.data)
    status = ERROR_CODE_HTTP_STATUS.get(rejection.code, 400)
    if rejection.code == UNSUPPORTED_PROTOCOL_VERSION:
        status = 400
    return _jsonrpc_error(request_id, error, status)


def _jsonrpc_result(request_id: Any, served: Served) -> Response:
    message = {"jsonrpc": "2.0", "id": request_id, "result": served.result}
    if not served.notifications and not served.stream:
        return Response(json.dumps(message, separators=(",", ":")), status=200, mimetype=JSON)
    # The whole stream is written at once: the tool already ran, so nothing
    # holds the connection (or a worker thread) open after this response.
    frames = [*served.notifications, message]
    body = "".join(f"event: message\r\ndata: {json.dumps(f, separators=(',', ':'))}\r\n\r\n"
                   for f in frames)
    return Response(body, status=200, mimetype=SSE,
                    headers={"Cache-Control": "no-cache, no-transform"})
