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
from flask_solidloop.models import metadata
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing.plugin import prepare_database, truncate_all

from .support.support_app import (
    DATABASE_URL_ENV,
    DEFAULT_DATABASE_URL,
    LLM_URL_ENV,
    SIDE_EFFECTS,
    SLOW_EFFECTS_DDL,
)

# The suite runs on flask_solidloop.testing's pytest plugin (loaded through its
# pytest11 entry point): the database, emulator and drain fixtures below are its
# fixtures, with this suite's choices (a database per test session) on top.


@pytest.fixture(scope="session")
def solidloop_database_url(pytestconfig):
    """A database of this session's own, so concurrent test runs never collide.

    --solidloop-db-url or SOLIDLOOP_TEST_DATABASE_URL pins a specific database
    instead (kept afterwards).
    """
    from flask_solidloop.testing.plugin import configured_database_url

    pinned = configured_database_url(pytestconfig)
    url = pinned or f"{DEFAULT_DATABASE_URL}_{os.getpid()}"
    os.environ[DATABASE_URL_ENV] = url
    try:
        ensure_database(url)
    except Exception as exc:
        pytest.exit(f"PostgreSQL is needed for the tests: {exc}", returncode=3)
    # A pinned database may hold tables of an older migration history.
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS " + ", ".join(
            t.name for t in metadata.sorted_tables) + ", solidloop_alembic_version CASCADE")
    prepare_database(url)
    yield url
    if not pinned:
        os.environ.pop(DATABASE_URL_ENV, None)
        drop_database(url)


@pytest.fixture(scope="session")
def database_url(solidloop_database_url):
    return solidloop_database_url


def drop_database(url: str) -> None:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    admin = libpq_url(parsed.set(database="postgres").render_as_string(hide_password=False))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(parsed.database)))


@pytest.fixture(scope="session")
def llm(solidloop_llm_server):
    os.environ[LLM_URL_ENV] = solidloop_llm_server.base_url
    os.environ["SOLIDLOOP_TEST_API_KEY"] = "sk-test-secret-123"
    yield solidloop_llm_server


@pytest.fixture(autouse=True)
def clean_database(request):
    """Every table of our metadata truncated (the plugin's truncate_all) before
    each test that touches the database."""
    if "database_url" not in request.fixturenames and "app" not in request.fixturenames:
        yield
        return
    truncate_all(request.getfixturevalue("database_url"))
    SIDE_EFFECTS.clear()
    yield


@pytest.fixture
def app(database_url, llm):
    from .support.support_app import create_app

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
def drain(solidloop_drain):
    return solidloop_drain


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


@pytest.fixture
def japp(database_url):
    """The host-jobs app (tests/support/jobs_app.py), its tables empty."""
    from sqlalchemy import text

    from flask_solidloop.state import get_state

    from .support import jobs_app

    app = jobs_app.create_app()
    with app.app_context():
        jobs_app.db.create_all()
        jobs_app.db.session.execute(text("TRUNCATE " + ", ".join(jobs_app.HOST_TABLES)))
        jobs_app.db.session.commit()
        yield app
        jobs_app.db.session.remove()
        for engine in jobs_app.db.engines.values():
            engine.dispose()
    get_state(app).broker.close()
