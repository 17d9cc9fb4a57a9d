"""Scrub secrets from anything headed for the wire log."""

from __future__ import annotations

from typing import Any

SECRET_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization"}
REDACTED = "[redacted]"


SECRET_NAME_PARTS = ("key", "token", "auth", "secret", "password", "cookie", "signature")


def is_secret_header(name: str) -> bool:
    lowered = name.lower()
    return lowered in SECRET_HEADERS or any(part in lowered for part in SECRET_NAME_PARTS)


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers for the wire log: anything that looks like a credential is replaced."""
    return {k: (REDACTED if is_secret_header(k) else v) for k, v in headers.items()}


def redact_secrets(value: Any, secrets: list[str]) -> Any:
    """Replace every occurrence of each secret string anywhere inside ``value``."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: redact_secrets(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v, secrets) for v in value]
    return value
