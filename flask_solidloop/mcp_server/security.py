"""Who may talk to an MCP server blueprint, and what of a request may be stored.

This module owns the DNS-rebinding rules (``Host`` and ``Origin`` allow-lists,
with the MCP SDK's ``host:*`` / ``origin:*`` port wildcards and its localhost
defaults), the bearer-token extraction, the principal's label (what sessions
are bound to and the wire log shows), and the redaction of headers and bodies
before anything reaches the database or a log line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "DEFAULT_ALLOWED_ORIGINS",
    "bearer_token",
    "host_allowed",
    "origin_allowed",
    "principal_label",
    "redact_headers",
    "scrub",
]

#: The SDK's localhost defaults (mcp.server.lowlevel.server, streamable_http_app).
DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = ("127.0.0.1:*", "localhost:*", "[::1]:*")
DEFAULT_ALLOWED_ORIGINS: tuple[str, ...] = (
    "http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*")

#: Headers never stored, whatever their value.
SECRET_HEADERS = frozenset({
    "authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key",
    "x-auth-token",
})
REDACTED = "[redacted]"


def _matches(value: str, allowed: Iterable[str]) -> bool:
    """The SDK's rule: an exact match, or ``base:*`` matching ``base:<any port>``."""
    for pattern in allowed:
        if value == pattern:
            return True
        if pattern.endswith(":*") and value.startswith(pattern[:-1]):
            return True
    return False


def host_allowed(host: str | None, allowed: Iterable[str]) -> bool:
    """A request without ``Host`` is refused: DNS rebinding hides behind the name."""
    return bool(host) and _matches(host.strip(), allowed)  # type: ignore[union-attr]


def origin_allowed(origin: str | None, allowed: Iterable[str]) -> bool:
    """No ``Origin`` means not a browser (or same-origin): allowed, as in the SDK."""
    if not origin:
        return True
    return _matches(origin.strip(), allowed)


def bearer_token(headers: Mapping[str, str] | Any) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None."""
    value = headers.get("Authorization")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def principal_label(principal: Any, token: str | None) -> str:
    """A short, stable label for what ``auth`` returned: a string as it is, an
    object with an ``id`` as ``Type:id``, else ``str()``. A label that would
    contain the token is replaced, so an ``auth`` returning the token itself
    cannot leak it into the sessions table or the wire log."""
    if isinstance(principal, str):
        label = principal
    elif getattr(principal, "mcp_label", None) is not None:
        label = str(principal.mcp_label)
    elif getattr(principal, "id", None) is not None:
        label = f"{type(principal).__name__}:{principal.id}"
    else:
        label = str(principal)
    label = label.strip() or type(principal).__name__
    if token and token in label:
        label = f"{type(principal).__name__}:{REDACTED}"
    return label[:200]


def redact_headers(headers: Iterable[tuple[str, str]], token: str | None) -> dict[str, str]:
    """Request headers fit for the wire log: secret headers and the token removed."""
    kept: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        kept[key] = REDACTED if key in SECRET_HEADERS else scrub(value, token)
    return kept


def scrub(text: str, token: str | None) -> str:
    """``text`` with every occurrence of the caller's token replaced."""
    if token and token in text:
        return text.replace(token, REDACTED)
    return text
