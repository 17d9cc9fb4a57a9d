"""The sync bridge (flask_solidloop.mcp.bridge) on its own: no server, no sockets.

Split from tests/integration/test_mcp_http_transport.py, which covers the bridge
against a real MCP server.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from typing import Any

import pytest

from flask_solidloop.mcp import bridge

from ..integration.test_mcp_http_transport import Killed, interrupt


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


#: Calls that start or enter an event loop from synchronous code.
_LOOP_ENTRIES = {("asyncio", "run"), ("anyio", "run"), ("asyncio", "Runner"),
                 ("anyio.from_thread", "start_blocking_portal")}
_LOOP_ENTRY_NAMES = {"new_event_loop", "run_coroutine_threadsafe", "start_blocking_portal"}


def test_the_bridge_is_the_only_way_into_an_event_loop():
    """Every sync-to-async crossing goes through mcp/bridge.py (decision 0008)."""
    import ast
    from pathlib import Path

    package = Path(bridge.__file__).resolve().parent.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(bridge.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else None
            if name in _LOOP_ENTRY_NAMES or (owner, name) in _LOOP_ENTRIES:
                found.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(func)}")
    assert found == [], "use flask_solidloop.mcp.bridge instead: " + "; ".join(found)


def test_bridge_coroutines_see_the_callers_context_variables():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def read() -> str:
        return var.get()

    async def isolated_from_async_code() -> str:
        return bridge.run_isolated(read)

    token = var.set("caller")
    try:
        assert bridge.run_sync(read, timeout=5) == "caller"
        assert bridge.run_isolated(read) == "caller"
        assert asyncio.run(isolated_from_async_code()) == "caller"
    finally:
        var.reset(token)


def test_run_isolated_runs_here_or_on_a_one_shot_loop():
    here = threading.get_ident()

    async def where() -> tuple[int, asyncio.AbstractEventLoop, int]:
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(None, lambda: 7)  # an executor to shut down
        return threading.get_ident(), loop, answer

    ident, loop, answer = bridge.run_isolated(where)
    assert (ident, answer) == (here, 7)  # no loop running here: asyncio.run on this thread
    assert loop.is_closed() and loop is not bridge.get_portal().loop

    async def from_async_code() -> tuple[int, asyncio.AbstractEventLoop, int]:
        return bridge.run_isolated(where)

    ident, loop, answer = asyncio.run(from_async_code())
    assert ident != here and answer == 7 and loop.is_closed()
    assert loop is not bridge.get_portal().loop
    leftovers = [t.name for t in threading.enumerate()
                 if t.name == "solidloop-isolated-loop" or t.name.startswith("asyncio_")]
    assert leftovers == []  # the one-shot loop thread and its executor are gone


def test_run_isolated_from_async_code_is_interruptible_and_cancels():
    cancelled = threading.Event()
    outcome: dict[str, Any] = {}

    async def forever() -> None:
        try:
            await asyncio.sleep(30)
        except BaseException:
            cancelled.set()
            raise

    async def caller() -> None:
        bridge.run_isolated(forever)

    def worker() -> None:
        started = time.monotonic()
        try:
            asyncio.run(caller())
        except Killed:
            outcome["killed_after"] = time.monotonic() - started

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.3)
    interrupt(thread, Killed)
    thread.join(5)
    assert not thread.is_alive()
    assert outcome["killed_after"] < 1.5  # a poll slice, not the 30 s sleep
    assert cancelled.wait(2)
