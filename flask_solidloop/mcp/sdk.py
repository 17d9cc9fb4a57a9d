"""What the transports built on the MCP SDK share (``HttpTransport``, ``StdioTransport``).

This module owns the pieces both transports would otherwise write twice: the
client identity sent in every handshake, the paginated ``tools/list`` loop,
and the unwrapping of the ExceptionGroups the SDK's task groups raise. It runs
inside a coroutine on the bridge's portal (see mcp/bridge.py); the
synchronous side, timeouts and error messages stay with each transport.
"""

from __future__ import annotations

import asyncio
from typing import Any

import mcp_types as types
from mcp.client.session import ClientSession

from .._version import __version__

__all__ = ["CLIENT_INFO", "LIST_PAGE_CAP", "exception_leaves", "list_all_tools"]

#: How we introduce ourselves to every MCP server.
CLIENT_INFO = types.Implementation(name="flask-solidloop", version=__version__)
#: The most ``tools/list`` pages read from one server (a guard against a server
#: that pages forever).
LIST_PAGE_CAP = 100


async def list_all_tools(session: ClientSession) -> list[dict[str, Any]]:
    """Every page of ``tools/list`` as MCP tool dicts, in the server's order.

    The listing ends when a page has no ``nextCursor`` (as the SDK reads it:
    any string, even an empty one, is a cursor), when a cursor comes back that
    was already followed (a server stuck on one page would otherwise repeat its
    tools), or after :data:`LIST_PAGE_CAP` pages.
    """
    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    followed: set[str] = set()
    for _ in range(LIST_PAGE_CAP):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        page = await session.list_tools(params=params)
        tools.extend(
            tool.model_dump(by_alias=True, mode="json", exclude_none=True)
            for tool in page.tools
        )
        cursor = page.next_cursor
        if cursor is None or cursor in followed:
            break
        followed.add(cursor)
    return tools


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) ExceptionGroups, depth first; cancellations last.

    The SDK's task groups wrap the failure that matters (a refused connection,
    a timeout, a JSON-RPC error) together with the cancellations it caused in
    sibling tasks; the transports classify the first non-cancellation.
    """
    found: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            found.append(e)

    walk(exc)
    found.sort(key=lambda e: isinstance(e, asyncio.CancelledError))
    return found
