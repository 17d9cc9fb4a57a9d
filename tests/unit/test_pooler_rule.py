"""The start-up rule for transaction-mode poolers (flask_solidloop.pooler, decision 0028):
which probes refuse a worker, and that the refusal is one line naming the fix,
with passwords masked."""

from __future__ import annotations

import pytest

from flask_solidloop.pooler import PoolingProbe, pooling_problem

POOLED = PoolingProbe(pooled=True, transaction_pooled=True, evidence="two connected clients "
                      "ran on one backend")
SESSION_MODE = PoolingProbe(pooled=True, transaction_pooled=False)
DIRECT = PoolingProbe(pooled=False, transaction_pooled=False)
APP = "postgresql+psycopg://app:s3cret@pgbouncer:6432/shop"
DB = "postgresql+psycopg://app:s3cret@db:5432/shop"


def problem(session_probe, *, prepares, direct_url, direct_probe):
    return pooling_problem(session_url=APP, session_probe=session_probe,
                           session_prepares=prepares, direct_url=direct_url,
                           direct_probe=direct_probe)


@pytest.mark.parametrize("prepares", [True, False])
def test_the_documented_split_and_direct_deployments_start(prepares):
    assert problem(POOLED, prepares=False, direct_url=DB, direct_probe=DIRECT) is None
    assert problem(DIRECT, prepares=prepares, direct_url=None, direct_probe=DIRECT) is None
    assert problem(SESSION_MODE, prepares=prepares, direct_url=None,
                   direct_probe=SESSION_MODE) is None
    assert problem(SESSION_MODE, prepares=prepares, direct_url=DB,
                   direct_probe=SESSION_MODE) is None


def test_everything_through_the_pooler_names_solidloop_database_url():
    line = problem(POOLED, prepares=False, direct_url=None, direct_probe=POOLED)
    assert line is not None and "\n" not in line
    assert line.startswith("SQLALCHEMY_DATABASE_URI (postgresql+psycopg://app:***@pgbouncer")
    assert "set SOLIDLOOP_DATABASE_URL to a URL that reaches PostgreSQL directly" in line
    assert "s3cret" not in line and "prepare_threshold" not in line


@pytest.mark.parametrize("direct_url", [None, APP])
def test_both_wrong_names_both_fixes_in_one_line(direct_url):
    line = problem(POOLED, prepares=True, direct_url=direct_url, direct_probe=POOLED)
    assert line is not None and "\n" not in line
    assert "SOLIDLOOP_DATABASE_URL" in line
    assert ('and turn preparing off on the engine: SQLALCHEMY_ENGINE_OPTIONS = '
            '{"connect_args": {"prepare_threshold": None}}') in line


def test_a_pooled_solidloop_database_url_is_named_first():
    line = problem(POOLED, prepares=True, direct_url=APP, direct_probe=POOLED)
    assert line is not None and "\n" not in line and "s3cret" not in line
    assert line.startswith("SOLIDLOOP_DATABASE_URL (postgresql+psycopg://app:***@pgbouncer")
    assert "point SOLIDLOOP_DATABASE_URL at PostgreSQL directly" in line


def test_preparing_behind_the_pooler_names_prepare_threshold():
    line = problem(POOLED, prepares=True, direct_url=DB, direct_probe=DIRECT)
    assert line is not None and "\n" not in line and "s3cret" not in line
    assert '{"connect_args": {"prepare_threshold": None}}' in line
    assert "two connected clients ran on one backend" in line


def test_the_broker_takes_sessions_bound_to_the_apps_pooled_url():
    """The split deployment: the broker's own URL is direct, the app's session
    goes through the pooler; ``session=`` may be bound to either, not elsewhere."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from flask_solidloop.errors import InvalidJobError
    from flask_solidloop.queue.broker import PostgresBroker

    broker = PostgresBroker(DB, session_url=APP)
    for url in (APP, DB):
        broker.check_session(Session(bind=create_engine(url)))  # neither connects
    with pytest.raises(InvalidJobError, match="not to this app's job database"):
        broker.check_session(Session(bind=create_engine(
            "postgresql+psycopg://app@elsewhere:5432/shop")))
    with pytest.raises(InvalidJobError):
        PostgresBroker(DB).check_session(Session(bind=create_engine(APP)))
