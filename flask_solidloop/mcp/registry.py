"""An agent's tools for one turn: its ``mcps`` entries resolved into one name space.

The registry validates every entry (``name`` is required; exactly one of
``toolset=``, ``url=``, ``command=`` or ``transport=``), applies whitelists and
prefixes (``prefix__tool``), refuses name collisions naming both servers, and
checks ``required_tools``. It routes a call by its advertised name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import AgentDefinitionError
from .toolset import CallContext, ToolResult, Toolset

ENTRY_KINDS = ("toolset", "url", "command", "transport")
ENTRY_KEYS = {
    "name", "prefix", "tools", "required_tools", "toolset", "url", "command", "transport",
    "api_token", "api_token_env", "headers", "timeout", "env", "cwd",
}


@dataclass(frozen=True)
class ToolRoute:
    advertised_name: str
    server_name: str
    tool_name: str
    definition: dict[str, Any]
    toolset: Toolset


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
            f"toolset=, url=, command=, transport= (found: {', '.join(kinds) or 'none'})"
        )
    kind = kinds[0]
    if kind == "toolset" and not isinstance(entry["toolset"], Toolset):
        raise AgentDefinitionError(
            f"agent {agent!r}: mcps entry {entry['name']!r}: toolset= must be a Toolset, "
            f"got {type(entry['toolset']).__name__}"
        )
    return kind


class ToolRegistry:
    """The tools an agent advertises to the model, keyed by advertised name."""

    def __init__(self, routes: list[ToolRoute]) -> None:
        self.routes = {route.advertised_name: route for route in routes}

    @classmethod
    def build(cls, mcps: list[dict[str, Any]], *, agent: str) -> ToolRegistry:
        routes: dict[str, ToolRoute] = {}
        seen_servers: set[str] = set()
        for entry in mcps:
            kind = validate_entry(entry, agent)
            server = str(entry["name"])
            if server in seen_servers:
                raise AgentDefinitionError(
                    f"agent {agent!r}: two mcps entries are named {server!r}; names must be unique"
                )
            seen_servers.add(server)
            if kind != "toolset":
                raise AgentDefinitionError(
                    f"agent {agent!r}: mcps entry {server!r} uses {kind}=, a transport this "
                    "version does not ship yet; use toolset= (in-process) for now"
                )
            toolset: Toolset = entry["toolset"]
            available = {tool["name"]: tool for tool in toolset.list_tools()}
            whitelist = entry.get("tools")
            if whitelist is not None:
                missing = [t for t in whitelist if t not in available]
                if missing:
                    raise AgentDefinitionError(
                        f"agent {agent!r}: mcps entry {server!r} whitelists tool(s) "
                        f"{', '.join(missing)} that server {server!r} does not offer; "
                        f"it offers: {', '.join(available) or 'nothing'}"
                    )
                available = {name: available[name] for name in whitelist}
            for required in entry.get("required_tools") or []:
                if required not in available:
                    raise AgentDefinitionError(
                        f"agent {agent!r}: required tool {required!r} is not offered by "
                        f"server {server!r}; it offers: {', '.join(available) or 'nothing'}"
                    )
            prefix = entry.get("prefix")
            for tool_name, definition in available.items():
                advertised = f"{prefix}__{tool_name}" if prefix else tool_name
                if advertised in routes:
                    other = routes[advertised].server_name
                    raise AgentDefinitionError(
                        f"agent {agent!r}: tool name {advertised!r} is offered by both "
                        f"{other!r} and {server!r}; add prefix= to one of the entries"
                    )
                routes[advertised] = ToolRoute(
                    advertised_name=advertised,
                    server_name=server,
                    tool_name=tool_name,
                    definition={**definition, "name": advertised},
                    toolset=toolset,
                )
        return cls(list(routes.values()))

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
        return route.toolset.call(route.tool_name, arguments, ctx)
