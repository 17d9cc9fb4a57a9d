"""The transport contract: how the tool layer talks to one MCP server.

Four kinds of ``mcps`` entry end up behind this Protocol: an in-process
toolset, a Streamable HTTP server (``url=``), a child process over stdio
(``command=``), or any object a host passes as ``transport=``. The tool turn
is synchronous (a dramatiq worker thread), so the Protocol is too; transports
built on the async MCP SDK bridge to it (see mcp/bridge.py).

Rules every transport follows:

* ``list_tools()`` returns MCP tool dicts (``name``, ``description``,
  ``inputSchema``, optionally ``outputSchema``/``annotations``).
* ``call_tool()`` returns a :class:`~flask_solidloop.mcp.toolset.ToolResult`.
  A tool-level failure (the server answered ``isError: true``) is a result,
  not an exception.
* Infrastructure failures (connection refused, timeout, 5xx, 401, broken
  JSON-RPC, a command that does not exist) raise
  :class:`~flask_solidloop.errors.McpTransportError` with a ``kind``.
* ``meta`` goes into the request's ``_meta`` (the idempotency key travels
  there as ``"solidloop/idempotencyKey"``).
* ``session_state()`` describes the session to persist per loop and server
  (protocol version, session id, server info), and a transport can be built
  from it again, so a later turn in another process resumes the same session.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .toolset import ToolResult

IDEMPOTENCY_META_KEY = "solidloop/idempotencyKey"

__all__ = ["IDEMPOTENCY_META_KEY", "McpTransport"]


@runtime_checkable
class McpTransport(Protocol):
    def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP tool dicts."""

    def call_tool(self, name: str, arguments: dict[str, Any], *,
                  meta: dict[str, Any] | None = None) -> ToolResult:
        """Call one tool; raise McpTransportError for infrastructure failures."""

    def session_state(self) -> dict[str, Any]:
        """What to persist to resume this session elsewhere ({} when stateless)."""

    def close(self) -> None:
        """Release the session (and any child process)."""
