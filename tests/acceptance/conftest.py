"""Fixtures of the acceptance tests (real worker processes)."""

from __future__ import annotations

import psycopg
import pytest

from flask_solidloop.urls import libpq_url

from ..support.support_app import SLOW_EFFECTS_DDL


@pytest.fixture
def effects(database_url):
    """Who ran which tool body, by idempotency key (logged by the tools themselves,
    outside our transactions): ``effects(key, phase="start")`` lists the pids."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(SLOW_EFFECTS_DDL)
        conn.execute("TRUNCATE slow_effects")

    def runs(key: str, phase: str = "start") -> list[int]:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            return [pid for (pid,) in conn.execute(
                "SELECT pid FROM slow_effects WHERE idempotency_key = %s AND phase = %s "
                "ORDER BY id", (key, phase))]

    return runs


@pytest.fixture(scope="session")
def mcp_gunicorn(database_url, tmp_path_factory):
    """tests/support/mcp_server_app.py under ``gunicorn -w 4 -k gthread`` (shared by the
    MCP server blueprint tests of a session): its base URL."""
    from ..support.mcp_gunicorn import serve

    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    with serve(workers=4, threads=4, log_path=log,
               env={"SOLIDLOOP_TEST_DATABASE_URL": database_url}) as base:
        yield base
