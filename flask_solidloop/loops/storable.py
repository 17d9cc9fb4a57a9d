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
