"""No credential from a URL reaches a stored row or a log line.

Loops run on a real worker against a model URL with a password in it and an
MCP server URL with a token in its userinfo and its query; one more loop
points at a closed port with the same password, so the connection error
(which names the URL) is stored and logged too. Then a ``pg_dump`` of the
whole database and the worker's log are searched for the canaries.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse

import pytest
from sqlalchemy.engine import make_url

from flask_solidloop.testing.mcp_emulator import MCPEmulator

from ..support.support_app import CANARY_LLM_URL_ENV, CANARY_MCP_URL_ENV, CanaryAgent
from .test_e2e_workers import kill_group, spawn_workers, wait_for

pytestmark = pytest.mark.e2e

PASSWORD = "canaryPW7f3a9"
USER_TOKEN = "canaryTOK51c2e"
QUERY_TOKEN = "canaryQ88d0b"


def with_credentials(url: str, userinfo: str, query: str = "") -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, f"{userinfo}@{parts.netloc}", parts.path,
                                    query, ""))


def pg_dump(database_url: str) -> str:
    url = make_url(database_url)
    binary = shutil.which("pg_dump") or "/usr/lib/postgresql/15/bin/pg_dump"
    return subprocess.run(
        [binary, "-h", url.host or "127.0.0.1", "-p", str(url.port or 5432),
         "-U", url.username or "postgres", "--data-only", url.database],
        check=True, capture_output=True, text=True).stdout


def test_credentials_in_urls_are_never_stored_or_logged(
        app, session, llm, database_url, monkeypatch, tmp_path):
    with MCPEmulator() as server:
        server.tool("echo", description="Echo", handler=lambda arguments, meta: "echoed")
        monkeypatch.setenv(CANARY_LLM_URL_ENV,
                           with_credentials(llm.base_url, f"user:{PASSWORD}"))
        monkeypatch.setenv(CANARY_MCP_URL_ENV, with_credentials(
            server.url, f"agent:{USER_TOKEN}", f"token={QUERY_TOKEN}&page=1"))
        llm.script("echo it", {"tool_calls": [{"name": "echo", "arguments": {}}]})
        llm.script(lambda body: body["messages"][-1]["role"] == "tool", "done")
        # The HTTP clients' line per request (held at WARNING by default) let
        # through: the log then carries the URLs whose credentials must not.
        monkeypatch.setenv("SOLIDLOOP_HTTP_DEBUG", "1")
        log = tmp_path / "worker.log"
        proc = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                              "--processes", "1", "--threads", "2"], log=log)
        try:
            good = CanaryAgent.start(message="echo it").id
            wait_for(session, [good], timeout=60, proc=proc, log=log)
            # The same password on a port nothing listens on: the outage (deferred,
            # its error kept on the loop) and then the failure name the URL.
            monkeypatch.setenv(CANARY_LLM_URL_ENV,
                               f"http://user:{PASSWORD}@127.0.0.1:9")
            monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(
                {"SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT": 2.0}))
            kill_group(proc)
            log = tmp_path / "worker-2.log"
            proc = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                                  "--processes", "1", "--threads", "2"], log=log)
            dead = CanaryAgent.start(message="echo it").id
            statuses = wait_for(session, [dead], timeout=60, proc=proc, log=log)
        finally:
            kill_group(proc)
    assert statuses[dead] == "failed"
    session.expire_all()
    from flask_solidloop.models import Loop

    assert session.get(Loop, good).status == "completed"
    error = session.get(Loop, dead).error_message
    assert error.startswith("the provider stayed out for ")
    assert "cannot connect to http://user:***@127.0.0.1:9" in error
    dump = pg_dump(database_url)
    logged = "".join(path.read_text(errors="replace") for path in tmp_path.glob("worker*.log"))
    # The search is meaningful: the URLs themselves are in both, redacted.
    assert "user:***@127.0.0.1" in dump
    assert "HTTP Request" in logged and "token=***" in logged
    for canary in (PASSWORD, USER_TOKEN, QUERY_TOKEN):
        assert canary not in dump, f"{canary} is stored in the database"
        assert canary not in logged, f"{canary} is in the worker log"
