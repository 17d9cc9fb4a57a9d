"""The MCP client side: every tool an agent calls is an MCP tool reached from here.

* ``toolset``: in-process tools (:class:`Toolset`, ``add_tool`` and ``@tool``,
  schemas from type hints, :class:`ToolResult`, :class:`CallContext`);
* ``transport``: the synchronous contract every server kind implements;
* ``http_transport`` (``url=``) and ``stdio_transport`` (``command=``), built on
  the MCP SDK, with ``sdk`` holding what they share;
* ``bridge``: the one crossing from synchronous code into an event loop;
* ``registry``: an agent's ``mcps`` entries resolved into one tool name space;
* ``oauth`` and ``oauth_blueprint``: OAuth 2.1 for ``url=`` servers that require
  it (``auth=`` entries: discovery, grants, encrypted tokens, the sign-in routes).
"""

from flask_solidloop.mcp.toolset import CallContext, ToolDefinition, ToolResult, Toolset

__all__ = ["CallContext", "ToolDefinition", "ToolResult", "Toolset"]
