"""The MCP server blueprint over real HTTP (gunicorn -w 4 -k gthread): sessions,
security, bad input and the inbound wire log. Raw requests through httpx, so
each test says exactly what went on the wire."""

from __future__ import annotations

import json
import re
import socket

import httpx
import psycopg
import pytest

from flask_solidloop.urls import libpq_url

from ..support.mcp_gunicorn import eventually

ACCEPT = "application/json, text/event-stream"
MODERN = "2026-07-28"
SECRET = "token-alice"  # the token is the secret: it must never be stored


def envelope(**params) -> dict:
    return {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                      "io.modelcontextprotocol/clientCapabilities": {}}, **params}


def rpc(method: str, params: dict | None = None, id_: int | None = 1) -> dict:
    body: dict = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        body["params"] = params
    if id_ is not None:
        body["id"] = id_
    return body


class Mcp:
    """Raw Streamable HTTP against one blueprint."""

    def __init__(self, base: str, path: str = "/mcp/calc", token: str | None = SECRET) -> None:
        self.url = base + path
        self.token = token

    def headers(self, **extra: str) -> dict:
        headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        headers.update(extra)
        return headers

    def post(self, body, **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes | str) else json.dumps(body)
        return httpx.post(self.url, content=content, headers=self.headers(**headers), timeout=30)

    def modern(self, method: str, params: dict | None = None, **headers: str) -> httpx.Response:
        routing = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}
        if method == "tools/call" and params and "name" in params:
            routing["Mcp-Name"] = params["name"]
        return self.post(rpc(method, envelope(**(params or {}))), **{**routing, **headers})

    def initialize(self, version: str = "2025-11-25") -> str:
        reply = self.post(rpc("initialize", {"protocolVersion": version, "capabilities": {},
                                             "clientInfo": {"name": "raw", "version": "1"}}))
        assert reply.status_code == 200, reply.text
        assert reply.json()["result"]["protocolVersion"] == version
        session_id = reply.headers["Mcp-Session-Id"]
        ack = self.post(rpc("notifications/initialized", id_=None),
                        **{"Mcp-Session-Id": session_id, "MCP-Protocol-Version": version})
        assert ack.status_code == 202
        return session_id

    def in_session(self, session_id: str, method: str, params: dict | None = None,
                   version: str | None = "2025-11-25", **headers: str) -> httpx.Response:
        extra = {"Mcp-Session-Id": session_id}
        if version:
            extra["MCP-Protocol-Version"] = version
        return self.post(rpc(method, params), **{**extra, **headers})


@pytest.fixture
def mcp(mcp_gunicorn):
    return Mcp(mcp_gunicorn)


@pytest.fixture
def db(database_url):
    def query(sql: str, *args):
        with psycopg.connect(libpq_url(database_url)) as conn:
            return conn.execute(sql, args).fetchall()
    return query


# -- auth -----------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong", "token-"])
def test_no_principal_is_401_with_a_bearer_challenge(mcp_gunicorn, token):
    reply = Mcp(mcp_gunicorn, token=token).post(rpc("ping"))
    assert reply.status_code == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")


# -- the handshake era ---------------------------------------------------------------------


def test_a_session_lives_in_postgres_bound_to_its_principal(mcp, mcp_gunicorn, db):
    session_id = mcp.initialize()
    rows = db("SELECT server_name, principal_label, protocol_version, client_info, "
              "terminated_at FROM solidloop_mcp_inbound_sessions WHERE id = %s", session_id)
    assert rows == [("mcp_calc", "alice", "2025-11-25", {"name": "raw", "version": "1"}, None)]

    listed = mcp.in_session(session_id, "tools/list")
    assert listed.status_code == 200
    assert "add" in {t["name"] for t in listed.json()["result"]["tools"]}
    # Absent MCP-Protocol-Version after initialize means 2025-03-26, which we speak.
    assert mcp.in_session(session_id, "ping", version=None).status_code == 200

    # Another principal holding the id gets what an unknown id gets.
    bob = Mcp(mcp_gunicorn, token="token-bob")
    assert bob.in_session(session_id, "tools/list").status_code == 404
    # Another blueprint does not know it either.
    agents = Mcp(mcp_gunicorn, path="/mcp/agents")
    assert agents.in_session(session_id, "tools/list").status_code == 404
    assert mcp.in_session("no-such-session", "tools/list").status_code == 404

    # GET (the server-to-client stream) is declined, so no thread is ever pinned.
    get = httpx.get(mcp.url, headers={**mcp.headers(), "Mcp-Session-Id": session_id})
    assert get.status_code == 405

    # DELETE by another principal does nothing; by the owner it ends the session.
    assert httpx.delete(bob.url, headers={**bob.headers(), "Mcp-Session-Id": session_id}
                        ).status_code == 404
    ended = httpx.delete(mcp.url, headers={**mcp.headers(), "Mcp-Session-Id": session_id})
    assert ended.status_code == 200
    assert mcp.in_session(session_id, "tools/list").status_code == 404
    assert db("SELECT terminated_at IS NOT NULL FROM solidloop_mcp_inbound_sessions "
              "WHERE id = %s", session_id) == [(True,)]


def test_handshake_versions_are_checked(mcp):
    session_id = mcp.initialize("2025-06-18")
    reply = mcp.in_session(session_id, "ping", version="1999-01-01")
    assert reply.status_code == 400
    assert "2025-11-25" in reply.json()["error"]["data"]["supported"]
    # A client proposing a version we do not speak is offered our latest.
    offered = mcp.post(rpc("initialize", {"protocolVersion": "2099-01-01", "capabilities": {},
                                          "clientInfo": {"name": "x", "version": "1"}}))
    assert offered.json()["result"]["protocolVersion"] == "2025-11-25"
    # A request without a session is refused; a notification in a session is 202.
    assert mcp.post(rpc("tools/list")).status_code == 400
    cancelled = mcp.post(rpc("notifications/cancelled", {"requestId": 7}, id_=None),
                         **{"Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-06-18"})
    assert cancelled.status_code == 202


# -- 2026-07-28 -------------------------------------------------------------------------------


def test_stateless_requests_carry_result_type_and_cache_hints(mcp, db):
    discover = mcp.modern("server/discover")
    assert discover.status_code == 200, discover.text
    result = discover.json()["result"]
    assert result["supportedVersions"] == [MODERN]
    assert result["resultType"] == "complete" and "ttlMs" in result and "cacheScope" in result
    listed = mcp.modern("tools/list").json()["result"]
    assert listed["resultType"] == "complete" and listed["cacheScope"] == "private"
    called = mcp.modern("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}})
    assert called.json()["result"]["content"][0]["text"] == "3"
    assert called.json()["result"]["resultType"] == "complete"
    # Whitespace around header values is not a mismatch (sent raw: httpx refuses it).
    body = json.dumps(rpc("tools/list", envelope())).encode()
    port = int(mcp.url.split(":")[2].split("/")[0])
    raw = (f"POST /mcp/calc HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
           f"Authorization: Bearer {SECRET}\r\nAccept: {ACCEPT}\r\n"
           "Content-Type: application/json\r\nMcp-Method:   tools/list  \r\n"
           f"MCP-Protocol-Version: \t{MODERN} \r\nContent-Length: {len(body)}\r\n"
           "Connection: close\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert db("SELECT count(*) FROM solidloop_mcp_inbound_sessions") == [(0,)]


def test_a_tools_writes_through_ctx_session_commit_before_the_answer(mcp, db, database_url):
    """Served to an outside client, a tool's uncommitted writes through
    ctx.session commit once it returned (rolled back if it raised)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS probe_notes (note text)")
        conn.execute("DELETE FROM probe_notes")
    kept = mcp.modern("tools/call", {"name": "remember",
                                     "arguments": {"note": "kept", "fail": False}})
    assert kept.json()["result"]["content"][0]["text"] == "noted"
    failed = mcp.modern("tools/call", {"name": "remember",
                                       "arguments": {"note": "undone", "fail": True}})
    assert failed.json()["result"]["isError"] is True
    assert db("SELECT note FROM probe_notes") == [("kept",)]


def test_subscriptions_listen_is_acknowledged_then_closed(mcp):
    reply = mcp.modern("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    frames = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: ")]
    assert frames[0]["method"] == "notifications/subscriptions/acknowledged"
    assert frames[-1]["id"] == 1 and "result" in frames[-1]
    assert frames[-1]["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 1


# -- bad input: the right JSON-RPC error or HTTP status, never a 500 ---------------------------


def test_bad_input_gets_the_right_error(mcp):
    def error(reply: httpx.Response) -> tuple[int, int]:
        return reply.status_code, reply.json()["error"]["code"]

    assert error(mcp.post(b"{not json")) == (400, -32700)
    assert error(mcp.post([rpc("ping"), rpc("ping", id_=2)])) == (400, -32600)
    assert error(mcp.post(b'"just a string"')) == (400, -32600)
    assert error(mcp.modern("resources/list")) == (404, -32601)
    assert error(mcp.modern("no/such/method")) == (404, -32601)
    assert error(mcp.modern("tools/call", {"arguments": {}})) == (400, -32602)
    assert error(mcp.modern("tools/call", {"name": "nope"})) == (400, -32602)
    # Unsupported modern version: -32022 with the versions we speak.
    reply = mcp.post(rpc("ping", {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2099-01-01",
        "io.modelcontextprotocol/clientCapabilities": {}}}),
        **{"MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "ping"})
    assert error(reply) == (400, -32022)
    assert reply.json()["error"]["data"]["supported"] == [MODERN]
    # A routing header that does not match the body.
    assert error(mcp.modern("tools/call", {"name": "add", "arguments": {"a": 1, "b": 1}},
                            **{"Mcp-Name": "lookup"})) == (400, -32020)
    assert error(mcp.modern("tools/list", **{"Mcp-Method": "server/discover"})) == (400, -32020)
    # ping is a handshake-era method: 2026-07-28 does not have it.
    assert error(mcp.modern("ping")) == (404, -32601)
    # Tool-level problems are tool results the model can act on.
    invalid = mcp.modern("tools/call", {"name": "add", "arguments": {"a": "x", "b": 1}})
    assert invalid.status_code == 200 and invalid.json()["result"]["isError"] is True
    assert "invalid arguments for tool 'add'" in invalid.json()["result"]["content"][0]["text"]
    raised = mcp.modern("tools/call", {"name": "explode", "arguments": {"reason": "boom"}})
    assert raised.json()["result"]["isError"] is True
    # A raising tool's text stays on the server (expose_errors=False): an error id.
    hidden = raised.json()["result"]["content"][0]["text"]
    assert "boom" not in hidden and re.match(r"^the tool failed \(error id [0-9a-f]{12}\)", hidden)
    # HTTP-level refusals.
    assert mcp.post(rpc("ping"), Accept="application/json").status_code == 406
    assert mcp.post(rpc("ping"), Accept="text/html").status_code == 406
    assert mcp.post(rpc("ping"), **{"Content-Type": "text/plain"}).status_code == 415
    assert mcp.post(b"{" + b" " * (4 * 1024 * 1024 + 10) + b"}").status_code == 413


def test_host_and_origin_are_checked(mcp):
    assert mcp.modern("tools/list", Host="evil.example").status_code == 421
    assert mcp.modern("tools/list", Origin="http://evil.example").status_code == 403
    assert mcp.modern("tools/list", Origin="http://localhost:5173").status_code == 200


# -- the inbound wire log ------------------------------------------------------------------------


def test_one_event_per_request_redacted_and_no_token_anywhere(mcp, db, mcp_gunicorn):
    session_id = mcp.initialize()
    mcp.in_session(session_id, "tools/call", {"name": "add", "arguments": {"a": 2, "b": 2},
                                             "_meta": {"note": SECRET}})
    events = eventually(lambda: db(
        "SELECT status_code, duration_ms, payload FROM solidloop_events "
        "WHERE kind = 'mcp_inbound' AND payload->>'session_id' = %s ORDER BY id", session_id),
        lambda rows: len(rows) >= 3)
    # Each gunicorn process writes its own events from a background thread, so
    # ids follow the writers, not the requests: one row per request, in any order.
    methods = sorted(payload["method"] for _, _, payload in events)
    assert methods == ["initialize", "notifications/initialized", "tools/call"]
    status, duration, payload = next(e for e in events if e[2]["method"] == "tools/call")
    assert status == 200 and duration > 0
    assert payload["tool"] == "add" and payload["principal"] == "alice"
    assert payload["server"] == "mcp_calc" and payload["era"] == "handshake"
    assert payload["request"]["headers"]["authorization"] == "[redacted]"
    assert '"a": 2' in payload["request"]["body"]
    assert '"text":"4"' in payload["response"]["body"]
    everything = db("SELECT string_agg(payload::text || coalesce(error, ''), ' ') "
                    "FROM solidloop_events")[0][0]
    sessions = db("SELECT string_agg(t::text, ' ') FROM solidloop_mcp_inbound_sessions t")[0][0]
    assert SECRET not in everything and SECRET not in sessions
