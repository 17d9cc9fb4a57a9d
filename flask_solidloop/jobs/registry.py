"""The registry of a ``SolidLoop`` object's host jobs, and its binding to apps.

``@solidloop.actor``, ``solidloop.queue(name)`` and ``@solidloop.periodic``
record declarations here at import time, before any app exists. ``init_app``
calls :meth:`JobRegistry.bind` for each app: it declares the ``solidloop.job``
actor, every lazy actor and every queue on that app's broker, and remembers
the app, so declarations made later bind to it at once. Lookups of "the"
broker go through :meth:`JobRegistry.broker_for`: the current app's, or the
only app's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, overload

import dramatiq
from dramatiq.middleware import Retries
from dramatiq.results import Results
from flask import Flask, current_app, has_app_context

from ..config import QUEUE_DEFAULT, QUEUE_MAINTENANCE
from ..errors import InvalidJobError, JobImportError, NotInitializedError
from ..queue import sql as jobs_sql
from ..queue.broker import PostgresBroker
from ..queue.middleware.host_jobs import HostJobMiddleware
from ..queue.middleware.queue_consumers import UnconsumedQueueWarningMiddleware
from ..queue.middleware.scheduler import SchedulerMiddleware
from ..queue.results import PostgresResultBackend
from ..state import EXTENSION_KEY, SolidLoopState
from .actors import LazyActor, check_options, default_actor_options
from .functions import import_path_of, run_job
from .periodic import Schedule, Scheduler, every_seconds
from .rq import Queue, check_host_queue_name

F = TypeVar("F", bound=Callable[..., Any])


class JobRegistry:
    """Lazy actors, RQ-style queues and periodic schedules of one extension object."""

    def __init__(self) -> None:
        self.actors: dict[str, LazyActor] = {}
        self.queues: dict[str, Queue] = {}
        self.schedules: dict[str, Schedule] = {}
        self._apps: weakref.WeakSet[Flask] = weakref.WeakSet()

    # -- declarations ----------------------------------------------------------------

    @overload
    def actor(self, fn: F) -> LazyActor: ...

    @overload
    def actor(self, fn: None = None, *, actor_name: str | None = None,
              queue_name: str = QUEUE_DEFAULT, priority: int = 0,
              **options: Any) -> Callable[[F], LazyActor]: ...

    def actor(self, fn: Any = None, *, actor_name: str | None = None,
              queue_name: str = QUEUE_DEFAULT, priority: int = 0, **options: Any) -> Any:
        """Declare a lazy dramatiq actor (bare, or with dramatiq's actor options)."""
        check_host_queue_name(queue_name)
        check_options(options, default_actor_options(), where="@solidloop.actor")

        def declare(func: Any) -> LazyActor:
            if isinstance(func, LazyActor):
                raise InvalidJobError(f"{func.actor_name!r} is already an actor")
            if not callable(func):
                raise InvalidJobError(f"@solidloop.actor decorates a function, got {func!r}")
            name = actor_name or func.__name__
            if name.startswith("solidloop."):
                raise InvalidJobError(f"actor name {name!r} is reserved: names starting "
                                      "with 'solidloop.' belong to flask-solidloop")
            existing = self.actors.get(name)
            if existing is not None and (existing.fn.__module__, existing.fn.__qualname__) != (
                    func.__module__, func.__qualname__):
                raise InvalidJobError(
                    f"actor name {name!r} is already declared by {existing.fn.__module__}."
                    f"{existing.fn.__qualname__}; pass actor_name= to tell them apart")
            lazy = LazyActor(self, func, actor_name=name, queue_name=queue_name,
                             priority=priority, options=options)
            self.actors[name] = lazy
            for state in self._states():
                broker = state.broker
                lazy.bind(broker)
            return lazy

        return declare(fn) if fn is not None else declare

    def queue(self, name: str = QUEUE_DEFAULT) -> Queue:
        """The RQ-style queue ``name``, declared on every app's broker."""
        check_host_queue_name(name)
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = Queue(self, name)
            for state in self._states():
                state.broker.declare_queue(name)
        return queue

    def periodic(self, cron: str | None = None, *, every: timedelta | float | None = None,
                 name: str | None = None, queue_name: str | None = None,
                 args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                 ) -> Callable[[F], F]:
        """Run the decorated function or lazy actor once per period (see periodic.py)."""

        def register(func: F) -> F:
            func_name = import_path_of(func)
            target = queue_name or (func.queue_name if isinstance(func, LazyActor)
                                    else QUEUE_DEFAULT)
            self.queue(target)
            schedule = Schedule(name=name or func_name, func_name=func_name,
                                queue_name=target, cron=cron, every=every_seconds(every),
                                args=tuple(args), kwargs=dict(kwargs or {}))
            self.schedules[schedule.name] = schedule
            return func

        return register

    # -- binding -----------------------------------------------------------------------

    def bind(self, state: SolidLoopState) -> None:
        """Declare everything registered so far on ``state``'s broker (init_app)."""
        broker = state.broker
        # Before Retries: dramatiq runs after_* hooks in reverse, so this one sees
        # Retries' decision (retry or fail) when it records the outcome.
        broker.add_middleware(HostJobMiddleware(), before=Retries)
        broker.add_middleware(Results(backend=PostgresResultBackend(broker)))
        broker.add_middleware(UnconsumedQueueWarningMiddleware(
            heartbeat=state.config.worker_heartbeat))
        # Every RQ-style job runs as this actor. Its own queue is never used (each
        # message names the queue it was enqueued on); the maintenance queue is
        # already declared, so naming it costs no extra consumer.
        dramatiq.Actor(run_job, broker=broker, actor_name=jobs_sql.HOST_JOB_ACTOR,
                       queue_name=QUEUE_MAINTENANCE, priority=0,
                       options={"max_retries": 0, "throws": (JobImportError,)})
        # "default" whether or not anything declared it at import: a queue first
        # named inside a view (`solidloop.queue("default")` in a request) is never
        # declared in a worker process, and `rq worker` consumes it with no flags.
        broker.declare_queue(QUEUE_DEFAULT)
        for name in self.queues:
            broker.declare_queue(name)
        for lazy in self.actors.values():
            lazy.bind(broker)
        scheduler = Scheduler(broker, self.schedules, state.config)
        broker.add_middleware(SchedulerMiddleware(scheduler.tick, lambda: bool(self.schedules)))
        state.extras["jobs.scheduler"] = scheduler
        state.extras["jobs.results"] = next(
            m.backend for m in broker.middleware if isinstance(m, Results))
        self._apps.add(state.app)

    def _states(self) -> list[SolidLoopState]:
        return [app.extensions[EXTENSION_KEY] for app in list(self._apps)
                if EXTENSION_KEY in app.extensions]

    def state_for(self, broker: PostgresBroker) -> SolidLoopState | None:
        for state in self._states():
            if state.broker is broker:
                return state
        return None

    def broker_for(self, what: str) -> PostgresBroker:
        """The current app's broker, or the only app's; errors say which fix applies."""
        if has_app_context():
            app = current_app._get_current_object()  # type: ignore[attr-defined]
            if app in self._apps:
                state: SolidLoopState = app.extensions[EXTENSION_KEY]
                return state.broker
        states = self._states()
        if len(states) == 1:
            return states[0].broker
        if not states:
            raise NotInitializedError(
                f"{what} is not bound to an app yet: call solidloop.init_app(app) before "
                "sending (did you forget init_app, or is this a different SolidLoop object?)")
        raise NotInitializedError(
            f"{what} is bound to {len(states)} apps; send it inside an app context "
            "(`with app.app_context():`) to say which one")
