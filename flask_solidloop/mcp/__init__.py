"""MCP integration: in-process toolsets whose tools agents call as MCP tools."""

from flask_solidloop.mcp.toolset import CallContext, ToolDefinition, ToolResult, Toolset

__all__ = ["CallContext", "ToolDefinition", "ToolResult", "Toolset"]
