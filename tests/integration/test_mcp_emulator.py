"""Tests for flask_solidloop.testing.mcp_emulator: the official MCP SDK client (and raw
httpx) against a running MCPEmulator, in both protocol eras. No database."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import anyio
import httpx
import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import SERVER_INFO_META_KEY, CallToolResult, RequestParamsMeta, TextContent
from mcp.types.jsonrpc import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
)

from flask_solidloop.testing.mcp_emulator import MCPEmulator

IDEMPOTENCY_KEY = "solidloop/idempotencyKey"
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
MODERN = "2026-07-28"
GREET_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}


def greet(arguments: dict[str, Any], meta: dict[str, Any]) -> str:
    return f"Hello {arguments['name']}!"


def register_tools(emu: MCPEmulator) -> None:
    emu.tool("greet", description="Say hello.", input_schema=GREET_SCHEMA, handler=greet)
    emu.tool("weather", result={"city": "Paris", "temp_c": 21},
             output_schema={"type": "object", "properties": {"city": {"type": "string"}}})
    emu.tool("static", result="plain text")


@pytest.fixture
def emu() -> Iterator[MCPEmulator]:
    with MCPEmulator() as server:
        register_tools(server)
        yield server


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return anyio.run(fn)


def rpc(request_id: int | None, method: str, params: dict[str, Any] | None = None
        ) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if request_id is not None:
        message["id"] = request_id
    if params is not None:
        message["params"] = params
    return message


def initialize(client: httpx.Client, url: str, version: str = "2025-11-25") -> httpx.Response:
    return client.post(url, headers=HEADERS, json=rpc(1, "initialize", {
        "protocolVersion": version, "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "0"},
    }))


def open_session(client: httpx.Client, url: str) -> dict[str, str]:
    """Initialize over raw HTTP; the headers every later request of the session needs."""
    response = initialize(client, url)
    assert response.status_code == 200
    headers = {**HEADERS, "mcp-session-id": response.headers["mcp-session-id"],
               "mcp-protocol-version": "2025-11-25"}
    ack = client.post(url, headers=headers, json=rpc(None, "notifications/initialized"))
    assert ack.status_code == 202
    return headers


def modern_request(request_id: int, method: str, params: dict[str, Any] | None = None,
                   ) -> tuple[dict[str, str], dict[str, Any]]:
    """A well-formed 2026-07-28 request: the _meta envelope plus the routing headers."""
    body_params = dict(params or {})
    body_params["_meta"] = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {},
        **body_params.get("_meta", {}),
    }
    headers = {**HEADERS, "mcp-protocol-version": MODERN, "mcp-method": method}
    if method == "tools/call":
        headers["mcp-name"] = body_params["name"]
    return headers, rpc(request_id, method, body_params)


def text(result: CallToolResult) -> str:
    """The text of a result's first content block."""
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


def idempotency(key: str) -> RequestParamsMeta:
    """A request _meta carrying solidloop's idempotency key (an open TypedDict at runtime)."""
    return cast(RequestParamsMeta, {IDEMPOTENCY_KEY: key})


def leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in leaves(inner)]
    return [group]


# --------------------------------------------------------------------------- SDK client


def test_handshake_era_with_the_sdk_client(emu: MCPEmulator) -> None:
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with Client(emu.url, mode="legacy") as client:
            seen["version"] = client.protocol_version
            seen["server"] = client.server_info.name if client.server_info else None
            seen["sessions"] = emu.sessions
            listed = await client.list_tools()
            seen["tools"] = {t.name: t for t in listed.tools}
            seen["greet"] = await client.call_tool(
                "greet", {"name": "Ada"}, meta=idempotency("loop-1:call-1"))
            seen["weather"] = await client.call_tool("weather", {})
            seen["static"] = await client.call_tool("static", {})

    run(scenario)
    assert seen["version"] == "2025-11-25"
    assert seen["server"] == "emulator"
    assert len(seen["sessions"]) == 1
    tools = seen["tools"]
    assert set(tools) == {"greet", "weather", "static"}
    assert tools["greet"].description == "Say hello."
    assert tools["greet"].input_schema == GREET_SCHEMA
    assert tools["weather"].output_schema == {"type": "object",
                                              "properties": {"city": {"type": "string"}}}
    assert text(seen["greet"]) == "Hello Ada!"
    assert not seen["greet"].is_error
    assert seen["weather"].structured_content == {"city": "Paris", "temp_c": 21}
    assert json.loads(text(seen["weather"])) == {"city": "Paris", "temp_c": 21}
    assert text(seen["static"]) == "plain text"

    # the handler received the _meta sent by the client, and the run was recorded
    call = emu.calls[0]
    assert (call.name, call.arguments) == ("greet", {"name": "Ada"})
    assert call.meta == {IDEMPOTENCY_KEY: "loop-1:call-1"}
    assert call.session_id == seen["sessions"][0]
    assert call.protocol_version == "2025-11-25"

    # the wire, as recorded (headers lower-cased)
    methods = [(r.method, r.rpc_method, r.status) for r in emu.requests]
    assert methods[0] == ("POST", "initialize", 200)
    assert ("POST", "notifications/initialized", 202) in methods
    # the SDK opens its GET stream from a background task, so it may or may not get there;
    # when it does, the emulator declines (no standalone SSE stream)
    gets = [status for method, _, status in methods if method == "GET"]
    assert set(gets) <= {405, 404, None}
    others = [m for m in methods if m[0] != "GET"]
    assert others[-1] == ("DELETE", None, 200)  # the SDK ends its session on exit
    tool_call = next(r for r in emu.requests if r.rpc_method == "tools/call")
    assert tool_call.headers["mcp-session-id"] == seen["sessions"][0]
    assert tool_call.headers["mcp-protocol-version"] == "2025-11-25"
    assert tool_call.json["params"]["_meta"] == {IDEMPOTENCY_KEY: "loop-1:call-1"}
    assert emu.sessions == []


def test_stateless_era_with_the_sdk_client(emu: MCPEmulator) -> None:
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with Client(emu.url) as client:  # mode="auto": probes server/discover first
            seen["version"] = client.protocol_version
            seen["server"] = client.server_info.name if client.server_info else None
            seen["tools"] = [t.name for t in (await client.list_tools()).tools]
            seen["greet"] = await client.call_tool(
                "greet", {"name": "Bo"}, meta=idempotency("k-2"))
            seen["weather"] = await client.call_tool("weather", {})

    run(scenario)
    assert seen["version"] == MODERN
    assert seen["server"] == "emulator"
    assert seen["tools"] == ["greet", "weather", "static"]
    assert text(seen["greet"]) == "Hello Bo!"
    assert seen["greet"].meta[SERVER_INFO_META_KEY]["name"] == "emulator"
    assert seen["weather"].structured_content == {"city": "Paris", "temp_c": 21}

    assert emu.requests[0].rpc_method == "server/discover"
    assert "initialize" not in [r.rpc_method for r in emu.requests]
    assert emu.sessions == []
    call_request = next(r for r in emu.requests if r.rpc_method == "tools/call")
    assert call_request.headers["mcp-method"] == "tools/call"
    assert call_request.headers["mcp-name"] == "greet"
    assert "mcp-session-id" not in call_request.headers
    meta = emu.calls[0].meta
    assert meta[IDEMPOTENCY_KEY] == "k-2"
    assert meta["io.modelcontextprotocol/protocolVersion"] == MODERN
    assert emu.calls[0].session_id is None


def test_auto_mode_falls_back_to_the_handshake_when_stateless_is_off() -> None:
    with MCPEmulator(stateless=False) as emu:
        register_tools(emu)

        async def scenario() -> tuple[str | None, str]:
            async with Client(emu.url) as client:
                result = await client.call_tool("greet", {"name": "Cy"})
                return client.protocol_version, text(result)

        assert run(scenario) == ("2025-11-25", "Hello Cy!")
        statuses = [(r.rpc_method, r.status) for r in emu.requests]
        # the probe got -32022 naming handshake versions only, so the client fell back
        assert statuses[:2] == [("server/discover", 400), ("initialize", 200)]


def test_handler_errors_unknown_tools_and_bad_arguments(emu: MCPEmulator) -> None:
    def explode(arguments: dict[str, Any], meta: dict[str, Any]) -> str:
        raise ValueError("disk on fire")

    def refuse(arguments: dict[str, Any], meta: dict[str, Any]) -> str:
        raise MCPError(INVALID_PARAMS, "refused by the tool")

    emu.tool("explode", handler=explode)
    emu.tool("refuse", handler=refuse)
    emu.tool("echo")  # no result, no handler: echoes its arguments
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with Client(emu.url, mode="legacy") as client:
            seen["explode"] = await client.call_tool("explode", {})
            seen["bad_args"] = await client.call_tool("greet", {"name": 42})
            seen["echo"] = await client.call_tool("echo", {"a": [1, 2]})
            for name in ("refuse", "missing"):
                with pytest.raises(MCPError) as caught:
                    await client.call_tool(name, {})
                seen[name] = caught.value

    run(scenario)
    assert seen["explode"].is_error
    assert "ValueError: disk on fire" in text(seen["explode"])
    assert seen["bad_args"].is_error
    assert text(seen["bad_args"]).startswith("Input validation error")
    assert json.loads(text(seen["echo"])) == {"a": [1, 2]}
    assert (seen["refuse"].code, seen["refuse"].message) == (INVALID_PARAMS, "refused by the tool")
    assert seen["missing"].code == INVALID_PARAMS
    assert "Unknown tool: missing" in seen["missing"].message
    # a run is recorded only when the tool itself ran
    assert [c.name for c in emu.calls] == ["explode", "echo", "refuse"]


def test_bearer_token_is_required() -> None:
    with MCPEmulator(token="s3cret") as emu:
        register_tools(emu)

        async def without_token() -> None:
            async with Client(emu.url, mode="legacy") as client:
                await client.list_tools()

        with pytest.raises(BaseException) as caught:
            run(without_token)
        errors = [leaf for leaf in leaves(caught.value) if isinstance(leaf, MCPError)]
        assert errors and errors[0].code == INTERNAL_ERROR  # the SDK's stand-in for a bare 4xx
        assert [(r.rpc_method, r.status) for r in emu.requests] == [("initialize", 401)]

        async def with_token() -> list[str]:
            async with httpx2.AsyncClient(headers={"Authorization": "Bearer s3cret"}) as http:
                transport = streamable_http_client(emu.url, http_client=http)
                async with Client(transport, mode="legacy") as client:
                    return [t.name for t in (await client.list_tools()).tools]

        assert run(with_token) == ["greet", "weather", "static"]

        with httpx.Client() as raw:
            missing = raw.post(emu.url, headers=HEADERS, json=rpc(1, "tools/list"))
            wrong = raw.post(emu.url, headers={**HEADERS, "authorization": "Bearer nope"},
                             json=rpc(1, "tools/list"))
        assert missing.status_code == wrong.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
        assert "jsonrpc" not in missing.json()  # an OAuth-style body, not JSON-RPC


def test_session_lost_makes_the_client_initialize_again(emu: MCPEmulator) -> None:
    seen: dict[str, Any] = {}

    async def first_client() -> None:
        async with Client(emu.url, mode="legacy") as client:
            seen["old"] = emu.sessions[0]
            emu.fail_next("session_lost")
            with pytest.raises(MCPError) as caught:
                await client.call_tool("greet", {"name": "Di"})
            seen["error"] = caught.value
            seen["sessions_after"] = emu.sessions

    async def second_client() -> str:
        async with Client(emu.url, mode="legacy") as client:
            seen["new"] = emu.sessions[0]
            return text(await client.call_tool("greet", {"name": "Di"}))

    run(first_client)
    assert seen["error"].code == INVALID_REQUEST
    assert seen["sessions_after"] == []
    lost = next(r for r in emu.requests if r.rpc_method == "tools/call")
    assert lost.status == 404
    assert emu.calls == []
    # at the HTTP level too: the old session answers 404 from now on
    with httpx.Client() as raw:
        stale = raw.post(emu.url, headers={**HEADERS, "mcp-session-id": seen["old"]},
                         json=rpc(7, "tools/list"))
    assert stale.status_code == 404
    assert run(second_client) == "Hello Di!"
    assert seen["new"] != seen["old"]


def test_session_lost_over_raw_http(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)
        emu.fail_next("session_lost", method="tools/list")
        call = raw.post(emu.url, headers=headers, json=rpc(2, "tools/call",
                                                           {"name": "static", "arguments": {}}))
        assert call.status_code == 200  # the failure waits for a tools/list
        lost = raw.post(emu.url, headers=headers, json=rpc(3, "tools/list"))
        again = raw.post(emu.url, headers=headers, json=rpc(4, "tools/list"))
        fresh = open_session(raw, emu.url)
        listed = raw.post(emu.url, headers=fresh, json=rpc(5, "tools/list"))
    assert (lost.status_code, again.status_code) == (404, 404)
    assert lost.json()["error"]["code"] == INVALID_REQUEST
    assert fresh["mcp-session-id"] != headers["mcp-session-id"]
    assert listed.status_code == 200
    assert emu.sessions == [fresh["mcp-session-id"]]


def test_slow_answers_and_client_timeouts(emu: MCPEmulator) -> None:
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with Client(emu.url, mode="legacy") as client:
            await client.list_tools()
            emu.fail_next("slow", seconds=0.3, method="tools/call")
            started = time.perf_counter()
            seen["slow"] = await client.call_tool("static", {})
            seen["slow_s"] = time.perf_counter() - started
            # The timed-out call's server side lasts 2 s; the next call must not
            # wait behind it (well under 1.5 s, however loaded the machine).
            emu.fail_next("slow", seconds=2.0, method="tools/call")
            with pytest.raises(MCPError) as caught:
                await client.call_tool("static", {}, read_timeout_seconds=0.1)
            seen["timeout"] = caught.value
            started = time.perf_counter()
            seen["fast"] = await client.call_tool("static", {})
            seen["fast_s"] = time.perf_counter() - started

    run(scenario)
    assert text(seen["slow"]) == "plain text"
    assert seen["slow_s"] >= 0.3
    assert seen["timeout"].code == REQUEST_TIMEOUT
    assert text(seen["fast"]) == "plain text"
    assert seen["fast_s"] < 1.5


def test_is_error_failure(emu: MCPEmulator) -> None:
    emu.fail_next("is_error", tool="weather")  # does not touch other tools
    emu.fail_next("is_error", message="quota exceeded")

    async def scenario() -> list[Any]:
        async with Client(emu.url, mode="legacy") as client:
            return [await client.call_tool("greet", {"name": "Ed"}),
                    await client.call_tool("static", {}),
                    await client.call_tool("weather", {}),
                    await client.call_tool("weather", {})]

    failed, static, weather_failed, weather = run(scenario)
    assert failed.is_error and text(failed) == "quota exceeded"
    assert not static.is_error
    assert weather_failed.is_error
    assert weather.structured_content == {"city": "Paris", "temp_c": 21}
    assert [c.name for c in emu.calls] == ["static", "weather"]  # injected errors ran nothing


def test_malformed_answers(emu: MCPEmulator) -> None:
    async def scenario() -> list[MCPError]:
        errors = []
        async with Client(emu.url, mode="legacy") as client:
            await client.list_tools()
            emu.fail_next("malformed")
            emu.fail_next("malformed", body='{"hello": "not JSON-RPC"}')
            for _ in range(2):
                with pytest.raises(MCPError) as caught:
                    await client.call_tool("greet", {"name": "Flo"})
                errors.append(caught.value)
            assert text(await client.call_tool("static", {})) == "plain text"
        return errors

    errors = run(scenario)
    assert [e.code for e in errors] == [PARSE_ERROR, PARSE_ERROR]
    # the tool ran both times: only its answer was mangled
    assert [c.name for c in emu.calls] == ["greet", "greet", "static"]
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)
        emu.fail_next("malformed")
        answer = raw.post(emu.url, headers=headers, json=rpc(2, "tools/list"))
    assert answer.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.text)


def test_status_failures(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)
        emu.fail_next("status", status=503, retry_after=2)
        emu.fail_next("status", times=2, status=500)
        unavailable = raw.post(emu.url, headers=headers, json=rpc(2, "tools/list"))
        errors = [raw.post(emu.url, headers=headers, json=rpc(i, "tools/list")).status_code
                  for i in (3, 4)]
        healthy = raw.post(emu.url, headers=headers, json=rpc(5, "tools/list"))
        # notifications never consume failures
        emu.fail_next("status", status=401)
        note = raw.post(emu.url, headers=headers, json=rpc(None, "notifications/progress",
                                                          {"progressToken": 1, "progress": 1}))
        unauthorized = raw.post(emu.url, headers=headers, json=rpc(6, "tools/list"))
    assert unavailable.status_code == 503
    assert unavailable.headers["retry-after"] == "2"
    assert unavailable.headers["content-type"].startswith("text/plain")
    assert "jsonrpc" not in unavailable.text
    assert errors == [500, 500]
    assert healthy.status_code == 200
    assert note.status_code == 202
    assert unauthorized.status_code == 401
    assert unauthorized.headers["www-authenticate"].startswith("Bearer")

    async def scenario() -> MCPError:
        async with Client(emu.url, mode="legacy") as client:
            emu.fail_next("status", status=502, method="tools/call")
            with pytest.raises(MCPError) as caught:
                await client.call_tool("greet", {"name": "Gil"})
            return caught.value

    assert run(scenario).code == INTERNAL_ERROR
    assert emu.calls == []


# --------------------------------------------------------------------------- raw HTTP


def test_handshake_rules_over_raw_http(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        opened = initialize(raw, emu.url)
        session_id = opened.headers["mcp-session-id"]
        assert opened.json()["result"]["protocolVersion"] == "2025-11-25"
        assert opened.json()["result"]["capabilities"] == {"tools": {"listChanged": False}}
        headers = {**HEADERS, "mcp-session-id": session_id}

        notified = raw.post(emu.url, headers=headers, json=rpc(None, "notifications/initialized"))
        answered = raw.post(emu.url, headers=headers,
                            json={"jsonrpc": "2.0", "id": 99, "result": {}})
        ping = raw.post(emu.url, headers=headers, json=rpc(2, "ping"))
        listed = raw.post(emu.url, headers=headers, json=rpc(3, "tools/list"))
        discover = raw.post(emu.url, headers=headers, json=rpc(4, "server/discover"))
        unknown_method = raw.post(emu.url, headers=headers, json=rpc(5, "resources/list"))
        no_session = raw.post(emu.url, headers=HEADERS, json=rpc(6, "tools/list"))
        unknown = raw.post(emu.url, headers={**HEADERS, "mcp-session-id": "nope"},
                           json=rpc(7, "tools/list"))
        wrong_version = raw.post(emu.url, headers={**headers, "mcp-protocol-version": "2025-03-26"},
                                 json=rpc(8, "tools/list"))
        get = raw.get(emu.url, headers={"accept": "text/event-stream", **headers})
        unknown_note = raw.post(emu.url, headers={**HEADERS, "mcp-session-id": "nope"},
                                json=rpc(None, "notifications/initialized"))

    assert (notified.status_code, notified.content) == (202, b"")
    assert notified.headers["mcp-session-id"] == session_id
    assert answered.status_code == 202
    assert ping.json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    assert listed.headers["mcp-session-id"] == session_id
    assert [t["name"] for t in listed.json()["result"]["tools"]] == ["greet", "weather", "static"]
    assert "ttlMs" not in listed.json()["result"]  # 2026-only fields are sieved out
    assert discover.status_code == 200  # handshake-era errors travel with HTTP 200
    assert discover.json()["error"]["code"] == METHOD_NOT_FOUND
    assert unknown_method.json()["error"]["code"] == METHOD_NOT_FOUND
    assert no_session.status_code == 400
    assert unknown.status_code == 404
    assert wrong_version.status_code == 400
    assert get.status_code == 405
    assert unknown_note.status_code == 404


def test_delete_ends_the_session(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)
        other = open_session(raw, emu.url)
        assert sorted(emu.sessions) == sorted([headers["mcp-session-id"],
                                               other["mcp-session-id"]])
        deleted = raw.delete(emu.url, headers=headers)
        reused = raw.post(emu.url, headers=headers, json=rpc(2, "tools/list"))
        deleted_again = raw.delete(emu.url, headers=headers)
        no_session = raw.delete(emu.url, headers=HEADERS)
        still_alive = raw.post(emu.url, headers=other, json=rpc(3, "tools/list"))
    assert deleted.status_code == 200
    assert (reused.status_code, deleted_again.status_code) == (404, 404)
    assert no_session.status_code == 405
    assert still_alive.status_code == 200
    assert emu.sessions == [other["mcp-session-id"]]


def test_protocol_version_negotiation(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        old = initialize(raw, emu.url, "2025-03-26")
        future = initialize(raw, emu.url, "2099-01-01")
        headers = {**HEADERS, "mcp-session-id": old.headers["mcp-session-id"]}
        weather = raw.post(emu.url, headers=headers, json=rpc(2, "tools/call",
                                                             {"name": "weather", "arguments": {}}))
    assert old.json()["result"]["protocolVersion"] == "2025-03-26"
    assert future.json()["result"]["protocolVersion"] == "2025-11-25"
    assert emu.session_protocol_version(old.headers["mcp-session-id"]) == "2025-03-26"
    # the SDK validates every pre-2026 version against one 2025-11-25 schema, so fields
    # newer than 2025-03-26 (structuredContent) still reach a 2025-03-26 client
    assert weather.json()["result"]["structuredContent"] == {"city": "Paris", "temp_c": 21}
    assert emu.calls[0].protocol_version == "2025-03-26"


def test_stateless_era_over_raw_http(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        headers, body = modern_request(1, "server/discover")
        discovered = raw.post(emu.url, headers=headers, json=body)
        headers, body = modern_request(2, "tools/call", {
            "name": "greet", "arguments": {"name": "Hu"}, "_meta": {IDEMPOTENCY_KEY: "k"}})
        called = raw.post(emu.url, headers=headers, json=body)
        mismatch = raw.post(emu.url, headers={**headers, "mcp-name": "static"}, json=body)
        no_envelope = raw.post(emu.url, headers=headers,
                               json=rpc(3, "tools/call", {"name": "greet", "arguments": {}}))
        headers, body = modern_request(4, "initialize", {})
        no_initialize = raw.post(emu.url, headers=headers, json=body)
        headers, body = modern_request(5, "resources/list")
        unknown_method = raw.post(emu.url, headers=headers, json=body)
        note = raw.post(emu.url, headers={**HEADERS, "mcp-protocol-version": MODERN},
                        json=rpc(None, "notifications/cancelled", {"requestId": 2}))
        future_note = raw.post(emu.url, headers={**HEADERS, "mcp-protocol-version": "2099-01-01"},
                               json=rpc(None, "notifications/cancelled", {"requestId": 2}))

    result = discovered.json()["result"]
    assert result["supportedVersions"] == [MODERN]
    assert result["resultType"] == "complete"
    assert result["_meta"][SERVER_INFO_META_KEY] == {"name": "emulator", "version": "1.0.0"}
    assert called.status_code == 200
    assert called.json()["result"]["content"][0]["text"] == "Hello Hu!"
    assert "mcp-session-id" not in called.headers
    assert mismatch.status_code == 400
    assert mismatch.json()["error"]["code"] == HEADER_MISMATCH
    assert no_envelope.status_code == 400
    assert no_envelope.json()["error"]["code"] == INVALID_PARAMS
    assert no_initialize.status_code == 404
    assert unknown_method.status_code == 404
    assert unknown_method.json()["error"]["code"] == METHOD_NOT_FOUND
    assert (note.status_code, note.content) == (202, b"")
    assert future_note.status_code == 400
    assert emu.sessions == []
    assert [c.meta[IDEMPOTENCY_KEY] for c in emu.calls] == ["k"]


def test_dns_rebinding_guard(emu: MCPEmulator) -> None:
    port = emu.url.split(":")[2].split("/")[0]
    with httpx.Client() as raw:
        evil_origin = raw.post(emu.url, headers={**HEADERS, "origin": "http://evil.example"},
                               json=rpc(1, "ping"))
        evil_host = raw.post(emu.url, headers={**HEADERS, "host": "evil.example"},
                             json=rpc(1, "ping"))
        local_origin = initialize(raw, emu.url.replace("127.0.0.1", "localhost"))
        good_origin = raw.post(emu.url, headers={**HEADERS, "origin": f"http://localhost:{port}",
                                                 "host": f"localhost:{port}"},
                               json=rpc(None, "notifications/initialized"))
    assert evil_origin.status_code == 403
    assert evil_host.status_code == 421
    assert local_origin.status_code == 200
    assert good_origin.status_code == 400  # past the guard; rejected for lacking a session


def test_transport_level_rejections(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        not_json = raw.post(emu.url, headers=HEADERS, content=b"{nope")
        batch = raw.post(emu.url, headers=HEADERS, json=[rpc(1, "ping"), rpc(2, "ping")])
        not_rpc = raw.post(emu.url, headers=HEADERS, json={"hello": "world"})
        text_body = raw.post(emu.url, headers={**HEADERS, "content-type": "text/plain"},
                             content=b"{}")
        html_only = raw.post(emu.url, headers={**HEADERS, "accept": "text/html"},
                             json=rpc(1, "ping"))
        put = raw.put(emu.url, headers=HEADERS, json=rpc(1, "ping"))
        elsewhere = raw.post(emu.base_url + "/other", headers=HEADERS, json=rpc(1, "ping"))
    assert (not_json.status_code, not_json.json()["error"]["code"]) == (400, PARSE_ERROR)
    assert (batch.status_code, batch.json()["error"]["code"]) == (400, INVALID_REQUEST)
    assert not_rpc.status_code == 400
    assert text_body.status_code == 415
    assert html_only.status_code == 406
    assert put.status_code == 405
    assert elsewhere.status_code == 404
    assert [r.status for r in emu.requests] == [400, 400, 400, 415, 406, 405, 404]


def test_sse_answers() -> None:
    with MCPEmulator(sse=True) as emu:
        register_tools(emu)

        async def scenario(mode: str) -> str:
            async with Client(emu.url, mode=mode) as client:
                return text(await client.call_tool("greet", {"name": "Ivy"}))

        assert run(lambda: scenario("legacy")) == "Hello Ivy!"
        assert run(lambda: scenario("auto")) == "Hello Ivy!"
        with httpx.Client() as raw:
            streamed = initialize(raw, emu.url)
            plain = raw.post(emu.url, headers={**HEADERS, "accept": "application/json"},
                             json=rpc(1, "initialize", {
                                 "protocolVersion": "2025-11-25", "capabilities": {},
                                 "clientInfo": {"name": "raw", "version": "0"}}))
    assert streamed.headers["content-type"] == "text/event-stream"
    event, data, blank = streamed.text.split("\n")[:3]
    assert (event, blank) == ("event: message", "")
    assert json.loads(data.removeprefix("data: "))["result"]["protocolVersion"] == "2025-11-25"
    assert plain.headers["content-type"] == "application/json"


# --------------------------------------------------------------------------- API


def test_registration_and_failure_arguments_are_checked(emu: MCPEmulator) -> None:
    with pytest.raises(ValueError):
        emu.tool("has space", result="x")
    with pytest.raises(TypeError):
        emu.tool("both", result="x", handler=greet)
    with pytest.raises(ValueError):
        emu.tool("array", input_schema={"type": "array"})
    with pytest.raises(TypeError):
        emu.tool("number", result=42)
    with pytest.raises(ValueError):
        emu.fail_next("explode")
    with pytest.raises(TypeError):
        emu.fail_next("status")  # status= is required
    with pytest.raises(TypeError):
        emu.fail_next("slow", secs=1)
    with pytest.raises(ValueError):
        emu.fail_next("slow", times=0)
    emu.tool("full", result={"content": [{"type": "text", "text": "t"}], "isError": True,
                             "_meta": {"k": "v"}})
    emu.remove_tool("static")
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)
        full = raw.post(emu.url, headers=headers, json=rpc(2, "tools/call",
                                                          {"name": "full", "arguments": {}}))
        listed = raw.post(emu.url, headers=headers, json=rpc(3, "tools/list"))
    assert full.json()["result"] == {"content": [{"type": "text", "text": "t"}],
                                     "isError": True, "_meta": {"k": "v"}}
    assert [t["name"] for t in listed.json()["result"]["tools"]] == ["greet", "weather", "full"]


def test_recorded_requests_are_thread_safe_and_reset_forgets(emu: MCPEmulator) -> None:
    with httpx.Client() as raw:
        headers = open_session(raw, emu.url)

    def worker(index: int) -> None:
        with httpx.Client() as client:
            for n in range(10):
                client.post(emu.url, headers=headers, json=rpc(
                    index * 100 + n, "tools/call",
                    {"name": "greet", "arguments": {"name": f"w{index}-{n}"}}))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls = [r for r in emu.requests if r.rpc_method == "tools/call"]
    assert len(calls) == len(emu.calls) == 60
    assert {r.status for r in calls} == {200}
    assert len({c.arguments["name"] for c in emu.calls}) == 60
    assert all(key == key.lower() for r in emu.requests for key in r.headers)
    assert emu.last_request().session_id == headers["mcp-session-id"]

    emu.fail_next("slow", seconds=5)
    emu.reset()
    assert (emu.requests, emu.calls, emu.sessions) == ([], [], [])
    with httpx.Client() as raw:
        fresh = open_session(raw, emu.url)
        started = time.perf_counter()
        listed = raw.post(emu.url, headers=fresh, json=rpc(2, "tools/list"))
    assert time.perf_counter() - started < 2  # the queued failure was forgotten too
    assert listed.json()["result"]["tools"] == []  # and so were the tools
