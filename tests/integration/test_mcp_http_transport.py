"""HttpTransport and the sync bridge against a real SDK-built MCP server on 127.0.0.1.

Nothing is monkeypatched: the server is :class:`McpSdkServer` (the MCP SDK's own
MCPServer behind uvicorn), the client is the SDK's client behind HttpTransport.
Both protocol eras are covered: the "legacy" server refuses the 2026-07-28 probe
(so ``mode="auto"`` falls back to the initialize handshake), the "modern" one
refuses the handshake.

``python tests/integration/test_mcp_http_transport.py`` runs :func:`measure_bridge`, the
measurement behind docs/decisions/0008-mcp-sync-bridge.md.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import statistics
import threading
import time
from typing import Any

import pytest

from flask_solidloop.errors import McpTransportError
from flask_solidloop.mcp import bridge
from flask_solidloop.mcp.http_transport import HttpTransport
from flask_solidloop.mcp.transport import IDEMPOTENCY_META_KEY, McpTransport
from flask_solidloop.testing.mcp_sdk_server import McpSdkServer

ERAS = ("legacy", "modern")


@pytest.fixture(scope="module")
def servers():
    started = {era: McpSdkServer(era=era).start() for era in ERAS}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(params=ERAS)
def server(request, servers):
    server = servers[request.param]
    server.reset_log()
    return server


@pytest.fixture
def own_server():
    """A server of the test's own, for tests that restart or break it."""
    server = McpSdkServer(era="legacy").start()
    yield server
    server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- happy paths


def test_list_tools(server):
    transport = HttpTransport(server.url)
    assert isinstance(transport, McpTransport)
    tools = {tool["name"]: tool for tool in transport.list_tools()}
    assert set(tools) >= {"echo", "add", "slow", "fail", "record_meta"}
    assert tools["add"]["inputSchema"]["required"] == ["a", "b"]
    assert "outputSchema" in tools["add"]
    state = transport.session_state()
    assert state["era"] == server.era
    assert server.rpc_methods().count("server/discover") == 1  # first contact probes once
    transport.close()


def test_call_tool_text_structured_and_is_error(server):
    with HttpTransport(server.url) as transport:
        echo = transport.call_tool("echo", {"text": "héllo"})
        assert echo.text() == "héllo" and not echo.is_error

        added = transport.call_tool("add", {"a": 2, "b": 40})
        assert added.structured_content == {"result": 42}
        assert added.to_mcp()["content"] == [{"type": "text", "text": "42"}]

        failed = transport.call_tool("fail", {"message": "disk on fire"})
        assert failed.is_error and "disk on fire" in failed.text()

        unknown = transport.call_tool("no_such_tool", {})
        assert unknown.is_error


def test_meta_with_idempotency_key_reaches_the_server(server):
    with HttpTransport(server.url) as transport:
        key = "solidloop:tool_call:42"
        result = transport.call_tool("record_meta", {}, meta={IDEMPOTENCY_META_KEY: key,
                                                              "trace": "t-1"})
    assert server.received_meta[-1][IDEMPOTENCY_META_KEY] == key
    assert server.received_meta[-1]["trace"] == "t-1"
    assert json.loads(result.text())[IDEMPOTENCY_META_KEY] == key


def test_no_implicit_tools_list_per_call(server):
    with HttpTransport(server.url) as transport:
        for name, args in [("echo", {"text": "a"}), ("add", {"a": 1, "b": 2}),
                           ("record_meta", {}), ("echo", {"text": "b"})]:
            transport.call_tool(name, args)
    assert server.count("tools/list") == 0
    assert server.count("tools/call") == 4


# --------------------------------------------------------------------------- session reuse


def test_session_state_resumes_without_handshake_or_probe(server):
    first = HttpTransport(server.url)
    first.call_tool("echo", {"text": "one"})
    state = first.session_state()
    first.close(end_session=False)
    json.dumps(state)  # persistable as is
    assert "Authorization" not in json.dumps(state)

    server.reset_log()
    second = HttpTransport(server.url, session_state=state)
    assert second.call_tool("echo", {"text": "two"}).text() == "two"
    assert server.rpc_methods() == ["tools/call"]  # no discover, no initialize
    if server.era == "legacy":
        assert server.requests[0].session_id == state["session_id"]
        assert server.requests[0].protocol_version == state["protocol_version"]
    else:
        assert "session_id" not in state
    second.close()


def test_negotiated_mode_is_remembered_in_process(server):
    HttpTransport(server.url).call_tool("echo", {"text": "first"})
    server.reset_log()
    with HttpTransport(server.url) as again:  # no session_state: the process memo applies
        again.call_tool("echo", {"text": "second"})
    methods = server.rpc_methods()
    assert "server/discover" not in methods
    expected = ["initialize", "notifications/initialized", "tools/call"]
    assert methods == (expected if server.era == "legacy" else ["tools/call"])


def test_resume_in_a_forked_child_process(servers):
    server = servers["legacy"]
    transport = HttpTransport(server.url)
    transport.call_tool("echo", {"text": "parent"})  # the parent's portal is running
    state = transport.session_state()
    server.reset_log()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's loop thread does not exist here
        try:
            child = HttpTransport(server.url, session_state=state)
            text = child.call_tool("echo", {"text": "child"}).text()
            same = transport.call_tool("echo", {"text": "inherited"}).text()
            os.write(write_fd, json.dumps([text, same, bridge.generation()]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        text, same, child_generation = json.loads(pipe.read() or '[null, null, null]')
    os.waitpid(pid, 0)
    assert (text, same) == ("child", "inherited")
    assert child_generation != bridge.generation()
    assert server.rpc_methods() == ["tools/call", "tools/call"]
    assert {r.session_id for r in server.requests} == {state["session_id"]}
    assert transport.call_tool("echo", {"text": "parent again"}).text() == "parent again"


def test_lost_session_reinitializes_once(own_server):
    transport = HttpTransport(own_server.url)
    transport.call_tool("echo", {"text": "before"})
    old_session = transport.session_state()["session_id"]
    own_server.restart()  # the new session manager knows no session
    own_server.reset_log()

    assert transport.call_tool("echo", {"text": "after"}).text() == "after"
    assert [(r.rpc_method, r.status) for r in own_server.requests] == [
        ("tools/call", 404), ("initialize", 200), ("notifications/initialized", 202),
        ("tools/call", 200)]
    assert transport.session_state()["session_id"] not in (None, old_session)
    transport.close()


def test_session_lost_again_after_reinitialize_raises_session(own_server):
    transport = HttpTransport(own_server.url)
    transport.list_tools()
    own_server.fault_next("status", status=404, method="tools/call", times=2)
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "session"
    assert own_server.url in str(caught.value)
    assert own_server.count("initialize") == 2  # the first one, then exactly one more
    assert transport.call_tool("echo", {"text": "y"}).text() == "y"  # a third session works


def test_server_changing_era_is_probed_again(own_server):
    transport = HttpTransport(own_server.url)
    transport.call_tool("echo", {"text": "x"})
    assert transport.session_state()["era"] == "legacy"

    own_server.era = "modern"  # an upgrade: the handshake-era session is refused now
    assert transport.call_tool("echo", {"text": "up"}).text() == "up"
    assert transport.session_state()["era"] == "modern"

    own_server.era = "legacy"  # and back: 2026-07-28 requests are refused
    own_server.reset_log()
    assert transport.call_tool("echo", {"text": "down"}).text() == "down"
    assert transport.session_state()["era"] == "legacy"
    assert own_server.rpc_methods() == ["tools/call", "server/discover", "initialize",
                                        "notifications/initialized", "tools/call"]
    transport.close()


def test_close_ends_the_session_and_is_idempotent(own_server):
    transport = HttpTransport(own_server.url)
    transport.call_tool("echo", {"text": "x"})
    session_id = transport.session_state()["session_id"]
    transport.close()
    transport.close()
    deletes = [r for r in own_server.requests if r.http_method == "DELETE"]
    assert [r.session_id for r in deletes] == [session_id]
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "session"


# --------------------------------------------------------------------------- failures


def test_connection_refused_is_connect():
    url = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(McpTransportError) as caught:
        HttpTransport(url, server_name="search").list_tools()
    assert caught.value.kind == "connect"
    assert caught.value.server == "search"
    assert url in str(caught.value) and "running" in str(caught.value)


def test_server_going_away_mid_session_is_connect_then_recovers(own_server):
    transport = HttpTransport(own_server.url)
    transport.call_tool("echo", {"text": "x"})
    own_server.stop()
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "connect"
    own_server.start()
    assert transport.call_tool("echo", {"text": "back"}).text() == "back"


def test_slow_tool_past_timeout_is_timeout(server):
    transport = HttpTransport(server.url, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("slow", {"seconds": 3})
    assert caught.value.kind == "timeout"
    assert time.monotonic() - started < 2
    assert "0.5 s" in str(caught.value)
    assert transport.call_tool("echo", {"text": "still fine"}).text() == "still fine"
    transport.close()


@pytest.mark.parametrize("token", [None, "wrong-token-123"])
def test_wrong_or_missing_token_is_auth(token):
    with McpSdkServer(token="right-token") as server:
        with pytest.raises(McpTransportError) as caught:
            HttpTransport(server.url, api_token=token).list_tools()
        assert caught.value.kind == "auth"
        assert "401" in str(caught.value) and server.url in str(caught.value)
        assert "wrong-token-123" not in str(caught.value)
        assert HttpTransport(server.url, api_token="right-token").list_tools()


def test_5xx_is_http_and_non_json_rpc_is_protocol(server):
    transport = HttpTransport(server.url)
    transport.list_tools()
    server.fault_next("status", status=503, method=None)
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "http" and "503" in str(caught.value)

    server.fault_next("malformed", method=None)
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "protocol"
    assert transport.call_tool("echo", {"text": "ok"}).text() == "ok"
    transport.close()


def test_credentials_in_the_url_never_reach_messages():
    port = free_port()
    with pytest.raises(McpTransportError) as caught:
        HttpTransport(f"http://user:hunter2@127.0.0.1:{port}/mcp?key=hunter2").list_tools()
    assert "hunter2" not in str(caught.value)


# --------------------------------------------------------------------------- the bridge


class Killed(BaseException):
    """Stands in for dramatiq's TimeLimitExceeded (also a BaseException)."""


def interrupt(thread: threading.Thread, exc: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(exc))


def test_worker_thread_killed_mid_call(server):
    transport = HttpTransport(server.url, timeout=10)
    transport.list_tools()
    outcome: dict[str, Any] = {}

    def worker() -> None:
        try:
            transport.call_tool("slow", {"seconds": 5})
        except Killed:
            outcome["killed_at"] = time.monotonic()

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.3)
    interrupted_at = time.monotonic()
    interrupt(thread, Killed)
    thread.join(3)
    assert not thread.is_alive()
    # delivered within a poll slice, not when the 5 s call ends
    assert outcome["killed_at"] - interrupted_at < 2.5
    # The session survives: the abandoned request was cancelled, not left dangling.
    assert transport.call_tool("echo", {"text": "alive"}).text() == "alive"
    if server.era == "legacy":
        deadline = time.monotonic() + 2
        while server.count("notifications/cancelled") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.count("notifications/cancelled") == 1
    transport.close()


def test_measurement_script_runs():
    results = measure_bridge(calls=3, threads=2, verbose=False, slow_seconds=1.0)
    assert results["b_call_in_open_session_ms"] > 0
    assert results["killed_mid_call_b"]["session_usable_after"]


# --------------------------------------------------------------------------- measurement


def measure_bridge(calls: int = 200, threads: int = 8, verbose: bool = True,
                   server_process: bool = False, slow_seconds: float = 3.0) -> dict[str, Any]:
    """Measure the two bridge designs on this machine (numbers in ADR 0008).

    (a) a fresh event loop per call: ``anyio.run(connect + call + close)`` with
        the SDK client (shared SSL context, no other reuse);
    (b) the process portal: a session kept open on one long-lived loop
        (``HttpTransport.call_tool``), plus open+call+close through the portal.
    Also: the bare cost of entering a loop each way, the threads and loops each
    design adds with ``threads`` concurrent worker threads, and what a worker
    thread killed mid-call leaves behind. ``server_process=True`` runs the MCP
    server in a child process so it does not share this process's GIL.
    """
    import contextlib
    import subprocess
    import sys

    import anyio
    import httpx2
    import mcp_types as types
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    from flask_solidloop.mcp.http_transport import shared_ssl_context

    results: dict[str, Any] = {}

    @contextlib.contextmanager
    def serve(era: str) -> Any:
        if not server_process:
            with McpSdkServer(era=era) as server:
                yield server.url
            return
        child = subprocess.Popen(
            [sys.executable, "-m", "flask_solidloop.testing.mcp_sdk_server",
             "--port", str(free_port()), "--era", era],
            stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            yield child.stdout.readline().strip()
        finally:
            child.terminate()
            child.wait(10)

    def median_ms(fn: Any, n: int) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return round(statistics.median(samples) * 1000, 2)

    async def fresh(url: str, mode: str, tool: str = "echo", args: Any = None) -> None:
        http = httpx2.AsyncClient(verify=shared_ssl_context())
        async with http, Client(streamable_http_client(url, http_client=http),
                                mode=mode, cache=None) as client:
            await client.session.send_request(
                types.CallToolRequest(params=types.CallToolRequestParams(
                    name=tool, arguments=args or {"text": "x"})),
                types.CallToolResult)

    async def noop() -> None:
        return None

    def extra_threads() -> int:
        """Threads other than the main one, workers ("Thread-N") and an in-process server's."""
        return sum(1 for t in threading.enumerate()
                   if t is not threading.main_thread()
                   and not t.name.startswith(("Thread-", "mcp-sdk-server", "AnyIO worker")))

    for era in ("legacy", "modern"):
        with serve(era) as url:
            pinned = "legacy" if era == "legacy" else "2026-07-28"
            results[f"a_open_call_close_{era}_ms"] = median_ms(
                lambda url=url, pinned=pinned: anyio.run(fresh, url, pinned), calls)
            results[f"a_open_call_close_{era}_probe_ms"] = median_ms(
                lambda url=url: anyio.run(fresh, url, "auto"), max(calls // 4, 3))
            transport = HttpTransport(url)
            results[f"b_call_in_open_session_{era}_ms"] = median_ms(
                lambda transport=transport: transport.call_tool("echo", {"text": "x"}), calls)
            transport.close()

            def portal_fresh(url: str = url) -> None:
                with HttpTransport(url) as transport:
                    transport.call_tool("echo", {"text": "x"})
            results[f"b_open_call_close_via_portal_{era}_ms"] = median_ms(portal_fresh, calls)

    results["b_call_in_open_session_ms"] = min(
        results["b_call_in_open_session_legacy_ms"], results["b_call_in_open_session_modern_ms"])
    results["a_loop_only_ms"] = median_ms(lambda: anyio.run(noop), calls)
    results["b_portal_only_ms"] = median_ms(lambda: bridge.run_sync(noop, timeout=5), calls)

    with serve("modern") as url:
        # Threads, loops and wall time with `threads` workers calling concurrently.
        for design in ("a", "b"):
            if design == "a":
                bridge.shutdown()  # (a) must not be charged for the portal's thread
            transport = HttpTransport(url)
            barrier = threading.Barrier(threads + 1)
            peak = [0]

            def work(design: str = design, transport: HttpTransport = transport,
                     barrier: threading.Barrier = barrier, peak: list[int] = peak) -> None:
                barrier.wait()
                for _ in range(max(calls // 10, 2)):
                    if design == "a":
                        anyio.run(fresh, url, "2026-07-28")
                    else:
                        transport.call_tool("echo", {"text": "x"})
                    peak[0] = max(peak[0], extra_threads())

            workers = [threading.Thread(target=work) for _ in range(threads)]
            for worker in workers:
                worker.start()
            barrier.wait()
            started = time.perf_counter()
            for worker in workers:
                worker.join()
            results[f"{design}_{threads}_threads_wall_s"] = round(time.perf_counter() - started, 3)
            results[f"{design}_extra_threads_peak"] = peak[0]
            results[f"{design}_event_loops_peak"] = threads if design == "a" else 1
            transport.close()

        # A worker thread killed mid-call (dramatiq's time limit does this), each design.
        for design in ("a", "b"):
            transport = HttpTransport(url)
            outcome: dict[str, Any] = {}

            def victim(design: str = design, transport: HttpTransport = transport,
                       outcome: dict[str, Any] = outcome) -> None:
                started = time.monotonic()
                try:
                    if design == "a":
                        anyio.run(fresh, url, "2026-07-28", "slow", {"seconds": slow_seconds})
                    else:
                        transport.call_tool("slow", {"seconds": slow_seconds})
                    outcome["finished_normally"] = True
                except Killed:
                    outcome["killed"] = True
                except BaseException as exc:  # what the kill turned into
                    outcome["raised"] = type(exc).__name__
                outcome["after_s"] = round(time.monotonic() - started, 3)

            thread = threading.Thread(target=victim)
            thread.start()
            time.sleep(0.3)
            interrupt(thread, Killed)
            thread.join(10)
            outcome["thread_ended"] = not thread.is_alive()
            if design == "b":
                outcome["session_usable_after"] = (
                    transport.call_tool("echo", {"text": "ok"}).text() == "ok")
            transport.close()
            results[f"killed_mid_call_{design}"] = outcome

    if verbose:
        for key, value in results.items():
            print(f"{key:45} {value}")
    return results


if __name__ == "__main__":
    measure_bridge(server_process=True)


def test_a_400_that_says_the_session_is_unknown_reinitializes_once(own_server):
    transport = HttpTransport(own_server.url)
    transport.call_tool("echo", {"text": "before"})
    old_session = transport.session_state()["session_id"]
    own_server.reset_log()
    own_server.fault_next("stale_session", method="tools/call")
    assert transport.call_tool("echo", {"text": "after"}).text() == "after"
    assert [(r.rpc_method, r.status) for r in own_server.requests] == [
        ("tools/call", 400), ("initialize", 200), ("notifications/initialized", 202),
        ("tools/call", 200)]
    assert transport.session_state()["session_id"] not in (None, old_session)
    transport.close()


def test_a_400_about_the_session_twice_raises_session_and_forgets_it(own_server):
    transport = HttpTransport(own_server.url, server_name="ev")
    transport.list_tools()
    own_server.fault_next("stale_session", method="tools/call", times=2)
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    err = caught.value
    assert err.kind == "session"
    assert "HTTP 400" in str(err) and "No valid session ID provided" in str(err)
    assert own_server.url in str(err) and str(err).startswith("ev: the MCP server")
    # A loop storing this state starts afresh, not with the stale id.
    state = transport.session_state()
    assert "session_id" not in state
    resumed = HttpTransport(own_server.url, session_state=state)
    assert resumed.call_tool("echo", {"text": "y"}).text() == "y"
    assert own_server.count("initialize") == 3


def test_a_400_about_something_else_is_not_session_loss(own_server):
    transport = HttpTransport(own_server.url)
    transport.list_tools()
    own_server.fault_next("status", status=400, method="tools/call")
    with pytest.raises(McpTransportError) as caught:
        transport.call_tool("echo", {"text": "x"})
    assert caught.value.kind == "http" and "HTTP 400" in str(caught.value)
    assert own_server.count("initialize") == 1
