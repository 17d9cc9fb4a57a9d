"""The admin's gates: who may see it (``authorize``), which requests may change
anything (CSRF), and what the browser may run (CSP and friends).

Fail closed throughout: no ``authorize`` means every request is denied, an
``authorize`` that raises denies, and an unsafe request needs positive proof
that it came from the admin's own pages.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from hashlib import sha256
from urllib.parse import urlsplit

from flask import Request, Response

logger = logging.getLogger("flask_solidloop.admin")

Authorize = Callable[[Request], bool]

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

#: Only the blueprint's own static files run; no inline script or style, no
#: eval (htmx is configured not to need it), no framing, forms post here only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
    # the browser's one shared live stream (static/stream-worker.js)
    "worker-src 'self'"
)


def allowed(authorize: Authorize | None, request: Request) -> bool:
    """True only when the host's ``authorize(request)`` returns exactly True."""
    if authorize is None:
        return False
    try:
        return authorize(request) is True
    except Exception:  # a broken hook must not open the admin
        logger.exception("admin authorize() raised; denying the request")
        return False


def _origin(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def csrf_problem(request: Request, trusted_origins: Iterable[str]) -> str | None:
    """Why an unsafe request is refused, or None if it came from our own pages.

    ``Sec-Fetch-Site`` (every current browser sends it) must say
    ``same-origin``; without it, ``Origin`` (or failing that ``Referer``) must
    be this host's origin or one of ``trusted_origins`` (a proxy's public one).
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        if site == "same-origin":
            return None
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    own = {request.host_url.rstrip("/").lower(), *(o.lower() for o in trusted_origins)}
    origin = request.headers.get("Origin")
    if origin and origin != "null":
        return None if origin.lower() in own else f"cross-site request refused (Origin {origin})"
    referer = request.headers.get("Referer")
    if referer:
        ref_origin = _origin(referer)
        return None if ref_origin in own else "cross-site request refused (Referer)"
    return ("request refused: no Sec-Fetch-Site, Origin or Referer header shows it came "
            "from the admin's own pages")


def csrf_token(secret: str, identity: str) -> str:
    """A token bound to the app's secret and the session identity (optional layer)."""
    return hmac.new(secret.encode(), f"solidloop-admin:{identity}".encode(), sha256).hexdigest()


def token_ok(secret: str, identity: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(csrf_token(secret, identity), given or "")


def harden(response: Response) -> Response:
    """Headers on every admin response."""
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers.setdefault("Cache-Control", "no-store")
    return response
