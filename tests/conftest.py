"""Shared fixtures: a real PostgreSQL database per test session, cleaned between
tests; a real LLM emulator on 127.0.0.1; the support app.

They serve tests/integration, tests/acceptance and tests/migration, and are all
lazy: nothing here connects until a test asks for ``database_url``, ``llm`` or a
fixture built on them. tests/unit/conftest.py overrides ``database_url`` and
``llm`` with fixtures that fail the asking test, so a unit-only run never creates
the session database, and never reaches the ``pytest.exit`` below when
PostgreSQL is down.
"""

from __future__ import annotations

import os

import psycopg
import pytest
from psycopg import sql

from flask_solidloop.database import ensure_database
from flask_solidloop.migrations import upgrade
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing import LLMEmulator

from .support_app import DATABASE_URL_ENV, DEFAULT_DATABASE_URL, LLM_URL_ENV, SIDE_EFFECTS

TABLES = ("solidloop_events", "solidloop_mcp_sessions", "solidloop_tool_calls", "solidloop_workers",
          "solidloop_host_jobs", "solidloop_results", "solidloop_periodic",
          "solidloop_messages", "solidloop_loops", "solidloop_jobs")


@pytest.fixture(scope="session")
def database_url():
    """A database of this session's own, so concurrent test runs never collide.

    SOLIDLOOP_TEST_DATABASE_URL pins a specific database instead (kept afterwards).
    """
    pinned = os.environ.get(DATABASE_URL_ENV)
    url = pinned or f"{DEFAULT_DATABASE_URL}_{os.getpid()}"
    os.environ[DATABASE_URL_ENV] = url
    try:
        ensure_database(url)
    except Exception as exc:
        pytest.exit(f"PostgreSQL is needed for the tests: {exc}", returncode=3)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS " + ", ".join(TABLES)
                     + ", solidloop_alembic_version CASCADE")
    upgrade(url)
    yield url
    if not pinned:
        os.environ.pop(DATABASE_URL_ENV, None)
        drop_database(url)


def drop_database(url: str) -> None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    admin = libpq_url(parsed.set(database="postgres").render_as_string(hide_password=False))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(parsed.database)))


@pytest.fixture(scope="session")
def llm():
    emulator = LLMEmulator().start()
    os.environ[LLM_URL_ENV] = emulator.base_url
    os.environ["SOLIDLOOP_TEST_API_KEY"] = "sk-test-secret-123"
    yield emulator
    emulator.stop()


@pytest.fixture(autouse=True)
def clean_database(request):
    if "database_url" not in request.fixturenames and "app" not in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("database_url")
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("TRUNCATE " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE")
    SIDE_EFFECTS.clear()
    yield


@pytest.fixture
def app(database_url, llm):
    from .support_app import create_app

    llm.reset()
    app = create_app()
    with app.app_context():
        yield app
        app.extensions["sqlalchemy"].session.remove()
        for engine in app.extensions["sqlalchemy"].engines.values():
            engine.dispose()
    app.extensions["solidloop"].stop_renewer()
    app.extensions["solidloop"].broker.close()


@pytest.fixture
def session(app):
    return app.extensions["sqlalchemy"].session


@pytest.fixture
def drain(app):
    from flask_solidloop.testing import drain as run

    return lambda **kw: run(app, **kw)
