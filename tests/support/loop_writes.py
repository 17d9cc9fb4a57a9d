"""Counting writes to loop rows: a PostgreSQL trigger that records every UPDATE
of a loop, so a test can assert each loop was acted on exactly once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import text

WriteCounts = Callable[[], dict[int, int]]


def counted_loop_writes(session: Any, *, delay: float = 0.0) -> Iterator[WriteCounts]:
    """Install the trigger (each write also sleeping ``delay`` seconds, a slow
    disk), yield a function giving the writes per loop id so far, then remove it.
    Meant as the body of a fixture."""
    session.execute(text(
        "CREATE TABLE IF NOT EXISTS test_loop_writes (loop_id bigint, status text);"
        "TRUNCATE test_loop_writes;"
        "CREATE OR REPLACE FUNCTION test_count_loop_write() RETURNS trigger AS $$ BEGIN "
        "INSERT INTO test_loop_writes VALUES (NEW.id, NEW.status); "
        f"PERFORM pg_sleep({float(delay)}); "
        "RETURN NEW; END $$ LANGUAGE plpgsql;"
        "CREATE TRIGGER test_count_loop_writes AFTER UPDATE ON solidloop_loops "
        "FOR EACH ROW EXECUTE FUNCTION test_count_loop_write();"))
    session.commit()

    def counts() -> dict[int, int]:
        session.rollback()
        return dict(session.execute(text(
            "SELECT loop_id, count(*) FROM test_loop_writes GROUP BY loop_id")).all())
    yield counts
    session.rollback()
    session.execute(text("DROP TRIGGER IF EXISTS test_count_loop_writes ON solidloop_loops;"
                         "DROP TABLE IF EXISTS test_loop_writes;"))
    session.commit()
