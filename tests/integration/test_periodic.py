"""The in-worker maintenance thread: one pass at a time across processes."""

from __future__ import annotations

import threading

import pytest

from flask_solidloop.queue.middleware.periodic import PeriodicTaskMiddleware, lock_key
from flask_solidloop.urls import libpq_url


def test_one_pass_at_a_time_across_holders(database_url):
    conninfo = libpq_url(database_url)
    inside = threading.Event()
    release = threading.Event()
    ran: list[str] = []

    def slow_pass() -> None:
        ran.append("first")
        inside.set()
        release.wait(10)

    first = PeriodicTaskMiddleware("test-reaper", 60, slow_pass, conninfo=conninfo)
    second = PeriodicTaskMiddleware("test-reaper", 60, lambda: ran.append("second"),
                                    conninfo=conninfo)
    other = PeriodicTaskMiddleware("test-janitor", 60, lambda: ran.append("other"),
                                   conninfo=conninfo)
    thread = threading.Thread(target=first.run_once)
    thread.start()
    try:
        assert inside.wait(10)
        assert second.run_once() is False  # the lock is held by the first pass
        assert other.run_once() is True  # another task's lock is another key
        release.set()
        thread.join(10)
        assert second.run_once() is True  # released after the pass
        assert ran == ["first", "other", "second"]
        assert (first.passes, second.passes, second.skipped) == (1, 1, 1)
    finally:
        release.set()
        for task in (first, second, other):
            task.stop()
    assert lock_key("reaper") == lock_key("reaper") != lock_key("janitor")


def test_a_failing_pass_releases_the_lock(database_url):
    conninfo = libpq_url(database_url)

    def broken() -> None:
        raise RuntimeError("boom")

    task = PeriodicTaskMiddleware("test-broken", 60, broken, conninfo=conninfo)
    follower = PeriodicTaskMiddleware("test-broken", 60, lambda: None, conninfo=conninfo)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            task.run_once()
        assert follower.run_once() is True
    finally:
        task.stop()
        follower.stop()
