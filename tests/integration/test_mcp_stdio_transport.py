"""StdioTransport against real MCP servers running as child processes.

The real peers (npm server-filesystem and server-everything, PyPI mcp-server-time)
are installed into the repo by ``bash scripts/mcp_peers.sh``; CI runs it before
the tests. The failure modes (hang, garbage on stdout, early exit, ...) use a
small inline JSON-RPC server written to a temp file, run with this interpreter.

Per-call latencies of the real peers are printed, not asserted: the first is
the process start-up plus one exchange, and all depend on the machine's load.

Servers are kept by default (one child per process and command, see the module
docs); the ``fake`` tests run in both modes (``kept`` and ``spawned``, i.e.
``stateless=True``), and every test ends with the kept servers stopped.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flask_solidloop.errors import McpTransportError
from flask_solidloop.mcp.stdio_transport import StdioTransport, stop_kept_servers
from flask_solidloop.mcp.toolset import ToolResult
from flask_solidloop.mcp.transport import IDEMPOTENCY_META_KEY, McpTransport

ROOT = Path(__file__).resolve().parents[2]
NPM_BIN = ROOT / ".mcp-peers" / "node_modules" / ".bin"
FILESYSTEM = NPM_BIN / "mcp-server-filesystem"
EVERYTHING = NPM_BIN / "mcp-server-everything"
#: The interpreter's own, or the one scripts/mcp_peers.sh put in the project's
#: .venv (a tox environment runs the suite with another interpreter).
TIME_SERVER = next(
    (path for path in (Path(sys.executable).parent / "mcp-server-time",
                       ROOT / ".venv" / "bin" / "mcp-server-time") if path.exists()),
    Path(sys.executable).parent / "mcp-server-time")

#: The SDK's shutdown after a failed call: stdin close, 2 s, SIGTERM, 2 s, SIGKILL.
SHUTDOWN_BOUND = 4.0
#: How long a kept server has to answer the ping after an abandoned call.
PING_BOUND = 5.0
#: Room for a loaded CI machine on top of the bounds above.
SLACK = 4.0

FAKE_SERVER = r'''
import json, os, sys, time

mode = sys.argv[1]
if os.environ.get("FAKE_PID_FILE"):
    with open(os.environ["FAKE_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))

def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

if mode == "hang":          # never reads, never answers, ignores stdin EOF
    while True:
        time.sleep(1)
if mode == "garbage":
    sys.stdout.write("Server starting... " + os.environ.get("API_TOKEN", "") + "\n")
    sys.stdout.flush()
if mode == "exit":
    sys.stderr.write("fatal: config file /etc/fake.toml missing\n")
    sys.exit(3)

TOOLS = [
    {"name": "echo_meta", "description": "Echo the request params.",
     "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    {"name": "where", "inputSchema": {"type": "object"}},
]

for line in sys.stdin:
    if not line.strip():
        continue
    msg = json.loads(line)
    method, rid = msg.get("method"), msg.get("id")
    if rid is None:
        continue                                  # notifications
    if mode == "blank":
        sys.stdout.write("\n\n")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "fake", "version": "1.0"}}})
    elif method == "tools/list":
        cursor = (msg.get("params") or {}).get("cursor")
        page = {"tools": TOOLS[1:]} if cursor == "p2" else {"tools": TOOLS[:1], "nextCursor": "p2"}
        send({"jsonrpc": "2.0", "id": rid, "result": page})
    elif method == "tools/call":
        name = msg["params"]["name"]
        if mode == "hang_call":
            time.sleep(60)
        if mode == "bad_result":
            send({"jsonrpc": "2.0", "id": rid, "result": {"content": "not a list"}})
        elif name == "echo_meta":
            text = json.dumps(msg["params"], sort_keys=True)
            send({"jsonrpc": "2.0", "id": rid, "result": {
                "content": [{"type": "text", "text": text}],
                "structuredContent": msg["params"]}})
        elif name == "where":
            seen = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)})
            send({"jsonrpc": "2.0", "id": rid,
                  "result": {"content": [{"type": "text", "text": seen}]}})
        else:
            send({"jsonrpc": "2.0", "id": rid,
                  "error": {"code": -32602, "message": f"Unknown tool: {name}"}})
    else:
        send({"jsonrpc": "2.0", "id": rid,
              "error": {"code": -32601, "message": f"Method not found: {method}"}})
'''

MODERN_SERVER = '''
import json
from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("modern-fake")

@app.tool()
def echo_meta(ctx: Context) -> str:
    """Echo the request's _meta and the negotiated protocol version."""
    meta = dict(ctx.request_context.meta or {})
    return json.dumps({"meta": meta, "version": ctx.protocol_version}, default=str)

app.run()
'''


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def peers() -> None:
    missing = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
               for p in (FILESYSTEM, EVERYTHING, TIME_SERVER) if not p.exists()]
    if missing:
        pytest.fail(
            "the real MCP peers are not installed (missing: " + ", ".join(missing) + "); "
            "run `bash scripts/mcp_peers.sh` from the repo root first",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _stop_kept_servers():
    stop_kept_servers()  # those other tests of this process left (loops drained here)
    yield
    stop_kept_servers()


@pytest.fixture(params=[False, True], ids=["kept", "spawned"])
def fake(request, tmp_path: Path):
    script = tmp_path / "fake_mcp_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "server.pid"

    def make(mode: str = "ok", **kwargs) -> StdioTransport:
        env = {"FAKE_PID_FILE": str(pid_file), **kwargs.pop("env", {})}
        kwargs.setdefault("timeout", 20.0)
        kwargs.setdefault("server_name", "fake")
        kwargs.setdefault("stateless", request.param)
        return StdioTransport([sys.executable, str(script), mode], env=env, **kwargs)

    make.pid_file = pid_file  # type: ignore[attr-defined]
    make.stateless = request.param  # type: ignore[attr-defined]
    return make


def _children() -> list[int]:
    """Live (or zombie) direct children of this test process, from /proc."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """True while the process exists, zombies included (they were never reaped)."""
    return Path(f"/proc/{pid}").exists()


def _assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 2.0  # the child watcher reaps asynchronously
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid), f"server process {pid} outlived the call"


def _assert_no_children() -> None:
    """No process left once the kept servers are stopped (a worker's shutdown)."""
    stop_kept_servers()
    deadline = time.monotonic() + 2.0
    while _children() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _children() == [], f"child processes left behind: {_children()}"


def _timed(label: str, fn, capsys):
    started = time.perf_counter()
    result = fn()
    elapsed = (time.perf_counter() - started) * 1000
    with capsys.disabled():
        print(f"\n  [stdio latency] {label}: {elapsed:.0f} ms (spawn + handshake + call + exit)")
    return result


def _text(result: ToolResult) -> str:
    assert isinstance(result, ToolResult)
    return result.text()


# --------------------------------------------------------------------------- real peers


def test_filesystem_list_and_read(peers, tmp_path: Path, capsys):
    (tmp_path / "notes.txt").write_text("tea is served at four\n")
    (tmp_path / "sub").mkdir()
    fs = StdioTransport([str(FILESYSTEM), str(tmp_path)], timeout=30, server_name="fs")
    assert isinstance(fs, McpTransport)

    tools = _timed("server-filesystem list_tools", fs.list_tools, capsys)
    by_name = {tool["name"]: tool for tool in tools}
    assert {"read_text_file", "list_directory", "write_file"} <= set(by_name)
    assert by_name["read_text_file"]["inputSchema"]["type"] == "object"
    assert "path" in by_name["read_text_file"]["inputSchema"]["properties"]
    assert by_name["read_text_file"]["description"]

    listing = _timed(
        "server-filesystem list_directory",
        lambda: fs.call_tool("list_directory", {"path": str(tmp_path)},
                             meta={IDEMPOTENCY_META_KEY: "solidloop:tool_call:1"}),
        capsys,
    )
    assert not listing.is_error
    assert "[FILE] notes.txt" in _text(listing) and "[DIR] sub" in _text(listing)

    read = fs.call_tool("read_text_file", {"path": str(tmp_path / "notes.txt")})
    assert not read.is_error and "tea is served at four" in _text(read)

    # Outside the allowed directory: the server says no, as a tool result.
    denied = fs.call_tool("read_text_file", {"path": "/etc/hostname"})
    assert denied.is_error and "denied" in _text(denied).lower()
    assert fs.session_state() == {}
    fs.close()
    _assert_no_children()


def test_everything_echo_with_meta_and_errors(peers, capsys):
    ev = StdioTransport([str(EVERYTHING), "stdio"], timeout=30)
    assert ev.server_name == "mcp-server-everything"
    tools = _timed("server-everything list_tools", ev.list_tools, capsys)
    assert {"echo", "get-sum", "get-env"} <= {tool["name"] for tool in tools}

    echoed = _timed(
        "server-everything echo",
        lambda: ev.call_tool("echo", {"message": "hello"},
                             meta={IDEMPOTENCY_META_KEY: "solidloop:tool_call:7", "trace": 1}),
        capsys,
    )
    assert not echoed.is_error and _text(echoed) == "Echo: hello"

    summed = ev.call_tool("get-sum", {"a": 2, "b": 40})
    assert not summed.is_error and "42" in _text(summed)

    # Tool-level failures come back as results, never as McpTransportError.
    bad_args = ev.call_tool("get-sum", {"a": "two", "b": 40})
    assert bad_args.is_error and "a" in _text(bad_args)
    unknown = ev.call_tool("no-such-tool", {})
    assert unknown.is_error and "no-such-tool" in _text(unknown)

    structured = ev.call_tool("get-structured-content", {"location": "New York"})
    assert not structured.is_error
    assert set(structured.structured_content or {}) >= {"temperature", "conditions"}
    _assert_no_children()


def test_everything_sees_only_a_minimal_environment(peers, monkeypatch):
    monkeypatch.setenv("SOLIDLOOP_TEST_LEAK", "worker-secret-value")
    ev = StdioTransport([str(EVERYTHING), "stdio"], timeout=30,
                        env={"SERVER_TOKEN": "tok-0123456789"})
    env = json.loads(_text(ev.call_tool("get-env", {})))
    assert "SOLIDLOOP_TEST_LEAK" not in env
    assert env["SERVER_TOKEN"] == "tok-0123456789"
    assert env["PATH"] == os.environ["PATH"]
    assert set(env) <= {"HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER",
                        "LANG", "LC_ALL", "LC_CTYPE", "SERVER_TOKEN"}


def test_time_server_get_current_time(peers, capsys):
    clock = StdioTransport([str(TIME_SERVER), "--local-timezone", "UTC"], timeout=30)
    tools = _timed("mcp-server-time list_tools", clock.list_tools, capsys)
    assert {"get_current_time", "convert_time"} <= {tool["name"] for tool in tools}

    now = _timed(
        "mcp-server-time get_current_time",
        lambda: clock.call_tool("get_current_time", {"timezone": "UTC"},
                                meta={IDEMPOTENCY_META_KEY: "solidloop:tool_call:9"}),
        capsys,
    )
    assert not now.is_error
    assert now.structured_content is not None
    assert now.structured_content["timezone"] == "UTC"
    assert now.structured_content["datetime"].endswith("+00:00")

    wrong = clock.call_tool("get_current_time", {"timezone": "Mars/Olympus_Mons"})
    assert wrong.is_error and "Mars/Olympus_Mons" in _text(wrong)
    _assert_no_children()


# --------------------------------------------------------------------------- the wire


def test_meta_travels_as_underscore_meta_and_pages_are_joined(fake):
    server = fake("ok")
    assert [tool["name"] for tool in server.list_tools()] == ["echo_meta", "where"]
    result = server.call_tool("echo_meta", {"x": 1},
                              meta={IDEMPOTENCY_META_KEY: "solidloop:tool_call:5"})
    assert result.structured_content == {
        "name": "echo_meta",
        "arguments": {"x": 1},
        "_meta": {IDEMPOTENCY_META_KEY: "solidloop:tool_call:5"},
    }
    plain = server.call_tool("echo_meta", {})
    assert "_meta" not in (plain.structured_content or {})


def test_meta_reaches_a_modern_era_server(tmp_path: Path):
    # An SDK 2.x server: mode="auto" negotiates 2026-07-28, whose _meta envelope
    # the SDK fills in; ours must travel alongside it.
    script = tmp_path / "modern_server.py"
    script.write_text(MODERN_SERVER)
    server = StdioTransport([sys.executable, str(script)], timeout=30)
    seen = json.loads(_text(server.call_tool(
        "echo_meta", {}, meta={IDEMPOTENCY_META_KEY: "solidloop:tool_call:11"})))
    assert seen["version"] == "2026-07-28"
    assert seen["meta"][IDEMPOTENCY_META_KEY] == "solidloop:tool_call:11"


def test_listing_follows_cursors_until_none_or_repeated():
    """mcp/sdk.py's tools/list loop, shared by the stdio and HTTP transports."""
    import anyio
    import mcp_types

    from flask_solidloop.mcp import sdk

    class Pages:
        def __init__(self, *pages: tuple[str, str | None]) -> None:
            self.pages = list(pages)
            self.cursors: list[str | None] = []

        async def list_tools(self, params: Any = None) -> mcp_types.ListToolsResult:
            self.cursors.append(params.cursor if params is not None else None)
            name, next_cursor = (self.pages.pop(0) if self.pages
                                 else ("more", f"c{len(self.cursors)}"))  # pages forever
            return mcp_types.ListToolsResult(
                tools=[mcp_types.Tool(name=name, inputSchema={"type": "object"})],
                nextCursor=next_cursor)

    empty_cursor = Pages(("a", ""), ("b", None))  # "" is a cursor, as the SDK reads it
    assert [t["name"] for t in anyio.run(sdk.list_all_tools, empty_cursor)] == ["a", "b"]
    assert empty_cursor.cursors == [None, ""]

    stuck = Pages(("a", "p2"), ("b", "p2"))  # a server stuck on one page
    assert [t["name"] for t in anyio.run(sdk.list_all_tools, stuck)] == ["a", "b"]
    assert stuck.cursors == [None, "p2"]

    endless = Pages()  # a new cursor every time
    assert len(anyio.run(sdk.list_all_tools, endless)) == sdk.LIST_PAGE_CAP


def test_jsonrpc_error_to_tools_call_is_a_tool_result(fake):
    result = fake("ok").call_tool("no_such_tool", {"q": 1})
    assert result.is_error
    assert _text(result) == "MCP error -32602: Unknown tool: no_such_tool"


def test_cwd_string_command_and_blank_lines(fake, tmp_path: Path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    server = fake("blank", cwd=workdir)
    seen = json.loads(_text(server.call_tool("where", {})))
    assert seen["cwd"] == str(workdir)

    script = tmp_path / "fake_mcp_server.py"
    by_string = StdioTransport(f"{sys.executable} {script} ok", timeout=20)
    assert [t["name"] for t in by_string.list_tools()] == ["echo_meta", "where"]


def test_concurrent_calls_and_a_running_event_loop(fake):
    server = fake("ok")
    results: list[ToolResult] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(server.call_tool("echo_meta", {"x": i})))
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.structured_content["arguments"]["x"] for r in results) == [0, 1, 2]

    async def inside_a_loop() -> ToolResult:
        return server.call_tool("echo_meta", {"x": 9})

    assert asyncio.run(inside_a_loop()).structured_content["arguments"] == {"x": 9}
    _assert_no_children()


# --------------------------------------------------------------------------- failures


def test_missing_command_is_a_spawn_error():
    transport = StdioTransport(["solidloop-no-such-mcp-server", "--port", "1"])
    with pytest.raises(McpTransportError) as caught:
        transport.list_tools()
    err = caught.value
    assert err.kind == "spawn" and err.server == "solidloop-no-such-mcp-server"
    message = str(err)
    assert "'solidloop-no-such-mcp-server' not found on PATH" in message
    assert "installed" in message
    assert "solidloop-no-such-mcp-server --port 1" in message  # the command line

    with pytest.raises(McpTransportError) as caught:
        StdioTransport(["/nonexistent/dir/server"], server_name="abs").call_tool("x", {})
    assert caught.value.kind == "spawn" and "/nonexistent/dir/server" in str(caught.value)

    with pytest.raises(McpTransportError) as caught:
        StdioTransport([sys.executable], cwd="/nonexistent/workdir").list_tools()
    assert caught.value.kind == "spawn" and "working directory" in str(caught.value)


def test_hanging_server_times_out_and_is_killed(fake):
    server = fake("hang", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(McpTransportError) as caught:
        server.list_tools()
    elapsed = time.monotonic() - started
    assert caught.value.kind == "timeout"
    assert "within 1 s" in str(caught.value) and "fake_mcp_server.py hang" in str(caught.value)
    assert 1.0 <= elapsed < 1.0 + SHUTDOWN_BOUND + SLACK, elapsed
    _assert_gone(int(fake.pid_file.read_text()))
    _assert_no_children()


def test_server_that_hangs_in_a_tool_call_times_out(fake):
    server = fake("hang_call", timeout=1.0)
    with pytest.raises(McpTransportError) as caught:
        server.call_tool("echo_meta", {})
    assert caught.value.kind == "timeout" and "tools/call" in str(caught.value)
    _assert_gone(int(fake.pid_file.read_text()))


class Killed(BaseException):
    """Stands in for dramatiq's TimeLimitExceeded (also a BaseException)."""


def test_worker_thread_killed_mid_call_stops_the_server(fake):
    """The calling thread waits on the portal, so a time limit reaches it at once."""
    server = fake("hang_call", timeout=30.0)
    outcome: dict[str, float] = {}

    def worker() -> None:
        started = time.monotonic()
        try:
            server.call_tool("echo_meta", {})
        except Killed:
            outcome["killed_after"] = time.monotonic() - started

    thread = threading.Thread(target=worker)
    thread.start()
    deadline = time.monotonic() + 10
    while not fake.pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # the server is up and sitting in tools/call
    interrupted_at = time.monotonic()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(Killed))
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - interrupted_at < 1.0  # a poll slice, not the 30 s timeout
    assert "killed_after" in outcome
    # Spawned: the exchange was cancelled; its shielded teardown stops the process.
    # Kept: the abandoned call's server gets a ping in the background; this one is
    # stuck in the call, does not answer, and is stopped.
    pid = int(fake.pid_file.read_text())
    deadline = time.monotonic() + SHUTDOWN_BOUND + SLACK + (0 if fake.stateless else PING_BOUND)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_gone(pid)
    _assert_no_children()


def test_calls_in_a_forked_child_process(fake):
    server = fake("ok")
    assert server.call_tool("echo_meta", {"x": 1}).structured_content["arguments"] == {"x": 1}
    parent_server = int(fake.pid_file.read_text())
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's portal thread does not exist here
        try:
            result = server.call_tool("echo_meta", {"x": 2})
            os.write(write_fd, json.dumps(result.structured_content).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        child_answer = json.loads(pipe.read() or "null")
    os.waitpid(pid, 0)
    assert child_answer is not None and child_answer["arguments"] == {"x": 2}
    assert server.call_tool("echo_meta", {"x": 3}).structured_content["arguments"] == {"x": 3}
    if not fake.stateless:
        # The forked process started a server of its own; the parent kept its one.
        assert int(fake.pid_file.read_text()) != parent_server
        assert _children() == [parent_server]
    _assert_no_children()


def test_garbage_on_stdout_is_a_protocol_error_and_secrets_are_masked(fake):
    server = fake("garbage", env={"API_TOKEN": "sk-live-abcdef123456"})
    started = time.monotonic()
    with pytest.raises(McpTransportError) as caught:
        server.list_tools()
    assert time.monotonic() - started < 10  # fails at once, not at the 20 s timeout
    err = caught.value
    assert err.kind == "protocol" and err.server == "fake"
    assert "not a JSON-RPC message" in str(err) and "Server starting..." in str(err)
    assert "sk-live-abcdef123456" not in str(err) and "***" in str(err)
    _assert_gone(int(fake.pid_file.read_text()))


def test_early_exit_is_a_protocol_error_with_stderr(fake):
    with pytest.raises(McpTransportError) as caught:
        fake("exit").call_tool("echo_meta", {})
    err = caught.value
    assert err.kind == "protocol"
    assert "closed its stdout" in str(err)
    assert "fatal: config file /etc/fake.toml missing" in str(err)  # stderr tail
    _assert_no_children()


def test_malformed_result_is_a_protocol_error(fake):
    with pytest.raises(McpTransportError) as caught:
        fake("bad_result").call_tool("echo_meta", {})
    assert caught.value.kind == "protocol"
    assert "not a valid MCP result" in str(caught.value)


# --------------------------------------------------------------------------- kept sessions


def _servers(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (zombies have none)."""
    found = []
    needle = f"SOLIDLOOP_TEST_MARK={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return sorted(found)


def _everything(mark: str, **kwargs: Any) -> StdioTransport:
    kwargs.setdefault("timeout", 30)
    return StdioTransport([str(EVERYTHING), "stdio"], env={"SOLIDLOOP_TEST_MARK": mark},
                          **kwargs)


def test_a_kept_server_is_reused_across_calls_transports_and_threads(peers, capsys):
    mark = f"reuse-{os.getpid()}"
    ev = _everything(mark)
    first = _timed("server-everything echo, first (start-up)",
                   lambda: ev.call_tool("echo", {"message": "one"}), capsys)
    assert _text(first) == "Echo: one"
    [pid] = _servers(mark)
    _timed("server-everything echo, kept session",
           lambda: ev.call_tool("echo", {"message": "two"}), capsys)
    assert len(ev.list_tools()) > 5
    # Another transport for the same command and env: the same child.
    assert _text(_everything(mark).call_tool("echo", {"message": "three"})) == "Echo: three"
    assert _servers(mark) == [pid]

    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def add(i: int) -> None:
        try:
            results[i] = _text(ev.call_tool("get-sum", {"a": i, "b": 1000}))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert all(str(i + 1000) in results[i] for i in range(8)), results
    assert _servers(mark) == [pid]

    # Another env is another server.
    other = f"{mark}-other"
    _everything(other).call_tool("echo", {"message": "x"})
    assert len(_servers(other)) == 1 and _servers(other) != [pid]
    assert stop_kept_servers() == 2
    _assert_gone(pid)
    assert _servers(mark) == [] and _servers(other) == []


def test_a_server_killed_mid_call_fails_that_call_and_the_next_starts_a_new_one(peers):
    from flask_solidloop.mcp.registry import TransportServer
    from flask_solidloop.mcp.toolset import CallContext

    mark = f"killed-{os.getpid()}"
    server = TransportServer("ev", _everything(mark))
    assert not server.call("echo", {"message": "up"}, CallContext()).is_error
    [pid] = _servers(mark)
    outcome: dict[str, Any] = {}

    def long_call() -> None:
        started = time.monotonic()
        outcome["result"] = server.call("trigger-long-running-operation",
                                        {"duration": 20, "steps": 2}, CallContext())
        outcome["after"] = time.monotonic() - started

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(0.5)  # in flight
    os.kill(pid, 9)
    thread.join(15)
    assert not thread.is_alive()
    result = outcome["result"]
    assert result.is_error and result.error_kind == "infra:protocol"
    assert "exited" in _text(result) and outcome["after"] < 15
    _assert_gone(pid)
    recovered = server.call("echo", {"message": "again"}, CallContext())
    assert not recovered.is_error and _text(recovered) == "Echo: again"
    [new_pid] = _servers(mark)
    assert new_pid != pid


def test_a_slow_call_times_out_and_a_responsive_server_is_kept(peers):
    mark = f"slow-{os.getpid()}"
    ev = _everything(mark, timeout=1.0)
    ev.call_tool("echo", {"message": "up"})
    [pid] = _servers(mark)
    with pytest.raises(McpTransportError) as caught:
        ev.call_tool("trigger-long-running-operation", {"duration": 4, "steps": 2})
    assert caught.value.kind == "timeout" and "kept" in str(caught.value)
    assert _text(ev.call_tool("echo", {"message": "still"})) == "Echo: still"
    assert _servers(mark) == [pid]


def test_stateless_spawns_a_process_per_call(tmp_path: Path):
    script = tmp_path / "fake_mcp_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "server.pid"
    server = StdioTransport([sys.executable, str(script), "ok"], stateless=True, timeout=20,
                            env={"FAKE_PID_FILE": str(pid_file)})
    seen = []
    for i in range(2):
        assert server.call_tool("echo_meta", {"x": i}).structured_content["arguments"] == {"x": i}
        seen.append(int(pid_file.read_text()))
        assert _children() == []  # nothing outlives the call
    assert seen[0] != seen[1]
    assert stop_kept_servers() == 0


def test_a_server_that_is_not_concurrent_gets_one_process_per_thread(tmp_path: Path):
    script = tmp_path / "fake_mcp_server.py"
    script.write_text(FAKE_SERVER)
    server = StdioTransport([sys.executable, str(script), "ok"], concurrent=False, timeout=20)
    server.call_tool("echo_meta", {})
    server.call_tool("echo_meta", {})
    assert len(_children()) == 1  # this thread's, reused
    # Two more threads, alive at once (a finished thread's id may be reused).
    barrier = threading.Barrier(2, timeout=30)

    def call() -> None:
        server.call_tool("echo_meta", {})
        barrier.wait()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(_children()) == 3
    assert stop_kept_servers() == 3
    _assert_no_children()


def test_a_time_limit_interrupts_a_kept_call_and_a_responsive_server_is_kept(peers):
    mark = f"interrupted-{os.getpid()}"
    ev = _everything(mark)
    ev.call_tool("echo", {"message": "up"})
    [pid] = _servers(mark)
    outcome: dict[str, float] = {}

    def worker() -> None:
        started = time.monotonic()
        try:
            ev.call_tool("trigger-long-running-operation", {"duration": 20, "steps": 2})
        except Killed:
            outcome["killed_after"] = time.monotonic() - started

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.5)  # in flight
    interrupted_at = time.monotonic()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(Killed))
    thread.join(5)
    assert not thread.is_alive() and "killed_after" in outcome
    assert time.monotonic() - interrupted_at < 1.0  # a poll slice, not the 30 s timeout
    time.sleep(0.5)  # the background ping is answered
    assert _text(ev.call_tool("echo", {"message": "after"})) == "Echo: after"
    assert _servers(mark) == [pid]
