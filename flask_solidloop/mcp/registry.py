"""An agent's tools for one turn: its ``mcps`` entries resolved into one name space.

The registry validates every entry (``name`` is required; exactly one of
``toolset=``, ``url=``, ``command=``, ``transport=`` or ``agent=``, a child
agent: one tool that starts a loop of that agent, docs/guides/conversations.md),
applies whitelists and prefixes (``prefix__tool``), refuses name collisions
naming both servers, and checks ``required_tools``. It routes a call by its advertised name.
"""

from __future__ import annotations

import inspect
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..errors import AgentDefinitionError, ConfigurationError, McpTransportError
from .toolset import CallContext, ToolResult, Toolset
from .transport import IDEMPOTENCY_META_KEY, McpTransport

ENTRY_KINDS = ("toolset", "url", "command", "transport", "agent")
ENTRY_KEYS = {
    "name", "prefix", "tools", "required_tools", "toolset", "url", "command", "transport",
    "api_token", "api_token_env", "headers", "timeout", "env", "cwd",
    # OAuth 2.1 for a url= server: {"type": "oauth", ...} (mcp/oauth.py).
    "auth",
    # The key in SOLIDLOOP_RATE_LIMITS ("tool:<rate_limit>") of every tool of
    # the entry without one of its own (limits/).
    "rate_limit",
    # A child agent's entry: the agent (class or registered name), and the
    # tool's description (else the agent class's docstring).
    "agent", "description",
    # A command= entry: spawn a process per call instead of keeping one
    # (stateless), or keep one per worker thread rather than per process.
    "stateless", "concurrent",
}


class ToolServer(ABC):
    """One ``mcps`` entry, callable by tool name. Subclasses own their transport."""

    name: str

    @abstractmethod
    def tools(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def call(self, tool_name: str, arguments: Any, ctx: CallContext) -> ToolResult: ...


class ToolsetServer(ToolServer):
    """An in-process toolset: no network hop."""

    def __init__(self, name: str, toolset: Toolset) -> None:
        self.name = name
        self.toolset = toolset

    def tools(self) -> list[dict[str, Any]]:
        return self.toolset.list_tools()

    def call(self, tool_name: str, arguments: Any, ctx: CallContext) -> ToolResult:
        return self.toolset.call(tool_name, arguments, ctx)


def agent_name_of(agent: Any) -> str | None:
    """The registered name an ``agent=`` entry names: the string itself, or the
    class's ``agent_name`` (None for a class not registered)."""
    if isinstance(agent, str):
        return agent
    name = getattr(agent, "agent_name", None)
    return str(name) if name else None


def agent_tool(entry: dict[str, Any]) -> dict[str, Any]:
    """The one tool a child agent's entry offers: named as the entry, its input
    the child's first message, described by the entry or the agent's docstring."""
    agent = entry["agent"]
    description = entry.get("description")
    if not description and not isinstance(agent, str):
        description = inspect.getdoc(agent)
        if description and description == inspect.getdoc(_agent_base(agent)):
            description = None  # the base class's docstring says nothing of this agent
    if not description:
        description = (f"Delegate a task to the {agent_name_of(agent) or entry['name']!r} "
                       "agent and get its final answer.")
    return {"name": str(entry["name"]), "description": str(description),
            "inputSchema": {"type": "object", "properties": {"message": {
                "type": "string",
                "description": "The task for the agent, as its first user message: "
                               "everything it needs to know."}},
                "required": ["message"], "additionalProperties": False}}


def _agent_base(agent: type) -> type:
    """The first class of ``agent``'s bases named Agent (the library's base)."""
    for base in agent.__mro__[1:]:
        if base.__name__ == "Agent":
            return base
    return object


class AgentServer(ToolServer):
    """A child agent's entry: one tool whose call is a deferred call that starts
    a loop of the agent (loops/store/children.py) and takes its end as its
    result. Its call runs here only when it did not start a child (arguments
    that are not a JSON object): the model reads why."""

    def __init__(self, name: str, entry: dict[str, Any]) -> None:
        self.name = name
        self.entry = entry

    def tools(self) -> list[dict[str, Any]]:
        return [agent_tool(self.entry)]

    def call(self, tool_name: str, arguments: Any, ctx: CallContext) -> ToolResult:
        return ToolResult.error(
            f"the agent tool {tool_name!r} starts its agent only when called with "
            '{"message": "..."} (a JSON object with a non-empty message)')


class TransportServer(ToolServer):
    """A server behind an McpTransport (Streamable HTTP, stdio, or the host's own).

    Infrastructure failures come back as tool errors the model sees, classified
    ``infra:<kind>`` on the tool call so an operator can tell a dead server from a
    tool that refused its input.
    """

    def __init__(self, name: str, transport: McpTransport, *, owned: bool = True) -> None:
        self.name = name
        self.transport = transport
        self.owned = owned

    def tools(self) -> list[dict[str, Any]]:
        try:
            return self.transport.list_tools()
        finally:
            self.release()

    def session_state(self) -> dict[str, Any]:
        return self.transport.session_state()

    def release(self) -> None:
        """Free local resources after use, keeping a server-side session alive so
        the loop's stored session_state can resume it on a later call."""
        if not self.owned:
            return  # a host's transport= object: its lifetime is the host's business
        try:
            self.transport.close(end_session=False)  # type: ignore[call-arg]
        except TypeError:
            self.transport.close()
        except Exception:
            pass

    def call(self, tool_name: str, arguments: Any, ctx: CallContext) -> ToolResult:
        if not isinstance(arguments, dict):
            return ToolResult.error(
                f"arguments for tool {tool_name!r} must be a JSON object, "
                f"got {type(arguments).__name__}")
        meta = {IDEMPOTENCY_META_KEY: ctx.idempotency_key} if ctx.idempotency_key else None
        try:
            return self.transport.call_tool(tool_name, arguments, meta=meta)
        except McpTransportError as exc:
            self.release()
            result = ToolResult.error(
                f"the tool server {self.name!r} could not run {tool_name!r} "
                f"({exc.kind}): {exc}")
            result.error_kind = f"infra:{exc.kind}"
            return result


def make_server(entry: dict[str, Any], session_state: dict[str, Any] | None = None) -> ToolServer:
    """The ToolServer for one validated ``mcps`` entry; ``session_state`` resumes
    an HTTP session the loop stored earlier."""
    name = str(entry["name"])
    if entry.get("toolset") is not None:
        return ToolsetServer(name, entry["toolset"])
    if entry.get("agent") is not None:
        return AgentServer(name, entry)
    if entry.get("transport") is not None:
        return TransportServer(name, entry["transport"], owned=False)
    timeout = float(entry.get("timeout") or 60)
    if entry.get("url") is not None and entry.get("auth") is not None:
        from .http_transport import HttpTransport
        from .oauth import oauth_server

        return oauth_server(entry, lambda token, state: HttpTransport(
            entry["url"], headers=entry.get("headers"), api_token=token, timeout=timeout,
            session_state=state, server_name=name), session_state or None)
    if entry.get("url") is not None:
        from .http_transport import HttpTransport

        token = entry.get("api_token")
        if token is None and entry.get("api_token_env"):
            token = os.environ.get(entry["api_token_env"])
            if not token:
                raise ConfigurationError(
                    entry["api_token_env"], "(unset)",
                    f"the mcps entry {name!r} reads its token from this environment "
                    "variable, but it is unset or empty in the worker's environment")
        return TransportServer(name, HttpTransport(
            entry["url"], headers=entry.get("headers"), api_token=token, timeout=timeout,
            session_state=session_state or None, server_name=name))
    from .stdio_transport import StdioTransport

    return TransportServer(name, StdioTransport(
        entry["command"], env=entry.get("env"), cwd=entry.get("cwd"), timeout=timeout,
        server_name=name, stateless=bool(entry.get("stateless", False)),
        concurrent=bool(entry.get("concurrent", True))))


@dataclass(frozen=True)
class ToolRoute:
    advertised_name: str
    server_name: str
    tool_name: str
    definition: dict[str, Any]
    server: ToolServer


def validate_entry(entry: Any, agent: str) -> str:
    """Check one ``mcps`` entry's shape and return its kind."""
    if not isinstance(entry, dict):
        raise AgentDefinitionError(
            f"agent {agent!r}: each mcps entry must be a dict, got {type(entry).__name__}"
        )
    if not entry.get("name"):
        raise AgentDefinitionError(
            f"agent {agent!r}: every mcps entry needs a name, e.g. "
            "{'name': 'search', 'toolset': search}"
        )
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {entry['name']!r} has unknown key(s) "
            f"{', '.join(unknown)}; known: {', '.join(sorted(ENTRY_KEYS))}"
        )
    kinds = [k for k in ENTRY_KINDS if entry.get(k) is not None]
    if len(kinds) != 1:
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {entry['name']!r} must have exactly one of "
            f"toolset=, url=, command=, transport=, agent= (found: {', '.join(kinds) or 'none'})"
        )
    kind = kinds[0]
    name = entry["name"]
    if kind == "url" and not str(entry["url"]).startswith(("http://", "https://")):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {name!r}: url must start with http:// or https://, "
            f"got {entry['url']!r}")
    if kind == "command" and not entry["command"]:
        raise AgentDefinitionError(f"agent {agent!r}: mcps entry {name!r}: command is empty")
    for flag in ("stateless", "concurrent"):
        if flag in entry and kind != "command":
            raise AgentDefinitionError(
                f"agent {agent!r}: mcps entry {name!r}: {flag}= applies to command= "
                "(stdio) entries only; remove it")
        if flag in entry and not isinstance(entry[flag], bool):
            raise AgentDefinitionError(
                f"agent {agent!r}: mcps entry {name!r}: {flag}= must be True or False, "
                f"got {entry[flag]!r}")
    if kind == "transport" and not isinstance(entry["transport"], McpTransport):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {name!r}: transport= must implement "
            "list_tools(), call_tool(), session_state() and close() (see mcp/transport.py)")
    if kind == "toolset" and not isinstance(entry["toolset"], Toolset):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {entry['name']!r}: toolset= must be a Toolset, "
            f"got {type(entry['toolset']).__name__}"
        )
    if kind == "agent" and not (
            (isinstance(entry["agent"], str) and entry["agent"].strip())
            or (isinstance(entry["agent"], type) and hasattr(entry["agent"], "agent_name"))):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {name!r}: agent= must be an Agent class or a "
            f"registered agent's name, got {entry['agent']!r}")
    if kind == "agent" and not agent_name_of(entry["agent"]):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {name!r}: agent {entry['agent'].__name__} is not "
            "registered; decorate it with @solidloop.agent('name')")
    if entry.get("auth") is not None:
        from .oauth import validate_auth

        validate_auth(entry["auth"], agent=agent, name=str(name), has_url=kind == "url",
                      has_static_token=bool(entry.get("api_token") or entry.get("api_token_env")))
    if entry.get("description") is not None and not isinstance(entry["description"], str):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {name!r}: description must be a str")
    return kind


class ToolRegistry:
    """The tools an agent advertises to the model, keyed by advertised name."""

    def __init__(self, routes: list[ToolRoute]) -> None:
        self.routes = {route.advertised_name: route for route in routes}
        self.new_snapshots: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}

    @classmethod
    def build(cls, mcps: list[dict[str, Any]], *, agent: str, remote: bool = True,
              snapshots: dict[str, list[dict[str, Any]]] | None = None) -> ToolRegistry:
        """Resolve every entry. With ``remote=False`` only in-process toolsets are
        listed and remote entries are checked for shape alone (no network).

        ``snapshots`` maps a remote server's name to the tool list a loop already
        saw: those servers are not asked again. Servers listed now are reported
        in ``new_snapshots`` (tools and session state) for the caller to persist.
        """
        routes: dict[str, ToolRoute] = {}
        new_snapshots: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
        seen_servers: set[str] = set()
        for entry in mcps:
            kind = validate_entry(entry, agent)
            server_name = str(entry["name"])
            if server_name in seen_servers:
                raise AgentDefinitionError(
                    f"agent {agent!r}: two mcps entries are named {server_name!r}; "
                    "names must be unique"
                )
            seen_servers.add(server_name)
            if kind == "toolset":
                server: ToolServer = ToolsetServer(server_name, entry["toolset"])
            elif kind == "agent":
                server = AgentServer(server_name, entry)
            elif not remote:
                # start() validates shapes only: it never reaches out to a server.
                continue
            else:
                server = make_server(entry)
            if kind not in ("toolset", "agent") and snapshots is not None \
                    and server_name in snapshots:
                listed = snapshots[server_name]
            else:
                listed = server.tools()
                if isinstance(server, TransportServer):
                    new_snapshots[server_name] = (listed, server.session_state())
            available = {tool["name"]: tool for tool in listed}
            whitelist = entry.get("tools")
            if whitelist is not None:
                missing = [t for t in whitelist if t not in available]
                if missing:
                    raise AgentDefinitionError(
                        f"agent {agent!r}: mcps entry {server_name!r} whitelists tool(s) "
                        f"{', '.join(missing)} that server {server_name!r} does not offer; "
                        f"it offers: {', '.join(available) or 'nothing'}"
                    )
                available = {name: available[name] for name in whitelist}
            for required in entry.get("required_tools") or []:
                if required not in available:
                    raise AgentDefinitionError(
                        f"agent {agent!r}: required tool {required!r} is not offered by "
                        f"server {server_name!r}; it offers: {', '.join(available) or 'nothing'}"
                    )
            prefix = entry.get("prefix")
            for tool_name, definition in available.items():
                advertised = f"{prefix}__{tool_name}" if prefix else tool_name
                if advertised in routes:
                    other = routes[advertised].server_name
                    raise AgentDefinitionError(
                        f"agent {agent!r}: tool name {advertised!r} is offered by both "
                        f"{other!r} and {server_name!r}; add prefix= to one of the entries"
                    )
                routes[advertised] = ToolRoute(
                    advertised_name=advertised,
                    server_name=server_name,
                    tool_name=tool_name,
                    definition={**definition, "name": advertised},
                    server=server,
                )
        registry = cls(list(routes.values()))
        registry.new_snapshots = new_snapshots
        return registry

    @property
    def names(self) -> list[str]:
        return list(self.routes)

    def definitions(self) -> list[dict[str, Any]]:
        return [route.definition for route in self.routes.values()]

    def resolve(self, name: str) -> ToolRoute | None:
        return self.routes.get(name)

    def call(self, name: str, arguments: Any, ctx: CallContext) -> ToolResult:
        route = self.routes.get(name)
        if route is None:
            return ToolResult.error(
                f"unknown tool {name!r}; available tools: {', '.join(self.routes) or 'none'}"
            )
        return route.server.call(route.tool_name, arguments, ctx)


def call_on_server(
    mcps: list[dict[str, Any]], server_name: str, tool_name: str, arguments: Any,
    ctx: CallContext, session_state: dict[str, Any] | None = None,
) -> tuple[ToolResult, dict[str, Any] | None] | None:
    """Call ``tool_name`` on the entry named ``server_name`` without listing any
    server first (the tool turn already knows the route).

    Returns the result and, for a remote server, its session state after the
    call (to store when it changed); None if no entry has that name.
    """
    for entry in mcps:
        if str(entry.get("name")) == server_name:
            server = make_server(entry, session_state)
            try:
                result = server.call(tool_name, arguments, ctx)
            finally:
                if isinstance(server, TransportServer):
                    server.release()
            state = server.session_state() if isinstance(server, TransportServer) else None
            return result, state
    return None
