"""The psycopg connection under a SQLAlchemy session, and a statement run on it.

The broker (queue/) and the loop store (loops/) both write plain SQL on the
connection a host's session holds, inside that session's transaction, so
their rows commit with the host's. This module, at the bottom of the layers,
is the one way to reach that connection: psycopg's own ``%(name)s``
parameters then work as written in ``queue/sql.py`` and ``loops/sql/``.
"""

from __future__ import annotations

from typing import Any

import psycopg

from .errors import BrokerError


def driver_connection(target: Any) -> psycopg.Connection[Any]:
    """The psycopg connection under a SQLAlchemy session or connection (in the
    transaction the session has begun, beginning it if none is), or ``target``
    itself when it is a psycopg connection."""
    if isinstance(target, psycopg.Connection):
        return target
    get_connection = getattr(target, "connection", None)
    if get_connection is None:
        raise BrokerError(
            f"cannot run a statement on {type(target).__name__}: pass a SQLAlchemy Session "
            "or Connection, or a psycopg Connection"
        )
    sa_connection = get_connection() if callable(get_connection) else get_connection
    driver = sa_connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise BrokerError(
            "the session is not using the psycopg 3 driver; use a postgresql+psycopg:// URL"
        )
    return driver


def execute_on(target: Any, query: str, params: Any, *, fetch: bool = False) -> list[Any]:
    """Run ``query`` on ``target``'s connection (see :func:`driver_connection`);
    its rows when ``fetch`` and it returns any."""
    cur = driver_connection(target).execute(query, params)
    return cur.fetchall() if fetch and cur.description else []


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is what a database that went away (or is busy) raises, as
    opposed to a defect: psycopg's ``OperationalError`` and ``InterfaceError``
    (a dropped or refused connection, an admin shutdown, a cancelled
    statement, a deadlock, a serialization failure), SQLAlchemy's wrappers of
    those, a connection it invalidated, and its pool's timeout. A constraint,
    bad SQL or bad data is not transient."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(
            exc.orig, psycopg.OperationalError | psycopg.InterfaceError)
    return isinstance(exc, sa_exc.DisconnectionError | sa_exc.TimeoutError)
