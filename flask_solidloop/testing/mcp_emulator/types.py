"""The shapes the MCP emulator passes around: a recorded request and a recorded tool
run (both public), a registered tool, a handshake-era session and a queued failure."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Handler = Callable[[dict[str, Any], dict[str, Any]], Any]

SESSION_HEADER = "mcp-session-id"
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass
class RecordedRequest:
    """One HTTP request as the emulator received it (``status`` is filled once answered)."""

    method: str  # HTTP method
    path: str
    headers: dict[str, str]  # lower-case keys
    json: Any  # parsed body, or None if empty/not JSON
    body: str  # raw body, decoded as UTF-8 (invalid bytes replaced)
    rpc_method: str | None  # the JSON-RPC "method" of the body, if any
    query: str = ""
    status: int | None = None  # HTTP status of the answer

    @property
    def session_id(self) -> str | None:
        return self.headers.get(SESSION_HEADER)

    @property
    def rpc_id(self) -> Any:
        return self.json.get("id") if isinstance(self.json, dict) else None


@dataclass(frozen=True)
class RecordedCall:
    """One tool run: a ``tools/call`` that reached a registered tool's result or handler."""

    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any]  # the request's params._meta ({} when absent)
    session_id: str | None  # None in the stateless era
    protocol_version: str


@dataclass
class Tool:
    definition: dict[str, Any]  # the tools/list entry, wire-shaped
    input_schema: dict[str, Any]
    result: Any = None
    handler: Handler | None = None


@dataclass
class Session:
    id: str
    protocol_version: str
    client_info: dict[str, Any] | None
    created: float = field(default_factory=time.monotonic)
    initialized: bool = False  # notifications/initialized received


@dataclass
class Failure:
    kind: str
    options: dict[str, Any]
    remaining: int
    method: str | None
    tool: str | None
