"""loops/store/transaction.py: a statement that is its caller's whole
transaction runs in autocommit outside a session that holds nothing
(``run_alone``), joins the session's transaction otherwise, and is prepared on
its first run unless the host's connections never prepare. Real PostgreSQL,
real SQLAlchemy sessions."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from flask_solidloop.dbapi import driver_connection
from flask_solidloop.loops.store.transaction import run_alone


@pytest.fixture
def engine_with(database_url):
    engines = []

    def make(**connect_args):
        engine = create_engine(database_url, pool_size=1, max_overflow=0,
                               connect_args=connect_args)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


def prepared(session: Session, marker: str) -> int:
    """How many statements naming ``marker`` the session's connection has prepared."""
    return session.execute(text(
        "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE :m"),
        {"m": f"%{marker}%"}).scalar_one()


def test_a_session_holding_nothing_runs_the_statement_alone_and_prepared(engine_with):
    marker = f"m{uuid.uuid4().hex}"
    with Session(engine_with()) as session:
        row, alone = run_alone(session, f"SELECT 1 AS one, '{marker}' AS m", {}, sole=True)
        assert row == {"one": 1, "m": marker} and alone
        assert not session.in_transaction()
        # The pool's one connection ran it: it holds the statement prepared.
        assert prepared(session, marker) == 1


def test_a_session_in_a_transaction_joins_it(engine_with):
    marker = f"m{uuid.uuid4().hex}"
    with Session(engine_with()) as session:
        session.execute(text("CREATE TEMP TABLE sole_probe (id int) ON COMMIT DROP"))
        row, alone = run_alone(session, f"INSERT INTO sole_probe VALUES (1) "
                               f"RETURNING id, '{marker}' AS m", {}, sole=True)
        assert row == {"id": 1, "m": marker} and not alone
        # Inside the session's transaction: its temp table still has the row.
        assert session.execute(text("SELECT count(*) FROM sole_probe")).scalar_one() == 1
        assert prepared(session, marker) == 1
        session.rollback()


def test_not_sole_always_joins_the_session(engine_with):
    with Session(engine_with()) as session:
        row, alone = run_alone(session, "SELECT 2 AS two", {}, sole=False)
        assert row == {"two": 2} and not alone and session.in_transaction()


def test_connections_that_never_prepare_are_left_so(engine_with):
    """``prepare_threshold=None`` (a transaction-pooling PgBouncer needs it):
    the statement is not prepared, alone or in the session's transaction."""
    marker = f"m{uuid.uuid4().hex}"
    with Session(engine_with(prepare_threshold=None)) as session:
        run_alone(session, f"SELECT '{marker}' AS m", {}, sole=True)
        run_alone(session, f"SELECT '{marker}' AS m", {}, sole=False)
        assert driver_connection(session).prepare_threshold is None
        assert prepared(session, marker) == 0


def test_a_failed_autocommit_statement_leaves_the_connection_transactional(engine_with):
    """The statement's error is the one raised, and the pooled connection goes
    back to the pool out of autocommit: the session's next transaction rolls
    back for real."""
    import psycopg

    with Session(engine_with()) as session:
        with pytest.raises(psycopg.errors.DivisionByZero):
            run_alone(session, "SELECT 1 / 0 AS boom", {}, sole=True)
        assert not driver_connection(session).autocommit
        session.execute(text("CREATE TEMP TABLE sole_after (id int)"))
        session.rollback()
        assert session.execute(text(
            "SELECT to_regclass('pg_temp.sole_after') IS NULL")).scalar_one()


def test_a_transaction_begun_without_a_connection_holds_nothing(engine_with):
    """Adding a loaded object begins a session transaction with no connection
    (queries.row_object does): the statement still runs alone."""
    from flask_solidloop.loops.store.transaction import _on_the_wire

    with Session(engine_with()) as session:
        session.begin()
        assert session.in_transaction() and not _on_the_wire(session)
        _, alone = run_alone(session, "SELECT 1 AS one", {}, sole=True)
        assert alone
        session.execute(text("SELECT 1"))
        assert _on_the_wire(session)
        _, alone = run_alone(session, "SELECT 1 AS one", {}, sole=True)
        assert not alone
