"""Fixtures of the acceptance tests (real worker processes)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mcp_gunicorn(database_url, tmp_path_factory):
    """tests/support/mcp_server_app.py under ``gunicorn -w 4 -k gthread`` (shared by the
    MCP server blueprint tests of a session): its base URL."""
    from ..support.mcp_gunicorn import serve

    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    with serve(workers=4, threads=4, log_path=log,
               env={"SOLIDLOOP_TEST_DATABASE_URL": database_url}) as base:
        yield base
