"""OAuth-protected MCP servers, from the client side: a real authorization server
(authlib, tests/support/oauth_server.py) and an MCP server that takes only its
JWTs (tests/support/oauth_mcp.py), both on 127.0.0.1; loops run through the LLM
emulator and the in-process drain, the refresh race through 4 processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import urllib.parse
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from cryptography.fernet import Fernet
from sqlalchemy import select, text

from flask_solidloop import Agent
from flask_solidloop.loops.queries import classify_failure, failure_class_sql
from flask_solidloop.mcp import oauth
from flask_solidloop.mcp.oauth_blueprint import oauth_blueprint
from flask_solidloop.models import Loop, McpOAuthToken, ToolCall
from flask_solidloop.testing import drain as run

from ..support.oauth_mcp import ProtectedMCP
from ..support.oauth_refresh_worker import refresh_in_a_process
from ..support.oauth_server import start_oauth_server
from ..support.rows import loop_of as finished
from ..support.support_app import llm_settings, solidloop

SECRET_ENV = "SOLIDLOOP_TEST_OAUTH_SECRET"
CALLBACK = "http://localhost/solidloop/oauth/callback"


@pytest.fixture
def key():
    return Fernet.generate_key().decode()


@pytest.fixture
def app(database_url, llm, key):
    from ..support.support_app import create_app

    llm.reset()
    app = create_app(SOLIDLOOP_OAUTH_KEY=key)
    with app.app_context():
        yield app
        app.extensions["sqlalchemy"].session.remove()
        for engine in app.extensions["sqlalchemy"].engines.values():
            engine.dispose()
    app.extensions["solidloop"].stop_renewer()
    app.extensions["solidloop"].broker.close()


@pytest.fixture
def authz():
    server = start_oauth_server(access_token_lifetime=300)
    yield server
    server.stop()


@pytest.fixture
def mcp(authz):
    with ProtectedMCP(authz) as server:
        server.tool("lookup", description="Find a record",
                    input_schema={"type": "object", "properties": {"key": {"type": "string"}},
                                  "required": ["key"]},
                    handler=lambda arguments, meta: f"record {arguments['key']} is green")
        authz.resources = [server.url]
        yield server


def remote_agent(name: str, mcps: list[dict]) -> type[Agent]:
    class Remote(Agent):
        system_prompt = "You use remote tools."

        def llm(self):
            return llm_settings()

    Remote.mcps = mcps
    return solidloop.agent(name)(Remote)


def script_lookup(llm):
    llm.script("look up", {"tool_calls": [{"name": "lookup", "arguments": {"key": "k1"}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool",
               {"content": "It is green."})


def code_entry(mcp, client_id, **auth):
    return {"name": "crm", "url": mcp.url,
            "auth": {"type": "oauth", "client_id": client_id, **auth}}


def sign_in(app, entry, **blueprint):
    """Drive the blueprint with a browser's steps: sign-in, the AS's auto-approve
    (real HTTP), back to the callback. Returns the authorization request's query."""
    app.register_blueprint(oauth_blueprint([entry], **blueprint))
    browser = app.test_client()
    start = browser.get(f"/solidloop/oauth/{entry['name']}/sign-in")
    assert start.status_code == 302, start.text
    authorize = start.headers["Location"]
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(authorize).query))
    approved = httpx.get(authorize, follow_redirects=False)
    assert approved.status_code == 302, approved.text
    back = urllib.parse.urlsplit(approved.headers["Location"])
    assert back.path == "/solidloop/oauth/callback" and "code=" in back.query, back
    done = browser.get(f"{back.path}?{back.query}")
    assert done.status_code == 200, done.text
    assert "Signed in to crm" in done.text
    return query


def all_solidloop_text_containing(session, secret: str) -> list[str]:
    """Every solidloop table whose rows, as text, contain ``secret``."""
    tables = session.execute(text(
        "SELECT tablename FROM pg_tables WHERE tablename LIKE 'solidloop_%'")).scalars().all()
    return [t for t in tables if session.execute(
        text(f"SELECT 1 FROM {t} AS r WHERE r::text LIKE :s LIMIT 1"),
        {"s": f"%{secret}%"}).first()]


def test_discovery_follows_the_401_to_the_authorization_server(app, authz, mcp):
    entry = oauth.OAuthEntry.from_entry(code_entry(mcp, "any"))
    found = oauth.discover(entry)
    assert found.resource_metadata is not None
    assert str(found.resource_metadata.resource) == mcp.url
    assert str(found.metadata.token_endpoint) == f"{authz.issuer}/token"
    assert str(found.metadata.authorization_endpoint) == f"{authz.issuer}/authorize"
    assert mcp.refused == 1  # the unauthenticated probe, answered with resource_metadata
    assert mcp.metadata_requests == ["/resource-metadata.json"]  # the one the 401 named


def test_discovery_falls_back_to_the_well_known_url(app, authz, mcp):
    mcp.advertise = False
    found = oauth.discover(oauth.OAuthEntry.from_entry(code_entry(mcp, "any")))
    assert found.resource_metadata is not None
    assert str(found.metadata.issuer) == authz.issuer
    assert mcp.metadata_requests == ["/.well-known/oauth-protected-resource/mcp"]


def test_a_loop_calls_a_server_with_client_credentials(app, session, llm, authz, mcp,
                                                        monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    client = authz.register_client(grant_types=["client_credentials"])
    monkeypatch.setenv(SECRET_ENV, client.client_secret)
    agent = remote_agent("oauth_cc", [{"name": "crm", "url": mcp.url, "auth": {
        "type": "oauth", "grant": "client_credentials", "client_id": client.client_id,
        "client_secret_env": SECRET_ENV}}])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    assert mcp.calls[-1].name == "lookup"
    # RFC 8707: every token request named the MCP server as its resource.
    assert authz.token_requests and all(
        form["resource"] == mcp.url for form in authz.token_requests)
    assert [f["grant_type"] for f in authz.token_requests] == ["client_credentials"]
    token = mcp.accepted[-1]
    stored = session.scalars(select(McpOAuthToken)).one()
    assert stored.access_token_encrypted and token not in stored.access_token_encrypted
    assert all_solidloop_text_containing(session, token) == []
    assert all_solidloop_text_containing(session, client.client_secret) == []
    # Every log line of the process but the test authorization server's own (authlib
    # logs the tokens it issues at DEBUG): ours, the SDK's, the HTTP clients'.
    ours = "\n".join(r.getMessage() for r in caplog.records
                     if not r.name.startswith("authlib"))
    assert "job start" in ours and "send_request_headers" in ours
    assert token not in ours and client.client_secret not in ours


def test_the_code_flow_with_pkce_signs_in_and_a_loop_uses_the_token(
        app, session, llm, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    query = sign_in(app, entry)
    assert query["code_challenge_method"] == "S256" and query["code_challenge"]
    assert query["resource"] == mcp.url and query["client_id"] == client.client_id
    exchange = authz.token_requests[-1]
    assert exchange["grant_type"] == "authorization_code" and exchange["code_verifier"]
    assert exchange["resource"] == mcp.url
    stored = session.scalars(select(McpOAuthToken)).one()
    assert stored.subject == "default" and stored.refresh_token_encrypted
    issued = authz.tokens[-1]
    for secret in (issued.access_token, issued.refresh_token):
        assert all_solidloop_text_containing(session, secret) == []

    agent = remote_agent("oauth_code", [entry])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    assert finished(session, loop.id).status == "completed"
    assert mcp.accepted[-1] == issued.access_token
    assert authz.refresh_count == 0


def test_tokens_per_user_follow_the_loops_subject(app, session, llm, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    sign_in(app, entry, subject=lambda server: "user:42")  # the signed-in user, per the host

    class PerUser(Agent):
        system_prompt = "You use remote tools."

        def llm(self):
            return llm_settings()

        def mcps(self):
            # start() validates with no loop yet; a turn has one.
            subject = f"user:{self.loop.subject_id}" if self.loop else "default"
            return [{**entry, "auth": {**entry["auth"], "subject": subject}}]

    agent = solidloop.agent("oauth_per_user")(PerUser)
    script_lookup(llm)
    signed = agent.start(message="please look up k1", subject=("user", "42"))
    other = agent.start(message="please look up k1", subject=("user", "7"))
    run(app)
    assert finished(session, signed.id).status == "completed"
    row = finished(session, other.id)
    assert row.status == "failed"
    assert "no OAuth token for subject 'user:7' yet" in row.error_message
    assert [r.subject for r in session.scalars(select(McpOAuthToken))] == ["user:42"]


def test_a_client_id_metadata_document_is_the_client_id_when_the_server_takes_one(
        app, session, authz, mcp):
    mcp.client_metadata = {"client_name": "solidloop tests", "redirect_uris": [CALLBACK],
                           "grant_types": ["authorization_code", "refresh_token"],
                           "token_endpoint_auth_method": "none"}
    mcp.client_metadata["client_id"] = mcp.client_metadata_url
    entry = code_entry(mcp, "never-registered", client_metadata_url=mcp.client_metadata_url)
    query = sign_in(app, entry)
    assert query["client_id"] == mcp.client_metadata_url
    stored = session.scalars(select(McpOAuthToken)).one()
    assert stored.client_id == mcp.client_metadata_url


def test_dynamic_registration_when_configured_and_no_metadata_document(
        app, session, authz, mcp):
    authz.cimd = False
    advertised = authz.metadata
    authz.metadata = lambda: {**advertised(), "registration_endpoint": mcp.registration_url}
    entry = {"name": "crm", "url": mcp.url, "auth": {
        "type": "oauth", "dynamic_registration": True,
        "client_metadata_url": "https://app.example/client.json"}}
    query = sign_in(app, entry)
    assert len(mcp.registered) == 1
    registered = mcp.registered[0]
    assert registered["redirect_uris"] == [CALLBACK]
    assert registered["token_endpoint_auth_method"] == "none"
    assert query["client_id"] in authz.clients and query["client_id"] != entry["auth"][
        "client_metadata_url"]
    stored = session.scalars(select(McpOAuthToken)).one()
    assert stored.client_id == query["client_id"] and stored.access_token_encrypted


def test_four_processes_racing_to_refresh_do_one_refresh(
        app, session, database_url, key, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    sign_in(app, entry)
    before = authz.tokens[-1].access_token
    # Expired for every process: each one sets out to refresh it.
    session.execute(McpOAuthToken.__table__.update().values(
        expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    session.commit()
    # fork: each child starts with the modules loaded (spawn re-imports them, tens of
    # seconds on a loaded machine) and leaves through os._exit, so the parent's
    # inherited connections are never touched; each child opens its own engine.
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=refresh_in_a_process, args=(
        database_url, key, oauth.OAuthEntry.from_entry(entry), barrier, results))
        for _ in range(4)]
    for proc in procs:
        proc.start()
    tokens = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert authz.refresh_count == 1, authz.token_requests
    assert len(set(tokens)) == 1, tokens
    assert tokens[0] != before and authz.verify(tokens[0], mcp.url) is not None


def test_a_revoked_token_fails_the_loop_naming_server_and_sign_in_url(
        app, session, llm, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    sign_in(app, entry)
    oauth.access_token(oauth.OAuthEntry.from_entry(entry))  # this process caches it
    authz.revoke_all()
    agent = remote_agent("oauth_revoked", [entry])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert row.error_message.startswith("McpAuthError: crm:"), row.error_message
    assert "sign in at /solidloop/oauth/crm/sign-in" in row.error_message
    assert classify_failure(row.error_message) == "auth:oauth"
    # One refresh tried and refused; the 401s did not loop (one listing attempt:
    # the transport's era probe and its handshake fallback).
    assert authz.refresh_count == 1 and mcp.refused <= 3
    stored = session.scalars(select(McpOAuthToken)).one()
    assert stored.refresh_token_encrypted is None  # nobody tries the revoked one again


def test_a_token_revoked_between_turns_fails_the_loop_at_the_tool_call(
        app, session, llm, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    sign_in(app, entry)
    agent = remote_agent("oauth_revoked_later", [entry])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app, queues=("solidloop_llm",))  # tools listed with a good token; the call is due
    authz.revoke_all()
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed", row.error_message
    assert row.error_message.startswith("tool call 1: McpAuthError: crm:"), row.error_message
    assert "sign in at /solidloop/oauth/crm/sign-in" in row.error_message
    assert classify_failure(row.error_message) == "auth:oauth"
    # The admin's SQL rule says the same.
    assert session.scalar(select(failure_class_sql()).where(Loop.id == loop.id)) == "auth:oauth"
    assert authz.refresh_count == 1 and mcp.calls == []


def test_a_401_before_expiry_refreshes_once_and_the_call_goes_through(
        app, session, llm, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    entry = code_entry(mcp, client.client_id)
    sign_in(app, entry)
    first = oauth.access_token(oauth.OAuthEntry.from_entry(entry))
    # The access token alone is revoked (not expired): the server answers 401.
    response = httpx.post(f"{authz.issuer}/revoke", data={
        "token": first, "token_type_hint": "access_token", "client_id": client.client_id})
    assert response.status_code == 200
    agent = remote_agent("oauth_renewed", [entry])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    assert authz.refresh_count == 1
    assert mcp.accepted and first not in mcp.accepted


def test_a_server_that_refuses_a_fresh_token_fails_the_loop_instead_of_looping(
        app, session, llm, authz, mcp, monkeypatch):
    client = authz.register_client(grant_types=["client_credentials"])
    monkeypatch.setenv(SECRET_ENV, client.client_secret)
    mcp.refuse_all = True
    agent = remote_agent("oauth_refused", [{"name": "crm", "url": mcp.url, "auth": {
        "type": "oauth", "grant": "client_credentials", "client_id": client.client_id,
        "client_secret_env": SECRET_ENV}}])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "refused a freshly issued OAuth token" in row.error_message
    assert classify_failure(row.error_message) == "auth:oauth"
    # The first token, then exactly one new one after the 401.
    assert [f["grant_type"] for f in authz.token_requests] == ["client_credentials"] * 2


def test_an_unreachable_authorization_server_is_a_tool_error_the_loop_survives(
        app, session, llm, authz, mcp, monkeypatch):
    client = authz.register_client(grant_types=["client_credentials"])
    monkeypatch.setenv(SECRET_ENV, client.client_secret)
    agent = remote_agent("oauth_as_down", [{"name": "crm", "url": mcp.url, "auth": {
        "type": "oauth", "grant": "client_credentials", "client_id": client.client_id,
        "client_secret_env": SECRET_ENV}}])
    llm.script("look up", {"tool_calls": [{"name": "lookup", "arguments": {"key": "k1"}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool",
               {"content": "The records are unavailable."})
    loop = agent.start(message="please look up k1")
    run(app, queues=("solidloop_llm",))  # listed with a token; the call is due
    # The token is due for renewal and the authorization server is gone.
    oauth._cache.clear()
    session.execute(McpOAuthToken.__table__.update().values(
        expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    session.commit()
    authz.stop()
    run(app)
    row = finished(session, loop.id)
    assert row.status == "completed", row.error_message
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False and call.error_kind == "infra:connect"
    assert "could not be reached" in call.result["content"][0]["text"]
    assert mcp.calls == []


def test_a_loop_with_no_token_yet_fails_with_the_sign_in_url(app, session, llm, authz, mcp):
    agent = remote_agent("oauth_unsigned", [code_entry(mcp, "someone")])
    script_lookup(llm)
    loop = agent.start(message="please look up k1")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert "McpAuthError: crm: no OAuth token for subject 'default' yet" in row.error_message
    assert "/solidloop/oauth/crm/sign-in" in row.error_message
    assert authz.token_requests == [] and mcp.calls == []


def test_a_resource_the_authorization_server_does_not_serve_is_refused(
        app, session, llm, authz, mcp, monkeypatch):
    client = authz.register_client(grant_types=["client_credentials"])
    monkeypatch.setenv(SECRET_ENV, client.client_secret)
    authz.resources = ["http://127.0.0.1:1/elsewhere"]
    entry = {"name": "crm", "url": mcp.url, "auth": {
        "type": "oauth", "grant": "client_credentials", "client_id": client.client_id,
        "client_secret_env": SECRET_ENV}}
    with pytest.raises(oauth.McpAuthError, match="invalid_target"):
        oauth.access_token(oauth.OAuthEntry.from_entry(entry))
    assert os.environ[SECRET_ENV] not in str(authz.token_requests[-1].get("resource"))


def start_sign_in(app, entry):
    """The sign-in up to the authorization server's answer: the browser and the
    callback's query (the code not yet exchanged)."""
    app.register_blueprint(oauth_blueprint([entry]))
    browser = app.test_client()
    start = browser.get(f"/solidloop/oauth/{entry['name']}/sign-in")
    assert start.status_code == 302, start.text
    approved = httpx.get(start.headers["Location"], follow_redirects=False)
    assert approved.status_code == 302, approved.text
    back = urllib.parse.urlsplit(approved.headers["Location"])
    return browser, start.headers["Location"], dict(urllib.parse.parse_qsl(back.query))


@pytest.mark.parametrize("iss", ["https://evil.example", "{issuer}/", "{ISSUER}"])
def test_the_callback_refuses_an_iss_that_is_not_the_issuer_exactly(
        app, session, authz, mcp, iss):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    browser, _, query = start_sign_in(app, code_entry(mcp, client.client_id))
    query["iss"] = iss.format(issuer=authz.issuer, ISSUER=authz.issuer.upper())
    done = browser.get(f"/solidloop/oauth/callback?{urllib.parse.urlencode(query)}")
    assert done.status_code == 400, done.text
    assert "RFC 9207" in done.text and "not" in done.text
    assert authz.token_requests == []  # the code never went to a token endpoint
    assert session.scalars(select(McpOAuthToken)).all() == []
    # The issuer exactly as published is taken.
    query["iss"] = authz.issuer
    done = browser.get(f"/solidloop/oauth/callback?{urllib.parse.urlencode(query)}")
    assert done.status_code == 200, done.text


def test_the_callback_refuses_a_missing_iss_when_the_server_advertises_it(
        app, session, authz, mcp):
    client = authz.register_client(public=True, redirect_uris=[CALLBACK],
                                   grant_types=["authorization_code", "refresh_token"])
    advertised = authz.metadata
    authz.metadata = lambda: {**advertised(),
                              "authorization_response_iss_parameter_supported": True}
    browser, _, query = start_sign_in(app, code_entry(mcp, client.client_id))
    query.pop("iss", None)
    done = browser.get(f"/solidloop/oauth/callback?{urllib.parse.urlencode(query)}")
    assert done.status_code == 400, done.text
    assert "advertises the iss response parameter" in done.text
    assert authz.token_requests == []
    query["iss"] = authz.issuer
    done = browser.get(f"/solidloop/oauth/callback?{urllib.parse.urlencode(query)}")
    assert done.status_code == 200, done.text


def test_without_an_entry_scope_the_resource_metadatas_scopes_are_asked_for(
        app, authz, mcp):
    def asked(entry):
        url = oauth.begin_sign_in(oauth.OAuthEntry.from_entry(entry), subject="default",
                                  redirect_uri=CALLBACK, nonce="n")
        return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))

    # The protected resource's scopes_supported (authz.scopes), offline_access added
    # only if the authorization server lists it.
    scope = asked(code_entry(mcp, "c1"))["scope"].split()
    assert scope[:len(authz.scopes)] == authz.scopes
    assert scope[len(authz.scopes):] in ([], ["offline_access"])
    assert asked(code_entry(mcp, "c1", scope="only.this"))["scope"] == "only.this"
