"""The Flask extension: ``SolidLoop(app=None, db=None)`` and ``init_app``.

Per-app state (validated config, broker, actors, dispatcher) lives in
``app.extensions["solidloop"]`` as a :class:`SolidLoopState`; the
``SolidLoop`` object itself only holds what is app-independent: the agent
registry and the global middleware hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import dramatiq
from dramatiq.middleware import Retries, TimeLimit
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from .agent import Agent
from .config import QUEUE_LLM, QUEUE_MAINTENANCE, QUEUE_TOOL, Config
from .durability.renewer import LeaseRenewer
from .errors import AgentDefinitionError, ConfigurationError, UnknownAgentError
from .models import Loop
from .pipeline.builder import Builder
from .pipeline.llm_stack import DEFAULT_LLM_STACK
from .pipeline.tool_stack import DEFAULT_TOOL_STACK
from .queue.app_context import AppContextMiddleware
from .queue.broker import PostgresBroker, libpq_url
from .queue.current_job import CurrentJobMiddleware
from .queue.dispatch import Dispatcher
from .queue.renewer_middleware import LeaseRenewerMiddleware

A = TypeVar("A", bound=type[Agent])
StackHook = Callable[[Builder], None]
#: Thirty days: effectively no dramatiq time limit for the solidloop actors.
NO_TIME_LIMIT_MS = 30 * 24 * 3600 * 1000


@dataclass
class SolidLoopState:
    """Everything flask-solidloop knows about one app."""

    extension: SolidLoop
    app: Flask
    db: SQLAlchemy
    config: Config
    database_url: str
    broker: PostgresBroker
    actors: dict[str, dramatiq.Actor]
    dispatch: Dispatcher
    extras: dict[str, Any] = field(default_factory=dict)
    #: Unix time of this process's last successful reap / prune (process-local).
    last_reaped_at: float | None = None
    last_pruned_at: float | None = None
    _renewer: LeaseRenewer | None = field(default=None, repr=False)
    _renewer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def renewer(self) -> LeaseRenewer:
        """This process's lease renewer (one per process, created on first use)."""
        with self._renewer_lock:
            if self._renewer is None:
                self._renewer = LeaseRenewer(libpq_url(self.broker.url))
            return self._renewer

    def stop_renewer(self) -> None:
        with self._renewer_lock:
            renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    def agent_class(self, name: str) -> type[Agent]:
        try:
            return self.extension.agents[name]
        except KeyError:
            raise UnknownAgentError(name, list(self.extension.agents)) from None

    def agent_for(self, name: str, loop: Loop | None = None) -> Agent:
        return self.agent_class(name)(loop)

    def llm_stack(self) -> Builder:
        builder = Builder(DEFAULT_LLM_STACK)
        for hook in self.extension.llm_middleware_hooks:
            hook(builder)
        return builder

    def tool_stack(self) -> Builder:
        builder = Builder(DEFAULT_TOOL_STACK)
        for hook in self.extension.tool_middleware_hooks:
            hook(builder)
        return builder


class SolidLoop:
    """Flask extension that runs LLM agents as durable dramatiq jobs on PostgreSQL."""

    def __init__(
        self,
        app: Flask | None = None,
        db: SQLAlchemy | None = None,
        *,
        configure_llm_middlewares: StackHook | None = None,
        configure_tool_middlewares: StackHook | None = None,
    ) -> None:
        self.db = db
        self.agents: dict[str, type[Agent]] = {}
        self.llm_middleware_hooks: list[StackHook] = []
        self.tool_middleware_hooks: list[StackHook] = []
        if configure_llm_middlewares:
            self.llm_middleware_hooks.append(configure_llm_middlewares)
        if configure_tool_middlewares:
            self.tool_middleware_hooks.append(configure_tool_middlewares)
        if app is not None:
            self.init_app(app, db)

    # -- registration -------------------------------------------------------------

    def agent(self, name: str) -> Callable[[A], A]:
        """Register an Agent subclass under a stable name stored on its loops."""
        if not isinstance(name, str) or not name.strip():
            raise AgentDefinitionError("an agent name must be a non-empty string")

        def register(cls: A) -> A:
            if not (isinstance(cls, type) and issubclass(cls, Agent)):
                raise AgentDefinitionError(
                    f"@solidloop.agent({name!r}) must decorate an Agent subclass, got {cls!r}"
                )
            existing = self.agents.get(name)
            if existing is not None and existing.__qualname__ != cls.__qualname__:
                raise AgentDefinitionError(
                    f"agent name {name!r} is already registered by {existing.__qualname__}"
                )
            cls.agent_name = name
            cls._extension = self
            self.agents[name] = cls
            return cls

        return register

    def configure_llm_middlewares(self, hook: StackHook) -> StackHook:
        """Register a hook that edits the LLM stack of every agent (decorator)."""
        self.llm_middleware_hooks.append(hook)
        return hook

    def configure_tool_middlewares(self, hook: StackHook) -> StackHook:
        """Register a hook that edits the tool stack of every agent (decorator)."""
        self.tool_middleware_hooks.append(hook)
        return hook

    # -- app binding --------------------------------------------------------------

    def init_app(self, app: Flask, db: SQLAlchemy | None = None) -> None:
        if "solidloop" in app.extensions:
            raise RuntimeError(
                "flask-solidloop is already initialised on this app; call init_app once"
            )
        db = db or self.db or _find_sqlalchemy(app)
        config = Config.from_mapping(app.config)
        url = _check_urls(config, app.config.get("SQLALCHEMY_DATABASE_URI"))
        broker = PostgresBroker(
            url,
            job_lease=config.job_lease,
            poll_interval=config.poll_interval,
            max_deliveries=config.job_max_deliveries,
        )
        broker.add_middleware(CurrentJobMiddleware())
        broker.add_middleware(AppContextMiddleware(app))
        for middleware in broker.middleware:
            if isinstance(middleware, Retries):
                middleware.max_retries = config.job_max_retries
        state = SolidLoopState(
            extension=self, app=app, db=db, config=config, database_url=url, broker=broker,
            actors={}, dispatch=None,  # type: ignore[arg-type]
        )
        broker.add_middleware(LeaseRenewerMiddleware(state))
        state.actors = _declare_actors(state)
        state.dispatch = Dispatcher(broker, state.actors)
        app.extensions["solidloop"] = state
        from .cli import solidloop_cli

        app.cli.add_command(solidloop_cli)


def _check_urls(config: Config, session_url: Any) -> str:
    """Validate the session URL (jobs are written on its connections) and the
    broker URL (consumers LISTEN on it); return the broker URL."""
    if not session_url:
        raise ConfigurationError(
            "SQLALCHEMY_DATABASE_URI", session_url,
            "flask-solidloop needs a PostgreSQL URL (postgresql+psycopg://...)",
        )
    session_url = str(session_url)
    if session_url.split("://", 1)[0] not in ("postgresql+psycopg", "postgres+psycopg"):
        raise ConfigurationError(
            "SQLALCHEMY_DATABASE_URI", _safe(session_url),
            "flask-solidloop needs PostgreSQL through psycopg 3: use a "
            "postgresql+psycopg:// URL (jobs are written on the session's own connection)",
        )
    if config.database_url is None:
        return session_url
    broker_url = str(config.database_url)
    if not broker_url.split("://", 1)[0].startswith(("postgresql", "postgres")):
        raise ConfigurationError(
            "SOLIDLOOP_DATABASE_URL", _safe(broker_url),
            "must be a PostgreSQL URL naming the same database as SQLALCHEMY_DATABASE_URI",
        )
    return broker_url


def _safe(url: str) -> str:
    from .queue.broker import redact_url

    return redact_url(url)


def _find_sqlalchemy(app: Flask) -> SQLAlchemy:
    db = app.extensions.get("sqlalchemy")
    if db is None:
        raise RuntimeError(
            "flask-solidloop needs Flask-SQLAlchemy: pass SolidLoop(app, db=db) or "
            "init_app(app, db=db), or initialise SQLAlchemy on the app first"
        )
    return db


def _declare_actors(state: SolidLoopState) -> dict[str, dramatiq.Actor]:
    """Bind the three actors to this app's broker (ids in, nothing returned)."""
    from .loops.turns import run_llm_turn, run_tool_call

    config = state.config
    common: dict[str, Any] = {"max_retries": config.job_max_retries, "min_backoff": 1000,
                              "max_backoff": 30000}
    if any(isinstance(m, TimeLimit) for m in state.broker.middleware):
        # dramatiq's TimeLimit kills a thread asynchronously, possibly mid-commit.
        # Turn length is bounded by our own leases and max_duration instead.
        common["time_limit"] = NO_TIME_LIMIT_MS

    def llm_turn(loop_id: int) -> None:
        run_llm_turn(state, loop_id)

    def tool_call(tool_call_id: int, execution_token: str,
                  reaper_lease_token: str | None = None) -> None:
        run_tool_call(state, tool_call_id, execution_token, reaper_lease_token)

    def maintenance(task: str) -> None:
        from .durability import run_maintenance

        run_maintenance(state, task)

    broker = state.broker
    return {
        "llm_turn": dramatiq.Actor(llm_turn, broker=broker, actor_name="solidloop.llm_turn",
                                   queue_name=QUEUE_LLM, priority=0, options=dict(common)),
        "tool_call": dramatiq.Actor(tool_call, broker=broker, actor_name="solidloop.tool_call",
                                    queue_name=QUEUE_TOOL, priority=0, options=dict(common)),
        "maintenance": dramatiq.Actor(maintenance, broker=broker,
                                      actor_name="solidloop.maintenance",
                                      queue_name=QUEUE_MAINTENANCE, priority=10,
                                      options=dict(common)),
    }
