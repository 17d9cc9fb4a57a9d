"""Reach, create and migrate the database, with errors that name the URL tried.

Every message here is one line a newcomer can act on: it names the database
(password redacted) and the command that fixes it. :func:`check_schema` is what
every CLI command and every worker runs before touching a ``solidloop_*`` table.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from .errors import DatabaseUnavailableError
from .urls import libpq_url, redact_url

__all__ = ["UPGRADE_COMMAND", "applied_revision", "check_connection", "check_schema",
           "ensure_database", "unavailable", "upgrade_database"]

UPGRADE_COMMAND = "flask solidloop db upgrade"


def unavailable(url: str, exc: BaseException) -> DatabaseUnavailableError:
    """The one-line error for a connection to ``url`` that failed with ``exc``."""
    reason = " ".join(str(exc).split()).removeprefix("connection failed: ").rstrip(".?")
    reason = reason or type(exc).__name__
    if "does not exist" in reason and "database" in reason:
        return DatabaseUnavailableError(
            f"the database of {redact_url(url)} does not exist; create it with "
            f"`{UPGRADE_COMMAND} --create-database`")
    # libpq's own hint ("Is the server running on that host ...") is a question
    # of its own: keep it, and add ours only when it is absent.
    hint = ("" if "Is the server running" in reason else
            "; is the server running, and does SQLALCHEMY_DATABASE_URI name the right "
            "host, port, user and database")
    return DatabaseUnavailableError(
        f"cannot connect to PostgreSQL at {redact_url(url)}: {reason}{hint}?")


def check_connection(url: str) -> None:
    """Raise DatabaseUnavailableError unless PostgreSQL answers at ``url``."""
    try:
        psycopg.connect(libpq_url(url), connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        raise unavailable(url, exc) from exc


def applied_revision(url: str) -> str | None:
    """The solidloop revision applied in the database at ``url`` (None: never migrated).

    One short psycopg connection, so it works before any engine or pool exists.
    """
    from .migrations import VERSION_TABLE

    try:
        with psycopg.connect(libpq_url(url), connect_timeout=5, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass(%s)", (VERSION_TABLE,)).fetchone() == (None,):
                return None
            row = conn.execute(
                sql.SQL("SELECT version_num FROM {} LIMIT 1").format(
                    sql.Identifier(VERSION_TABLE))).fetchone()
    except psycopg.OperationalError as exc:
        raise unavailable(url, exc) from exc
    return row[0] if row else None


def check_schema(url: str) -> None:
    """Raise DatabaseUnavailableError unless the solidloop tables at ``url`` are at head.

    Never-migrated and outdated databases get one line naming the database and
    the command to run, instead of SQL errors about a missing table later.
    """
    from .migrations import head_revision

    applied = applied_revision(url)
    head = head_revision()
    if applied == head:
        return
    if applied is None:
        raise DatabaseUnavailableError(
            f"the solidloop tables are missing in {redact_url(url)} (never migrated); "
            f"run `{UPGRADE_COMMAND}`")
    raise DatabaseUnavailableError(
        f"the solidloop tables in {redact_url(url)} are at revision {applied}, this "
        f"version of flask-solidloop needs {head}; run `{UPGRADE_COMMAND}`")


def ensure_database(url: str) -> bool:
    """Create the database named in ``url`` if it is missing. True if it was created."""
    parsed = make_url(url)
    name = parsed.database
    if not name:
        raise DatabaseUnavailableError(f"the URL {redact_url(url)} names no database")
    admin = libpq_url(parsed.set(database="postgres").render_as_string(hide_password=False))
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                  (name,)).fetchone()
            if exists:
                return False
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True
    except psycopg.OperationalError as exc:
        reason = " ".join(str(exc).split())
        raise DatabaseUnavailableError(
            f"cannot connect to PostgreSQL at {redact_url(url)} (tried its 'postgres' "
            f"database to create {name!r}): {reason}"
        ) from exc
    except psycopg.errors.DuplicateDatabase:
        return False


def upgrade_database(url: str, revision: str = "heads") -> None:
    from .migrations import upgrade

    check_connection(url)
    upgrade(url, revision)
