"""The protocol's small pieces: answers shaped as MCP servers send them (a JSON-RPC
error, a bare text or JSON body, the "unknown session" 404) and what the emulator
reads off a request (the media types it accepts, a host name, the stateless era's
protocol version in ``params._meta``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import mcp.types as mcp_types
from mcp.types.jsonrpc import INVALID_REQUEST, JSONRPCMessage, JSONRPCNotification, JSONRPCRequest

from .._local_server import Response


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, dumps(payload), "application/json", dict(headers or {}))


def rpc_error(
    status: int, request_id: Any, code: int, message: str, data: Any = None,
    headers: dict[str, str] | None = None,
) -> Response:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return json_response(status, {"jsonrpc": "2.0", "id": request_id, "error": error}, headers)


def session_not_found() -> Response:
    return rpc_error(404, None, INVALID_REQUEST, "Not Found: unknown or expired session")


def text_response(status: int, text: str, headers: dict[str, str] | None = None) -> Response:
    return Response(status, text.encode("utf-8"), "text/plain; charset=utf-8", dict(headers or {}))


def error_payload(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error response, as a dict (sent with HTTP 200 in the handshake era)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def media_types(header: str) -> set[str]:
    return {part.split(";")[0].strip().lower() for part in header.split(",") if part.strip()}


def hostname(value: str) -> str | None:
    """The host name of a ``Host`` header value or an origin, lower-case, without brackets."""
    target = value if "://" in value else "//" + value
    try:
        return urlsplit(target).hostname
    except ValueError:
        return None


def params_of(message: JSONRPCMessage) -> dict[str, Any] | None:
    return message.params if isinstance(message, JSONRPCRequest | JSONRPCNotification) else None


def meta_version(params: Any) -> str | None:
    """The stateless-era envelope's protocol version, if ``params._meta`` carries one."""
    if not isinstance(params, Mapping):
        return None
    meta = params.get("_meta")
    if not isinstance(meta, Mapping):
        return None
    version = meta.get(mcp_types.PROTOCOL_VERSION_META_KEY)
    return version if isinstance(version, str) else None
