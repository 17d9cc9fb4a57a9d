"""Per-app state: :class:`SolidLoopState` and :func:`get_state`, the only reader
of ``app.extensions["solidloop"]``.

``init_app`` builds one state per app and stores it there (Flask-SQLAlchemy's
habit: per-app state on the app, never on the extension object). Everything
below the extension (loops/, pipeline/, runtime/, maintenance/) receives the
state as an argument; nothing else reads ``current_app`` for it.

The state sits just above the queue, the lease renewer and the config in the
layer order, so it cannot name the agent base class or the pipeline. It types
agents with the :class:`AgentLike` protocol instead, which ``Agent``
implements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import dramatiq
from flask import Flask, current_app
from flask_sqlalchemy import SQLAlchemy

from .config import Config
from .errors import NotInitializedError, UnknownAgentError
from .leases import LeaseRenewer, RenewerSlot
from .queue.broker import PostgresBroker
from .queue.dispatch import Dispatcher

if TYPE_CHECKING:
    from .llm.types import ProviderSettings
    from .models import Loop

EXTENSION_KEY = "solidloop"

__all__ = ["EXTENSION_KEY", "AgentLike", "AgentRegistry", "SolidLoopState", "get_state"]


class AgentLike(Protocol):
    """What the lower layers use of an agent (``flask_solidloop.Agent`` implements it)."""

    agent_name: str | None

    def option(self, name: str) -> Any: ...
    def provider(self) -> ProviderSettings: ...
    def tool_entries(self) -> list[dict[str, Any]]: ...
    def effective_max_duration(self, default: int) -> int: ...
    def validate(self) -> None: ...
    def configure_llm_middlewares(self, builder: Any) -> None: ...
    def configure_tool_middlewares(self, builder: Any) -> None: ...
    def approval_policy(self, tool_name: str, arguments: dict[str, Any], ctx: Any) -> bool: ...
    def on_wait(self, request: Any, session: Any) -> None: ...
    def mcp_principal(self) -> Any: ...


class AgentRegistry(Protocol):
    """What the state needs of the extension object: its registry and hooks."""

    # Read-only views, typed loosely: state.py sits below agent.py and pipeline/.
    @property
    def agents(self) -> Mapping[str, Any]: ...
    @property
    def llm_middleware_hooks(self) -> Sequence[Callable[[Any], None]]: ...
    @property
    def tool_middleware_hooks(self) -> Sequence[Callable[[Any], None]]: ...
    @property
    def loop_end_hooks(self) -> Sequence[tuple[str | None, Callable[[Any, Any], Any]]]: ...
    @property
    def loop_archive_hooks(self) -> Sequence[Callable[[Any, Any], Any]]: ...
    @property
    def subject_budget_hook(self) -> Callable[[Any, Any], Any] | None: ...


@dataclass
class SolidLoopState:
    """Everything flask-solidloop knows about one app."""

    extension: AgentRegistry
    app: Flask
    db: SQLAlchemy
    config: Config
    database_url: str
    broker: PostgresBroker
    leases: RenewerSlot
    actors: dict[str, dramatiq.Actor] = field(default_factory=dict)
    dispatch: Dispatcher = field(init=False)
    extras: dict[str, Any] = field(default_factory=dict)
    #: Unix time of this process's last successful reap / prune (process-local).
    last_reaped_at: float | None = None
    last_pruned_at: float | None = None

    def bind_actors(self, actors: dict[str, dramatiq.Actor]) -> None:
        self.actors = actors
        self.dispatch = Dispatcher(self.broker, actors,
                                   continuation_first=self.config.continuation_first)

    def renewer(self) -> LeaseRenewer:
        """This process's lease renewer (one per process, created on first use)."""
        return self.leases.get()

    def stop_renewer(self) -> None:
        self.leases.stop()

    def tool_timeout_seconds(self, agent: AgentLike) -> float:
        """How long the agent's tool calls may run: SOLIDLOOP_DEFAULT_TOOL_TIMEOUT,
        or its slowest server's or tool's own timeout if that is longer."""
        timeouts: list[float] = []
        for entry in agent.tool_entries():
            if entry.get("url") is not None:
                timeouts.append(float(entry.get("timeout") or 60))
            elif entry.get("toolset") is not None:
                if entry.get("timeout"):
                    timeouts.append(float(entry["timeout"]))
                timeouts += [definition.timeout for definition in entry["toolset"].definitions()
                             if definition.timeout]
        return max([float(self.config.default_tool_timeout), *timeouts])

    def agent_class(self, name: str) -> Any:
        """The Agent subclass registered as ``name`` (UnknownAgentError if none)."""
        try:
            return self.extension.agents[name]
        except KeyError:
            raise UnknownAgentError(name, list(self.extension.agents)) from None

    def agent_for(self, name: str, loop: Loop | None = None) -> AgentLike:
        agent: AgentLike = self.agent_class(name)(loop)
        return agent


def get_state(app: Flask | None = None) -> SolidLoopState:
    """The state of ``app`` (default: the current app).

    Raises NotInitializedError, naming the fix, when there is no app context
    or the app never ran ``init_app``.
    """
    if app is None:
        try:
            app = current_app._get_current_object()  # type: ignore[attr-defined]
        except RuntimeError:
            raise NotInitializedError(
                "flask-solidloop needs an app context here: use `with app.app_context():` "
                "(or pass the app)"
            ) from None
    assert app is not None
    state: SolidLoopState | None = app.extensions.get(EXTENSION_KEY)
    if state is None:
        raise NotInitializedError(
            f"flask-solidloop is not initialised on app {app.name!r}. Did you forget "
            "solidloop.init_app(app, db=db)?"
        )
    return state
