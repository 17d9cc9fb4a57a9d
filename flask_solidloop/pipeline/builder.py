"""The middleware stack builder behind every LLM and tool turn.

A middleware is a class constructed with the next callable in the chain and
called with the turn's context (the shape of Rack's middlewares)::

    class Audit:
        def __init__(self, next_step):
            self.next_step = next_step

        def __call__(self, ctx):
            log(ctx)
            return self.next_step(ctx)

Positional edits (insert_before / insert_after / replace) raise
UnknownMiddlewareError when their target is not in the stack: placement is the
point, so a missed target is an error, not a guess. ``delete`` is lenient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import UnknownMiddlewareError

Handler = Callable[[Any], Any]
MiddlewareClass = Callable[[Handler], Handler]


def _name(middleware: Any) -> str:
    return getattr(middleware, "__qualname__", None) or repr(middleware)


class Builder:
    """An ordered, editable list of middleware classes."""

    def __init__(self, middlewares: Iterable[MiddlewareClass] = ()) -> None:
        self._stack: list[MiddlewareClass] = list(middlewares)

    @property
    def middlewares(self) -> list[MiddlewareClass]:
        return list(self._stack)

    def copy(self) -> Builder:
        return Builder(self._stack)

    def __contains__(self, middleware: object) -> bool:
        return middleware in self._stack

    def __iter__(self):
        return iter(list(self._stack))

    def __len__(self) -> int:
        return len(self._stack)

    def _index(self, target: MiddlewareClass) -> int:
        try:
            return self._stack.index(target)
        except ValueError:
            present = ", ".join(_name(m) for m in self._stack) or "(empty)"
            raise UnknownMiddlewareError(
                f"{_name(target)} is not in this stack; present: {present}"
            ) from None

    def use(self, middleware: MiddlewareClass) -> Builder:
        """Append ``middleware`` at the innermost end of the stack."""
        self._stack.append(middleware)
        return self

    def insert_before(self, target: MiddlewareClass, middleware: MiddlewareClass) -> Builder:
        self._stack.insert(self._index(target), middleware)
        return self

    def insert_after(self, target: MiddlewareClass, middleware: MiddlewareClass) -> Builder:
        self._stack.insert(self._index(target) + 1, middleware)
        return self

    def replace(self, target: MiddlewareClass, middleware: MiddlewareClass) -> Builder:
        self._stack[self._index(target)] = middleware
        return self

    def delete(self, target: MiddlewareClass) -> Builder:
        """Remove ``target`` if present; a no-op otherwise."""
        self._stack = [m for m in self._stack if m is not target]
        return self

    def build(self, terminal: Handler | None = None) -> Handler:
        """Chain the stack into one callable. The innermost ``next`` is ``terminal``."""
        handler: Handler = terminal or (lambda ctx: None)
        for middleware in reversed(self._stack):
            handler = middleware(handler)
        return handler
