"""OAuth for the MCP server blueprint: the blueprint as an OAuth resource server.

This module owns what ``mcp_blueprint(..., oauth=OAuthResource(...))`` adds:
the RFC 9728 protected-resource metadata document and the app-level
well-known routes that serve it, the ``WWW-Authenticate`` challenges of its
401 / 403 answers, and the validation of bearer tokens issued by an outside
authorization server: JWTs verified against the server's JWKS (PyJWT's
``PyJWKClient``), other tokens by RFC 7662 introspection, both checked for
this resource's audience (RFC 8707). A validated token becomes an
:class:`OAuthPrincipal`. See docs/decisions/0041-mcp-server-oauth.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt
from flask import Blueprint, Response
from flask.blueprints import BlueprintSetupState
from mcp.shared.auth import ProtectedResourceMetadata
from mcp.shared.auth_utils import resource_url_from_server_url
from pydantic import ValidationError

from ..errors import ConfigurationError, McpTokenRefusedError

__all__ = ["Introspection", "OAuthPrincipal", "OAuthResource"]

logger = logging.getLogger("flask_solidloop.mcp_server")

WELL_KNOWN = "/.well-known/oauth-protected-resource"
#: Asymmetric algorithms only: ``none`` and the HMAC ones would let anyone who
#: knows a shared secret (or nothing at all) mint tokens.
DEFAULT_ALGORITHMS: tuple[str, ...] = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
_APP_KEY = "solidloop_mcp_oauth_resources"


@dataclass(frozen=True)
class OAuthPrincipal:
    """Who a validated access token speaks for: ``ctx.principal`` of a tool.

    ``subject`` is the token's ``sub`` (the resource owner; for a
    client-credentials token often the client itself), ``client_id`` its
    ``client_id`` (or ``azp``), ``scopes`` what it grants. The token itself is
    not kept. ``mcp_label`` is what sessions and agent loops bind to.
    """

    subject: str | None
    client_id: str | None
    scopes: frozenset[str]
    issuer: str | None
    expires_at: int | None
    claims: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    mcp_label: str = ""


@dataclass(frozen=True)
class Introspection:
    """How to ask the authorization server about a token (RFC 7662).

    ``endpoint`` defaults to the ``introspection_endpoint`` of the first
    authorization server's metadata; the resource authenticates with HTTP
    Basic ``client_id`` / ``client_secret`` (``client_secret_basic``).
    """

    client_id: str
    client_secret: str = field(repr=False)
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.client_id, str) or not self.client_id:
            raise ConfigurationError("Introspection.client_id", self.client_id,
                                     "must be the resource's client id at the authorization server")
        if not isinstance(self.client_secret, str) or not self.client_secret:
            raise ConfigurationError("Introspection.client_secret", "[redacted]",
                                     "must be a non-empty string (the resource's client secret)")
        if self.endpoint is not None:
            _check_url("Introspection.endpoint", self.endpoint)


def _check_url(option: str, value: Any) -> str:
    if not isinstance(value, str) or urlsplit(value).scheme not in ("http", "https") or not (
            urlsplit(value).netloc):
        raise ConfigurationError(option, value, "must be an absolute http(s) URL, "
                                 "e.g. https://login.example.com")
    if urlsplit(value).username or urlsplit(value).password:
        raise ConfigurationError(option, "[redacted]", "must not carry credentials in the URL")
    return value


def _strip(url: str) -> str:
    return url.rstrip("/")


class OAuthResource:
    """The blueprint as an OAuth 2.1 resource server (MCP authorization, RFC 9728 / 8707).

    ``resource`` is the blueprint's public URL, as clients reach it (its
    canonical form is the audience tokens must carry, and the path of the
    metadata URL). ``authorization_servers`` are the issuer URLs of the
    servers whose tokens are accepted. ``audience`` overrides the expected
    ``aud`` (default: ``resource``); ``jwks_uri`` overrides the key set
    (default: each server's metadata ``jwks_uri``); ``introspection`` lets
    tokens that are not verifiable JWTs be checked by RFC 7662, and
    ``introspect_jwts=True`` sends JWTs there too (a revoked JWT is then
    refused at once, at the price of a round trip per request).
    ``required_scopes`` must all be granted (else 403); ``scopes_supported``
    (default ``required_scopes``) and ``resource_name`` /
    ``resource_documentation`` go into the metadata document. ``leeway``
    (seconds) is the clock skew allowed on ``exp`` / ``nbf``; a token with an
    unknown ``kid`` refetches the key set at most once per
    ``jwks_refresh_cooldown`` seconds (so random kids cannot flood the server).
    """

    def __init__(self, resource: str, authorization_servers: Iterable[str], *,
                 audience: str | None = None, jwks_uri: str | None = None,
                 introspection: Introspection | None = None,
                 introspect_jwts: bool = False,
                 required_scopes: Iterable[str] = (),
                 scopes_supported: Iterable[str] | None = None,
                 resource_name: str | None = None,
                 resource_documentation: str | None = None,
                 algorithms: Iterable[str] = DEFAULT_ALGORITHMS,
                 leeway: float = 30.0, timeout: float = 10.0,
                 jwks_refresh_cooldown: float = 30.0) -> None:
        _check_url("OAuthResource.resource", resource)
        if urlsplit(resource).fragment:
            raise ConfigurationError("OAuthResource.resource", resource,
                                     "must not have a #fragment (RFC 8707)")
        self.resource = resource_url_from_server_url(resource)
        if isinstance(authorization_servers, str):
            raise ConfigurationError("OAuthResource.authorization_servers", authorization_servers,
                                     "must be a list of issuer URLs, not a string")
        self.authorization_servers = tuple(
            _check_url("OAuthResource.authorization_servers", s) for s in authorization_servers)
        if not self.authorization_servers:
            raise ConfigurationError("OAuthResource.authorization_servers", [],
                                     "must name at least one authorization server (its issuer URL)")
        self.audience = audience if audience is not None else self.resource
        if not isinstance(self.audience, str) or not self.audience:
            raise ConfigurationError("OAuthResource.audience", audience,
                                     "must be a non-empty string (default: the resource URL)")
        self.jwks_uri = _check_url("OAuthResource.jwks_uri", jwks_uri) if jwks_uri else None
        if introspection is not None and not isinstance(introspection, Introspection):
            raise ConfigurationError("OAuthResource.introspection", type(introspection).__name__,
                                     "must be Introspection(client_id, client_secret)")
        self.introspection = introspection
        if introspect_jwts and introspection is None:
            raise ConfigurationError("OAuthResource.introspect_jwts", introspect_jwts,
                                     "needs introspection=Introspection(client_id, client_secret)")
        self.introspect_jwts = bool(introspect_jwts)
        self.required_scopes = _scopes("required_scopes", required_scopes)
        self.scopes_supported = (_scopes("scopes_supported", scopes_supported)
                                 if scopes_supported is not None else self.required_scopes)
        listed_algorithms = [algorithms] if isinstance(algorithms, str) else list(algorithms)
        self.algorithms = [a for a in listed_algorithms if isinstance(a, str)
                           and not a.upper().startswith("HS") and a.lower() != "none"]
        if not self.algorithms or len(self.algorithms) != len(listed_algorithms):
            raise ConfigurationError(
                "OAuthResource.algorithms", listed_algorithms,
                "must list only asymmetric JWS algorithms (RS256, ES256, ...; never none "
                "or HS*: a shared secret would let others mint tokens)")
        self.leeway = float(leeway)
        self.timeout = float(timeout)
        self.jwks_refresh_cooldown = float(jwks_refresh_cooldown)
        try:
            self.metadata = ProtectedResourceMetadata.model_validate({
                "resource": self.resource,
                "authorization_servers": list(self.authorization_servers),
                "scopes_supported": list(self.scopes_supported) or None,
                "bearer_methods_supported": ["header"],
                "resource_name": resource_name,
                "resource_documentation": resource_documentation,
            })
        except ValidationError as exc:
            raise ConfigurationError("OAuthResource", resource,
                                     f"is not valid protected-resource metadata: {exc}") from None
        path = urlsplit(self.resource).path.rstrip("/")
        #: Where the metadata is served, relative to the app root (RFC 9728 §3.1).
        self.metadata_path = WELL_KNOWN + path
        parts = urlsplit(self.resource)
        #: The absolute URL the 401's ``resource_metadata`` names.
        self.metadata_url = f"{parts.scheme}://{parts.netloc}{self.metadata_path}"
        self._lock = threading.Lock()
        self._as_metadata: dict[str, dict[str, Any]] = {}
        self._jwks: dict[str, jwt.PyJWKClient] = {}
        self._http: httpx.Client | None = None

    def __repr__(self) -> str:
        return (f"OAuthResource(resource={self.resource!r}, "
                f"authorization_servers={list(self.authorization_servers)!r})")

    # -- the metadata and the challenges -------------------------------------------

    def metadata_document(self) -> dict[str, Any]:
        return self.metadata.model_dump(mode="json", exclude_none=True)

    def challenge(self, error: str | None = None, description: str | None = None,
                  scope: str | None = None) -> str:
        """A ``WWW-Authenticate`` value (RFC 6750 §3, RFC 9728 §5.1)."""
        parts = []
        if error:
            parts.append(f'error="{error}"')
        if description:
            parts.append('error_description="{}"'.format(
                description.replace("\\", "").replace('"', "'")))
        if scope:
            parts.append(f'scope="{scope}"')
        parts.append(f'resource_metadata="{self.metadata_url}"')
        return "Bearer " + ", ".join(parts)

    def refusal(self, refused: McpTokenRefusedError | None) -> Response:
        """The 401 / 403 / 503 for a request that is not let in (None: no token)."""
        if refused is None:
            body = {"error": "unauthorized",
                    "error_description": "a bearer token from the authorization server is required"}
            return Response(json.dumps(body), status=401, mimetype="application/json",
                            headers={"WWW-Authenticate": self.challenge()})
        body = {"error": refused.error, "error_description": refused.description}
        headers = {}
        if refused.status in (401, 403):
            headers["WWW-Authenticate"] = self.challenge(
                refused.error, refused.description, refused.scope)
        return Response(json.dumps(body), status=refused.status, mimetype="application/json",
                        headers=headers)

    def register_routes(self, state: BlueprintSetupState) -> None:
        """Serve the metadata at the app root (a blueprint's routes live under its
        prefix; RFC 9728's well-known URL does not)."""
        app = state.app
        resources: dict[str, OAuthResource] = app.extensions.setdefault(_APP_KEY, {})
        if self.metadata_path in resources and resources[self.metadata_path] is not self:
            raise ConfigurationError(
                "OAuthResource.resource", self.resource,
                f"another OAuth blueprint already serves {self.metadata_path}: "
                "each blueprint needs its own resource URL")
        if self.metadata_path not in resources:
            resources[self.metadata_path] = self
            if self.metadata_path != WELL_KNOWN:  # a resource at the root: the route below
                app.add_url_rule(self.metadata_path, endpoint=f"{state.name}_oauth_metadata",
                                 view_func=self._serve_metadata, methods=["GET"],
                                 strict_slashes=False)
        if "solidloop_oauth_root" not in app.view_functions:
            app.add_url_rule(WELL_KNOWN, endpoint="solidloop_oauth_root",
                             view_func=_serve_root, methods=["GET"], strict_slashes=False)

    def _serve_metadata(self) -> Response:
        return _metadata_response(self)

    # -- validating a token ----------------------------------------------------------

    def authenticate(self, token: str | None) -> OAuthPrincipal:
        """The principal of ``token``, or :class:`McpTokenRefusedError` (a ``None`` token:
        401 without an error code, as RFC 6750 §3.1 asks)."""
        if not token:
            raise McpTokenRefusedError(401, "", "a bearer token is required")
        claims = None
        if not self.introspect_jwts and _looks_like_jwt(token):
            issuer = self._jwt_issuer(token)
            if issuer is not None:
                claims = self._verify_jwt(token, issuer)
        if claims is None:
            if self.introspection is None:
                raise McpTokenRefusedError(
                    401, "invalid_token",
                    "the token is not a JWT signed by a trusted authorization server")
            claims = self._introspect(token)
        principal = self._principal(claims)
        missing = [s for s in self.required_scopes if s not in principal.scopes]
        if missing:
            raise McpTokenRefusedError(403, "insufficient_scope",
                                       f"the token lacks the scope(s) {' '.join(missing)}",
                                       scope=" ".join(self.required_scopes))
        return principal

    def _trusted_issuer(self, issuer: Any) -> str | None:
        if not isinstance(issuer, str):
            return None
        for server in self.authorization_servers:
            if _strip(server) == _strip(issuer):
                return server
        return None

    def _jwt_issuer(self, token: str) -> str | None:
        """The trusted server whose JWKS verifies ``token``; None when the token
        must be introspected instead (no JWKS known)."""
        try:
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise McpTokenRefusedError(
                401, "invalid_token", "the token is not a well-formed JWT") from None
        server = self._trusted_issuer(unverified.get("iss"))
        if server is None:
            raise McpTokenRefusedError(401, "invalid_token",
                                       "the token's issuer is not a trusted authorization server")
        if self.jwks_uri is None and not self._server_metadata(server).get("jwks_uri"):
            return None
        return server

    def _jwks_client(self, server: str) -> jwt.PyJWKClient:
        uri = self.jwks_uri or str(self._server_metadata(server)["jwks_uri"])
        with self._lock:
            client = self._jwks.get(uri)
            if client is None:
                client = jwt.PyJWKClient(uri, cache_keys=True, timeout=self.timeout,
                                         cooldown_duration=self.jwks_refresh_cooldown)
                self._jwks[uri] = client
            return client

    def _verify_jwt(self, token: str, server: str) -> dict[str, Any]:
        try:
            key = self._jwks_client(server).get_signing_key_from_jwt(token)
        except jwt.PyJWKClientConnectionError as exc:
            logger.warning("MCP server: JWKS of %s unreachable: %s", server, exc)
            raise McpTokenRefusedError(
                503, "temporarily_unavailable",
                "the authorization server's keys cannot be fetched") from None
        except jwt.PyJWTError:
            raise McpTokenRefusedError(
                401, "invalid_token",
                "the token is not signed by a key of the authorization server") from None
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=self.algorithms, audience=self.audience,
                issuer=_issuer_forms(server), leeway=self.leeway,
                options={"require": ["exp", "iss", "aud"]})
        except jwt.ExpiredSignatureError:
            raise McpTokenRefusedError(401, "invalid_token", "the token has expired") from None
        except jwt.InvalidAudienceError:
            raise McpTokenRefusedError(401, "invalid_token",
                                       f"the token was not issued for {self.audience}") from None
        except jwt.PyJWTError as exc:
            raise McpTokenRefusedError(
                401, "invalid_token", f"the token is invalid: {exc}") from None
        return claims

    def _introspect(self, token: str) -> dict[str, Any]:
        assert self.introspection is not None
        server = self.authorization_servers[0]
        endpoint = self.introspection.endpoint or self._server_metadata(server).get(
            "introspection_endpoint")
        if not endpoint:
            raise McpTokenRefusedError(503, "temporarily_unavailable",
                                       "the authorization server names no introspection_endpoint")
        try:
            reply = self._client().post(
                str(endpoint), data={"token": token, "token_type_hint": "access_token"},
                auth=(self.introspection.client_id, self.introspection.client_secret),
                headers={"Accept": "application/json"})
            reply.raise_for_status()
            answer = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("MCP server: introspection at %s failed: %s", endpoint,
                           type(exc).__name__)
            raise McpTokenRefusedError(
                503, "temporarily_unavailable",
                "the authorization server cannot check the token now") from None
        if not isinstance(answer, dict) or answer.get("active") is not True:
            raise McpTokenRefusedError(401, "invalid_token", "the token is not active")
        now = time.time()
        exp = answer.get("exp")
        if isinstance(exp, int | float) and exp + self.leeway < now:
            raise McpTokenRefusedError(401, "invalid_token", "the token has expired")
        audiences = answer.get("aud")
        audiences = [audiences] if isinstance(audiences, str) else (audiences or [])
        if self.audience not in audiences:
            raise McpTokenRefusedError(401, "invalid_token",
                                       f"the token was not issued for {self.audience}")
        if "iss" in answer and self._trusted_issuer(answer["iss"]) is None:
            raise McpTokenRefusedError(401, "invalid_token",
                                       "the token's issuer is not a trusted authorization server")
        return answer

    def _principal(self, claims: dict[str, Any]) -> OAuthPrincipal:
        scope = claims.get("scope")
        if isinstance(scope, str):
            scopes = frozenset(scope.split())
        else:
            listed = claims.get("scp") or []
            scopes = frozenset(str(s) for s in listed) if isinstance(listed, list) else frozenset()
        subject = claims.get("sub")
        client_id = claims.get("client_id") or claims.get("azp")
        subject = str(subject) if subject is not None else None
        client_id = str(client_id) if client_id is not None else None
        label = subject or (f"client:{client_id}" if client_id else "oauth:anonymous")
        issuer = claims.get("iss")
        if len(self.authorization_servers) > 1 and issuer:
            label = f"{issuer} {label}"
        exp = claims.get("exp")
        return OAuthPrincipal(subject=subject, client_id=client_id, scopes=scopes,
                              issuer=str(issuer) if issuer else None,
                              expires_at=int(exp) if isinstance(exp, int | float) else None,
                              claims=dict(claims), mcp_label=label[:200])

    # -- the authorization servers' metadata ---------------------------------------------

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(timeout=self.timeout, follow_redirects=False)
            return self._http

    def _server_metadata(self, server: str) -> dict[str, Any]:
        """RFC 8414 metadata of ``server`` (then OpenID discovery), fetched once."""
        with self._lock:
            known = self._as_metadata.get(server)
        if known is not None:
            return known
        parts = urlsplit(server)
        path = parts.path.rstrip("/")
        base = f"{parts.scheme}://{parts.netloc}"
        candidates = [f"{base}/.well-known/oauth-authorization-server{path}",
                      f"{base}/.well-known/openid-configuration{path}",
                      f"{_strip(server)}/.well-known/openid-configuration"]
        for url in dict.fromkeys(candidates):
            try:
                reply = self._client().get(url, headers={"Accept": "application/json"})
            except httpx.HTTPError as exc:
                logger.warning("MCP server: metadata of %s unreachable: %s", server,
                               type(exc).__name__)
                raise McpTokenRefusedError(503, "temporarily_unavailable",
                                           "the authorization server cannot be reached") from None
            if reply.status_code == 200:
                try:
                    found = reply.json()
                except ValueError:
                    continue
                if isinstance(found, dict):
                    with self._lock:
                        self._as_metadata[server] = found
                    return found
        raise McpTokenRefusedError(503, "temporarily_unavailable",
                                   "the authorization server publishes no metadata")


def _issuer_forms(server: str) -> list[str]:
    return list(dict.fromkeys([server, _strip(server), _strip(server) + "/"]))


def _scopes(option: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ConfigurationError(f"OAuthResource.{option}", values,
                                 "must be a list of scope names, not a string")
    listed = tuple(values)
    if not all(isinstance(v, str) and v and " " not in v for v in listed):
        raise ConfigurationError(f"OAuthResource.{option}", listed,
                                 "must be a list of scope names without spaces")
    return listed


def _looks_like_jwt(token: str) -> bool:
    if token.count(".") != 2:
        return False
    try:
        jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        return False
    return True


def _metadata_response(resource: OAuthResource) -> Response:
    # Public by design (RFC 9728): browser-based clients fetch it cross-origin.
    return Response(json.dumps(resource.metadata_document()), status=200,
                    mimetype="application/json",
                    headers={"Access-Control-Allow-Origin": "*",
                             "Cache-Control": "public, max-age=3600"})


def _serve_root() -> Response:
    """``/.well-known/oauth-protected-resource`` itself: the one OAuth blueprint's
    document, or 404 when the app has several (which one would it be?)."""
    from flask import current_app

    resources = current_app.extensions.get(_APP_KEY, {})
    if len(resources) != 1:
        return Response("Not Found: with several OAuth-protected MCP endpoints, use "
                        f"{WELL_KNOWN}/<path of the endpoint>", status=404,
                        mimetype="text/plain")
    return _metadata_response(next(iter(resources.values())))


def attach(blueprint: Blueprint, resource: OAuthResource) -> None:
    """Have ``blueprint`` register ``resource``'s well-known routes on its app."""
    blueprint.record(resource.register_routes)
