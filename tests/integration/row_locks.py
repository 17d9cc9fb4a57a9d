"""What the lock-order tests share: watching another connection's row lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from flask_solidloop.queue.broker import libpq_url


def loop_row_locked(probe: psycopg.Connection, loop_id: int, *, timeout: float = 10) -> bool:
    """Whether someone holds the loop's row lock within ``timeout`` seconds, as
    ``probe`` (an autocommit connection) finds by trying it without waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            probe.execute("SELECT 1 FROM solidloop_loops WHERE id = %s FOR UPDATE NOWAIT",
                          (loop_id,))
        except psycopg.errors.LockNotAvailable:
            return True
        time.sleep(0.02)
    return False


def hold_loop_while(database_url: str, loop_id: int, waiting: str,
                    change: Callable[[psycopg.Connection], Any],
                    run: Callable[[], Any]) -> dict[str, Any]:
    """Lock the loop row on a second connection, start ``run`` (its statement,
    whose text starts with ``waiting``, blocks on that lock after taking its
    snapshot), apply ``change`` on the holder and commit it; return what
    ``run`` returned (``value``) or raised (``error``)."""
    outcome: dict[str, Any] = {}
    with psycopg.connect(libpq_url(database_url)) as holder, \
            psycopg.connect(libpq_url(database_url), autocommit=True) as probe:
        holder.execute("SELECT 1 FROM solidloop_loops WHERE id = %s FOR UPDATE", (loop_id,))

        def target() -> None:
            try:
                outcome["value"] = run()
            except BaseException as exc:  # reported to the test
                outcome["error"] = exc

        waiter = threading.Thread(target=target)
        waiter.start()
        deadline = time.monotonic() + 10
        # Wait until the statement is blocked on the holder's lock.
        while time.monotonic() < deadline and not probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND starts_with(query, %s)", (waiting,)).fetchone()[0]:
            time.sleep(0.01)
        blocked = time.monotonic() < deadline
        change(holder)
        holder.commit()
        waiter.join(10)
    assert blocked, "the statement never waited for the loop row"
    assert not waiter.is_alive()
    return outcome
