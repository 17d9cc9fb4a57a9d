"""The Flask extension: ``SolidLoop(app=None, db=None)`` and ``init_app``.

Per-app state (validated config, broker, actors, dispatcher) lives in
``app.extensions["solidloop"]`` as a :class:`~flask_solidloop.state.SolidLoopState`
(read it with :func:`~flask_solidloop.state.get_state`); the ``SolidLoop``
object itself only holds what is app-independent: the agent registry and the
global middleware hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, overload

from dramatiq.middleware import Retries
from flask import Blueprint, Flask, Response
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.engine import make_url

from .agent import Agent
from .config import Config
from .errors import AgentDefinitionError, ConfigurationError, InvalidArgumentError, SetupError
from .jobs import JobRegistry, Queue
from .leases import RenewerSlot
from .loops import control, traces
from .loops.store import LoopArchiveHook, LoopEndHook
from .maintenance.janitor import prune_if_due, runs_in_workers
from .maintenance.reaper import reap
from .maintenance.rollup import rollup
from .mcp.toolset import Toolset
from .models import Loop, ToolCall
from .pipeline.builder import Builder
from .pooler import watch_first_connect
from .queue.broker import PostgresBroker
from .queue.middleware import (
    AppContextMiddleware,
    CurrentJobMiddleware,
    LeaseRenewerMiddleware,
    LogRedactionMiddleware,
    PeriodicTaskMiddleware,
    TracingMiddleware,
    WorkerRegistryMiddleware,
)
from .queue.middleware.periodic import (
    JanitorTaskMiddleware,
    ReaperTaskMiddleware,
    RollupTaskMiddleware,
)
from .runtime.actors import declare_actors
from .runtime.llm_io import LlmIoMiddleware
from .runtime.mcp_servers import StdioServersMiddleware
from .state import EXTENSION_KEY, SolidLoopState
from .streaming import StreamEvent
from .telemetry import tracing
from .urls import install_log_redaction, libpq_url, redact_url

if TYPE_CHECKING:
    from .mcp_server import ExposedAgent, OAuthResource

A = TypeVar("A", bound=type[Agent])
StackHook = Callable[[Builder], None]
#: ``hook(subject_type, subject_id)``: the subject's budget dict, or None.
SubjectBudgetHook = Callable[[str | None, str | None], Any]

__all__ = ["SolidLoop", "SolidLoopState"]


class SolidLoop:
    """Flask extension that runs LLM agents as durable dramatiq jobs on PostgreSQL."""

    def __init__(
        self,
        app: Flask | None = None,
        db: SQLAlchemy | None = None,
        *,
        configure_llm_middlewares: StackHook | None = None,
        configure_tool_middlewares: StackHook | None = None,
        on_loop_archive: LoopArchiveHook | None = None,
    ) -> None:
        self.db = db
        self.agents: dict[str, type[Agent]] = {}
        self.llm_middleware_hooks: list[StackHook] = []
        self.tool_middleware_hooks: list[StackHook] = []
        #: ``(agent name or None, hook)``: run in the transaction that ends a loop.
        self.loop_end_hooks: list[tuple[str | None, LoopEndHook]] = []
        #: ``hook(archived, session)``: run before the loop retention deletes a loop.
        self.loop_archive_hooks: list[LoopArchiveHook] = []
        #: The host's ``subject_budget(subject_type, subject_id)``, if it set one.
        self.subject_budget_hook: SubjectBudgetHook | None = None
        if configure_llm_middlewares:
            self.llm_middleware_hooks.append(configure_llm_middlewares)
        if configure_tool_middlewares:
            self.tool_middleware_hooks.append(configure_tool_middlewares)
        if on_loop_archive is not None:
            self.on_loop_archive(on_loop_archive)
        #: The host's lazy actors, RQ-style queues and periodic schedules.
        self.jobs = JobRegistry()
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

    def subject_budget(self, hook: SubjectBudgetHook) -> SubjectBudgetHook:
        """Register ``hook(subject_type, subject_id)`` returning the subject's budget
        (``{"cost_usd": 5.0, "window": 86400}``, any of ``cost_usd``, ``tokens``,
        ``llm_turns``, ``tool_calls``) or None for none: it replaces
        SOLIDLOOP_SUBJECT_BUDGET. Called by workers before each LLM request of a
        loop with a subject, so keep it quick (a dict lookup, a cached row).
        Use as ``@solidloop.subject_budget``."""
        if not callable(hook):
            raise InvalidArgumentError(
                f"@solidloop.subject_budget must decorate a function "
                f"hook(subject_type, subject_id), got {hook!r}")
        self.subject_budget_hook = hook
        return hook

    @overload
    def on_loop_end(self, agent: LoopEndHook) -> LoopEndHook: ...

    @overload
    def on_loop_end(self, agent: str | type[Agent] | None = None
                    ) -> Callable[[LoopEndHook], LoopEndHook]: ...

    def on_loop_end(self, agent: str | type[Agent] | LoopEndHook | None = None) -> Any:
        """Register ``hook(loop, session)``, called inside the transaction that
        ends a loop (completed, failed, stopped), for the loops of ``agent`` (a
        registered name or Agent class; None: every agent's). What it writes
        through ``session`` (a job enqueued with ``session=session``, a row)
        commits with the ending or not at all; an ending that a newer
        generation pre-empted runs no hook. It runs in a savepoint: if it
        raises, its writes are undone, the error is logged, and the loop ends
        all the same. Use as ``@solidloop.on_loop_end`` or
        ``@solidloop.on_loop_end(agent="triage")``."""
        if callable(agent) and not isinstance(agent, type):
            self.loop_end_hooks.append((None, agent))
            return agent
        name = self._agent_name_of(agent)

        def register(hook: LoopEndHook) -> LoopEndHook:
            if not callable(hook):
                raise InvalidArgumentError(
                    f"@solidloop.on_loop_end must decorate a function hook(loop, session), "
                    f"got {hook!r}")
            self.loop_end_hooks.append((name, hook))
            return hook

        return register

    def on_loop_archive(self, hook: LoopArchiveHook) -> LoopArchiveHook:
        """Register ``hook(archived, session)``, called for each ended loop that
        SOLIDLOOP_LOOP_RETENTION is about to delete, with an
        :class:`~flask_solidloop.ArchivedLoop` (the loop, its messages and tool
        calls as dicts of their columns). It runs inside the deleting
        transaction, in a savepoint, while the loop's row is locked: what it
        writes through ``session`` commits with the delete (exactly once); a
        copy sent elsewhere is at least once (a crash before the commit keeps
        the loop for the next pass). If it raises, its writes are undone and
        that loop is kept (tried again at the next pass); the rest of the batch
        goes. It must not commit or roll back ``session``. Use as ``@solidloop.on_loop_archive`` or
        ``SolidLoop(on_loop_archive=hook)``."""
        if not callable(hook):
            raise InvalidArgumentError(
                f"@solidloop.on_loop_archive must decorate a function hook(archived, "
                f"session), got {hook!r}")
        self.loop_archive_hooks.append(hook)
        return hook

    @staticmethod
    def _agent_name_of(agent: str | type[Agent] | None) -> str | None:
        if agent is None or isinstance(agent, str):
            return agent
        if isinstance(agent, type) and issubclass(agent, Agent):
            name = getattr(agent, "agent_name", None)
            if isinstance(name, str):
                return name
            raise InvalidArgumentError(
                f"{agent.__qualname__} is not registered: decorate it with "
                "@solidloop.agent(name) before naming it in on_loop_end(agent=...)")
        raise InvalidArgumentError(
            f"on_loop_end(agent=...) takes an agent's registered name or its class, "
            f"got {agent!r}")

    # -- the host's jobs ----------------------------------------------------------------

    @property
    def actor(self) -> Any:
        """``@solidloop.actor`` / ``@solidloop.actor(queue_name=..., max_retries=...)``:
        a dramatiq actor declared at import and bound to each app's broker at init_app.
        ``send_with_options(session=db.session)`` commits the job with that session."""
        return self.jobs.actor

    def queue(self, name: str = "default") -> Queue:
        """An RQ-style queue: ``solidloop.queue("default").enqueue(f, *args)``."""
        return self.jobs.queue(name)

    @property
    def periodic(self) -> Any:
        """``@solidloop.periodic("*/5 * * * *")`` or ``@solidloop.periodic(every=timedelta(...))``
        on a function or lazy actor: one job per period across all workers."""
        return self.jobs.periodic

    def results_backend(self, app: Flask | None = None) -> Any:
        """The dramatiq Results backend (on PostgreSQL) of ``app`` (default: current app)."""
        from .state import get_state

        return get_state(app).extras["jobs.results"]

    # -- waiting tool calls --------------------------------------------------------------

    def pending_approvals(self, *, agent: str | None = None, limit: int = 200,
                          session: Any = None) -> list[ToolCall]:
        """Tool calls of every loop (of ``agent``) that await an approval, oldest
        first: a staff page's list (decide each through ``Agent(call.loop_id)``)."""
        from .state import get_state

        return control.pending_calls(get_state(), agent=agent, waits_for="approval",
                                     limit=limit, session=session)

    def pending_calls(self, *, agent: str | None = None, limit: int = 200,
                      session: Any = None) -> list[ToolCall]:
        """Tool calls of every loop (of ``agent``) that await an approval or a
        result, oldest first."""
        from .state import get_state

        return control.pending_calls(get_state(), agent=agent, limit=limit, session=session)

    # -- a loop's event stream ----------------------------------------------------------

    def events(self, loop_id: int, after: str | int | None = None,
               timeout: float | None = None, *, reasoning: bool = False,
               app: Flask | None = None) -> Iterator[StreamEvent]:
        """The loop's events after ``after`` (an event's ``id``; None: from the
        start), in order, as they commit: ``status_changed``,
        ``message_started``, ``text_delta``, ``tool_call``, ...
        (docs/guides/streaming.md). It ends after ``completed`` or ``failed``
        when nothing follows, or once ``timeout`` seconds have passed; while it
        waits it holds no database connection. ``reasoning`` adds the
        ``reasoning_delta`` events of agents that set ``stream_reasoning``. A loop
        that does not exist (never did, or SOLIDLOOP_LOOP_RETENTION deleted it)
        raises InvalidArgumentError."""
        from .state import get_state
        from .streaming import follow, parse_after, require_loop

        state = get_state(app)
        start = parse_after(after)
        require_loop(state, loop_id)
        stream = follow(state, loop_id, start, seconds=timeout,
                        heartbeat=state.config.stream_heartbeat, reasoning=reasoning)
        return (event for event in stream if event is not None)

    def sse_response(self, loop_id: int, *, authorize: Callable[[Loop], bool] | None = None,
                     after: str | int | None = None, reasoning: bool = False,
                     render: Callable[[StreamEvent], Any] | None = None,
                     seconds: float | None = None, heartbeat: float | None = None) -> Response:
        """A Server-Sent Events response of the loop's events for a Flask view:
        it resumes after the browser's ``Last-Event-ID`` (or ``?last_event_id=``,
        or ``after``), sends heartbeats, ends after SOLIDLOOP_STREAM_SECONDS (the
        browser reconnects where it was) or with an ``end`` event when the loop
        has finished. ``authorize(loop)`` returning False answers 403; a loop
        that does not exist, 404. ``render(event)`` makes the ``data:`` of an
        event (an HTML fragment, say; None skips it); JSON by default."""
        from .state import get_state
        from .streaming import sse_response

        return sse_response(get_state(), loop_id, authorize=authorize, after=after,
                            reasoning=reasoning, render=render, seconds=seconds,
                            heartbeat=heartbeat)

    # -- the MCP server blueprint -------------------------------------------------------

    def mcp_blueprint(
        self,
        *toolsets: Toolset,
        auth: Callable[[str | None, Any], Any] | None = None,
        name: str | None = None,
        allowed_hosts: Iterable[str] | None = None,
        allowed_origins: Iterable[str] | None = None,
        agents: Iterable[type[Agent] | ExposedAgent] = (),
        principal_label: Callable[[Any], str] | None = None,
        instructions: str | None = None,
        expose_errors: bool = False,
        oauth: OAuthResource | None = None,
        tasks_queue: str = "default",
    ) -> Blueprint:
        """A Flask blueprint exposing ``toolsets`` (and ``agents``) to outside MCP
        clients over Streamable HTTP; register it at the prefix you pick::

            app.register_blueprint(solidloop.mcp_blueprint(search, auth=check_token),
                                   url_prefix="/mcp/search")

        ``auth(token, request)`` is required (fail closed): it returns the caller's
        principal, or None for a 401. Handlers then see ``ctx.principal``. Only the
        toolsets passed are exposed; ``agents=[Support]`` adds ``start_support`` /
        ``status_support`` tools; ``ExposedAgent(Support, arguments=...,
        on_start=...)`` lets the host map the caller's principal and arguments
        to the loop's subject and state; on 2026-07-28 a client that declares the
        Tasks extension gets each agent's start as an MCP task. ``oauth=OAuthResource(
        resource=..., authorization_servers=[...])`` replaces ``auth``: bearer tokens of
        an outside authorization server (JWT or introspected), RFC 9728 metadata at the
        app's ``/.well-known/oauth-protected-resource/<path>``. ``allowed_hosts`` /
        ``allowed_origins`` default to localhost (any port) plus the app's
        ``SERVER_NAME``. A tool that raises answers outside callers a generic
        message with an error id (logged with the exception) unless
        ``expose_errors=True``. A tool declared with ``task="optional"`` or
        ``task="required"`` runs a task-augmented call (2026-07-28, the Tasks
        extension declared) as an MCP task: a job on ``tasks_queue`` that a
        worker runs. See docs/guides/mcp_server.md.
        """
        from .mcp_server import ExposedAgent, build_blueprint

        agents = list(agents)
        for entry in agents:
            agent_cls = entry.agent if isinstance(entry, ExposedAgent) else entry
            if not (isinstance(agent_cls, type) and issubclass(agent_cls, Agent)):
                raise AgentDefinitionError(
                    "mcp_blueprint(agents=...) takes Agent subclasses (or ExposedAgent("
                    f"Agent, ...) entries), got {agent_cls!r}")
            if agent_cls._extension is not self:
                raise AgentDefinitionError(
                    f"{agent_cls.__name__} is not registered on this SolidLoop; decorate it "
                    "with @solidloop.agent('name') first")
        return build_blueprint(toolsets, auth=auth, name=name, allowed_hosts=allowed_hosts,
                               allowed_origins=allowed_origins, agents=agents,
                               principal_label=principal_label, instructions=instructions,
                               oauth=oauth, expose_errors=expose_errors,
                               task_queue=self.jobs.queue(tasks_queue))

    # -- blueprints -----------------------------------------------------------------

    def admin_blueprint(self, *, authorize: Callable[[Any], bool] | None,
                        subject_resolver: Callable[[Any], Any] | None = None,
                        name: str = "solidloop_admin", require_token: bool = False,
                        page_size: int = 50,
                        operator: Callable[[Any], str | None] | None = None) -> Any:
        """The admin UI as a blueprint: ``app.register_blueprint(bp, url_prefix="/admin")``.

        ``authorize(request) -> bool`` decides every request and must return
        True; without it (or when it raises) everything is denied.
        ``subject_resolver(loop)`` returns the subject's URL, or
        ``{"url": ..., "label": ...}``; only relative and http(s) URLs become
        links. ``require_token=True`` adds a signed CSRF token (needs
        ``app.secret_key``) on top of the Fetch-Metadata / Origin check.
        ``operator(request)`` names who acts, recorded as ``decided_by`` on the
        tool calls an operator approves or denies (default ``"admin"``).
        See docs/guides/admin.md.
        """
        from .admin import create_blueprint

        return create_blueprint(authorize=authorize, subject_resolver=subject_resolver,
                                name=name, require_token=require_token, page_size=page_size,
                                operator=operator)

    # -- app binding --------------------------------------------------------------

    def init_app(self, app: Flask, db: SQLAlchemy | None = None) -> None:
        if EXTENSION_KEY in app.extensions:
            raise SetupError(
                "flask-solidloop is already initialised on this app; call init_app once"
            )
        db = db or self.db or _find_sqlalchemy(app)
        # Our dependencies log request URLs (credentials included) at INFO.
        install_log_redaction()
        config = Config.from_mapping(app.config)
        url = _check_urls(config, app.config.get("SQLALCHEMY_DATABASE_URI"))
        broker = PostgresBroker(
            url,
            job_lease=config.job_lease_seconds,
            poll_interval=config.poll_interval,
            idle_poll_interval=config.idle_poll_interval,
            max_deliveries=config.job_max_deliveries,
            promote_after=(float(config.first_turn_max_wait) if config.continuation_first
                           else None),
            fair_share_quantum=config.fair_share_quantum,
            session_url=str(app.config.get("SQLALCHEMY_DATABASE_URI")),
        )
        broker.add_middleware(CurrentJobMiddleware())
        broker.add_middleware(AppContextMiddleware(app))
        for middleware in broker.middleware:
            if isinstance(middleware, Retries):
                middleware.max_retries = config.job_max_retries
        state = SolidLoopState(extension=self, app=app, db=db, config=config, database_url=url,
                               broker=broker, leases=RenewerSlot(libpq_url(broker.url)))
        # Before the renewer's: a stopping worker drains its in-flight LLM calls
        # while their leases are still renewed (runtime/llm_io.py).
        broker.add_middleware(LlmIoMiddleware(state))
        # Kept stdio MCP servers are children of the worker process: stopped with it.
        broker.add_middleware(StdioServersMiddleware())
        broker.add_middleware(LeaseRenewerMiddleware(state.leases))
        broker.add_middleware(LogRedactionMiddleware())
        broker.add_middleware(TracingMiddleware())
        broker.add_middleware(WorkerRegistryMiddleware(
            libpq_url(broker.url), interval=config.worker_heartbeat,
            retention=config.worker_retention))
        for middleware in _maintenance_in_workers(state):
            broker.add_middleware(middleware)
        if config.metrics:
            broker.add_middleware(_metrics_middleware(state))
        state.bind_actors(declare_actors(state))
        self.jobs.bind(state)
        # Spans (docs/decisions/0033-tracing.md): content capture, and each ended
        # run's invoke_agent span in the process that ended it.
        tracing.configure(capture=config.otel_capture_content)
        traces.connect(app, state)
        if config.pooler_check:
            _watch_engine(app, db, config)
        if config.oauth_key:
            # OAuth-protected MCP servers (docs/decisions/0040-mcp-client-oauth.md):
            # their tokens live beside our tables, reached through the session's URL.
            from .mcp import oauth as mcp_oauth

            mcp_oauth.configure(database_url=str(app.config["SQLALCHEMY_DATABASE_URI"]),
                                keys=config.oauth_key,
                                refresh_margin=config.oauth_refresh_margin,
                                sign_in_url=config.oauth_sign_in_url)
        app.extensions[EXTENSION_KEY] = state
        from .cli import solidloop_cli

        app.cli.add_command(solidloop_cli)


def _metrics_middleware(state: SolidLoopState) -> Any:
    """SOLIDLOOP_METRICS's middleware (runtime/metrics.py); refused, naming the
    extra, without prometheus-client."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise SetupError(
            "SOLIDLOOP_METRICS is on but prometheus-client is not installed: "
            "pip install 'flask-solidloop[metrics]'") from None
    from .runtime.metrics import metrics_middleware

    return metrics_middleware(state)


def _maintenance_in_workers(state: SolidLoopState) -> list[PeriodicTaskMiddleware]:
    """The reaper (every SOLIDLOOP_REAPER_INTERVAL seconds), the janitor
    (every SOLIDLOOP_JANITOR_INTERVAL seconds) and the charts' rollup (every
    SOLIDLOOP_ROLLUP_INTERVAL seconds), run by worker processes
    themselves, each by the fleet's leader for it: recovery and retention
    need nothing but workers."""
    def in_app_context(task: Callable[[SolidLoopState], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with state.app.app_context():
                try:
                    return task(state)
                finally:
                    state.db.session.remove()
        return run

    config = state.config
    tasks: list[PeriodicTaskMiddleware] = []
    # The reaper's leader recovers expired jobs each pass: the consumers of
    # every process need not (one pass per interval for the fleet).
    state.broker.recover_in_consumers = config.reaper_interval <= 0
    if config.reaper_interval > 0:
        tasks.append(ReaperTaskMiddleware("reaper", config.reaper_interval,
                                          in_app_context(reap), broker=state.broker))
    if runs_in_workers(config):
        tasks.append(JanitorTaskMiddleware("janitor", config.janitor_interval,
                                           in_app_context(prune_if_due), broker=state.broker))
    if config.rollup_interval > 0:
        tasks.append(RollupTaskMiddleware("rollup", config.rollup_interval,
                                          in_app_context(rollup), broker=state.broker))
    return tasks


def _watch_engine(app: Flask, db: SQLAlchemy, config: Config) -> None:
    """On the engine's first connection, log a line if it prepares statements
    behind a transaction-mode pooler (decision 0028; workers refuse instead)."""
    try:
        with app.app_context():
            engine = db.engine
    except Exception:  # SQLAlchemy not initialised on this app yet: nothing to watch
        return
    watch_first_connect(engine, direct_url=(str(config.database_url)
                                            if config.database_url else None))


def _check_urls(config: Config, session_url: Any) -> str:
    """Validate the session URL (jobs are written on its connections) and the
    broker URL (consumers LISTEN on it); return the broker URL."""
    if not session_url:
        raise ConfigurationError(
            "SQLALCHEMY_DATABASE_URI", session_url,
            "flask-solidloop needs a PostgreSQL URL (postgresql+psycopg://...)",
        )
    session_url = str(session_url)
    if not _names_psycopg3(session_url):
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


def _names_psycopg3(url: str) -> bool:
    """Whether SQLAlchemy reaches ``url`` through psycopg 3: ``+psycopg`` said
    outright, or a bare ``postgresql://`` where SQLAlchemy's default driver for
    it is psycopg 3 (2.1 and later; 2.0's is psycopg2)."""
    scheme = url.split("://", 1)[0]
    if scheme in ("postgresql+psycopg", "postgres+psycopg"):
        return True
    if scheme != "postgresql":
        return False
    try:
        return make_url(url).get_dialect().driver == "psycopg"
    except Exception:  # an unparsable URL: refused with the message below
        return False


def _safe(url: str) -> str:
    return redact_url(url)


def _find_sqlalchemy(app: Flask) -> SQLAlchemy:
    db = app.extensions.get("sqlalchemy")
    if db is None:
        raise SetupError(
            "flask-solidloop needs Flask-SQLAlchemy: pass SolidLoop(app, db=db) or "
            "init_app(app, db=db), or initialise SQLAlchemy on the app first"
        )
    return db
