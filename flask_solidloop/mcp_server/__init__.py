"""The MCP server blueprint: toolsets (and agents) exposed to outside MCP clients.

This package owns the server side of MCP, apart from the client side in
flask_solidloop/mcp/: :func:`build_blueprint` (what
``SolidLoop.mcp_blueprint(...)`` returns), the methods it answers
(:mod:`.protocol`), the Streamable HTTP glue in a Flask view (:mod:`.http`),
Host/Origin rules and redaction (:mod:`.security`), the start/status tools
of agents exposed as tools (:mod:`.agents`, with :class:`ExposedAgent`, the
host's say over an agent's start tool), the same agents as MCP tasks
(:mod:`.tasks`, the extension's wire; :class:`.agents.LoopTasks`, its loops),
a toolset's ``task=`` tools as tasks run by the workers (:mod:`.tooltasks`),
and OAuth, the blueprint as a resource server of an outside authorization
server (:mod:`.oauth`, with :class:`OAuthResource`). Sessions and wire-log
events are written by :mod:`.store`; loops are started through the Agent API
and read through loops.queries. See docs/guides/mcp_server.md and
docs/decisions/0011-mcp-server-blueprint.md, 0041-mcp-server-oauth.md and
0043-agents-as-mcp-tasks.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from flask import Blueprint

from ..errors import ConfigurationError
from ..jobs import Queue
from ..mcp.toolset import Toolset
from . import security
from .agents import ExposedAgent, LoopTasks, agent_toolset
from .http import Auth, McpEndpoint
from .oauth import Introspection, OAuthPrincipal, OAuthResource, attach
from .protocol import ServerSpec, report_progress
from .tasks import TaskBackend
from .tooltasks import TaskBackends, ToolTasks, register

#: What a host imports from here (docs/index.md, "The public API"); the blueprint
#: itself comes from ``SolidLoop.mcp_blueprint``, which calls :func:`build_blueprint`.
__all__ = ["ExposedAgent", "Introspection", "OAuthPrincipal", "OAuthResource",
           "report_progress"]

_BLUEPRINT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


def build_blueprint(
    toolsets: Iterable[Toolset],
    *,
    auth: Auth | None,
    name: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    allowed_origins: Iterable[str] | None = None,
    agents: Iterable[Any] = (),  # Agent subclasses or ExposedAgent entries
    principal_label: Callable[[Any], str] | None = None,
    instructions: str | None = None,
    expose_errors: bool = False,
    oauth: OAuthResource | None = None,
    task_queue: Queue | None = None,
) -> Blueprint:
    """A Flask blueprint serving ``toolsets`` (and ``agents``) over Streamable HTTP.

    Fails closed: without ``auth`` or ``oauth`` nothing is built. Tool names must be unique
    across what one blueprint exposes. See ``SolidLoop.mcp_blueprint``.
    """
    toolsets = list(toolsets)
    agents = list(agents)
    if oauth is not None and not isinstance(oauth, OAuthResource):
        raise ConfigurationError(
            "oauth", type(oauth).__name__,
            "must be OAuthResource(resource=..., authorization_servers=[...]) from "
            "flask_solidloop.mcp_server")
    if oauth is not None and auth is not None:
        raise ConfigurationError(
            "auth", auth,
            "mcp_blueprint takes auth= or oauth=, not both: with oauth= the validated "
            "token is the principal (map it to your user in the tools, ctx.principal)")
    if oauth is None and (auth is None or not callable(auth)):
        raise ConfigurationError(
            "auth", auth,
            "mcp_blueprint needs auth= or oauth=: a callable auth(token, request) returning "
            "the caller's principal, or None to answer 401 (the endpoint is never open by "
            "default), or oauth=OAuthResource(...) for tokens of an authorization server; "
            "for a local test server pass auth=lambda token, request: 'local'")
    if not toolsets and not agents:
        raise ConfigurationError(
            "toolsets", toolsets,
            "mcp_blueprint needs at least one Toolset (positional) or agents=[...] to expose")
    for toolset in toolsets:
        if not isinstance(toolset, Toolset):
            raise ConfigurationError(
                "toolsets", toolset,
                "mcp_blueprint takes Toolset objects positionally: "
                "mcp_blueprint(search, auth=...)")
    if name is None:
        name = "mcp_" + "_".join(t.name for t in toolsets) if toolsets else "mcp_agents"
        name = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:100]
    if not isinstance(name, str) or not _BLUEPRINT_NAME.match(name):
        raise ConfigurationError(
            "name", name, "must match ^[A-Za-z0-9_-]{1,100}$ (it names the blueprint, its "
            "sessions and its wire-log events)")

    def label_of(principal: Any) -> str:
        if principal_label is not None:
            return str(principal_label(principal))[:200]
        return security.principal_label(principal, None)

    if not isinstance(expose_errors, bool):
        raise ConfigurationError("expose_errors", expose_errors,
                                 "must be True or False (False: outside callers get a "
                                 "generic message with an error id for a raising tool)")
    exposed = list(toolsets)
    if agents:
        exposed.append(agent_toolset(name, agents, label_of))
    tools: dict[str, tuple[Toolset, str]] = {}
    for toolset in exposed:
        for definition in toolset:
            if definition.name in tools:
                other = tools[definition.name][0].name
                raise ConfigurationError(
                    "toolsets", toolset.name,
                    f"tool name {definition.name!r} is offered by both {other!r} and "
                    f"{toolset.name!r}; one blueprint needs unique tool names: rename one, "
                    "or expose the toolsets on two blueprints")
            tools[definition.name] = (toolset, definition.name)

    def _strings(option: str, values: Iterable[str] | None) -> tuple[str, ...] | None:
        if values is None:
            return None
        if isinstance(values, str):
            raise ConfigurationError(option, values, "must be a list of strings, not a string")
        listed = tuple(values)
        if not all(isinstance(v, str) and v for v in listed):
            raise ConfigurationError(option, listed, "must be a list of non-empty strings")
        return listed

    backends: list[TaskBackend] = [LoopTasks(agents, label_of)] if agents else []
    tool_tasks = None
    if any(toolset.get(tool).task is not None for toolset, tool in tools.values()):
        if task_queue is None:
            raise ConfigurationError(
                "task_queue", task_queue,
                "a tool declared with task= runs its tasks as jobs: build the blueprint "
                "with SolidLoop.mcp_blueprint (it passes the queue)")
        tool_tasks = ToolTasks(name, tools, label_of, task_queue)
        backends.append(tool_tasks)
        register(name, tools, expose_errors)
    endpoint = McpEndpoint(
        ServerSpec(name=name, tools=tools, instructions=instructions,
                   tasks=(backends[0] if len(backends) == 1
                          else TaskBackends(*backends) if backends else None),
                   expose_errors=expose_errors, tool_tasks=tool_tasks), auth=auth,
        allowed_hosts=_strings("allowed_hosts", allowed_hosts),
        allowed_origins=_strings("allowed_origins", allowed_origins),
        principal_label=principal_label, oauth=oauth,
    )
    blueprint = Blueprint(name, __name__)
    if oauth is not None:
        attach(blueprint, oauth)
    # strict_slashes=False: the prefix itself (/mcp/search) is served, no redirect.
    blueprint.add_url_rule("/", endpoint="mcp", view_func=endpoint,
                           methods=["GET", "POST", "DELETE"], strict_slashes=False)
    blueprint.mcp_endpoint = endpoint  # type: ignore[attr-defined]
    return blueprint
