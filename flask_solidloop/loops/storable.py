"""Make text and JSON storable in PostgreSQL, once, at the store.

PostgreSQL refuses two things a model, a tool or a remote server can send:
the NUL character (in ``text`` and in ``jsonb``: "unsupported Unicode escape
sequence") and lone UTF-16 surrogates (they are not UTF-8 at all). ``jsonb``
also refuses NaN and the infinities, and SQLAlchemy cannot serialize values
that are not JSON (a ``datetime`` inside a hand-built ``ToolResult`` block, a
set, an object). Any of these used to fail the whole loop after the tool had
already run, losing its result.

Here every such character becomes U+FFFD (the replacement character) and every
value JSON cannot hold becomes its ``str()``; each function also says whether
it changed anything, so the store can flag the row (``metadata.sanitized``).
Pure functions: no I/O, no database.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from .. import jsontext
from ..llm.client import text_size

REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def text(value: str | None) -> tuple[str | None, bool]:
    """``value`` with NUL and lone surrogates replaced; and whether it changed."""
    if value is None or not _UNSTORABLE.search(value):
        return value, False
    return _UNSTORABLE.sub(REPLACEMENT, value), True


class _Walk:
    def __init__(self) -> None:
        self.altered = False
        self.unserializable = False

    def value(self, value: Any) -> Any:
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, str):
            cleaned, changed = text(value)
            self.altered |= changed
            return cleaned
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            self.altered = True
            return str(value)
        if isinstance(value, dict):
            return {self.key(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        self.unserializable = True
        cleaned, _ = text(str(value))
        return cleaned

    def key(self, key: Any) -> str:
        if not isinstance(key, str):
            # json.dumps would turn int/float/bool/None keys into strings too.
            key = json.dumps(key) if isinstance(key, int | float | bool) or key is None \
                else str(key)
            if not isinstance(key, str):
                self.unserializable = True
        cleaned, changed = text(key)
        self.altered |= changed
        return cleaned or ""


def json_value(value: Any) -> tuple[Any, bool, bool]:
    """A storable copy of ``value``: (copy, text was altered, a value was not JSON).

    A structure nested deeper than Python can walk becomes its ``repr`` cut to
    a readable length (or a note saying so), flagged as not JSON (it cannot
    have come from ``json.loads`` anyway).
    """
    walk = _Walk()
    try:
        return walk.value(value), walk.altered, walk.unserializable
    except RecursionError:
        try:
            shown = repr(value)[:10_000]
        except RecursionError:
            shown = f"<{type(value).__name__} nested too deep to store>"
        return text(shown)[0], True, True


def excerpt(value: Any, limit: int) -> tuple[Any, bool]:
    """``value`` as it goes into the wire log: whole when its JSON is at most
    ``limit`` characters, else an excerpt with the full size and a SHA-256, so
    a large body is kept once (on its row) and still recognisable here."""
    if text_size(value) >= _STREAMED_EXCERPT_CHARS:
        return _streamed_excerpt(value, limit)
    try:
        encoded = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        encoded = repr(value)
    if len(encoded) <= limit:
        return value, False
    return {
        "excerpt": encoded[:limit],
        "size": len(encoded),
        "sha256": hashlib.sha256(encoded.encode("utf-8", "replace")).hexdigest(),
        "truncated": True,
    }, True


#: Values with more text than this are measured and hashed piece by piece.
_STREAMED_EXCERPT_CHARS = 256_000


def _streamed_excerpt(value: Any, limit: int) -> tuple[Any, bool]:
    """:func:`excerpt` of a large value, its JSON measured, hashed and cut as it
    is encoded: the same excerpt, size and digest, without the whole JSON text
    and its bytes in memory at once."""
    digest = hashlib.sha256()
    size, head = 0, ""
    try:
        for piece in jsontext.pieces(value, default=str):
            size += len(piece)
            if len(head) < limit:
                head += piece[:limit - len(head)]
            digest.update(piece.encode("utf-8", "replace"))
    except (TypeError, ValueError, RecursionError):
        encoded = repr(value)
        size, head = len(encoded), encoded[:limit]
        digest = hashlib.sha256(encoded.encode("utf-8", "replace"))
    if size <= limit:
        return value, False
    return {"excerpt": head, "size": size, "sha256": digest.hexdigest(),
            "truncated": True}, True


#: The request-body keys that carry the conversation (OpenAI-compatible and
#: Anthropic: ``messages``; Gemini: ``contents``), and the roles of the model's turns.
_CONVERSATION_KEYS = ("messages", "contents")
_MODEL_ROLES = ("assistant", "model")
#: The key that replaces the omitted part of a logged request's conversation.
HISTORY_OMITTED = "solidloop_history_omitted"


def conversation_tail(body: Any) -> Any:
    """A request body as the wire log keeps it: the conversation from the model's
    last answer on (what this request adds), the earlier part replaced by its
    count and the SHA-256 of its JSON as sent (compact, keys sorted). Every
    earlier entry is in the loop's messages and in an earlier request's event,
    so a loop's log grows with its turns, not with the square of them. A body
    with no model turn yet (a loop's first request) is kept whole."""
    if not isinstance(body, dict):
        return body
    for key in _CONVERSATION_KEYS:
        turns = body.get(key)
        if not isinstance(turns, list):
            continue
        last = max((i for i, turn in enumerate(turns)
                    if isinstance(turn, dict) and turn.get("role") in _MODEL_ROLES),
                   default=None)
        if last is None:
            return body
        omitted = turns[:last]
        if not omitted:
            return body
        return {**body, key: turns[last:], HISTORY_OMITTED: {
            "field": key, "count": len(omitted), "sha256": history_digest(omitted)}}
    return body


def history_digest(turns: Any) -> str:
    """SHA-256 of ``turns`` as compact JSON with sorted keys (see conversation_tail).
    Hashed as it is encoded, piece by piece: a history of megabytes is never
    held a second and a third time, as a JSON string and its bytes."""
    digest = hashlib.sha256()
    for piece in jsontext.pieces(turns, sort_keys=True, separators=(",", ":"), default=str):
        digest.update(piece.encode("utf-8", "replace"))
    return digest.hexdigest()


#: The key that replaces a logged request's tool declarations when the same
#: ones were logged for the loop before.
TOOLS_OMITTED = "solidloop_tools_omitted"


def tools_digest(body: Any) -> str | None:
    """SHA-256 of a request body's tool declarations (``tools``, every dialect),
    as :func:`history_digest` hashes; None for a body without any."""
    tools = body.get("tools") if isinstance(body, dict) else None
    return history_digest(tools) if isinstance(tools, list) and tools else None


def without_tools(body: dict[str, Any], digest: str) -> dict[str, Any]:
    """``body`` with its tool declarations replaced by their count and SHA-256
    (their digest, :func:`tools_digest`): an earlier event of the loop holds
    them whole."""
    kept = {key: value for key, value in body.items() if key != "tools"}
    kept[TOOLS_OMITTED] = {"field": "tools", "count": len(body["tools"]), "sha256": digest}
    return kept


#: Longest error text stored on a loop or an event (a database error can carry
#: a whole SQL statement and its parameters).
MAX_ERROR_TEXT = 2000


def error_text(exc: BaseException) -> str:
    """``Class: message`` as a loop's ``error_message`` keeps it: cut to a
    readable length, and storable."""
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > MAX_ERROR_TEXT:
        message = message[:MAX_ERROR_TEXT] + " [truncated]"
    return text(message)[0] or ""


def message_content(content: str, meta: dict[str, Any] | None
                    ) -> tuple[str | None, dict[str, Any]]:
    """A new message's content made storable, and its metadata, which says so
    (``sanitized``) when it had to change."""
    cleaned, altered = text(content)
    meta = dict(meta or {})
    if altered:
        meta["sanitized"] = ["content"]
    return cleaned, meta


def sanitized(fields: dict[str, bool]) -> list[str]:
    """The names of the fields whose text had to be made storable."""
    return [name for name, altered in fields.items() if altered]
