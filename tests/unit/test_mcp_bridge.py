"""The sync bridge (flask_solidloop.mcp.bridge) on its own: no server, no sockets.

Split from tests/integration/test_mcp_http_transport.py, which covers the bridge
against a real MCP server.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from flask_solidloop.mcp import bridge


def test_bridge_runs_coroutines_and_cancels_on_timeout():
    import anyio

    assert bridge.run_sync(_answer, timeout=5) == 42
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await anyio.sleep(30)
        except BaseException:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        bridge.run_sync(forever, timeout=0.2)
    assert cancelled.wait(2)

    def from_the_loop() -> Any:
        async def inner() -> Any:
            return bridge.run_sync(_answer)
        return bridge.run_sync(inner, timeout=5)

    with pytest.raises(RuntimeError, match="deadlock"):
        from_the_loop()


async def _answer() -> int:
    return 42
