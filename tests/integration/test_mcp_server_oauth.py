"""The MCP server blueprint as an OAuth resource server (decision 0041), against
JWTs minted here and a JWKS / authorization-server metadata served by a real
HTTP server on 127.0.0.1. The end-to-end tests with a real authorization
server are tests/acceptance/test_mcp_server_oauth.py."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from flask_solidloop import CallContext, ConfigurationError, Toolset
from flask_solidloop.mcp_server import Introspection, OAuthPrincipal, OAuthResource

from ..support.support_app import solidloop

MODERN = "2026-07-28"
RESOURCE = "http://localhost/mcp/orders"

orders = Toolset("oauth_orders")


@orders.tool
def who_calls(ctx: CallContext) -> dict:
    """Who the validated token speaks for."""
    principal = ctx.principal
    assert isinstance(principal, OAuthPrincipal)
    return {"subject": principal.subject, "client_id": principal.client_id,
            "scopes": sorted(principal.scopes), "label": principal.mcp_label,
            "claims_have_token": "token" in principal.claims}


class KeyServer:
    """RFC 8414 metadata and a JWKS on 127.0.0.1; ``keys`` may change while it runs."""

    def __init__(self) -> None:
        self.keys: dict[str, rsa.RSAPrivateKey] = {"k1": _key()}
        self.jwks_fetches = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/.well-known/oauth-authorization-server":
                    body = {"issuer": server.issuer, "jwks_uri": f"{server.issuer}/jwks.json",
                            "token_endpoint": f"{server.issuer}/token"}
                elif self.path == "/jwks.json":
                    server.jwks_fetches += 1
                    body = {"keys": [
                        {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(k.public_key())),
                         "kid": kid, "use": "sig", "alg": "RS256"}
                        for kid, k in server.keys.items()]}
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.issuer = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def mint(self, kid: str = "k1", *, key: rsa.RSAPrivateKey | None = None, **claims) -> str:
        now = int(time.time())
        body = {"iss": self.issuer, "sub": "alice", "client_id": "ide", "aud": RESOURCE,
                "scope": "orders", "iat": now, "exp": now + 60, **claims}
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(body, key or self.keys[kid], algorithm="RS256", headers={"kid": kid})

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def keys():
    server = KeyServer()
    yield server
    with contextlib.suppress(Exception):
        server.stop()


@pytest.fixture
def client(app, keys):
    # No refresh cooldown, so the rotation test need not wait 30 s.
    resource = OAuthResource(RESOURCE, [keys.issuer], required_scopes=["orders"],
                             resource_name="Orders", jwks_refresh_cooldown=0)
    app.register_blueprint(solidloop.mcp_blueprint(orders, oauth=resource, name="oauth_orders"),
                           url_prefix="/mcp/orders")
    return app.test_client()


def call(client, token: str | None, method: str = "tools/call", params: dict | None = None):
    params = params if params is not None else {"name": "who_calls", "arguments": {}}
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {}}, **params}}
    headers = {"Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if "name" in params:
        headers["Mcp-Name"] = params["name"]
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return client.post("/mcp/orders", json=body, headers=headers)


METADATA_URL = "http://localhost/.well-known/oauth-protected-resource/mcp/orders"


def test_the_metadata_is_served_at_the_app_root_for_the_resource(client, keys):
    for path in ("/.well-known/oauth-protected-resource/mcp/orders",
                 "/.well-known/oauth-protected-resource"):
        answer = client.get(path)
        assert answer.status_code == 200, path
        assert answer.get_json() == {
            "resource": RESOURCE, "authorization_servers": [keys.issuer],
            "scopes_supported": ["orders"], "bearer_methods_supported": ["header"],
            "resource_name": "Orders"}
        assert answer.headers["Access-Control-Allow-Origin"] == "*"


def test_a_valid_token_is_the_callers_principal_without_the_token(client, keys):
    answer = call(client, keys.mint())
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert answer.get_json()["result"]["structuredContent"] == {
        "subject": "alice", "client_id": "ide", "scopes": ["orders"], "label": "alice",
        "claims_have_token": False}
    # A client-credentials token without sub is labelled by its client.
    answer = call(client, keys.mint(sub=None, client_id="robot"))
    assert answer.get_json()["result"]["structuredContent"]["label"] == "client:robot"


def test_no_token_is_a_401_naming_the_metadata(client):
    answer = call(client, None)
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"] == f'Bearer resource_metadata="{METADATA_URL}"'


@pytest.mark.parametrize("claims, why", [
    ({"aud": "http://localhost/mcp/other"}, "was not issued for http://localhost/mcp/orders"),
    ({"exp": int(time.time()) - 120}, "has expired"),
    ({"nbf": int(time.time()) + 600}, "not yet valid"),
    ({"iss": "http://127.0.0.1:9"}, "issuer is not a trusted authorization server"),
    ({"exp": None}, 'missing the "exp" claim'),
])
def test_a_refused_token_is_a_401_invalid_token(client, keys, claims, why):
    answer = call(client, keys.mint(**claims))
    assert answer.status_code == 401
    challenge = answer.headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer error="invalid_token"'), challenge
    assert f'resource_metadata="{METADATA_URL}"' in challenge
    assert why in answer.get_json()["error_description"]


def test_a_forged_or_symmetric_token_is_refused(client, keys):
    forged = keys.mint(key=_key())  # the right kid, another key
    assert call(client, forged).status_code == 401
    now = int(time.time())
    hs = jwt.encode({"iss": keys.issuer, "aud": RESOURCE, "exp": now + 60, "scope": "orders"},
                    "a-shared-secret-of-enough-length-for-hs256", algorithm="HS256",
                    headers={"kid": "k1"})
    assert call(client, hs).status_code == 401
    assert call(client, "not-a-jwt").status_code == 401


def test_a_missing_scope_is_a_403_insufficient_scope(client, keys):
    answer = call(client, keys.mint(scope="profile"))
    assert answer.status_code == 403
    challenge = answer.headers["WWW-Authenticate"]
    assert 'error="insufficient_scope"' in challenge and 'scope="orders"' in challenge
    assert f'resource_metadata="{METADATA_URL}"' in challenge


def test_keys_are_cached_and_an_unknown_kid_refreshes_them(client, keys):
    assert call(client, keys.mint()).status_code == 200
    assert call(client, keys.mint()).status_code == 200
    assert keys.jwks_fetches == 1
    keys.keys["k2"] = _key()  # the authorization server rotates its key
    answer = call(client, keys.mint("k2"))
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert keys.jwks_fetches == 2


def test_an_unreachable_authorization_server_is_503_not_401(client, keys):
    keys.stop()
    answer = call(client, keys.mint())
    assert answer.status_code == 503
    assert "WWW-Authenticate" not in answer.headers


def test_sessions_bind_to_the_tokens_subject(client, keys):
    headers = {"Accept": "application/json, text/event-stream",
               "Authorization": f"Bearer {keys.mint()}"}
    init = client.post("/mcp/orders", headers=headers, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}})
    assert init.status_code == 200, init.get_data(as_text=True)
    session_id = init.headers["Mcp-Session-Id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
    same = {**headers, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    assert client.post("/mcp/orders", headers=same, json=listing).status_code == 200
    mallory = {**same, "Authorization": f"Bearer {keys.mint(sub='mallory')}"}
    assert client.post("/mcp/orders", headers=mallory, json=listing).status_code == 404


def test_two_oauth_blueprints_each_serve_their_own_document(app, keys):
    for path in ("a", "b"):
        resource = OAuthResource(f"http://localhost/mcp/{path}", [keys.issuer])
        app.register_blueprint(solidloop.mcp_blueprint(orders, oauth=resource,
                                                       name=f"oauth_{path}"),
                               url_prefix=f"/mcp/{path}")
    web = app.test_client()
    for path in ("a", "b"):
        document = web.get(f"/.well-known/oauth-protected-resource/mcp/{path}").get_json()
        assert document["resource"] == f"http://localhost/mcp/{path}"
        assert "scopes_supported" not in document
    # Which one would the bare well-known URL describe? Neither.
    assert web.get("/.well-known/oauth-protected-resource").status_code == 404


def test_with_two_issuers_the_label_names_the_issuer(app, keys):
    other = KeyServer()
    try:
        resource = OAuthResource(RESOURCE, [keys.issuer, other.issuer])
        app.register_blueprint(solidloop.mcp_blueprint(orders, oauth=resource,
                                                       name="oauth_two"),
                               url_prefix="/mcp/orders")
        web = app.test_client()
        labels = [call(web, server.mint()).get_json()["result"]["structuredContent"]["label"]
                  for server in (keys, other)]
        # Both say sub=alice; they are not the same caller.
        assert labels == [f"{keys.issuer} alice", f"{other.issuer} alice"]
    finally:
        other.stop()


def test_the_plain_auth_callable_keeps_its_challenge(app):
    app.register_blueprint(solidloop.mcp_blueprint(orders, auth=lambda token, request: None,
                                                   name="plain_orders",
                                                   allowed_hosts=["localhost"]),
                           url_prefix="/mcp/orders")
    web = app.test_client()
    answer = call(web, "whatever")
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"] == 'Bearer realm="mcp"'
    assert web.get("/.well-known/oauth-protected-resource").status_code == 404


@pytest.mark.parametrize("build, named", [
    (lambda: solidloop.mcp_blueprint(orders, auth=lambda t, r: "x", oauth=OAuthResource(
        RESOURCE, ["https://login.example.com"])), "auth= or oauth=, not both"),
    (lambda: solidloop.mcp_blueprint(orders, oauth={"resource": RESOURCE}),
     "must be OAuthResource("),
    (lambda: solidloop.mcp_blueprint(orders), "needs auth= or oauth="),
    (lambda: OAuthResource("/mcp/orders", ["https://login.example.com"]),
     "must be an absolute http(s) URL"),
    (lambda: OAuthResource(RESOURCE, "https://login.example.com"),
     "must be a list of issuer URLs, not a string"),
    (lambda: OAuthResource(RESOURCE, []), "must name at least one authorization server"),
    (lambda: OAuthResource(RESOURCE, ["https://login.example.com"], introspect_jwts=True),
     "needs introspection=Introspection("),
    (lambda: OAuthResource(RESOURCE, ["https://login.example.com"], algorithms=["HS256"]),
     "must list only asymmetric JWS algorithms"),
    (lambda: OAuthResource(RESOURCE, ["https://login.example.com"],
                           algorithms=["RS256", "none"]), "never none or HS*"),
    (lambda: OAuthResource(RESOURCE, ["https://login.example.com"],
                           required_scopes="orders"), "not a string"),
    (lambda: Introspection("rs", ""), "must be a non-empty string"),
])
def test_bad_oauth_configuration_is_one_clear_error(build, named):
    with pytest.raises(ConfigurationError) as caught:
        build()
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_introspection_secret_is_not_in_its_repr():
    assert "s3cret" not in repr(Introspection("rs", "s3cret"))
