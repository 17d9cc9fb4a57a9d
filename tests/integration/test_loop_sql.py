"""Every statement of loops/sql/ (and of limits/sql.py) prepares on a real PostgreSQL with the
migrated schema, every parameter's type left for the server to infer (what a
``None`` sends): a statement that does not parse, names a column that is not
there or leaves a parameter's type ambiguous fails here, not in a worker."""

from __future__ import annotations

import re

import psycopg
import pytest

from flask_solidloop.limits import sql as limits_sql
from flask_solidloop.loops import sql
from flask_solidloop.queue.broker import libpq_url


@pytest.fixture
def conn(database_url):
    with psycopg.connect(libpq_url(database_url), autocommit=True) as connection:
        yield connection


STATEMENTS = {**sql.STATEMENTS, **{
    f"limits.{name}": value for name, value in vars(limits_sql).items()
    if name.isupper() and not name.startswith("_") and isinstance(value, str)}}


@pytest.mark.parametrize("name", list(STATEMENTS))
def test_the_statement_prepares_with_untyped_parameters(conn, name):
    text = STATEMENTS[name]
    # psycopg's named parameters as the server's positional ones, one per name.
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    positional = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", text)
    conn.execute("PREPARE probe AS " + positional)
    try:
        # Each named parameter became one typed placeholder.
        (count,) = conn.execute(
            "SELECT cardinality(parameter_types) FROM pg_prepared_statements "
            "WHERE name = 'probe'").fetchone()
        assert count == len(names)
    finally:
        conn.execute("DEALLOCATE probe")
