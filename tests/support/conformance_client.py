"""The official MCP conformance suite's CLIENT under test: our MCP client's OAuth.

``conformance client --command "python -m tests.support.conformance_client"``
runs this module with the suite's test MCP server URL as its argument, and
``MCP_CONFORMANCE_SCENARIO`` / ``MCP_CONFORMANCE_CONTEXT`` in the environment.
It builds tests/support/support_app.py's app (its database from
SOLIDLOOP_TEST_DATABASE_URL, the token store's), one ``mcps`` entry
``{"name": "conf", "url": <url>, "auth": {"type": "oauth", ...}}`` chosen from
the scenario's context, and then does what a host and a worker do:

* client credentials (the context names a client secret and the scenario is a
  client-credentials one): nothing to sign in to;
* else the authorization-code grant, signed in headlessly through the product's
  sign-in blueprint: its sign-in route (Flask test client), the suite's
  ``/authorize`` with a real HTTP GET (its redirect not followed: it answers
  at once with the code), and the blueprint's callback (test client, with the
  browser's nonce cookie). The client is the context's pre-registered one, else
  a Client ID Metadata Document URL when the authorization server takes one,
  else dynamic registration;

then lists the server's tools and calls the first one through the product's
transport (:func:`flask_solidloop.mcp.registry.make_server`, the OAuth
server a loop would use). Exit 0 on success; 1 with the error on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
import uuid
from typing import Any

import httpx

#: The URL the suite's CIMD scenario expects as the client id.
CLIENT_METADATA_URL = "https://conformance-test.local/client-metadata.json"
SECRET_ENV = "SOLIDLOOP_CONFORMANCE_CLIENT_SECRET"


def _entry(url: str, scenario: str, context: dict[str, Any]) -> dict[str, Any]:
    subject = f"conformance-{uuid.uuid4().hex[:12]}"  # scenarios may run in parallel
    auth: dict[str, Any] = {"type": "oauth", "subject": subject}
    if context.get("client_secret"):
        os.environ[SECRET_ENV] = str(context["client_secret"])
        auth.update(client_id=str(context["client_id"]), client_secret_env=SECRET_ENV)
        if "client-credentials" in scenario:
            auth["grant"] = "client_credentials"
    elif context.get("client_id"):
        auth["client_id"] = str(context["client_id"])
    else:
        auth.update(client_metadata_url=CLIENT_METADATA_URL, dynamic_registration=True)
    return {"name": "conf", "url": url, "auth": auth}


def _sign_in(app: Any, entry: dict[str, Any]) -> None:
    from flask_solidloop.mcp.oauth_blueprint import oauth_blueprint

    app.register_blueprint(oauth_blueprint([entry]))
    browser = app.test_client()
    start = browser.get(f"/solidloop/oauth/{entry['name']}/sign-in")
    if start.status_code != 302:
        raise SystemExit(f"the sign-in did not start (HTTP {start.status_code}): "
                         f"{start.get_data(as_text=True).strip()}")
    approved = httpx.get(start.headers["Location"], follow_redirects=False, timeout=30)
    if approved.status_code not in (301, 302, 303, 307, 308):
        raise SystemExit(f"the authorization endpoint answered HTTP {approved.status_code}: "
                         f"{approved.text[:300]}")
    back = urllib.parse.urlsplit(approved.headers["Location"])
    done = browser.get(f"{back.path}?{back.query}")
    if done.status_code != 200:
        raise SystemExit(f"the sign-in's callback refused (HTTP {done.status_code}): "
                         f"{done.get_data(as_text=True).strip()}")


def run(url: str) -> None:
    from cryptography.fernet import Fernet

    from flask_solidloop.mcp.registry import make_server
    from flask_solidloop.mcp.toolset import CallContext

    from .support_app import create_app

    scenario = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    app = create_app(SOLIDLOOP_OAUTH_KEY=Fernet.generate_key().decode())
    entry = _entry(url, scenario, context)
    with app.app_context():
        if entry["auth"].get("grant") != "client_credentials":
            _sign_in(app, entry)
        # As a loop does: one server for the listing (it releases its transport),
        # another for the call, resuming the listing's session state.
        listing = make_server(entry)
        tools = listing.tools()
        if not tools:
            raise SystemExit("the server listed no tools")
        name = tools[0]["name"]
        server = make_server(entry, listing.session_state() or None)
        try:
            result = server.call(name, {}, CallContext(server_name="conf", tool_name=name))
        finally:
            server.release()
        if result.error_kind:
            raise SystemExit(f"calling {name!r} failed ({result.error_kind}): "
                             f"{result.content}")
        print(f"called {name!r}: {result.content}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.conformance_client <mcp-server-url>",
              file=sys.stderr)
        return 2
    try:
        run(argv[0])
    except SystemExit as exc:
        print(f"conformance client: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the verdict is the exit code; the error is the evidence
        print(f"conformance client: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
