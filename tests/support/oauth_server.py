"""A real OAuth 2.1 authorization server for tests, on authlib's Flask integration.

``start_oauth_server()`` serves it on 127.0.0.1 (a free port, werkzeug in a
thread) and returns an :class:`OAuthServerHandle`. Everything is in memory:
clients, authorization codes, tokens. What it offers:

* RFC 8414 metadata at ``/.well-known/oauth-authorization-server`` (and the same
  document at ``/.well-known/openid-configuration``);
* the authorization-code grant with PKCE S256 required, behind an ``/authorize``
  that approves at once for the configured test user (a test follows the
  redirects with plain HTTP);
* the client-credentials grant;
* the refresh-token grant, rotating the refresh token; ``refresh_count`` counts
  every refresh request the token endpoint received (a double refresh shows 2,
  and the second one fails: its refresh token was rotated away);
* revocation (RFC 7009) at ``/revoke`` and introspection (RFC 7662) at
  ``/introspect`` for a resource-server client;
* access tokens are JWTs signed RS256 (keys at ``/jwks.json``) whose ``aud`` is
  the requested ``resource`` (RFC 8707): a resource outside ``resources`` (or a
  missing one, with ``require_resource``) is refused with ``invalid_target``;
* Client ID Metadata Documents: a ``client_id`` that is an http(s) URL is
  fetched and its ``redirect_uris`` trusted (``client_id_metadata_document_supported``
  in the metadata), unless ``cimd=False``.

The token endpoint runs one request at a time, so two racing refreshes of the
same refresh token cannot both succeed here: the second is refused.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from authlib.integrations.flask_oauth2 import AuthorizationServer
from authlib.oauth2 import OAuth2Error
from authlib.oauth2.rfc6749 import ClientMixin, grants
from authlib.oauth2.rfc6749.errors import InvalidRequestError
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7009 import RevocationEndpoint
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oauth2.rfc7662 import IntrospectionEndpoint
from flask import Flask, g, jsonify, request
from joserfc import jwt
from joserfc.jwk import RSAKey
from werkzeug.serving import WSGIRequestHandler, make_server

# authlib refuses plain http unless told; this server only ever listens on 127.0.0.1.
os.environ.setdefault("AUTHLIB_INSECURE_TRANSPORT", "1")

CLIENT_AUTH = ["client_secret_basic", "client_secret_post", "none"]


class InvalidTargetError(OAuth2Error):
    """RFC 8707: the requested resource is not one this server issues tokens for."""

    error = "invalid_target"


@dataclass
class User:
    name: str

    def get_user_id(self) -> str:
        return self.name


@dataclass
class Client(ClientMixin):
    client_id: str
    client_secret: str | None = None
    redirect_uris: list[str] = field(default_factory=list)
    grant_types: list[str] = field(default_factory=list)
    scope: str = "mcp"
    introspect: bool = False

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str | None:
        return self.redirect_uris[0] if self.redirect_uris else None

    def get_allowed_scope(self, scope: str | None) -> str:
        if not scope:
            return self.scope
        allowed = set(self.scope.split())
        return " ".join(s for s in scope.split() if s in allowed)

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return redirect_uri in self.redirect_uris

    def check_client_secret(self, client_secret: str) -> bool:
        return self.client_secret is not None and secrets.compare_digest(
            client_secret, self.client_secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        if self.client_secret is None:
            return method == "none"
        return method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type: str) -> bool:
        return response_type == "code"

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type in self.grant_types


@dataclass
class AuthCode:
    code: str
    client_id: str
    redirect_uri: str
    scope: str
    user: User
    resource: str | None
    code_challenge: str
    code_challenge_method: str
    expires_at: float

    def get_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_scope(self) -> str:
        return self.scope


@dataclass
class Token:
    access_token: str
    refresh_token: str | None
    client_id: str
    scope: str
    subject: str
    resource: str | None
    jti: str
    issued_at: float
    expires_in: int
    access_revoked: bool = False
    refresh_revoked: bool = False

    def check_client(self, client: Client) -> bool:
        return client.client_id == self.client_id or bool(getattr(client, "introspect", False))

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return self.expires_in

    def is_expired(self) -> bool:
        return time.time() >= self.issued_at + self.expires_in

    def is_revoked(self) -> bool:
        return self.access_revoked

    def get_user(self) -> User:
        return User(self.subject)

    def get_client(self) -> Client:  # pragma: no cover - authlib interface
        raise NotImplementedError


class _S256Only(CodeChallenge):
    """PKCE required, and only S256 (OAuth 2.1): a missing method is not "plain"."""

    SUPPORTED_CODE_CHALLENGE_METHOD = ["S256"]
    DEFAULT_CODE_CHALLENGE_METHOD = "S256"

    def validate_code_challenge(self, grant, redirect_uri):
        if not grant.request.payload.data.get("code_challenge"):
            raise InvalidRequestError("Missing 'code_challenge'")
        super().validate_code_challenge(grant, redirect_uri)
        if grant.request.payload.data.get("code_challenge_method") != "S256":
            raise InvalidRequestError("code_challenge_method must be S256")


class OAuthServerHandle:
    """The running server: its state, and the knobs a test turns."""

    def __init__(self, *, user: str, access_token_lifetime: int,
                 resources: list[str] | None, require_resource: bool, cimd: bool,
                 scopes: list[str]) -> None:
        self.user = user
        self.access_token_lifetime = access_token_lifetime
        self.resources = resources
        self.require_resource = require_resource
        self.cimd = cimd
        self.scopes = scopes
        self.clients: dict[str, Client] = {}
        self.codes: dict[str, AuthCode] = {}
        self.tokens: list[Token] = []
        #: Refresh-token requests the token endpoint received (failed ones too).
        self.refresh_count = 0
        #: Every form the token endpoint received, in order (for assertions on ``resource``).
        self.token_requests: list[dict[str, str]] = []
        self.authorize_requests: list[dict[str, str]] = []
        self.key = RSAKey.generate_key(2048, parameters={"kid": secrets.token_hex(4)})
        self._lock = threading.Lock()
        self.issuer = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- the test's API ---------------------------------------------------

    def register_client(self, client_id: str | None = None, *, secret: str | None = None,
                        public: bool = False, redirect_uris: list[str] | tuple[str, ...] = (),
                        grant_types: list[str] | tuple[str, ...] = (
                            "authorization_code", "refresh_token", "client_credentials"),
                        scope: str | None = None, introspect: bool = False) -> Client:
        """Register a client; a confidential one gets a random secret unless given."""
        cid = client_id or "client-" + secrets.token_hex(4)
        if not public and secret is None:
            secret = secrets.token_urlsafe(16)
        client = Client(cid, None if public else secret, list(redirect_uris),
                        list(grant_types), scope or " ".join(self.scopes), introspect)
        self.clients[cid] = client
        return client

    def revoke_all(self) -> None:
        """Revoke every access and refresh token issued so far."""
        with self._lock:
            for t in self.tokens:
                t.access_revoked = t.refresh_revoked = True

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.key.as_dict(private=False)]}

    def verify(self, token: str, audience: str) -> dict[str, Any] | None:
        """The claims of a live access token issued here for ``audience``, else None.

        Checks signature, issuer, audience, expiry, and (unlike a resource server
        that only has the JWKS) that it was not revoked.
        """
        try:
            decoded = jwt.decode(token, self.key, algorithms=["RS256"])
        except Exception:
            return None
        claims = decoded.claims
        if claims.get("iss") != self.issuer or claims.get("aud") != audience:
            return None
        if float(claims.get("exp", 0)) <= time.time():
            return None
        record = next((t for t in self.tokens if t.jti == claims.get("jti")), None)
        if record is None or record.access_revoked:
            return None
        return dict(claims)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- internals ----------------------------------------------------------

    def query_client(self, client_id: str) -> Client | None:
        client = self.clients.get(client_id)
        if client is None and self.cimd and client_id.startswith(("https://", "http://")):
            client = self._fetch_metadata_document(client_id)
        return client

    def _fetch_metadata_document(self, url: str) -> Client | None:
        try:
            doc = httpx.get(url, timeout=5).json()
        except Exception:
            return None
        if doc.get("client_id") != url:
            return None
        return Client(url, None, list(doc.get("redirect_uris") or []),
                      list(doc.get("grant_types") or ["authorization_code", "refresh_token"]),
                      doc.get("scope") or " ".join(self.scopes))

    def check_resource(self, requested: str | None, bound: str | None = None) -> str | None:
        """The audience for a token request, or InvalidTargetError (RFC 8707)."""
        if requested is None:
            requested = bound
        if requested is None:
            if self.require_resource:
                raise InvalidTargetError("the 'resource' parameter is required")
            return None
        if bound is not None and requested != bound:
            raise InvalidTargetError("resource differs from the one originally granted")
        if self.resources is not None and requested not in self.resources:
            raise InvalidTargetError(f"resource not served here: {requested}")
        return requested

    def access_token(self, client: Client, grant_type: str, user: User | None,
                     scope: str) -> str:
        now = int(time.time())
        jti = secrets.token_hex(12)
        g.oauth_jti = jti
        claims = {"iss": self.issuer, "sub": user.name if user else client.client_id,
                  "client_id": client.client_id, "scope": scope, "iat": now,
                  "exp": now + self.access_token_lifetime, "jti": jti}
        if g.get("oauth_resource"):
            claims["aud"] = g.oauth_resource
        return jwt.encode({"alg": "RS256", "kid": self.key.kid}, claims, self.key)

    def save_token(self, token: dict[str, Any], req: Any) -> None:
        user = req.user
        self.tokens.append(Token(
            token["access_token"], token.get("refresh_token"), req.client.client_id,
            token.get("scope", ""), user.name if user else req.client.client_id,
            g.get("oauth_resource"), g.oauth_jti, time.time(), int(token["expires_in"])))

    def metadata(self) -> dict[str, Any]:
        base = self.issuer
        return {
            "issuer": base,
            "authorization_endpoint": f"{base}/authorize",
            "token_endpoint": f"{base}/token",
            "revocation_endpoint": f"{base}/revoke",
            "introspection_endpoint": f"{base}/introspect",
            "jwks_uri": f"{base}/jwks.json",
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "refresh_token",
                                      "client_credentials"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": CLIENT_AUTH,
            "scopes_supported": self.scopes,
            "client_id_metadata_document_supported": self.cimd,
        }


def _create_app(handle: OAuthServerHandle) -> Flask:
    app = Flask("tests.support.oauth_server")
    server = AuthorizationServer(app, query_client=handle.query_client,
                                 save_token=handle.save_token)
    server.register_token_generator("default", BearerTokenGenerator(
        handle.access_token, lambda **_: secrets.token_urlsafe(32),
        lambda client, grant_type: handle.access_token_lifetime))

    def _resource() -> str | None:
        return request.form.get("resource") or request.args.get("resource")

    class CodeGrant(grants.AuthorizationCodeGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = CLIENT_AUTH

        def validate_authorization_request(self):
            uri = super().validate_authorization_request()
            try:
                handle.check_resource(_resource())
            except InvalidTargetError as e:
                e.redirect_uri = uri
                raise
            return uri

        def save_authorization_code(self, code, req):
            data = req.payload.data
            handle.codes[code] = AuthCode(
                code, req.client.client_id, req.payload.redirect_uri or "",
                req.payload.scope or req.client.scope, req.user, _resource(),
                data.get("code_challenge", ""), data.get("code_challenge_method", ""),
                time.time() + 300)

        def query_authorization_code(self, code, client):
            item = handle.codes.get(code)
            if item and item.client_id == client.client_id and item.expires_at > time.time():
                return item
            return None

        def delete_authorization_code(self, authorization_code):
            handle.codes.pop(authorization_code.code, None)

        def authenticate_user(self, authorization_code):
            return authorization_code.user

        def validate_token_request(self):
            super().validate_token_request()
            g.oauth_resource = handle.check_resource(
                _resource(), self.request.authorization_code.resource)

    class ClientCredentials(grants.ClientCredentialsGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

        def validate_token_request(self):
            super().validate_token_request()
            g.oauth_resource = handle.check_resource(_resource())

    class Refresh(grants.RefreshTokenGrant):
        TOKEN_ENDPOINT_AUTH_METHODS = CLIENT_AUTH
        INCLUDE_NEW_REFRESH_TOKEN = True

        def authenticate_refresh_token(self, refresh_token):
            return next((t for t in handle.tokens if t.refresh_token == refresh_token
                         and not t.refresh_revoked), None)

        def authenticate_user(self, refresh_token):
            return User(refresh_token.subject)

        def revoke_old_credential(self, refresh_token):
            refresh_token.refresh_revoked = True

        def validate_token_request(self):
            super().validate_token_request()
            g.oauth_resource = handle.check_resource(
                _resource(), self.request.refresh_token.resource)

    def _find(token_string, hint):
        for t in handle.tokens:
            if hint != "refresh_token" and t.access_token == token_string:
                return t
            if hint != "access_token" and t.refresh_token == token_string:
                return t
        return None

    class Revocation(RevocationEndpoint):
        CLIENT_AUTH_METHODS = CLIENT_AUTH

        def query_token(self, token_string, token_type_hint):
            return _find(token_string, token_type_hint)

        def revoke_token(self, token, req):
            token.access_revoked = True
            if req.form.get("token_type_hint") != "access_token":
                token.refresh_revoked = True

    class Introspection(IntrospectionEndpoint):
        CLIENT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

        def query_token(self, token_string, token_type_hint):
            return _find(token_string, token_type_hint)

        def check_permission(self, token, client, req):
            return client.introspect

        def introspect_token(self, token):
            return {"active": True, "client_id": token.client_id, "scope": token.scope,
                    "sub": token.subject, "aud": token.resource, "iss": handle.issuer,
                    "exp": int(token.issued_at + token.expires_in),
                    "iat": int(token.issued_at), "token_type": "Bearer"}

    server.register_grant(CodeGrant, [_S256Only(required=True)])
    server.register_grant(ClientCredentials)
    server.register_grant(Refresh)
    server.register_endpoint(Revocation)
    server.register_endpoint(Introspection)
    token_lock = threading.Lock()

    @app.get("/.well-known/oauth-authorization-server")
    @app.get("/.well-known/openid-configuration")
    def metadata():
        return jsonify(handle.metadata())

    @app.get("/jwks.json")
    def jwks():
        return jsonify(handle.jwks())

    @app.get("/authorize")
    def authorize():
        handle.authorize_requests.append(dict(request.args))
        user = User(handle.user)
        try:
            grant = server.get_consent_grant(end_user=user)
        except OAuth2Error as error:
            return server.handle_error_response(None, error)
        return server.create_authorization_response(grant_user=user, grant=grant)

    @app.post("/token")
    def token():
        # One at a time: two racing refreshes of one refresh token must not both win.
        with token_lock:
            form = dict(request.form)
            handle.token_requests.append(form)
            if form.get("grant_type") == "refresh_token":
                handle.refresh_count += 1
            return server.create_token_response()

    @app.post("/revoke")
    def revoke():
        return server.create_endpoint_response(Revocation.ENDPOINT_NAME)

    @app.post("/introspect")
    def introspect():
        return server.create_endpoint_response(Introspection.ENDPOINT_NAME)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


def start_oauth_server(*, user: str = "alice", access_token_lifetime: int = 60,
                       resources: list[str] | None = None, require_resource: bool = True,
                       cimd: bool = True, scopes: list[str] | None = None) -> OAuthServerHandle:
    """Serve a fresh authorization server on 127.0.0.1:<free port> in a thread.

    ``resources``: the RFC 8707 resources tokens may be issued for (None: any).
    ``user``: who ``/authorize`` signs in, without asking.
    """
    handle = OAuthServerHandle(user=user, access_token_lifetime=access_token_lifetime,
                               resources=resources, require_resource=require_resource,
                               cimd=cimd, scopes=scopes or ["mcp"])
    app = _create_app(handle)
    srv = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
    handle.issuer = f"http://127.0.0.1:{srv.server_port}"
    handle._server = srv
    handle._thread = threading.Thread(target=srv.serve_forever, name="oauth-server",
                                      daemon=True)
    handle._thread.start()
    return handle
