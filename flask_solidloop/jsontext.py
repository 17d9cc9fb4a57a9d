"""JSON text of large values, produced in pieces of bounded size.

``json.dumps`` of a request body or a history makes the whole text at once,
and its bytes after it: a turn over a long history then holds it three times
(the objects, the text, the bytes). The standard encoder's ``iterencode``
yields one piece per value, so a single long string is still one piece.
:func:`pieces` yields the same text as ``json.dumps`` with the same options
(``ensure_ascii=False``), long strings cut into chunks of ``chunk``
characters, so whoever sends, measures or hashes the text holds a chunk at a
time. Used by the LLM send path (a body's Content-Length and its streamed
content) and by the wire log (digests and excerpts of large bodies).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from .errors import SolidLoopError

_encode_string = json.encoder.encode_basestring  # type: ignore[attr-defined]


class NotJsonTypeError(SolidLoopError, TypeError):
    """A value JSON has no form for (what ``json.dumps`` raises TypeError for)."""


class NotJsonValueError(SolidLoopError, ValueError):
    """A value JSON cannot hold: a circular reference, or a non-finite float
    when ``allow_nan`` is off (what ``json.dumps`` raises ValueError for)."""

#: Characters of a string escaped at a time.
CHUNK = 65_536


def pieces(value: Any, *, separators: tuple[str, str] = (", ", ": "),
           sort_keys: bool = False, allow_nan: bool = True,
           default: Callable[[Any], Any] | None = None, chunk: int = CHUNK) -> Iterator[str]:
    """``json.dumps(value, ensure_ascii=False, separators=..., sort_keys=...,
    allow_nan=..., default=...)`` as consecutive pieces (their concatenation is
    that text), none longer than about ``chunk`` characters of escaped string.
    Raises where ``json.dumps`` raises, with subclasses of the same TypeError
    and ValueError, possibly after some pieces were yielded."""
    item_separator, key_separator = separators

    def floatstr(number: float) -> str:
        if number != number:
            text = "NaN"
        elif number == float("inf"):
            text = "Infinity"
        elif number == -float("inf"):
            text = "-Infinity"
        else:
            return float.__repr__(number)
        if not allow_nan:
            raise NotJsonValueError(
                f"Out of range float values are not JSON compliant: {number!r}")
        return text

    def string(text: str) -> Iterator[str]:
        if len(text) <= chunk:
            yield _encode_string(text)
            return
        yield '"'
        for start in range(0, len(text), chunk):
            yield _encode_string(text[start:start + chunk])[1:-1]
        yield '"'

    def key_text(key: Any) -> str:
        if isinstance(key, str):
            return key
        if isinstance(key, float):
            return floatstr(key)
        if key is True:
            return "true"
        if key is False:
            return "false"
        if key is None:
            return "null"
        if isinstance(key, int):
            return int.__repr__(key)
        raise NotJsonTypeError(
            f"keys must be str, int, float, bool or None, not {type(key).__name__}")

    def encode(node: Any, seen: set[int]) -> Iterator[str]:
        if isinstance(node, str):
            yield from string(node)
        elif node is None:
            yield "null"
        elif node is True:
            yield "true"
        elif node is False:
            yield "false"
        elif isinstance(node, int):
            yield int.__repr__(node)
        elif isinstance(node, float):
            yield floatstr(node)
        elif isinstance(node, list | tuple):
            if id(node) in seen:
                raise NotJsonValueError("Circular reference detected")
            seen.add(id(node))
            yield "["
            for index, item in enumerate(node):
                if index:
                    yield item_separator
                yield from encode(item, seen)
            yield "]"
            seen.discard(id(node))
        elif isinstance(node, dict):
            if id(node) in seen:
                raise NotJsonValueError("Circular reference detected")
            seen.add(id(node))
            yield "{"
            items = sorted(node.items()) if sort_keys else node.items()
            for index, (key, item) in enumerate(items):
                if index:
                    yield item_separator
                yield _encode_string(key_text(key))
                yield key_separator
                yield from encode(item, seen)
            yield "}"
            seen.discard(id(node))
        elif default is not None:
            yield from encode(default(node), seen)
        else:
            raise NotJsonTypeError(
                f"Object of type {type(node).__name__} is not JSON serializable")

    yield from encode(value, set())
