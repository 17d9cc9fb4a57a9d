"""The code the three dialect modules share, below them: JSON as the servers write
it, a message's text, token estimates, text split into stream pieces, and the
reason a body is not a JSON object (each dialect words its 400 around it)."""

from __future__ import annotations

import json
import re
from typing import Any

from .._local_server import Response


def estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(value: Any) -> str:
    """JSON as servers send it: UTF-8 text, with a lone surrogate (which UTF-8
    cannot hold) written as its ``\\uXXXX`` escape, as JSON.stringify does."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    body = dumps(payload).encode("utf-8")
    return Response(status, body, "application/json", dict(headers or {}))


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string, a list of parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return "\n".join(parts)
    return str(content)


def last_entry(request_json: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The last item of ``request_json[key]`` (messages, contents) if it is an object."""
    entries = request_json.get(key)
    if not isinstance(entries, list) or not entries:
        return None
    last = entries[-1]
    return last if isinstance(last, dict) else None


def body_problem(parsed: Any, body: str, json_error: str | None) -> str | None:
    """Why the request body is not a JSON object, or None when it is one."""
    if json_error is not None or not body.strip():
        return (
            "We could not parse the JSON body of your request. "
            f"({json_error or 'empty body'})"
        )
    if not isinstance(parsed, dict):
        return "The request body must be a JSON object."
    return None


def split(text: str, max_piece: int = 8) -> list[str]:
    """Split ``text`` into several small pieces (at least 3 when it has >= 3 chars)."""
    if not text:
        return []
    size = max(1, min(max_piece, -(-len(text) // 3)))
    return [text[i : i + size] for i in range(0, len(text), size)]
