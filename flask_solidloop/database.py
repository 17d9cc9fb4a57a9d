"""Reach, create and migrate the database, with errors that name the URL tried."""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from .errors import DatabaseUnavailableError
from .urls import libpq_url, redact_url


def check_connection(url: str) -> None:
    """Raise DatabaseUnavailableError unless PostgreSQL answers at ``url``."""
    try:
        psycopg.connect(libpq_url(url), connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailableError(
            f"cannot connect to PostgreSQL at {redact_url(url)}: {str(exc).strip()}. "
            "Is the server running, and does the URL (SQLALCHEMY_DATABASE_URI) name the "
            "right host, port, user and database?"
        ) from exc


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
        raise DatabaseUnavailableError(
            f"cannot connect to PostgreSQL at {redact_url(url)} (tried its 'postgres' "
            f"database to create {name!r}): {str(exc).strip()}"
        ) from exc
    except psycopg.errors.DuplicateDatabase:
        return False


def upgrade_database(url: str, revision: str = "heads") -> None:
    from .migrations import upgrade

    check_connection(url)
    upgrade(url, revision)
