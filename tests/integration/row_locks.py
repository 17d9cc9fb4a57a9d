"""What the lock-order tests share: watching another connection's row lock."""

from __future__ import annotations

import time

import psycopg


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
