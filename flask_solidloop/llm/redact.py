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


#: Shorter values ("none", "x") are placeholders, not secrets; replacing every
#: occurrence of them would garble the log.
MIN_SECRET_LENGTH = 8


def secret_forms(secrets: list[str]) -> list[str]:
    """Each secret as it may appear in text: raw, and escaped as repr() shows it."""
    forms: list[str] = []
    for secret in secrets:
        if secret and len(secret) >= MIN_SECRET_LENGTH:
            forms.append(secret)
            escaped = repr(secret)[1:-1]
            if escaped != secret:
                forms.append(escaped)
    return sorted(set(forms), key=len, reverse=True)


def redact_secrets(value: Any, secrets: list[str]) -> Any:
    """Replace every occurrence of each secret string anywhere inside ``value``."""
    secrets = secret_forms(secrets)
    if not secrets:
        return value
    return _redact(value, secrets)


def _redact(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: _redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, secrets) for v in value]
    return value
