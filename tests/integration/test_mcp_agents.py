"""Agents whose tools live on remote MCP servers: Streamable HTTP and stdio, real peers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Message, ToolCall
from flask_solidloop.testing import drain as run
from flask_solidloop.testing.mcp_emulator import MCPEmulator

from ..support.rows import loop_of as finished
from ..support.support_app import llm_settings, solidloop

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".mcp-peers" / "node_modules" / ".bin"


def remote_agent(name: str, mcps: list[dict]) -> type[Agent]:
    class Remote(Agent):
        system_prompt = "You use remote tools."

        def llm(self):
            return llm_settings()

    Remote.mcps = mcps
    return solidloop.agent(name)(Remote)


def test_an_http_mcp_server_runs_a_tool_with_the_idempotency_key(app, session, llm):
    with MCPEmulator(token="mcp-secret-token") as server:
        server.tool("lookup", description="Find a record",
                    input_schema={"type": "object", "properties": {"key": {"type": "string"}},
                                  "required": ["key"]},
                    handler=lambda arguments, meta: f"record {arguments['key']} is green")
        agent = remote_agent("http_remote", [{"name": "records", "url": server.url,
                                              "api_token": "mcp-secret-token",
                                              "prefix": "db"}])
        llm.script("look up", {"tool_calls": [{"name": "db__lookup",
                                               "arguments": {"key": "k1"}}]})
        llm.script("green", {"content": "It is green."})
        loop = agent.start(message="please look up k1")
        run(app)
        assert finished(session, loop.id).status == "completed"
        call = session.scalars(select(ToolCall)).one()
        assert (call.server_name, call.tool_name, call.is_success) == ("records", "lookup", True)
        assert server.calls[-1].meta["solidloop/idempotencyKey"] == call.idempotency_key
        answer = session.scalars(select(Message).where(Message.role == "tool")).one()
        assert answer.content == "record k1 is green"
        assert llm.requests[0].json["tools"][0]["function"]["name"] == "db__lookup"


def test_a_failing_mcp_server_is_a_classified_tool_error_the_loop_survives(
        app, session, llm):
    with MCPEmulator() as server:
        server.tool("ping", result="pong")
        agent = remote_agent("flaky_remote", [{"name": "flaky", "url": server.url,
                                               "timeout": 5}])
        llm.script("ping", {"tool_calls": [{"name": "ping", "arguments": {}}]})
        llm.script(lambda body: body["messages"][-1]["role"] == "tool",
                   {"content": "the server is struggling"})
        loop = agent.start(message="ping it")
        run(app, queues=("solidloop_llm",))
        server.fail_next("status", status=503, method="tools/call")
        run(app)
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False and call.error_kind == "infra:http"
    assert "could not run 'ping' (http)" in call.result["content"][0]["text"]


def test_start_never_contacts_a_remote_server(app, session):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    agent = remote_agent("gone_remote", [{"name": "gone", "url": f"http://127.0.0.1:{dead}/mcp"}])
    loop = agent.start(message="nothing listens there")
    assert loop.status == "queued"
    # the first turn is where the server is needed; its absence fails the loop readably
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "McpTransportError" in row.error_message and "gone" in row.error_message
    assert "cannot connect" in row.error_message


def _needs_peers():
    if not (PEERS / "mcp-server-filesystem").exists():
        pytest.fail("the MCP peers are missing: run `bash scripts/mcp_peers.sh`")


def test_a_stdio_filesystem_server_reads_a_file(app, session, llm, tmp_path):
    _needs_peers()
    (tmp_path / "notes.txt").write_text("the answer is 42")
    agent = remote_agent("fs_remote", [{"name": "fs", "timeout": 30,
                                        "command": [str(PEERS / "mcp-server-filesystem"),
                                                    str(tmp_path)],
                                        "tools": ["read_text_file"]}])
    llm.script("read", {"tool_calls": [{"name": "read_text_file",
                                        "arguments": {"path": str(tmp_path / "notes.txt")}}]})
    llm.script("42", {"content": "The answer is 42."})
    loop = agent.start(message="read my notes")
    run(app)
    assert finished(session, loop.id).status == "completed"
    assert [t["function"]["name"] for t in llm.requests[0].json["tools"]] == ["read_text_file"]
    answer = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert "the answer is 42" in answer.content


def test_a_stdio_python_server_tells_the_time(app, session, llm):
    _needs_peers()
    agent = remote_agent("time_remote", [{"name": "time", "timeout": 60,
                                          "command": [str(ROOT / ".venv" / "bin" /
                                                          "mcp-server-time"),
                                                      "--local-timezone", "UTC"],
                                          "required_tools": ["get_current_time"]}])
    llm.script("time", {"tool_calls": [{"name": "get_current_time",
                                        "arguments": {"timezone": "UTC"}}]})
    llm.script("UTC", {"content": "Got the time."})
    loop = agent.start(message="what time is it")
    run(app)
    assert finished(session, loop.id).status == "completed"
    answer = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert "UTC" in answer.content


def test_a_missing_required_tool_fails_the_loop_naming_tool_and_server(app, session, llm):
    with MCPEmulator() as server:
        server.tool("ping", result="pong")
        agent = remote_agent("needs_more", [{"name": "tiny", "url": server.url,
                                             "required_tools": ["launch"]}])
        loop = agent.start(message="go")
        run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "'launch'" in row.error_message and "'tiny'" in row.error_message


def test_the_tool_list_seen_at_the_first_turn_is_the_loops_snapshot(app, session, llm):
    from flask_solidloop.models import McpSession

    with MCPEmulator() as server:
        server.tool("ping", result="pong")
        agent = remote_agent("snapshot_remote", [{"name": "snap", "url": server.url,
                                                  "timeout": 5}])
        llm.script("ping", {"tool_calls": [{"name": "ping", "arguments": {}}]})
        llm.script("pong", {"tool_calls": [{"name": "ping", "arguments": {}}]}, times=1)
        llm.script(lambda body: len([m for m in body["messages"] if m["role"] == "tool"]) == 2,
                   {"content": "pinged twice"})
        loop = agent.start(message="ping it twice")
        run(app, queues=("solidloop_llm",))
        server.tool("shiny_new_tool", result="new")  # the server changes its tools later
        run(app, queues=("solidloop_tool",))
        run(app, queues=("solidloop_llm",))           # second turn: from the snapshot
        listed = [r for r in server.requests if r.rpc_method == "tools/list"]
        assert len(listed) == 1
        advertised = [t["function"]["name"] for t in llm.requests[-1].json["tools"]]
        assert advertised == ["ping"]
    # the server is gone now: the next turn still runs from the snapshot, and only
    # the call made to the dead server fails (as a classified tool error)
    run(app)
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    snapshot = session.scalars(select(McpSession)).one()
    assert [t["name"] for t in snapshot.tools] == ["ping"]
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.id)))
    assert [c.error_kind for c in calls] == [None, "infra:connect"]


def test_calls_resume_the_loops_stored_http_session(app, session, llm):
    from flask_solidloop.models import McpSession

    with MCPEmulator(stateless=False) as server:  # the handshake era: real sessions
        server.tool("ping", result="pong")
        agent = remote_agent("resume_remote", [{"name": "sess", "url": server.url,
                                                "timeout": 5}])
        llm.script("ping", {"tool_calls": [{"name": "ping", "arguments": {}}]})
        llm.script("pong", {"tool_calls": [{"name": "ping", "arguments": {}}]}, times=1)
        llm.script(lambda body: len([m for m in body["messages"] if m["role"] == "tool"]) == 2,
                   {"content": "done"})
        loop = agent.start(message="ping twice")
        run(app)
        assert finished(session, loop.id).status == "completed"
        initializes = [r for r in server.requests if r.rpc_method == "initialize"]
        calls = [c for c in server.calls if c.name == "ping"]
        stored = session.scalars(select(McpSession)).one().session_state
    assert len(calls) == 2
    assert len(initializes) == 1  # listing opened it; both calls resumed it
    assert {c.session_id for c in calls} == {stored.get("session_id")}


# -- each real peer in a loop, and bad input through the agent path -------------------------


def test_a_loop_uses_the_sdk_built_http_server(app, session, llm):
    from flask_solidloop.testing.mcp_sdk_server import McpSdkServer

    server = McpSdkServer().start()
    try:
        agent = remote_agent("sdk_http", [{"name": "sdk", "url": server.url, "timeout": 10,
                                           "tools": ["add"]}])
        llm.script("sum", {"tool_calls": [{"name": "add", "arguments": {"a": 20, "b": 22}}]})
        llm.script("42", {"content": "It is 42."})
        loop = agent.start(message="sum 20 and 22")
        run(app)
    finally:
        server.stop()
    assert finished(session, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is True and "42" in call.result["content"][0]["text"]


def test_a_loop_uses_the_everything_stdio_server(app, session, llm):
    _needs_peers()
    agent = remote_agent("everything", [{"name": "ev", "timeout": 30, "prefix": "ev",
                                         "command": [str(PEERS / "mcp-server-everything"),
                                                     "stdio"],
                                         "tools": ["echo", "get-sum"]}])
    llm.script("echo", {"tool_calls": [{"name": "ev__echo", "arguments": {"message": "hi"}},
                                       {"name": "ev__get-sum", "arguments": {"a": 2, "b": 40}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "done"})
    loop = agent.start(message="echo and sum")
    run(app)
    assert finished(session, loop.id).status == "completed"
    texts = [c.result["content"][0]["text"] for c in
             session.scalars(select(ToolCall).order_by(ToolCall.position))]
    assert "hi" in texts[0] and "42" in texts[1]


def test_arguments_that_fail_a_remote_schema_are_a_tool_error(app, session, llm):
    _needs_peers()
    agent = remote_agent("bad_remote_args", [{"name": "ev", "timeout": 30,
                                              "command": [str(PEERS / "mcp-server-everything"),
                                                          "stdio"],
                                              "tools": ["get-sum"]}])
    llm.script("sum", {"tool_calls": [{"name": "get-sum", "arguments": {"a": "two"}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "oops"})
    loop = agent.start(message="sum badly")
    run(app)
    assert finished(session, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False and call.error_kind is None  # the tool's refusal


def test_malformed_json_rpc_is_a_classified_tool_error(app, session, llm):
    from flask_solidloop.testing.mcp_sdk_server import McpSdkServer

    server = McpSdkServer().start()
    try:
        agent = remote_agent("garbled_rpc", [{"name": "sdk", "url": server.url, "timeout": 10,
                                              "tools": ["echo"]}])
        llm.script("garble", {"tool_calls": [{"name": "echo", "arguments": {"text": "x"}}]})
        llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "hm"})
        loop = agent.start(message="garble it")
        run(app, queues=("solidloop_llm",))
        server.fault_next("malformed", method="tools/call")
        run(app)
    finally:
        server.stop()
    assert finished(session, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert call.error_kind == "infra:protocol"


def test_a_stdio_command_that_does_not_exist_fails_the_first_turn_readably(app, session):
    agent = remote_agent("no_binary", [{"name": "ghost", "command": ["no-such-mcp-server-x"]}])
    loop = agent.start(message="anyone?")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "ghost" in row.error_message and "no-such-mcp-server-x" in row.error_message


def test_a_server_that_hangs_past_its_timeout_is_a_tool_error(app, session, llm):
    with MCPEmulator() as server:
        server.tool("nap", result="rested")
        agent = remote_agent("sleepy", [{"name": "sleepy", "url": server.url, "timeout": 1}])
        llm.script("nap", {"tool_calls": [{"name": "nap", "arguments": {}}]})
        llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "gave up"})
        loop = agent.start(message="take a nap")
        run(app, queues=("solidloop_llm",))
        server.fail_next("slow", seconds=3, method="tools/call")
        run(app)
    assert finished(session, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert call.error_kind == "infra:timeout"


# -- a real Streamable HTTP server restarted mid-loop ------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_everything_http(port: int):
    import os
    import subprocess
    import time

    proc = subprocess.Popen([str(PEERS / "mcp-server-everything"), "streamableHttp"],
                            env={**os.environ, "PORT": str(port)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"server-everything exited with {proc.returncode}") from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server-everything did not start listening within 30 s")


def test_a_loop_survives_its_http_server_restarting_between_calls(app, session, llm):
    """server-everything answers a session it does not know with HTTP 400: the
    transport initializes a new session, retries, and the loop stores it."""
    from flask_solidloop.mcp.http_transport import HttpTransport
    from flask_solidloop.models import McpSession

    _needs_peers()
    port = _free_port()
    servers = [_start_everything_http(port)]

    def restart_then_call(body: dict) -> dict:
        old = servers[-1]
        old.kill()
        old.wait(10)
        servers.append(_start_everything_http(port))
        return {"tool_calls": [{"name": "echo", "arguments": {"message": "two"}}]}

    def tool_messages(body: dict) -> int:
        return len([m for m in body["messages"] if m["role"] == "tool"])

    try:
        agent = remote_agent("everything_http", [{"name": "ev", "timeout": 15, "tools": ["echo"],
                                                  "url": f"http://127.0.0.1:{port}/mcp"}])
        llm.script("echo", {"tool_calls": [{"name": "echo", "arguments": {"message": "one"}}]},
                   times=1)
        llm.script(lambda body: tool_messages(body) == 1, restart_then_call, times=1)
        llm.script(lambda body: tool_messages(body) == 2, {"content": "done"})
        loop = agent.start(message="echo twice")
        run(app)
        row = finished(session, loop.id)
        assert row.status == "completed", row.error_message
        assert len(servers) == 2  # the server was restarted mid-loop
        calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
        assert [(c.is_success, c.error_kind) for c in calls] == [(True, None), (True, None)]
        assert "Echo: two" in calls[1].result["content"][0]["text"]
        # The loop stored the new session: it works against the new server as is.
        stored = session.scalars(select(McpSession)).one().session_state
        resumed = HttpTransport(f"http://127.0.0.1:{port}/mcp", session_state=stored)
        assert resumed.call_tool("echo", {"message": "three"}).text() == "Echo: three"
        assert resumed.session_state()["session_id"] == stored["session_id"]
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)
