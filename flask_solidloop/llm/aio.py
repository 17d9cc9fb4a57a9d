"""The asyncio side of the LLM send path: one event loop per process, on a
daemon thread, holding every LLM exchange of the process's async mode
(SOLIDLOOP_LLM_IO = "async", docs/decisions/0027-llm-io.md).

This module owns the loop's HTTP clients: one ``httpx.AsyncClient`` per
provider origin, sized like the thread mode's (:class:`.client.PoolLimits`).
The loop itself is a :class:`~..mcp.bridge.Portal` of its own (the one way
into an event loop, decision 0008), apart from the MCP portal so that tool
I/O and model I/O never wait on each other. What an exchange does is the send
path's (``client.post_json_async``, ``streaming.post_stream_async``: the same
retry loop as the threads'); who hands exchanges over and ends their turns is
the runtime's (runtime/llm_io.py). Nothing here touches the database.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from ..mcp.bridge import Portal
from .client import PoolLimits, origin_of

T = TypeVar("T")


class IoLoop:
    """An asyncio loop on a thread of its own, and its clients per origin."""

    def __init__(self, limits: PoolLimits, *, name: str = "solidloop-llm-io") -> None:
        self.limits = limits
        self.portal = Portal(name)
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.portal.add_finalizer(self._close_clients)

    def start(self) -> IoLoop:
        self.portal.loop  # noqa: B018 (starts the loop's thread)
        return self

    def submit(self, coroutine: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``coroutine()`` on the loop; its future, from any thread."""
        return self.portal.submit(coroutine)

    def client(self, url: str) -> httpx.AsyncClient:
        """The loop's client for ``url``'s origin (call it on the loop)."""
        key = origin_of(url)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = httpx.AsyncClient(
                limits=self.limits.httpx_limits())
        return client

    async def _close_clients(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._clients.clear()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the exchanges still running, close the clients, stop the loop."""
        self.portal.shutdown(timeout)


__all__ = ["IoLoop"]
