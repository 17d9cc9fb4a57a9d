"""A statement that is its caller's whole transaction, run without the session's.

The store's turn ends and claims are often one statement with nothing else to
commit, and a job's first read often precedes one of them. :func:`fetch_one`
runs such a statement in autocommit on a pooled connection of the session's
engine when the session holds nothing, and inside the session's transaction
otherwise; its caller learns which. Both loops.queries (reads) and loops.store
(writes) use it.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .._typing import SessionLike, real_session
from ..dbapi import driver_connection

_IDLE = TransactionStatus.IDLE


def _on_the_wire(real: Session) -> bool:
    """Whether the session's transaction has begun on a connection. Adding a
    loaded object to a session begins its transaction without one (a row
    loaded from a statement's ``RETURNING``): such a transaction holds nothing
    yet. ``_connections`` is SQLAlchemy's own record of that (2.0 and 2.1);
    without it, any transaction counts as begun."""
    transaction = real.get_transaction()
    return transaction is not None and bool(getattr(transaction, "_connections", True))


def fetch_one(session: SessionLike, query: str, params: Any, *,
              sole: bool) -> tuple[dict[str, Any] | None, bool]:
    """Run ``query`` and return its first row, and whether it ran by itself.

    ``sole``: the caller sends nothing else before its commit (a write), or
    needs no transaction around the read. When the session holds nothing (no
    transaction on a connection, nothing pending) and is bound to an engine, the statement
    then runs in autocommit on a connection of the engine's pool, outside the
    session: one statement is one transaction in PostgreSQL, atomic as before,
    without the ``BEGIN`` and ``COMMIT`` round trips (on this machine a
    ``BEGIN; UPDATE; COMMIT`` costs the server 244 µs of CPU, the ``UPDATE``
    alone 128) and without the session's transaction bookkeeping (about 90 µs
    of the worker's CPU; a pool checkout is 10). It returns True: the caller
    has nothing to commit. Otherwise the statement joins the session's
    transaction, for the caller to commit.

    Either way the statement is prepared on its first run. These statements
    run on every turn, and psycopg prepares a query only after
    ``prepare_threshold`` (5) runs on each connection: until then each run is
    parsed and planned again, and the fused statements are the costliest to
    plan (on this machine preparing at once took a tenth off PostgreSQL's CPU
    per turn in bench/turns.py). A host that turned preparing off
    (``prepare_threshold=None``, as behind a transaction-pooling PgBouncer)
    keeps it off: psycopg ignores ``prepare=True`` then."""
    real = real_session(session)
    if sole and not _on_the_wire(real) and not (real.new or real.dirty or real.deleted):
        bind = real.get_bind()
        if isinstance(bind, Engine):
            pooled = bind.raw_connection()
            try:
                driver = pooled.driver_connection
                if isinstance(driver, psycopg.Connection) and \
                        driver.info.transaction_status == _IDLE:
                    driver.autocommit = True
                    try:
                        return driver.cursor(row_factory=dict_row).execute(
                            query, params, prepare=True).fetchone(), True
                    finally:
                        if driver.info.transaction_status == _IDLE:
                            driver.autocommit = False
                        else:
                            # Cut off mid-statement (a dead socket, an interrupt):
                            # the pool must not hand this connection out again,
                            # and the statement's own error is the one to raise.
                            pooled.invalidate()
            finally:
                pooled.close()
    return driver_connection(session).cursor(row_factory=dict_row).execute(
        query, params, prepare=True).fetchone(), False
