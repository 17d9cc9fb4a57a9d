"""Failure injection: the kinds :meth:`MCPEmulator.fail_next` queues and their
options (:func:`make_failure` checks them), and the answers a failure gives: a bare
status (a 401 shaped like an OAuth refusal), or a malformed body in place of the
real answer."""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgumentError
from .._local_server import Response, reason_phrase
from .protocol import json_response, text_response
from .types import SESSION_HEADER, Failure

_MALFORMED_DEFAULT = b'{"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "te'

_REQUIRED = object()
#: failure kind -> {option: default}; ``_REQUIRED`` marks options without a default.
FAILURE_OPTIONS: dict[str, dict[str, Any]] = {
    "status": {
        "status": _REQUIRED, "body": None, "headers": None, "content_type": None,
        "retry_after": None,
    },
    "session_lost": {"message": "Session not found"},
    "slow": {"seconds": 1.0},
    "is_error": {"message": "Tool failed (injected by MCPEmulator.fail_next)."},
    "malformed": {"body": None, "status": 200, "content_type": "application/json"},
}


def make_failure(
    kind: str, times: int, method: str | None, tool: str | None, options: dict[str, Any]
) -> Failure:
    """The failure ``fail_next(kind, times, method=..., tool=..., **options)`` queues: its
    options checked, and completed with their defaults."""
    if kind not in FAILURE_OPTIONS:
        raise InvalidArgumentError(
            f"unknown failure kind {kind!r}; known: {', '.join(FAILURE_OPTIONS)}"
        )
    if not isinstance(times, int) or times < 1:
        raise InvalidArgumentError("times must be an int >= 1")
    allowed = FAILURE_OPTIONS[kind]
    unknown = set(options) - set(allowed)
    if unknown:
        raise InvalidArgumentError(
            f"failure {kind!r} got unexpected option(s) {sorted(unknown)}; "
            f"allowed: {sorted(allowed)}"
        )
    merged = {**allowed, **options}
    missing = [name for name, value in merged.items() if value is _REQUIRED]
    if missing:
        raise InvalidArgumentError(f"failure {kind!r} requires option(s) {missing}")
    if kind == "status" and not (
        isinstance(merged["status"], int) and 100 <= merged["status"] <= 599
    ):
        raise InvalidArgumentError("status must be an int HTTP status")
    if kind == "slow" and (
        not isinstance(merged["seconds"], int | float) or merged["seconds"] < 0
    ):
        raise InvalidArgumentError("seconds must be a number >= 0")
    return Failure(kind, merged, times, method, tool)


def unauthorized(wrong_token: bool = True, body: Any = None) -> Response:
    """401 with ``WWW-Authenticate: Bearer`` and an OAuth-style JSON body (not JSON-RPC)."""
    challenge = 'Bearer realm="MCPEmulator"'
    if wrong_token:
        challenge += ', error="invalid_token"'
    payload = body if body is not None else {
        "error": "invalid_token",
        "error_description": "Missing or invalid bearer token.",
    }
    return json_response(401, payload, {"WWW-Authenticate": challenge})


def status_failure(options: dict[str, Any]) -> Response:
    """The answer of a ``"status"`` failure: nothing ran."""
    status: int = options["status"]
    headers = dict(options["headers"] or {})
    if options["retry_after"] is not None:
        headers["Retry-After"] = str(options["retry_after"])
    body = options["body"]
    if status == 401 and (body is None or isinstance(body, dict)):
        response = unauthorized(True, body)
        response.headers.update(headers)
        return response
    if body is None:
        response = text_response(
            status, f"{status} {reason_phrase(status)} (injected by MCPEmulator.fail_next)", headers
        )
    elif isinstance(body, bytes):
        response = Response(status, body, "application/octet-stream", headers)
    elif isinstance(body, str):
        response = text_response(status, body, headers)
    else:
        response = json_response(status, body, headers)
    if options["content_type"] is not None:
        response.content_type = options["content_type"]
    return response


def malformed(options: dict[str, Any], response: Response) -> Response:
    """A ``"malformed"`` failure's body in place of ``response``; the session id stays, so
    a session the request opened exists though the client never learns it."""
    body = options["body"]
    if body is None:
        body = _MALFORMED_DEFAULT
    elif isinstance(body, str):
        body = body.encode("utf-8")
    keep = {k: v for k, v in response.headers.items() if k.lower() == SESSION_HEADER}
    return Response(options["status"], body, options["content_type"], keep)
