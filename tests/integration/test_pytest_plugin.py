"""The shipped pytest plugin, used by a user's test suite exactly as the testing
guide shows: a conftest of a few lines, --solidloop-db-url, the clean database,
the emulator and the drain (issue 13)."""

from __future__ import annotations

import psycopg
import pytest

from flask_solidloop.models import metadata
from flask_solidloop.testing.plugin import truncate_all
from flask_solidloop.urls import libpq_url

pytest_plugins = ["pytester"]

USER_CONFTEST = '''
import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_solidloop import Agent, SolidLoop
from flask_solidloop.state import get_state

solidloop = SolidLoop()
LLM = {}


@solidloop.agent("helper")
class Helper(Agent):
    system_prompt = "Help."

    def llm(self):
        return {"base_url": LLM["url"], "model": "m"}


@pytest.fixture
def app(solidloop_database_url, solidloop_clean_db, solidloop_llm):
    LLM["url"] = solidloop_llm.base_url
    app = Flask("userapp")
    app.config["SQLALCHEMY_DATABASE_URI"] = solidloop_database_url
    db = SQLAlchemy(app)
    solidloop.init_app(app, db=db)
    with app.app_context():
        yield app
        db.session.remove()
    get_state(app).broker.close()
'''

USER_TEST = '''
from conftest import Helper


def test_a_loop_completes(app, solidloop_llm, solidloop_drain):
    solidloop_llm.script("hi", {"content": "hello there"})
    loop = Helper.start(message="hi")
    assert solidloop_drain() == 1
    from flask_solidloop.models import Loop
    db = app.extensions["sqlalchemy"]
    db.session.expire_all()
    assert db.session.get(Loop, loop.id).status == "completed"


def test_the_database_is_clean_again(app):
    from flask_solidloop.models import Loop
    assert app.extensions["sqlalchemy"].session.query(Loop).count() == 0


def test_the_mcp_emulator_serves(solidloop_mcp):
    assert solidloop_mcp.url.startswith("http://127.0.0.1:")
'''


def test_a_users_suite_runs_on_the_plugin(pytester, database_url):
    pytester.makeconftest(USER_CONFTEST)
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("--solidloop-db-url", database_url, "-q",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_without_a_database_url_the_plugin_says_what_to_pass(pytester, monkeypatch):
    monkeypatch.delenv("SOLIDLOOP_TEST_DATABASE_URL", raising=False)
    pytester.makepyfile(test_x="def test_x(solidloop_database_url):\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    assert "pass --solidloop-db-url postgresql+psycopg://" in result.stdout.str() \
        + result.stderr.str()
    assert result.ret != 0


def test_clean_db_truncates_every_table_of_our_metadata(database_url):
    """Not a typed list: every table, solidloop_mcp_sessions and solidloop_workers included."""
    names = [t.name for t in metadata.sorted_tables]
    assert {"solidloop_mcp_sessions", "solidloop_workers", "solidloop_loops"} <= set(names)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("INSERT INTO solidloop_workers (identity, host, pid, threads) "
                     "VALUES ('h:1', 'h', 1, 1)")
        conn.execute("INSERT INTO solidloop_loops (agent_name, status) VALUES ('x', 'init')")
        loop_id = conn.execute("SELECT max(id) FROM solidloop_loops").fetchone()[0]
        conn.execute("INSERT INTO solidloop_mcp_sessions (loop_id, server_name, tools) "
                     "VALUES (%s, 's', '[]')", (loop_id,))
    truncate_all(database_url)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        for name in names:
            assert conn.execute(f"SELECT count(*) FROM {name}").fetchone() == (0,), name


@pytest.mark.parametrize("option", ["--solidloop-db-url"])
def test_the_option_is_registered(pytestconfig, option):
    assert pytestconfig.getoption(option, default="missing") != "missing"
