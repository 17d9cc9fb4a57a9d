"""An OAuth-protected MCP server for tests: the MCP emulator behind the test AS's JWTs.

``ProtectedMCP(oauth)`` is an :class:`MCPEmulator` that accepts a bearer token
only if ``oauth.verify(token, audience=<its own URL>)`` (signature, issuer,
audience = this resource, expiry, not revoked) and otherwise answers 401 with
``WWW-Authenticate: Bearer resource_metadata="<origin>/resource-metadata.json"``,
which it serves (RFC 9728) naming ``oauth.issuer`` as its authorization server, as
it does at the well-known ``/.well-known/oauth-protected-resource/mcp``.
``accepted`` lists the tokens it took; ``refused`` counts the 401s. It can also
serve a Client ID Metadata Document (``client_metadata``) at ``client_metadata_url``,
and register clients for the authorization server (RFC 7591) at ``registration_url``.
"""

from __future__ import annotations

import json
from typing import Any

from flask_solidloop.testing.mcp_emulator import MCPEmulator
from flask_solidloop.testing.mcp_emulator.failures import unauthorized
from flask_solidloop.testing.mcp_emulator.protocol import json_response

from .oauth_server import OAuthServerHandle

WELL_KNOWN = "/.well-known/oauth-protected-resource"
CLIENT_METADATA = "/client-metadata.json"
NAMED_METADATA = "/resource-metadata.json"
REGISTER = "/register"


class ProtectedMCP(MCPEmulator):
    def __init__(self, oauth: OAuthServerHandle, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.oauth = oauth
        self.accepted: list[str] = []
        self.refused = 0
        #: Refuse every token (a server whose audience or scope rules no token meets).
        self.refuse_all = False
        #: Name the metadata in the 401 (else a client must try the well-known URLs).
        self.advertise = True
        #: Paths of the metadata requests it answered.
        self.metadata_requests: list[str] = []
        #: The client metadata dynamic registrations sent (see ``registration_url``).
        self.registered: list[dict[str, Any]] = []
        #: Served at ``client_metadata_url`` when set: a Client ID Metadata Document.
        self.client_metadata: dict[str, Any] | None = None

    @property
    def metadata_url(self) -> str:
        """What the 401 names: not a well-known URL, so a test sees which one a client read."""
        return self.base_url + NAMED_METADATA

    @property
    def client_metadata_url(self) -> str:
        return self.base_url + CLIENT_METADATA

    @property
    def registration_url(self) -> str:
        return self.base_url + REGISTER

    def _handle(self, environ: dict[str, Any]):
        if environ.get("PATH_INFO") == REGISTER and environ.get("REQUEST_METHOD") == "POST":
            # RFC 7591, for the authorization server (its metadata is pointed here).
            size = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.loads(environ["wsgi.input"].read(size) or b"{}")
            client = self.oauth.register_client(
                public=True, redirect_uris=body.get("redirect_uris") or [],
                grant_types=body.get("grant_types") or ["authorization_code"])
            self.registered.append(body)
            return json_response(201, {**body, "client_id": client.client_id})
        if environ.get("PATH_INFO") == CLIENT_METADATA and self.client_metadata is not None:
            return json_response(200, self.client_metadata)
        if environ.get("REQUEST_METHOD") == "GET" and (
                environ.get("PATH_INFO", "").startswith(WELL_KNOWN)
                or environ.get("PATH_INFO") == NAMED_METADATA):
            self.metadata_requests.append(environ["PATH_INFO"])
            return json_response(200, {"resource": self.url,
                                       "authorization_servers": [self.oauth.issuer],
                                       "scopes_supported": self.oauth.scopes,
                                       "bearer_methods_supported": ["header"]})
        return super()._handle(environ)

    def _check_token(self, headers: dict[str, str]):
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        token = credentials.strip()
        if scheme.lower() == "bearer" and token and not self.refuse_all \
                and self.oauth.verify(token, self.url):
            self.accepted.append(token)
            return None
        self.refused += 1
        response = unauthorized(bool(token))
        challenge = f'Bearer resource_metadata="{self.metadata_url}"' if self.advertise \
            else 'Bearer realm="mcp"'
        response.headers["WWW-Authenticate"] = challenge + (
            ', error="invalid_token"' if token else "")
        return response
