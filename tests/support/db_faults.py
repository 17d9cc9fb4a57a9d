"""Real dropped connections at a chosen statement.

:class:`ConnectionDropper` wraps psycopg's ``Cursor.execute`` (every statement
of ours goes through it: the ORM's, the store's plain SQL, the broker's, the
lease renewer's): when a statement matches the armed pattern, the server
backend about to run it is terminated first, from another connection
(``pg_terminate_backend`` waits until it is gone), so the statement meets
exactly what a restarted or crashed server gives a client: ``server closed
the connection unexpectedly`` or ``terminating connection due to
administrator command``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from flask_solidloop.urls import libpq_url

logger = logging.getLogger("tests.db_faults")


class ConnectionDropper:
    """Drop the connection under the next ``times`` statements matching
    ``pattern`` (a regular expression searched in the statement's text),
    skipping the first ``after`` matches."""

    def __init__(self, database_url: str) -> None:
        self.conninfo = libpq_url(database_url)
        self.pattern: re.Pattern[str] | None = None
        self.times = 0
        self.after = 0
        self.matched = 0
        #: The statements whose connection was dropped, in order.
        self.dropped: list[str] = []
        self._lock = threading.Lock()

    def arm(self, pattern: str, *, times: int = 1, after: int = 0) -> ConnectionDropper:
        with self._lock:
            self.pattern, self.times, self.after, self.matched = (
                re.compile(pattern), times, after, 0)
            self.dropped = []
        return self

    def disarm(self) -> None:
        with self._lock:
            self.pattern = None

    def _should_drop(self, text: str) -> bool:
        with self._lock:
            if self.pattern is None or len(self.dropped) >= self.times \
                    or not self.pattern.search(text):
                return False
            self.matched += 1
            if self.matched <= self.after:
                return False
            self.dropped.append(text)
            return True

    def before(self, cursor: Any, query: Any) -> None:
        text = query if isinstance(query, str) else (
            query.decode() if isinstance(query, bytes) else str(query))
        if not self._should_drop(text):
            return
        pid = cursor.connection.info.backend_pid
        with psycopg.connect(self.conninfo, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        logger.warning("db_faults: dropped the connection under: %s", " ".join(text.split())[:120])


@contextmanager
def dropping_connections(database_url: str) -> Iterator[ConnectionDropper]:
    """A :class:`ConnectionDropper` installed on psycopg's cursors for the block."""
    dropper = ConnectionDropper(database_url)
    original = psycopg.Cursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        dropper.before(self, query)
        return original(self, query, params, **kwargs)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    try:
        yield dropper
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]


_installed: ConnectionDropper | None = None


def install_dropper(database_url: str, pattern: str, *, times: int = 1,
                    after: int = 0) -> ConnectionDropper:
    """For a worker subprocess: a dropper armed for the life of the process (once
    per process, whatever the number of apps it creates)."""
    global _installed
    if _installed is None:
        _installed = ConnectionDropper(database_url)
        original = psycopg.Cursor.execute
        dropper = _installed

        def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            dropper.before(self, query)
            return original(self, query, params, **kwargs)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        _installed.arm(pattern, times=times, after=after)
    return _installed


@contextmanager
def failing_once(pg: psycopg.Connection, name: str, *, table: str, when: str,
                 trigger: str) -> Iterator[None]:
    """The first row of ``table`` matching ``when`` (a condition on NEW) makes
    its statement, or with a deferred ``trigger`` its COMMIT, fail with a
    serialization failure (transient); later ones pass. The count is a
    sequence's, so it survives the rollback that undoes everything else.
    ``trigger``: its CREATE TRIGGER statement, with ``{name}`` and ``{table}``
    to fill in (a BEFORE INSERT trigger fails the statement; a deferred
    constraint trigger fails the COMMIT)."""
    pg.execute(f"CREATE SEQUENCE IF NOT EXISTS {name}")
    pg.execute(f"SELECT setval('{name}', 1, false)")
    pg.execute(f"""
        CREATE OR REPLACE FUNCTION {name}() RETURNS trigger AS $$
        BEGIN
          IF {when} AND nextval('{name}') = 1 THEN
            RAISE EXCEPTION 'injected: {name}' USING ERRCODE = 'serialization_failure';
          END IF;
          RETURN NEW;
        END $$ LANGUAGE plpgsql""")
    pg.execute(trigger.format(name=name, table=table))
    try:
        yield
    finally:
        pg.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
