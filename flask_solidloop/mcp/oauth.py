"""OAuth 2.1 for the remote MCP servers our agents call (``mcps`` entries with ``auth=``).

It owns what happens between a worker and an authorization server
(docs/decisions/0040-mcp-client-oauth.md):

* the entry's ``auth={"type": "oauth", ...}`` dict (:class:`OAuthEntry`);
* discovery per the MCP authorization spec: the 401's ``WWW-Authenticate:
  Bearer resource_metadata=...`` (else the RFC 9728 well-known URLs), the
  protected resource's first authorization server, its RFC 8414 metadata (else
  its OpenID configuration), parsed with the MCP SDK's models;
* the grants: client credentials, and the authorization code with PKCE S256
  (:func:`begin_sign_in` / :func:`finish_sign_in`, driven by the sign-in
  blueprint in :mod:`flask_solidloop.mcp.oauth_blueprint`); every authorization
  and token request carries ``resource`` = the server's canonical URL (RFC 8707);
* the token table (``solidloop_mcp_oauth_tokens``), tokens encrypted with
  Fernet under SOLIDLOOP_OAUTH_KEY, and :func:`access_token`: a fresh token,
  refreshed under ``SELECT ... FOR UPDATE`` on its row so one worker refreshes
  at a time and the others take its result;
* :class:`OAuthTransportServer`: an HTTP server's tools with a bearer token,
  retried once with a new token after a 401, and :class:`McpAuthError` (which
  fails the loop, naming the sign-in URL) when there is no usable token.

The extension calls :func:`configure` at ``init_app`` with the database URL and
the settings; this module keeps its own small engine (NullPool: a token is read
once per process until it nears expiry, from a cache).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx2
from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from mcp.client.auth.utils import (
    build_oauth_authorization_server_metadata_discovery_urls,
    build_protected_resource_metadata_discovery_urls,
    create_client_registration_request,
    extract_resource_metadata_from_www_auth,
    extract_scope_from_www_auth,
    get_client_metadata_scopes,
    issuers_match,
)
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)
from mcp.shared.auth_utils import check_resource_allowed, resource_url_from_server_url
from pydantic import AnyUrl, ValidationError
from sqlalchemy import Table, create_engine, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from ..errors import (
    AgentDefinitionError,
    ConfigurationError,
    InvalidArgumentError,
    McpAuthError,
    McpTransportError,
    SolidLoopError,
)
from ..models.oauth_token import McpOAuthToken
from .toolset import CallContext, ToolResult

__all__ = [
    "DEFAULT_SIGN_IN_PATH",
    "OAuthEntry",
    "access_token",
    "begin_sign_in",
    "configure",
    "finish_sign_in",
    "sign_in_url",
]

GRANTS = ("authorization_code", "client_credentials")
#: The OAuth grant types a client of each of our grants uses.
GRANT_TYPES = {"authorization_code": ("authorization_code", "refresh_token"),
               "client_credentials": ("client_credentials",)}
AUTH_KEYS = {"type", "grant", "client_id", "client_secret_env", "client_metadata_url",
             "dynamic_registration", "scope", "subject"}
#: The sign-in URL named in failures when SOLIDLOOP_OAUTH_SIGN_IN_URL is unset: the
#: blueprint's route under its default prefix.
DEFAULT_SIGN_IN_PATH = "/solidloop/oauth/{server}/sign-in"
#: Seconds a sign-in may take between its start and its callback.
SIGN_IN_TTL = 600
#: Seconds discovery results are reused within a process.
DISCOVERY_TTL = 600
HTTP_TIMEOUT = 30.0

_table = cast(Table, McpOAuthToken.__table__)


# --------------------------------------------------------------------------- the entry


@dataclass(frozen=True)
class OAuthEntry:
    """An ``mcps`` entry's ``auth`` dict, validated, with its server's name and URL."""

    server_name: str
    url: str
    grant: str
    client_id: str | None
    client_secret_env: str | None
    client_metadata_url: str | None
    scope: str | None
    subject: str
    dynamic_registration: bool = False

    @property
    def resource(self) -> str:
        """The RFC 8707 resource: the server's canonical URL."""
        return resource_url_from_server_url(self.url)

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> OAuthEntry:
        auth = entry["auth"]
        return cls(
            server_name=str(entry["name"]), url=str(entry["url"]),
            grant=str(auth.get("grant") or "authorization_code"),
            client_id=auth.get("client_id"), client_secret_env=auth.get("client_secret_env"),
            client_metadata_url=auth.get("client_metadata_url"), scope=auth.get("scope"),
            subject=str(auth.get("subject") or "default"),
            dynamic_registration=bool(auth.get("dynamic_registration")))

    def client_secret(self) -> str | None:
        """The client secret from the worker's environment (never stored)."""
        if not self.client_secret_env:
            return None
        value = os.environ.get(self.client_secret_env)
        if not value:
            raise ConfigurationError(
                self.client_secret_env, "(unset)",
                f"the mcps entry {self.server_name!r} reads its OAuth client secret from this "
                "environment variable, but it is unset or empty in this process's environment")
        return value


def validate_auth(auth: Any, *, agent: str, name: str, has_url: bool,
                  has_static_token: bool) -> None:
    """Check an entry's ``auth=`` shape; raise AgentDefinitionError naming the fix."""
    where = f"agent {agent!r}: mcps entry {name!r}"
    if not has_url:
        raise AgentDefinitionError(f"{where}: auth= is for url= servers only; remove it")
    if not isinstance(auth, dict) or auth.get("type") != "oauth":
        raise AgentDefinitionError(
            f"{where}: auth= must be a dict with type 'oauth', e.g. {{'type': 'oauth', "
            "'grant': 'client_credentials', 'client_id': '...', 'client_secret_env': '...'}")
    unknown = sorted(set(auth) - AUTH_KEYS)
    if unknown:
        raise AgentDefinitionError(
            f"{where}: auth= has unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(AUTH_KEYS))}")
    if has_static_token:
        raise AgentDefinitionError(
            f"{where}: auth= replaces api_token/api_token_env; keep one of them")
    grant = auth.get("grant") or "authorization_code"
    if grant not in GRANTS:
        raise AgentDefinitionError(
            f"{where}: auth grant must be 'authorization_code' or 'client_credentials', "
            f"got {grant!r}")
    for key in ("client_id", "client_secret_env", "client_metadata_url", "scope", "subject"):
        if auth.get(key) is not None and not (isinstance(auth[key], str) and auth[key]):
            raise AgentDefinitionError(f"{where}: auth {key} must be a non-empty str")
    if grant == "client_credentials" and not (auth.get("client_id")
                                              and auth.get("client_secret_env")):
        raise AgentDefinitionError(
            f"{where}: the client_credentials grant needs client_id and client_secret_env "
            "(the name of the environment variable holding the secret)")
    if auth.get("dynamic_registration") is not None and not isinstance(
            auth["dynamic_registration"], bool):
        raise AgentDefinitionError(f"{where}: auth dynamic_registration must be True or False")
    if grant == "authorization_code" and not (auth.get("client_id")
                                              or auth.get("client_metadata_url")
                                              or auth.get("dynamic_registration")):
        raise AgentDefinitionError(
            f"{where}: the authorization_code grant needs client_id (pre-registered), "
            "client_metadata_url (a Client ID Metadata Document URL) or "
            "dynamic_registration=True")
    cimd = auth.get("client_metadata_url")
    if cimd is not None and not str(cimd).startswith(("https://", "http://")):
        raise AgentDefinitionError(f"{where}: auth client_metadata_url must be an https URL")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class _Settings:
    database_url: str
    keys: tuple[str, ...]
    refresh_margin: int
    sign_in_url: str | None


_settings: _Settings | None = None
_engines: dict[str, Engine] = {}
_lock = threading.Lock()
#: (resource, subject) -> (access token, expires at as a unix time or None).
_cache: dict[tuple[str, str], tuple[str, float | None]] = {}
_discovered: dict[str, tuple[float, Discovery]] = {}


def configure(*, database_url: str, keys: tuple[str, ...], refresh_margin: int = 60,
              sign_in_url: str | None = None) -> None:
    """Where tokens live and how they are kept (the extension calls it at init_app)."""
    global _settings
    _settings = _Settings(database_url, tuple(keys), int(refresh_margin), sign_in_url)
    _cache.clear()


def _require() -> _Settings:
    if _settings is None or not _settings.keys:
        raise ConfigurationError(
            "SOLIDLOOP_OAUTH_KEY", None,
            "an mcps entry uses auth={'type': 'oauth'}: set a Fernet key, made with "
            "`python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'`")
    return _settings


def _fernet() -> MultiFernet:
    return MultiFernet([Fernet(key) for key in _require().keys])


def _engine() -> Engine:
    url = _require().database_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = create_engine(url, poolclass=NullPool)
    return engine


def sign_in_url(server: str, subject: str) -> str:
    """Where a person signs in to ``server`` for ``subject`` (named in failures)."""
    template = (_settings.sign_in_url if _settings else None) or DEFAULT_SIGN_IN_PATH
    return template.format(server=urllib.parse.quote(server, safe=""),
                           subject=urllib.parse.quote(subject, safe=""))


def _auth_error(entry: OAuthEntry, message: str) -> McpAuthError:
    if entry.grant == "client_credentials":
        # Nobody signs in to a machine client: its registration is what to check.
        return McpAuthError(f"{message}; check auth client_id and client_secret_env against "
                            "the client registered at the authorization server",
                            server=entry.server_name)
    return McpAuthError(message, server=entry.server_name,
                        sign_in_url=sign_in_url(entry.server_name, entry.subject))


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class Discovery:
    """What discovery found for one MCP server.

    ``issuer`` and ``resource`` are the strings exactly as published (the
    parsed models normalize URLs, e.g. add a trailing slash): the ``iss``
    authorization-response parameter is compared with the one (RFC 9207, no
    normalization) and the other is what ``resource`` carries (RFC 8707).
    ``challenge_scope`` is the ``scope`` of the server's 401 challenge.
    """

    resource_metadata: ProtectedResourceMetadata | None
    metadata: OAuthMetadata
    issuer: str = ""
    resource: str | None = None
    challenge_scope: str | None = None

    def scope(self, entry: OAuthEntry) -> str | None:
        """The scope to ask for: the entry's own, else the 401 challenge's, else the
        protected resource's ``scopes_supported``, else none (the MCP spec's order)."""
        if entry.scope:
            return entry.scope
        if self.challenge_scope is None and (self.resource_metadata is None or
                                             self.resource_metadata.scopes_supported is None):
            return None
        return get_client_metadata_scopes(self.challenge_scope, self.resource_metadata,
                                          self.metadata, list(GRANT_TYPES[entry.grant]))


def _http() -> httpx2.Client:
    from .http_transport import shared_ssl_context

    return httpx2.Client(timeout=HTTP_TIMEOUT, verify=shared_ssl_context(), trust_env=True)


def discover(entry: OAuthEntry) -> Discovery:
    """The server's authorization server metadata (cached for DISCOVERY_TTL)."""
    hit = _discovered.get(entry.url)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    try:
        with _http() as http:
            found = _discover(http, entry)
    except httpx2.HTTPError as exc:
        raise McpTransportError(
            "connect", f"OAuth discovery for {entry.resource} failed: {type(exc).__name__}",
            server=entry.server_name) from None
    _discovered[entry.url] = (time.monotonic() + DISCOVERY_TTL, found)
    return found


def _discover(http: httpx2.Client, entry: OAuthEntry) -> Discovery:
    # An unauthenticated request: a protected server answers 401 naming its metadata.
    probe = http.post(entry.url, json={"jsonrpc": "2.0", "id": "solidloop-oauth-discovery",
                                       "method": "server/discover", "params": {}},
                      headers={"Accept": "application/json, text/event-stream"})
    named = extract_resource_metadata_from_www_auth(probe) if probe.status_code == 401 else None
    challenge_scope = extract_scope_from_www_auth(probe) if probe.status_code == 401 else None
    prm, published_resource = None, None
    for url in build_protected_resource_metadata_discovery_urls(named, entry.url):
        response = http.get(url)
        if response.status_code == 200:
            try:
                prm = ProtectedResourceMetadata.model_validate_json(response.content)
                published_resource = str(json.loads(response.content)["resource"])
                break
            except (ValidationError, ValueError, KeyError, TypeError):
                prm = None
                continue
    if prm is not None and not check_resource_allowed(entry.resource, str(prm.resource)):
        raise _auth_error(entry, f"the server's protected-resource metadata names resource "
                                 f"{prm.resource}, not {entry.resource}; check the url=")
    issuer = str(prm.authorization_servers[0]) if prm is not None else None
    for url in build_oauth_authorization_server_metadata_discovery_urls(issuer, entry.url):
        response = http.get(url)
        if response.status_code != 200:
            continue
        try:
            metadata = OAuthMetadata.model_validate_json(response.content)
        except ValidationError:
            continue
        if issuer is not None and not issuers_match(str(metadata.issuer), issuer):
            # RFC 8414 section 3.3: metadata for another issuer is not to be used.
            raise _auth_error(entry, f"the authorization server metadata at {url} names "
                                     f"issuer {metadata.issuer}, not {issuer}")
        try:
            published_issuer = str(json.loads(response.content)["issuer"])
        except (ValueError, KeyError, TypeError):
            published_issuer = str(metadata.issuer)
        return Discovery(prm, metadata, published_issuer, published_resource, challenge_scope)
    raise _auth_error(entry, f"no OAuth authorization server metadata found for "
                             f"{entry.resource} (authorization server: "
                             f"{issuer or 'none named'}); check that the server implements "
                             "the MCP authorization spec")


# --------------------------------------------------------------------------- token requests


class _Refused(SolidLoopError):
    """The authorization server refused a token request (4xx): its ``error`` code."""

    def __init__(self, status: int, error: str, description: str) -> None:
        self.status, self.error, self.description = status, error, description
        super().__init__(f"{error} (HTTP {status}){': ' + description if description else ''}")


def _token_request(entry: OAuthEntry, endpoint: str, client_id: str,
                   form: dict[str, str], *, resource: str | None = None,
                   scope: str | None = None) -> OAuthToken:
    """POST ``form`` to the token endpoint with ``resource`` (default: the entry's
    canonical URL) and, but for a code exchange, ``scope`` (default: the entry's)."""
    secret = entry.client_secret()
    form = {**form, "resource": resource or entry.resource}
    scope = scope or entry.scope
    if scope and form.get("grant_type") != "authorization_code":
        form.setdefault("scope", scope)
    auth: tuple[str, str] | None = None
    if secret:
        auth = (client_id, secret)  # client_secret_basic
    else:
        form["client_id"] = client_id  # a public client (PKCE)
    try:
        with _http() as http:
            headers = {"Accept": "application/json"}
            response = (http.post(endpoint, data=form, auth=auth, headers=headers) if auth
                        else http.post(endpoint, data=form, headers=headers))
    except httpx2.HTTPError as exc:
        raise McpTransportError(
            "connect", f"the OAuth token endpoint {endpoint} could not be reached "
            f"({type(exc).__name__})", server=entry.server_name) from None
    if 400 <= response.status_code < 500:
        try:
            body = response.json()
        except ValueError:
            body = {}
        raise _Refused(response.status_code, str(body.get("error") or "refused"),
                       str(body.get("error_description") or ""))
    if response.status_code != 200:
        raise McpTransportError(
            "http", f"the OAuth token endpoint {endpoint} answered HTTP "
            f"{response.status_code}", server=entry.server_name)
    try:
        return OAuthToken.model_validate_json(response.content)
    except ValidationError:
        raise McpTransportError(
            "protocol", f"the OAuth token endpoint {endpoint} answered with no valid token",
            server=entry.server_name) from None


def _pkce() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(64)
    challenge = base64.urlsafe_b64encode(
        hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    return verifier, challenge


def _client_id(entry: OAuthEntry, metadata: OAuthMetadata, redirect_uri: str) -> str:
    """A Client ID Metadata Document URL when the server takes one, else the static id,
    else (``dynamic_registration``) a public client registered now (RFC 7591)."""
    if entry.client_metadata_url and metadata.client_id_metadata_document_supported:
        return entry.client_metadata_url
    if entry.client_id:
        return entry.client_id
    if entry.dynamic_registration and metadata.registration_endpoint is not None:
        return _register(entry, metadata, redirect_uri)
    raise _auth_error(entry, f"the authorization server {metadata.issuer} takes neither a "
                             "Client ID Metadata Document nor (configured here) dynamic "
                             "registration; set auth client_id to a client registered there")


def _register(entry: OAuthEntry, metadata: OAuthMetadata, redirect_uri: str) -> str:
    """Register a public client for this sign-in's redirect URI; its client id."""
    request = create_client_registration_request(metadata, OAuthClientMetadata(
        redirect_uris=[AnyUrl(redirect_uri)], token_endpoint_auth_method="none",
        grant_types=["authorization_code", "refresh_token"], response_types=["code"],
        client_name="flask-solidloop", scope=entry.scope), str(metadata.issuer))
    try:
        with _http() as http:
            response = http.send(request)
        if response.status_code not in (200, 201):
            raise _auth_error(entry, f"dynamic registration at {request.url} answered HTTP "
                                     f"{response.status_code}")
        return OAuthClientInformationFull.model_validate_json(response.content).client_id
    except httpx2.HTTPError as exc:
        raise McpTransportError("connect", f"dynamic registration at {request.url} failed: "
                                f"{type(exc).__name__}", server=entry.server_name) from None
    except ValidationError:
        raise _auth_error(entry, f"dynamic registration at {request.url} answered with no "
                                 "client id") from None


# --------------------------------------------------------------------------- storage


def _encrypt(value: str | None) -> str | None:
    return _fernet().encrypt(value.encode()).decode() if value else None


def _decrypt(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return _fernet().decrypt(value.encode()).decode()
    except InvalidToken:
        return None  # a key that was rotated out: as good as no token


def _values(token: OAuthToken, *, keep_refresh: str | None = None) -> dict[str, Any]:
    expires = (datetime.now(UTC) + timedelta(seconds=token.expires_in)
               if token.expires_in else None)
    return {"access_token_encrypted": _encrypt(token.access_token),
            "refresh_token_encrypted": _encrypt(token.refresh_token or keep_refresh),
            "expires_at": expires, "scope": token.scope}


def _remember(entry: OAuthEntry, token: str, expires_at: datetime | None) -> None:
    _cache[(entry.resource, entry.subject)] = (
        token, expires_at.timestamp() if expires_at else None)


def store_token(entry: OAuthEntry, subject: str, token: OAuthToken, *, issuer: str,
                token_endpoint: str, client_id: str) -> None:
    """Keep a token set the authorization-code grant just gave (one row per server
    and subject; a new sign-in replaces the old set)."""
    values = {"server_name": entry.server_name, "issuer": issuer,
              "token_endpoint": token_endpoint, "client_id": client_id, **_values(token),
              "updated_at": datetime.now(UTC)}
    statement = pg_insert(_table).values(resource=entry.resource, subject=subject, **values)
    with _engine().begin() as conn:
        conn.execute(statement.on_conflict_do_update(
            index_elements=["resource", "subject"], set_=values))
    _cache.pop((entry.resource, subject), None)


def access_token(entry: OAuthEntry, *, stale: str | None = None) -> str:
    """A usable access token for ``entry``'s server and subject.

    From the process's cache while it is more than SOLIDLOOP_OAUTH_REFRESH_MARGIN
    from expiry; else from the token row, locked (``FOR UPDATE``) in its own
    short transaction: re-checked after the lock (another worker may have just
    refreshed it), refreshed or fetched anew (client credentials) if still due,
    and committed. ``stale`` is a token the server refused with 401: it is
    replaced even if it has not expired. Raises McpAuthError when there is no
    token to use or refresh (the refresh token was refused: it is dropped).
    """
    settings = _require()
    key = (entry.resource, entry.subject)
    margin = settings.refresh_margin
    cached = _cache.get(key)
    if cached is not None and cached[0] != stale and (
            cached[1] is None or cached[1] - margin > time.time()):
        return cached[0]
    refused: _Refused | None = None
    where = (_table.c.resource == entry.resource) & (_table.c.subject == entry.subject)
    with _engine().begin() as conn:
        if entry.grant == "client_credentials":
            # The row exists before it is locked, so two workers fetching a first
            # client-credentials token also take turns.
            conn.execute(pg_insert(_table).values(
                resource=entry.resource, subject=entry.subject, server_name=entry.server_name,
            ).on_conflict_do_nothing(index_elements=["resource", "subject"]))
        row = conn.execute(select(_table).where(where).with_for_update()).first()
        if row is None:  # nobody signed in for this subject: nothing to write
            raise _auth_error(entry, f"no OAuth token for subject {entry.subject!r} yet")
        current = _decrypt(row.access_token_encrypted)
        now = datetime.now(UTC)
        if current is not None and current != stale and (
                row.expires_at is None or row.expires_at - timedelta(seconds=margin) > now):
            _remember(entry, current, row.expires_at)
            return current
        refresh = _decrypt(row.refresh_token_encrypted)
        values: dict[str, Any] | None = None
        try:
            if refresh is not None and row.token_endpoint and row.client_id:
                token = _token_request(entry, row.token_endpoint, row.client_id, {
                    "grant_type": "refresh_token", "refresh_token": refresh})
                values = _values(token, keep_refresh=refresh)
            elif entry.grant == "client_credentials":
                found = discover(entry)
                assert entry.client_id is not None  # validate_auth requires it
                token = _token_request(entry, str(found.metadata.token_endpoint),
                                       entry.client_id, {"grant_type": "client_credentials"},
                                       resource=found.resource, scope=found.scope(entry))
                values = {**_values(token), "issuer": found.issuer,
                          "token_endpoint": str(found.metadata.token_endpoint),
                          "client_id": entry.client_id}
        except _Refused as exc:
            refused = exc
            if entry.grant == "authorization_code":
                # Revoked or expired for good: forget it, so no worker tries it again.
                values = {"access_token_encrypted": None, "refresh_token_encrypted": None,
                          "expires_at": None}
        if values is not None:
            values["updated_at"] = now
            conn.execute(update(_table).where(where).values(**values))
    if refused is not None:
        raise _auth_error(entry, f"the authorization server refused to "
                                 f"{'refresh' if refresh else 'issue'} the OAuth token for "
                                 f"subject {entry.subject!r}: {refused}")
    if values is None:
        raise _auth_error(entry, f"no OAuth token for subject {entry.subject!r} yet")
    new = _decrypt(values["access_token_encrypted"])
    assert new is not None
    _remember(entry, new, values["expires_at"])
    return new


# --------------------------------------------------------------------------- sign-in


def begin_sign_in(entry: OAuthEntry, *, subject: str, redirect_uri: str, nonce: str) -> str:
    """The authorization URL a person's browser goes to (PKCE S256, ``resource``).

    What the callback needs (the PKCE verifier, subject, endpoints, ``nonce``)
    travels in ``state``, encrypted under SOLIDLOOP_OAUTH_KEY, so any web
    process can finish the sign-in and nothing is kept server-side meanwhile.
    """
    found = discover(entry)
    metadata = found.metadata
    if "S256" not in (metadata.code_challenge_methods_supported or []):
        raise _auth_error(entry, f"the authorization server {metadata.issuer} does not "
                                 "advertise PKCE S256; the MCP authorization spec requires it")
    client_id = _client_id(entry, metadata, redirect_uri)
    verifier, challenge = _pkce()
    state = _fernet().encrypt(json.dumps({
        "server": entry.server_name, "subject": subject, "verifier": verifier,
        "nonce": nonce, "redirect_uri": redirect_uri, "client_id": client_id,
        "issuer": found.issuer, "token_endpoint": str(metadata.token_endpoint),
        "iss_supported": bool(metadata.authorization_response_iss_parameter_supported),
        "resource": found.resource or entry.resource,
    }).encode()).decode()
    params = {"response_type": "code", "client_id": client_id, "redirect_uri": redirect_uri,
              "state": state, "code_challenge": challenge, "code_challenge_method": "S256",
              "resource": found.resource or entry.resource}
    scope = found.scope(entry)
    if scope:
        params["scope"] = scope
    endpoint = str(metadata.authorization_endpoint)
    return endpoint + ("&" if "?" in endpoint else "?") + urllib.parse.urlencode(params)


def read_sign_in_state(state: str) -> dict[str, Any]:
    """The sign-in's data from its ``state``; InvalidArgumentError (a ValueError) if
    forged or older than SIGN_IN_TTL."""
    try:
        return dict(json.loads(_fernet().decrypt(state.encode(), ttl=SIGN_IN_TTL)))
    except (InvalidToken, ValueError):
        raise InvalidArgumentError("the sign-in's state is invalid or expired; start the sign-in "
                         "again") from None


def finish_sign_in(entry: OAuthEntry, data: dict[str, Any], code: str,
                   iss: str | None = None) -> None:
    """Exchange the code (with the PKCE verifier and ``resource``) and store the tokens.

    ``iss`` is the authorization response's issuer parameter (RFC 9207): when
    present it must equal the issuer discovery recorded, character for
    character; when the authorization server advertises it, it must be present.
    Otherwise the code is never sent (McpAuthError): a mix-up attack's code
    would go to the wrong token endpoint.
    """
    if iss is not None and iss != data["issuer"]:
        raise _auth_error(entry, f"the authorization response names issuer {iss!r}, not "
                                 f"{data['issuer']!r}, the one this sign-in started with; "
                                 "the response was refused (RFC 9207)")
    if iss is None and data.get("iss_supported"):
        raise _auth_error(entry, f"the authorization server {data['issuer']} advertises the "
                                 "iss response parameter but its response had none; the "
                                 "response was refused (RFC 9207)")
    try:
        token = _token_request(entry, data["token_endpoint"], data["client_id"], {
            "grant_type": "authorization_code", "code": code,
            "redirect_uri": data["redirect_uri"], "code_verifier": data["verifier"]},
            resource=data.get("resource"))
    except _Refused as exc:
        raise _auth_error(entry, f"the authorization server refused the sign-in's code: "
                                 f"{exc}") from None
    store_token(entry, data["subject"], token, issuer=data["issuer"],
                token_endpoint=data["token_endpoint"], client_id=data["client_id"])


# --------------------------------------------------------------------------- the tool server


class _Unreachable:
    """The transport of a server whose authorization server could not be reached for
    a token: every request fails with that error, so the registry treats it as it
    treats an unreachable MCP server (a tool error the model reads; at the first
    turn's listing, a failed loop)."""

    def __init__(self, error: McpTransportError, session_state: dict[str, Any] | None
                 ) -> None:
        # Kept as text: its message already names the server.
        self.kind, self.message = error.kind, str(error)
        self.state = dict(session_state or {})

    def list_tools(self) -> list[dict[str, Any]]:
        raise McpTransportError(self.kind, self.message)

    def call_tool(self, name: str, arguments: dict[str, Any], *,
                  meta: dict[str, Any] | None = None) -> ToolResult:
        raise McpTransportError(self.kind, self.message)

    def session_state(self) -> dict[str, Any]:
        return dict(self.state)

    def close(self, *, end_session: bool = True) -> None:
        pass


def oauth_server(entry: dict[str, Any], build: Callable[[str, dict[str, Any] | None], Any],
                 session_state: dict[str, Any] | None) -> Any:
    """make_server's ToolServer for an ``auth=`` entry (imported lazily by the registry)."""
    from .registry import TransportServer

    class OAuthTransportServer(TransportServer):
        """An HTTP server's tools with a bearer token: after a 401, one retry with a new
        token (another worker's refresh, or ours); a second 401 is McpAuthError, so a
        token the server keeps refusing cannot loop. An authorization server that
        cannot be reached is an infrastructure failure like any other
        (McpTransportError); only a missing or refused token is McpAuthError."""

        def __init__(self) -> None:
            self.oauth = OAuthEntry.from_entry(entry)
            self.token: str | None = None
            try:
                self.token = access_token(self.oauth)
                transport: Any = build(self.token, session_state)
            except McpAuthError:
                raise
            except McpTransportError as exc:
                transport = _Unreachable(exc, session_state)
            super().__init__(self.oauth.server_name, transport)

        def _renew(self) -> None:
            state = self.transport.session_state()
            self.release()
            self.token = access_token(self.oauth, stale=self.token)
            self.transport = build(self.token, state or None)

        def _refused(self) -> McpAuthError:
            return _auth_error(self.oauth, "the server refused a freshly issued OAuth token "
                                           "(HTTP 401/403); check the token's audience and "
                                           "scope")

        def tools(self) -> list[dict[str, Any]]:
            try:
                return super().tools()
            except McpAuthError:
                raise
            except McpTransportError as exc:
                if exc.kind != "auth":
                    raise
            self._renew()
            try:
                return super().tools()
            except McpAuthError:
                raise
            except McpTransportError as exc:
                if exc.kind == "auth":
                    raise self._refused() from None
                raise

        def call(self, tool_name: str, arguments: Any, ctx: CallContext) -> ToolResult:
            result = super().call(tool_name, arguments, ctx)
            if result.error_kind != "infra:auth":
                return result
            # A 401 is refused before the tool runs: calling again is safe.
            try:
                self._renew()
            except McpAuthError:
                raise
            except McpTransportError as exc:
                failed = ToolResult.error(f"the tool server {self.name!r} could not run "
                                          f"{tool_name!r} ({exc.kind}): {exc}")
                failed.error_kind = f"infra:{exc.kind}"
                return failed
            result = super().call(tool_name, arguments, ctx)
            if result.error_kind == "infra:auth":
                raise self._refused()
            return result

    return OAuthTransportServer()
