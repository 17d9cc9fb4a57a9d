"""The pytest plugin of flask-solidloop (entry point ``pytest11: solidloop``).

Installed with the package; every fixture is opt-in (nothing connects, starts or
truncates until a test asks for it):

===========================  ==========================================================
``solidloop_database_url``   session: the test database (``--solidloop-db-url``, the
                             ``solidloop_db_url`` ini key, or
                             ``SOLIDLOOP_TEST_DATABASE_URL``), created if missing and
                             migrated to head once
``solidloop_clean_db``       truncates every table of flask-solidloop's metadata (read
                             from ``flask_solidloop.models.metadata``, never a list
                             typed by hand) before the test
``solidloop_llm``            session: a running :class:`LLMEmulator`, reset per test
``solidloop_mcp``            session: a running :class:`MCPEmulator`, reset per test
``solidloop_drain``          ``solidloop_drain()`` runs the due jobs of your ``app``
                             fixture in-process (see :func:`drain`)
``solidloop_chaos``          runs your agent under random worker SIGKILLs and checks the
                             durability contract (:mod:`flask_solidloop.testing.chaos`)
===========================  ==========================================================

A user's conftest::

    import pytest
    from myapp import create_app

    @pytest.fixture
    def app(solidloop_database_url, solidloop_clean_db):
        app = create_app({"SQLALCHEMY_DATABASE_URI": solidloop_database_url})
        with app.app_context():
            yield app
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

DATABASE_URL_ENV = "SOLIDLOOP_TEST_DATABASE_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("solidloop", "flask-solidloop")
    group.addoption("--solidloop-db-url", default=None, metavar="URL",
                    help="PostgreSQL URL (postgresql+psycopg://...) of a database the tests "
                         f"may wipe; default: the solidloop_db_url ini key, or ${DATABASE_URL_ENV}")
    parser.addini("solidloop_db_url", "PostgreSQL URL of the flask-solidloop test database")


def configured_database_url(config: pytest.Config) -> str | None:
    """The test database URL the options, the ini file or the environment name."""
    return (config.getoption("--solidloop-db-url") or config.getini("solidloop_db_url")
            or os.environ.get(DATABASE_URL_ENV) or None)


def prepare_database(url: str) -> None:
    """Create the database if missing and migrate the solidloop tables to head."""
    from ..database import check_connection, ensure_database
    from ..migrations import upgrade

    ensure_database(url)
    check_connection(url)
    upgrade(url)


def truncate_all(url: str) -> None:
    """Empty every table of flask-solidloop's metadata, restarting their sequences."""
    import psycopg
    from psycopg import sql

    from ..models import metadata
    from ..urls import libpq_url

    names = [table.name for table in metadata.sorted_tables]
    # TRUNCATE costs a new file per table and index whether or not the table
    # holds a row; most tests touch a few of our tables, so only those are
    # truncated: a table with a row, or whose sequence was drawn from (a row
    # inserted and deleted still moved the identity that RESTART IDENTITY resets).
    used = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT FROM {})").format(
            sql.Literal(name), sql.Identifier(name)) for name in names)
    drawn = sql.SQL(
        "SELECT t.relname FROM pg_sequences s"
        " JOIN pg_class q ON q.relname = s.sequencename"
        " AND q.relnamespace = s.schemaname::regnamespace"
        " JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = q.oid"
        " AND d.deptype IN ('a', 'i')"
        " JOIN pg_class t ON t.oid = d.refobjid"
        " WHERE s.last_value IS NOT NULL AND t.relname = ANY({})").format(sql.Literal(names))
    # Every table locked first, as one TRUNCATE of them all would: a previous
    # test's process still writing is waited for, and its rows are seen.
    lock = sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
        sql.SQL(", ").join(sql.Identifier(name) for name in names))
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for attempt in range(5):
            try:
                with conn.transaction():
                    conn.execute(lock)
                    dirty = {name for (name,) in conn.execute(used)}
                    dirty |= {name for (name,) in conn.execute(drawn)}
                    if dirty:
                        conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                            sql.SQL(", ").join(sql.Identifier(name) for name in names
                                               if name in dirty)))
                return
            except psycopg.errors.DeadlockDetected:
                # A previous test's server or worker still finishing a write (its
                # process is stopping) holds one table while TRUNCATE holds another;
                # PostgreSQL aborted ours. That writer is done in a moment.
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))


@pytest.fixture(scope="session")
def solidloop_database_url(pytestconfig: pytest.Config) -> str:
    url = configured_database_url(pytestconfig)
    if not url:
        raise pytest.UsageError(
            "the flask-solidloop fixtures need a PostgreSQL database the tests may wipe: pass "
            "--solidloop-db-url postgresql+psycopg://user@host/db_test, set solidloop_db_url "
            f"in the pytest ini file, or set {DATABASE_URL_ENV}")
    from ..errors import SolidLoopError

    try:
        prepare_database(url)
    except SolidLoopError as exc:
        pytest.exit(f"flask-solidloop test database: {exc}", returncode=3)
    return url


@pytest.fixture
def solidloop_clean_db(solidloop_database_url: str) -> str:
    truncate_all(solidloop_database_url)
    return solidloop_database_url


@pytest.fixture(scope="session")
def solidloop_llm_server() -> Iterator[Any]:
    from .llm_emulator import LLMEmulator

    # Strict: it refuses the request shapes real servers refuse, so a test cannot
    # pass on a request only the emulator would take.
    emulator = LLMEmulator(strict=True).start()
    yield emulator
    emulator.stop()


@pytest.fixture
def solidloop_llm(solidloop_llm_server: Any) -> Any:
    """The LLM emulator (``.base_url``, ``.script(...)``), reset for this test."""
    solidloop_llm_server.reset()
    return solidloop_llm_server


@pytest.fixture(scope="session")
def solidloop_mcp_server() -> Iterator[Any]:
    from .mcp_emulator import MCPEmulator

    emulator = MCPEmulator().start()
    yield emulator
    emulator.stop()


@pytest.fixture
def solidloop_mcp(solidloop_mcp_server: Any) -> Any:
    """The MCP emulator (``.url``, ``.tool(...)``), reset for this test."""
    solidloop_mcp_server.reset()
    return solidloop_mcp_server


@pytest.fixture
def solidloop_drain(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``solidloop_drain(**kw)``: run the due jobs of the ``app`` fixture in-process."""
    from .drain import drain

    app = request.getfixturevalue("app")
    return lambda **kw: drain(app, **kw)


@pytest.fixture
def solidloop_chaos(solidloop_database_url: str, solidloop_clean_db: str,
                    tmp_path: Any) -> Callable[..., Any]:
    """``solidloop_chaos(app_import, start_loops, **settings)`` -> a ChaosReport that
    has already asserted the durability contract (see testing/chaos.py)."""
    from .chaos import run_user_chaos

    def run(app_import: str, start_loops: Callable[[], list[int]], **settings: Any) -> Any:
        return run_user_chaos(app_import, start_loops, database_url=solidloop_database_url,
                              log_dir=tmp_path, **settings)

    return run
