"""Lazy dramatiq actors: ``@solidloop.actor`` declares at import, binds at ``init_app``.

``@dramatiq.actor`` binds to dramatiq's global broker when the module is
imported, which in an app-factory project does not exist yet (dramatiq then
falls back to Redis or RabbitMQ). A :class:`LazyActor` is an ordinary
``dramatiq.Actor`` whose broker is found when it is used: each ``init_app``
binds every lazy actor declared so far to that app's Postgres broker (and
actors declared later bind to every app initialised so far), the way
flask-melodramatiq's lazy actors do. With several apps, ``send`` uses the
current app's broker.

Sending is dramatiq's, plus one option: ``session=`` writes the job on that
SQLAlchemy session's connection, inside its open transaction (rollback leaves
nothing; commit delivers the job and its NOTIFY). Unknown options raise and
name the known ones.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.logging import get_logger
from dramatiq.message import Message

from ..errors import InvalidJobError
from ..queue.broker import PostgresBroker

if TYPE_CHECKING:
    from .registry import JobRegistry

_DEFAULT_OPTIONS: frozenset[str] | None = None


def default_actor_options() -> frozenset[str]:
    """Actor options every solidloop broker understands: those of dramatiq's
    default middleware, plus ``Results`` (store_results, result_ttl)."""
    global _DEFAULT_OPTIONS
    if _DEFAULT_OPTIONS is None:
        from dramatiq.middleware import default_middleware
        from dramatiq.results import Results

        options: set[str] = set(Results(backend=None).actor_options)
        for middleware in default_middleware:
            options |= set(middleware().actor_options)
        _DEFAULT_OPTIONS = frozenset(options)
    return _DEFAULT_OPTIONS


def check_options(given: Iterable[str], known: Iterable[str], *, where: str,
                  extra: Iterable[str] = ()) -> None:
    """InvalidJobError naming the known options when ``given`` has an unknown one."""
    valid = set(known) | set(extra)
    unknown = sorted(set(given) - valid)
    if not unknown:
        return
    hints = []
    for name in unknown:
        if name == "connection":
            hints.append("connection (to enqueue inside a transaction pass session=db.session)")
            continue
        close = difflib.get_close_matches(name, sorted(valid), n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise InvalidJobError(
        f"unknown option{'s' if len(unknown) > 1 else ''} for {where}: {', '.join(hints)}; "
        f"known options: {', '.join(sorted(valid))}"
    )


class LazyActor(dramatiq.Actor):
    """A dramatiq actor bound to the Postgres broker of each app it was initialised with."""

    def __init__(self, registry: JobRegistry, fn: Callable[..., Any], *, actor_name: str,
                 queue_name: str, priority: int, options: dict[str, Any]) -> None:
        # dramatiq.Actor.__init__ would bind to a broker now; binding waits for init_app.
        self.registry = registry
        self.fn = fn
        self.actor_name = actor_name
        self.queue_name = queue_name
        self.priority = priority
        self.options = options
        self.logger = get_logger(fn.__module__ or "_", actor_name)
        # Recorded by import path like any function: a worker that imports the
        # module finds this object, which runs fn when called.
        self.__module__ = fn.__module__
        self.__qualname__ = fn.__qualname__
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    @property
    def broker(self) -> PostgresBroker:  # type: ignore[override]
        """The broker of the current app (or of the only app this actor is bound to)."""
        return self.registry.broker_for(f"actor {self.actor_name!r}")

    def bind(self, broker: PostgresBroker) -> dramatiq.Actor:
        """Declare this actor on ``broker`` (what init_app does for each app)."""
        existing = broker.actors.get(self.actor_name)
        if existing is not None:
            if getattr(existing, "fn", None) is not self.fn and not _same_function(
                    existing.fn, self.fn):
                raise InvalidJobError(
                    f"actor name {self.actor_name!r} is already taken on this broker by "
                    f"{_where(existing.fn)}; give {_where(self.fn)} another actor_name="
                )
            del broker.actors[self.actor_name]  # a module imported twice re-declares its actors
        return dramatiq.Actor(self.fn, broker=broker, actor_name=self.actor_name,
                              queue_name=self.queue_name, priority=self.priority,
                              options=dict(self.options))

    def send_with_options(  # type: ignore[override]
        self,
        *,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        delay: timedelta | int | None = None,
        session: Any = None,
        **options: Any,
    ) -> Message[Any]:
        """dramatiq's ``send_with_options``; ``session=`` joins that session's transaction."""
        broker = self.broker
        check_options(options, broker.actor_options, where=f"actor {self.actor_name!r}",
                      extra=("args", "kwargs", "delay", "session"))
        if isinstance(delay, timedelta):
            delay = int(delay.total_seconds() * 1000)
        message = self.message_with_options(args=args, kwargs=kwargs, **options)
        if session is not None:
            broker.check_session(session)
        return broker.enqueue(message, delay=delay, connection=session)

    def __repr__(self) -> str:
        return (f"LazyActor({self.fn!r}, queue_name={self.queue_name!r}, "
                f"actor_name={self.actor_name!r})")


def _same_function(a: Any, b: Any) -> bool:
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def _where(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
