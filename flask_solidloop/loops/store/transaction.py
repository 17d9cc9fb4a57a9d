"""How loops/store/ runs its statements, and the three kinds of transaction its
functions declare.

Every public store function wears exactly one of these decorators, which say
how it treats the caller's session (tests/unit/test_store_shape.py checks):

* :func:`commits`: commits the session's transaction before it returns (the
  one it began, or the one that was open: a host command commits the host's
  pending writes with it). One that a turn calls after a failure starts by
  rolling back what the session holds; its docstring says so.
* :func:`joins`: writes in the caller's transaction and never commits or
  rolls back; the caller commits (creating a loop with the host's own rows).
* :func:`alone`: one statement. When the session holds nothing it runs in
  autocommit on a pooled connection of the session's engine, outside the
  session (:func:`run_alone`): no ``BEGIN``, no ``COMMIT``. Otherwise it joins
  the session's transaction and commits it.

The statements are loops/sql/'s, run on the session's psycopg connection
(dbapi.driver_connection), prepared on their first run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..._typing import SessionLike, real_session
from ...dbapi import driver_connection, is_transient
from ...queue.current_job import mark_current_job_done, note_current_job_done

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

logger = logging.getLogger("flask_solidloop.store")

#: The attribute each decorator sets: "commits", "joins" or "alone".
KIND = "solidloop_transaction"


def commits(function: F) -> F:
    """The function commits the session's transaction before it returns, when
    it wrote anything (one that wrote nothing and locked nothing may leave a
    read-only transaction open, for its caller to end)."""
    setattr(function, KIND, "commits")
    return function


def joins(function: F) -> F:
    """The function reads or writes in the caller's transaction; the caller commits."""
    setattr(function, KIND, "joins")
    return function


def alone(function: F) -> F:
    """One statement: in autocommit when the session holds nothing, else in the
    session's transaction, which the function commits."""
    setattr(function, KIND, "alone")
    return function


_IDLE = TransactionStatus.IDLE


def _on_the_wire(real: Session) -> bool:
    """Whether the session's transaction has begun on a connection. Adding a
    loaded object to a session begins its transaction without one (a row
    loaded from a statement's ``RETURNING``): such a transaction holds nothing
    yet. ``_connections`` is SQLAlchemy's own record of that (2.0 and 2.1);
    without it, any transaction counts as begun."""
    transaction = real.get_transaction()
    return transaction is not None and bool(getattr(transaction, "_connections", True))


def holds_nothing(session: SessionLike) -> bool:
    """No transaction on a connection, and nothing pending."""
    real = real_session(session)
    return not _on_the_wire(real) and not (real.new or real.dirty or real.deleted)


def run_alone(session: SessionLike, query: str, params: Any, *,
              sole: bool) -> tuple[dict[str, Any] | None, bool]:
    """Run ``query`` and return its first row, and whether it ran by itself.

    ``sole``: the caller sends nothing else before its commit (a write), or
    needs no transaction around the read. When the session holds nothing and
    is bound to an engine, the statement then runs in autocommit on a
    connection of the engine's pool, outside the session: one statement is
    one transaction in PostgreSQL, as atomic, without the ``BEGIN`` and
    ``COMMIT`` round trips (on this machine a ``BEGIN; UPDATE; COMMIT`` costs
    the server 244 µs of CPU, the ``UPDATE`` alone 128) and without the
    session's transaction bookkeeping (about 90 µs of the worker's CPU; a pool
    checkout is 10). It returns True: the caller has nothing to commit.
    Otherwise the statement joins the session's transaction (after a flush of
    what the session holds), for the caller to commit.

    Either way the statement is prepared on its first run: these run on every
    turn, and psycopg prepares a query only after ``prepare_threshold`` (5)
    runs on a connection, parsing and planning the costliest statements again
    until then. A host that turned preparing off (``prepare_threshold=None``,
    as behind a transaction-pooling PgBouncer) keeps it off: psycopg ignores
    ``prepare=True`` then."""
    real = real_session(session)
    if sole and holds_nothing(real):
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
    return fetch_row(session, query, params), False


def _on_driver(session: SessionLike, run: Callable[[psycopg.Connection[Any]], T]) -> T:
    """``run`` on the session's psycopg connection. When the statement kills the
    connection (a dropped socket, a server that went away), SQLAlchemy is told,
    as it would be had it run the statement itself: the connection is
    invalidated, so the session's rollback succeeds and its next statement
    gets a fresh one, never the dead one back from the pool."""
    session.flush()
    driver = driver_connection(session)
    try:
        return run(driver)
    except psycopg.Error as exc:
        if driver.closed or driver.broken:
            real_session(session).connection().invalidate(exc)
        raise


def fetch_row(session: SessionLike, query: str, params: Any) -> dict[str, Any] | None:
    """``query``'s first row as a dict, in the session's transaction (what the
    session holds flushed first, so the statement sees it)."""
    return _on_driver(session, lambda driver: driver.cursor(row_factory=dict_row).execute(
        query, params, prepare=True).fetchone())


def fetch_rows(session: SessionLike, query: str, params: Any) -> list[tuple[Any, ...]]:
    """``query``'s rows as tuples, in the session's transaction."""
    return _on_driver(session, lambda driver: driver.execute(
        query, params, prepare=True).fetchall())


def execute(session: SessionLike, query: str, params: Any) -> int:
    """Run a statement that returns nothing, in the session's transaction; the
    number of rows it changed."""
    return _on_driver(session, lambda driver: driver.execute(
        query, params, prepare=True).rowcount)


def recover(session: SessionLike) -> None:
    """Roll the session back after an error, whatever state its connection is
    in: a connection that died with the statement is discarded (the session
    closes, its objects detached), and the next statement starts on a fresh
    one."""
    try:
        session.rollback()
    except Exception as exc:
        if not is_transient(exc):
            raise
        real_session(session).close()


#: The first and the longest wait between two attempts of a retried write.
RETRY_FIRST_WAIT = 0.2
RETRY_LONGEST_WAIT = 2.0


def with_database_retry(write: Callable[[], T], *, session: SessionLike, seconds: float,
                        still_ours: Callable[[], bool], what: str) -> T:
    """Run a canonical write, again on a transient database error, for as long
    as the step still holds its lease (``still_ours``) and at most ``seconds``,
    backing off from 0.2 s to 2 s, each attempt on a fresh connection. The
    write must be safe to run twice (its checks refuse what the first attempt
    already wrote, should its COMMIT have landed unseen). The last error is
    raised when the time is up."""
    deadline = time.monotonic() + seconds
    wait = RETRY_FIRST_WAIT
    while True:
        try:
            return write()
        except Exception as exc:
            if not is_transient(exc):
                raise
            recover(session)
            left = deadline - time.monotonic()
            if left <= 0 or not still_ours():
                raise
            logger.warning("%s: the database failed (%s); trying again in %.1fs", what,
                           exc.__class__.__name__, min(wait, left))
            time.sleep(min(wait, left))
            wait = min(wait * 2, RETRY_LONGEST_WAIT)


def commit_unless(committed: bool, session: SessionLike) -> None:
    """Commit the session, or, when :func:`run_alone`'s statement committed by
    itself, expire what it holds as that commit would have: the statement wrote
    rows the session's objects may hold, and they load again on next use."""
    if committed:
        real_session(session).expire_all()
    else:
        session.commit()


def commit_keeping_objects(session: SessionLike) -> None:
    """Commit without expiring the session's objects: after a commit of rows this
    transaction locked and wrote, they hold what the database holds, and
    reloading them would only cost a SELECT each."""
    real = real_session(session)
    before = real.expire_on_commit
    real.expire_on_commit = False
    try:
        real.commit()
    finally:
        real.expire_on_commit = before


def commit_with_job_done(session: SessionLike, *, keep_objects: bool = False) -> None:
    """Commit a claim together with its running job marked done; once committed,
    tell the worker, so its consumer skips the acknowledgement that would match
    nothing. ``keep_objects``: the step goes on with the rows it just wrote."""
    marked = mark_current_job_done(session)
    if keep_objects:
        commit_keeping_objects(session)
    else:
        session.commit()
    if marked:
        note_current_job_done()


def end_transaction(session: SessionLike, *, keep_objects: bool = False) -> None:
    """Commit the session's open transaction, if it has one (a turn ends its
    reads before a network call or a tool run). Without one it does nothing:
    a bare ``commit()`` would begin and commit an empty transaction and expire
    every object the turn still uses. ``keep_objects``: the transaction only
    read, and the turn goes on with the rows it read (and the ones its claim
    wrote): they are not expired, so using them costs no SELECT."""
    if real_session(session).in_transaction():
        if keep_objects:
            commit_keeping_objects(session)
        else:
            session.commit()
