"""The sign-in blueprint for OAuth-protected MCP servers (authorization-code grant).

The host mounts it on its web app::

    from flask_solidloop.mcp.oauth_blueprint import oauth_blueprint

    app.register_blueprint(oauth_blueprint(
        [CRM_MCP], subject=lambda server: f"user:{current_user.id}"))

``GET <prefix>/<server>/sign-in`` redirects the browser to the server's
authorization server (PKCE S256, ``state``, ``resource``); ``GET
<prefix>/callback`` exchanges the code and stores the tokens encrypted
(flask_solidloop/mcp/oauth.py), under the subject ``subject(server)`` returns
(else the entry's own ``auth["subject"]``, default ``"default"``). The prefix
defaults to ``/solidloop/oauth``, the path SOLIDLOOP_OAUTH_SIGN_IN_URL names by
default. A nonce in a cookie ties the callback to the browser that started the
sign-in. Who may sign in is the host's decision: protect the blueprint as you
protect any page that binds an account (``before_request`` on it).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, abort, redirect, request, url_for

from ..errors import InvalidArgumentError, McpAuthError, McpTransportError
from .oauth import OAuthEntry, begin_sign_in, finish_sign_in, read_sign_in_state

__all__ = ["oauth_blueprint"]

_NONCE_COOKIE = "solidloop_oauth_nonce"


def oauth_blueprint(servers: list[dict[str, Any]], *,
                    subject: Callable[[str], str] | None = None,
                    redirect_uri: str | None = None, done_url: str | None = None,
                    name: str = "solidloop_oauth",
                    url_prefix: str = "/solidloop/oauth") -> Blueprint:
    """A blueprint that signs people in to the ``servers`` (``mcps`` entries with
    ``auth={"type": "oauth", "grant": "authorization_code", ...}``).

    ``subject(server_name)`` names whose token the sign-in stores (the current
    user's key, as the entry's ``auth["subject"]`` names it in the agent);
    ``redirect_uri`` overrides the callback's external URL (behind a proxy that
    does not forward the host); ``done_url`` is where the browser goes after a
    successful sign-in (else a short text page).
    """
    entries: dict[str, OAuthEntry] = {}
    for entry in servers:
        if not isinstance(entry, dict) or not entry.get("auth") or not entry.get("url"):
            raise InvalidArgumentError(
                "oauth_blueprint takes mcps entries with url= and auth=, got "
                f"{entry.get('name') if isinstance(entry, dict) else type(entry).__name__!r}")
        oauth = OAuthEntry.from_entry(entry)
        if oauth.grant != "authorization_code":
            raise InvalidArgumentError(
                f"mcps entry {oauth.server_name!r} uses the {oauth.grant} grant: nobody "
                "signs in to it; leave it out of oauth_blueprint")
        entries[oauth.server_name] = oauth
    blueprint = Blueprint(name, __name__, url_prefix=url_prefix)

    def subject_for(entry: OAuthEntry) -> str:
        return subject(entry.server_name) if subject is not None else entry.subject

    @blueprint.get("/<server>/sign-in")
    def sign_in(server: str) -> Any:
        entry = entries.get(server)
        if entry is None:
            abort(404)
        nonce = secrets.token_urlsafe(24)
        callback = redirect_uri or url_for(f"{name}.callback", _external=True)
        try:
            target = begin_sign_in(entry, subject=subject_for(entry), redirect_uri=callback,
                                   nonce=nonce)
        except McpTransportError as exc:
            return Response(f"cannot start the sign-in: {exc}\n", 502, mimetype="text/plain")
        response = redirect(target)
        response.set_cookie(_NONCE_COOKIE, nonce, max_age=600, httponly=True, samesite="Lax",
                            secure=request.is_secure, path=url_prefix)
        return response

    @blueprint.get("/callback")
    def callback() -> Any:
        if request.args.get("error"):
            return Response(f"the sign-in was refused: {request.args['error']} "
                            f"{request.args.get('error_description', '')}\n", 400,
                            mimetype="text/plain")
        try:
            data = read_sign_in_state(request.args.get("state", ""))
        except ValueError as exc:
            return Response(f"{exc}\n", 400, mimetype="text/plain")
        nonce = request.cookies.get(_NONCE_COOKIE)
        if not nonce or not secrets.compare_digest(nonce, str(data.get("nonce"))):
            return Response("this sign-in was started in another browser; start it again\n",
                            400, mimetype="text/plain")
        entry = entries.get(str(data.get("server")))
        code = request.args.get("code")
        if entry is None or not code:
            return Response("the callback names no code or an unknown server\n", 400,
                            mimetype="text/plain")
        if subject is not None and subject(entry.server_name) != data.get("subject"):
            return Response("the sign-in was started for someone else; start it again\n",
                            403, mimetype="text/plain")
        try:
            finish_sign_in(entry, data, code, request.args.get("iss"))
        except McpAuthError as exc:  # refused: a wrong or missing iss, a refused code
            return Response(f"the sign-in failed: {exc}\n", 400, mimetype="text/plain")
        except McpTransportError as exc:
            return Response(f"the sign-in failed: {exc}\n", 502, mimetype="text/plain")
        response = redirect(done_url) if done_url else Response(
            f"Signed in to {entry.server_name}.\n", mimetype="text/plain")
        response.delete_cookie(_NONCE_COOKIE, path=url_prefix)
        return response

    return blueprint
