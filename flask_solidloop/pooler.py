"""Whether a database URL goes through a transaction-mode pooler, and what that breaks.

A transaction-mode pooler (PgBouncer's ``pool_mode = transaction``) hands a
client's transactions to whichever server connection is free, so nothing a
session keeps outlives a transaction: ``LISTEN``, session advisory locks, and
statements psycopg prepared (decision 0028). This module owns the probe that
tells (:func:`probe_pooling`), the rule a worker applies at start
(:func:`pooling_problem`): the URL of the connections that keep a session
(``SOLIDLOOP_DATABASE_URL``) must not be transaction-pooled, and an engine
behind such a pooler must not prepare; and the web process's cheaper watch
(:func:`watch_first_connect`), which only logs. It connects with psycopg alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import Engine, event

from .urls import libpq_url, redact_url

__all__ = ["GUIDE", "PROBE_APPLICATION_NAME", "PoolingProbe", "pooling_problem",
           "probe_pooling", "watch_first_connect"]

logger = logging.getLogger("flask_solidloop.pooler")

#: application_name of the probe's short connections.
PROBE_APPLICATION_NAME = "solidloop-pooler-check"
#: Where the deployment is explained (named in every message).
GUIDE = "docs/guides/pgbouncer.md"
#: Rounds of the probe (each is three short transactions): one round can miss
#: when other clients take the server between its statements.
ROUNDS = 4
#: Set by the worker entry (runtime/worker.py) before it loads the app: its
#: start-up check speaks for the engine, so the engine's first connection
#: stays quiet.
worker_checks = False


@dataclass(frozen=True)
class PoolingProbe:
    """What :func:`probe_pooling` found out about one URL."""

    #: Something between us and PostgreSQL answers for it: the backend pid the
    #: server announced at connect (BackendKeyData) is not the one running our
    #: statements. PgBouncer makes up its own. Informative only.
    pooled: bool
    #: Proven: session state does not survive a transaction (the backend under
    #: one client changed between two of its transactions, or two live clients
    #: shared one backend). Never True on a direct connection.
    transaction_pooled: bool
    #: The proof, in words ("" when not transaction-pooled).
    evidence: str = ""


def _pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
    assert row is not None
    return int(row[0])


def probe_pooling(url: str, *, connect_timeout: int = 10) -> PoolingProbe:
    """Probe ``url`` (SQLAlchemy or libpq form) with two short connections.

    Client A runs ``SELECT pg_backend_pid()`` twice, each its own transaction
    (autocommit); client B then runs it inside a transaction it keeps open,
    and A runs it once more meanwhile. A transaction pooler shows itself
    either way it picks servers: most recently used first (PgBouncer's
    default) gives B the server A just released, while A is still
    connected; oldest first rotates A's statements across the idle servers.
    Other clients' traffic can hide one round, so it runs up to ROUNDS. On a
    direct connection, or through a session-mode pooler, one session keeps one
    backend for its whole life and two live sessions never share one, so
    neither proof can appear: the probe cannot misfire there. Connection errors propagate (psycopg's
    ``OperationalError``)."""
    conninfo = libpq_url(url)

    def connect(autocommit: bool) -> psycopg.Connection[Any]:
        # prepare_threshold=None: the probe must not leave prepared statements
        # behind on a pooler's server connections.
        return psycopg.connect(conninfo, autocommit=autocommit, connect_timeout=connect_timeout,
                               application_name=PROBE_APPLICATION_NAME,
                               prepare_threshold=None)

    changed = "one client's backend changed between two of its transactions"
    with connect(True) as a:
        announced = a.info.backend_pid
        pooled = False
        for _ in range(ROUNDS):
            first, second = _pid(a), _pid(a)
            pooled = pooled or announced not in (first, second)
            if first != second:
                return PoolingProbe(pooled, True, changed)
            with connect(False) as b:
                try:
                    shared = _pid(b)  # B's transaction stays open until it closes
                except psycopg.errors.ProtocolViolation:
                    # PgBouncer's statement mode: "transaction blocks not allowed".
                    return PoolingProbe(pooled, True, "the pooler refuses transaction blocks")
                if shared == first:
                    return PoolingProbe(pooled, True,
                                        "two connected clients ran on one backend")
                # B holds a server now; A's next transaction may get another one.
                if _pid(a) != first:
                    return PoolingProbe(pooled, True, changed)
                b.rollback()
    return PoolingProbe(pooled, False)


def pooling_problem(*, session_url: str, session_probe: PoolingProbe,
                    session_prepares: bool, direct_url: str | None,
                    direct_probe: PoolingProbe) -> str | None:
    """The one line that says why a worker must not start with these probes, or None.

    ``session_url`` is SQLALCHEMY_DATABASE_URI (the host's engine, which runs
    the store's statements); ``session_prepares`` whether that engine's psycopg
    connections prepare statements (their ``prepare_threshold`` is not None).
    ``direct_url`` is SOLIDLOOP_DATABASE_URL, None when unset (the session URL
    then serves both); ``direct_probe`` is the probe of the URL the broker,
    listener and renewer actually use."""
    prepare_fix = 'SQLALCHEMY_ENGINE_OPTIONS = {"connect_args": {"prepare_threshold": None}}'
    if direct_probe.transaction_pooled:
        # Both wrong: name both fixes in the one line, not one per attempt.
        also = (f", and turn preparing off on the engine: {prepare_fix}"
                if session_probe.transaction_pooled and session_prepares else "")
        if direct_url is None:
            return (f"SQLALCHEMY_DATABASE_URI ({redact_url(session_url)}) goes through a "
                    f"transaction-mode pooler ({direct_probe.evidence}), and with "
                    "SOLIDLOOP_DATABASE_URL unset the workers' LISTEN, lease renewer, "
                    "consumers and broker pool use it too, which such a pooler breaks; "
                    "set SOLIDLOOP_DATABASE_URL to a URL that reaches PostgreSQL directly "
                    f"(or through a session-mode pooler){also}, see {GUIDE}")
        return (f"SOLIDLOOP_DATABASE_URL ({redact_url(direct_url)}) goes through a "
                f"transaction-mode pooler ({direct_probe.evidence}), but the workers' "
                "LISTEN (and the broker's pool, which prepares its statements) need a "
                "session of their own; point SOLIDLOOP_DATABASE_URL at PostgreSQL directly (or "
                f"through a session-mode pooler){also}, see {GUIDE}")
    if session_probe.transaction_pooled and session_prepares:
        return (f"SQLALCHEMY_DATABASE_URI ({redact_url(session_url)}) goes through a "
                f"transaction-mode pooler ({session_probe.evidence}) and psycopg prepares "
                "statements on its connections, which such a pooler breaks "
                f"(InvalidSqlStatementName, DuplicatePreparedStatement); set {prepare_fix}, "
                f"see {GUIDE}")
    return None


def watch_first_connect(engine: Engine, *, direct_url: str | None) -> None:
    """Log one error line, once, if ``engine`` turns out to prepare statements
    behind a transaction-mode pooler (web processes: init_app never connects,
    so this runs on the engine's first connection). An engine with preparing
    off costs nothing; one with preparing on costs one ``SELECT
    pg_backend_pid()``, and the full probe only when that pid is not the one
    the server announced at connect (something sits in between)."""
    url = engine.url.render_as_string(hide_password=False)

    def first_connect(dbapi_connection: Any, _record: Any) -> None:
        if worker_checks or getattr(dbapi_connection, "prepare_threshold", None) is None:
            return
        try:
            announced = dbapi_connection.info.backend_pid
            row = dbapi_connection.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
            dbapi_connection.rollback()
            if row is None or row[0] == announced:
                return
            probe = probe_pooling(url)
        except Exception as exc:  # a check must never break the host's first connection
            logger.debug("pooler check skipped: %s", exc)
            return
        line = pooling_problem(session_url=url, session_probe=probe, session_prepares=True,
                               direct_url=direct_url,
                               direct_probe=PoolingProbe(pooled=False, transaction_pooled=False))
        if line:
            logger.error("flask-solidloop: %s", line)

    event.listen(engine, "first_connect", first_connect)
