"""The MCP server blueprint behind OAuth (decision 0041), end to end: a real
authorization server (tests/support/oauth_server.py, authlib) issues tokens,
the blueprint runs under gunicorn, and outside clients call it: raw HTTP, and
the MCP Inspector CLI (@modelcontextprotocol/inspector, installed by
scripts/mcp_peers.sh)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import httpx
import psycopg
import pytest

from flask_solidloop.urls import libpq_url

from ..support.mcp_gunicorn import eventually, free_port, serve
from ..support.oauth_server import start_oauth_server

ACCEPT = "application/json, text/event-stream"
MODERN = "2026-07-28"
ROOT = Path(__file__).resolve().parents[2]
INSPECTOR = ROOT / ".mcp-peers" / "node_modules" / ".bin" / "mcp-inspector"


@pytest.fixture(scope="module")
def world(database_url, tmp_path_factory):
    """The authorization server, two registered clients, and gunicorn serving
    the OAuth blueprints for resources on its own port."""
    auth_server = start_oauth_server(scopes=["mcp"])
    ide = auth_server.register_client("ide", grant_types=["client_credentials"])
    resource_server = auth_server.register_client("calc-rs", grant_types=[], introspect=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    env = {"SOLIDLOOP_TEST_DATABASE_URL": database_url,
           "SOLIDLOOP_TEST_OAUTH_ISSUER": auth_server.issuer,
           "SOLIDLOOP_TEST_OAUTH_BASE": base,
           "SOLIDLOOP_TEST_OAUTH_RS_ID": resource_server.client_id,
           "SOLIDLOOP_TEST_OAUTH_RS_SECRET": resource_server.client_secret or ""}
    try:
        with serve(workers=2, threads=4, env=env, log_path=log, port=port) as served:
            assert served == base
            yield {"base": base, "as": auth_server, "ide": ide}
    finally:
        auth_server.stop()


def token_for(world, resource: str, scope: str = "mcp") -> str:
    """A client-credentials access token of the authorization server for ``resource``."""
    ide = world["ide"]
    reply = httpx.post(f"{world['as'].issuer}/token", data={
        "grant_type": "client_credentials", "resource": resource, "scope": scope},
        auth=(ide.client_id, ide.client_secret), timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["access_token"]


def call(url: str, token: str | None, method: str = "tools/list",
         params: dict | None = None) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {}}, **(params or {})}}
    headers = {"Accept": ACCEPT, "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if params and "name" in params:
        headers["Mcp-Name"] = params["name"]
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(url, json=body, headers=headers, timeout=30)


def test_a_token_from_the_authorization_server_is_accepted(world):
    url = world["base"] + "/mcp/secure"
    token = token_for(world, url)
    listed = call(url, token)
    assert listed.status_code == 200, listed.text
    names = {tool["name"] for tool in listed.json()["result"]["tools"]}
    assert {"add", "whoami", "echo"} <= names
    who = call(url, token, "tools/call", {"name": "whoami", "arguments": {}})
    assert who.status_code == 200, who.text
    # A client-credentials token's subject is the client itself.
    assert who.json()["result"]["structuredContent"]["principal"] == "ide"


def test_no_token_is_a_401_whose_metadata_names_the_authorization_server(world):
    url = world["base"] + "/mcp/secure"
    refused = call(url, None)
    assert refused.status_code == 401
    metadata_url = world["base"] + "/.well-known/oauth-protected-resource/mcp/secure"
    assert refused.headers["WWW-Authenticate"] == f'Bearer resource_metadata="{metadata_url}"'
    document = httpx.get(metadata_url, timeout=10).json()
    assert document["resource"] == url
    assert document["authorization_servers"] == [world["as"].issuer]
    assert document["scopes_supported"] == ["mcp"]
    assert document["bearer_methods_supported"] == ["header"]
    # What a client does next: the authorization server's own metadata.
    server = httpx.get(document["authorization_servers"][0]
                       + "/.well-known/oauth-authorization-server", timeout=10).json()
    assert server["token_endpoint"] == world["as"].issuer + "/token"


def test_a_token_for_another_resource_is_refused(world):
    url = world["base"] + "/mcp/secure"
    other = token_for(world, world["base"] + "/mcp/introspected")
    refused = call(url, other)
    assert refused.status_code == 401
    challenge = refused.headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer error="invalid_token"'), challenge
    assert ('resource_metadata="' + world["base"]
            + '/.well-known/oauth-protected-resource/mcp/secure"') in challenge
    assert f"not issued for {url}" in refused.json()["error_description"]


def test_an_expired_token_is_refused(world):
    url = world["base"] + "/mcp/secure"
    auth_server = world["as"]
    lifetime = auth_server.access_token_lifetime
    auth_server.access_token_lifetime = -120  # expired when issued, past our 30 s leeway
    try:
        token = token_for(world, url)
    finally:
        auth_server.access_token_lifetime = lifetime
    refused = call(url, token)
    assert refused.status_code == 401
    assert 'error="invalid_token"' in refused.headers["WWW-Authenticate"]
    assert "expired" in refused.json()["error_description"]


def test_introspection_refuses_a_revoked_or_unknown_token(world):
    url = world["base"] + "/mcp/introspected"
    token = token_for(world, url)
    accepted = call(url, token)
    assert accepted.status_code == 200, accepted.text
    ide = world["ide"]
    revoked = httpx.post(f"{world['as'].issuer}/revoke", data={
        "token": token, "token_type_hint": "access_token"},
        auth=(ide.client_id, ide.client_secret), timeout=10)
    assert revoked.status_code == 200, revoked.text
    refused = call(url, token)
    assert refused.status_code == 401
    assert refused.json()["error_description"] == "the token is not active"
    opaque = call(url, secrets.token_urlsafe(24))
    assert opaque.status_code == 401
    assert 'error="invalid_token"' in opaque.headers["WWW-Authenticate"]


def test_introspection_checks_the_audience_too(world):
    token = token_for(world, world["base"] + "/mcp/secure")
    refused = call(world["base"] + "/mcp/introspected", token)
    assert refused.status_code == 401
    assert "not issued for" in refused.json()["error_description"]


def test_the_wire_log_names_the_principal_and_holds_no_token(world, database_url):
    def db(sql: str, *args):
        with psycopg.connect(libpq_url(database_url)) as conn:
            return conn.execute(sql, args).fetchall()

    url = world["base"] + "/mcp/secure"
    token = token_for(world, url)
    assert call(url, token, "tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}
                ).status_code == 200
    wrong = token_for(world, world["base"] + "/mcp/introspected")
    assert call(url, wrong).status_code == 401
    events = eventually(lambda: db(
        "SELECT status_code, error, payload FROM solidloop_events WHERE kind = 'mcp_inbound' "
        "AND payload->>'server' = 'mcp_secure' ORDER BY id"), lambda rows: len(rows) >= 2)
    by_status = {status: (error, payload) for status, error, payload in events}
    error, payload = by_status[200]
    assert payload["principal"] == "ide" and payload["tool"] == "add"
    assert payload["request"]["headers"]["authorization"] == "[redacted]"
    error, payload = by_status[401]
    assert error.startswith("not authenticated: invalid_token: the token was not issued for")
    everything = db("SELECT string_agg(payload::text || coalesce(error, ''), ' ') "
                    "FROM solidloop_events")[0][0]
    assert token not in everything and wrong not in everything
    # Not even the signature alone (what a careless excerpt would keep).
    assert token.rsplit(".", 1)[1] not in everything


def inspector(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if not INSPECTOR.exists():
        pytest.fail(f"{INSPECTOR} is missing: run bash scripts/mcp_peers.sh")
    env = {**os.environ, "MCP_CATALOG_PATH": str(tmp_path / "catalog.json"),
           "HOME": str(tmp_path)}
    return subprocess.run([str(INSPECTOR), "--cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def test_the_mcp_inspector_lists_the_tools_with_a_token(world, tmp_path):
    url = world["base"] + "/mcp/secure"
    token = token_for(world, url)
    done = inspector(tmp_path, url, "--transport", "http",
                     "--header", f"Authorization: Bearer {token}", "--method", "tools/list")
    assert done.returncode == 0, done.stderr + done.stdout
    names = {tool["name"] for tool in json.loads(done.stdout)["tools"]}
    assert {"add", "whoami", "echo", "remember", "nap"} <= names


def test_the_mcp_inspector_fails_without_a_token(world, tmp_path):
    done = inspector(tmp_path, world["base"] + "/mcp/secure", "--transport", "http",
                     "--method", "tools/list")
    assert done.returncode != 0
    assert '"tools"' not in done.stdout
    # It read the 401's challenge as "OAuth needed" (it would start the
    # authorization flow on a terminal), not as a broken server.
    assert '"code":"auth_required"' in done.stderr, done.stderr
