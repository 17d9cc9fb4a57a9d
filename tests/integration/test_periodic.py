"""The in-worker maintenance thread: one leader per task runs every pass,
the others stand by and take over when it stops, dies or falls silent."""

from __future__ import annotations

import time
import uuid

import pytest

from flask_solidloop.queue.middleware.periodic import PeriodicTaskMiddleware
from flask_solidloop.urls import libpq_url


def holders(name, conninfo, ran, *, count=2, ttl=60.0):
    return [PeriodicTaskMiddleware(name, 60, (lambda i=i: ran.append(i)), conninfo=conninfo,
                                   ttl=ttl) for i in range(count)]


def test_one_leader_runs_every_pass_and_the_others_stand_by(database_url, pg):
    conninfo = libpq_url(database_url)
    name = f"test-{uuid.uuid4().hex[:8]}"
    ran: list[int] = []
    first, second = holders(name, conninfo, ran)
    other, = holders(name + "-other", conninfo, ran, count=1)
    try:
        assert first.run_once() is True  # the task's first leader ever
        assert second.run_once() is False
        assert first.run_once() is True  # it keeps the leadership pass after pass
        assert second.run_once() is False
        assert other.run_once() is True  # another task has a leader of its own
        assert ran == [0, 0, 0]
        assert (first.passes, second.passes, second.skipped) == (2, 0, 2)
        assert pg.execute("SELECT holder FROM solidloop_leaders WHERE name = %s",
                          (name,)).fetchone()[0] == first.holder
        # A follower's check writes nothing: the row's version did not move.
        before = pg.execute("SELECT xmin::text FROM solidloop_leaders WHERE name = %s",
                            (name,)).fetchone()[0]
        assert second.run_once() is False
        assert pg.execute("SELECT xmin::text FROM solidloop_leaders WHERE name = %s",
                          (name,)).fetchone()[0] == before
    finally:
        for task in (first, second, other):
            task.stop()


def test_a_clean_stop_hands_the_leadership_over_at_once(database_url):
    conninfo = libpq_url(database_url)
    ran: list[int] = []
    first, second = holders(f"test-{uuid.uuid4().hex[:8]}", conninfo, ran)
    try:
        assert first.run_once() is True
        assert second.run_once() is False
        first.stop()
        assert second.run_once() is True
        assert ran == [0, 1]
    finally:
        first.stop()
        second.stop()


def test_a_silent_leader_is_replaced_after_its_ttl(database_url):
    # A leader that died or froze stops renewing; a follower takes over once
    # the leadership lapses, and the old leader, back, stands by.
    conninfo = libpq_url(database_url)
    ran: list[int] = []
    first, second = holders(f"test-{uuid.uuid4().hex[:8]}", conninfo, ran, ttl=1.0)
    try:
        assert first.run_once() is True
        assert second.run_once() is False
        time.sleep(1.3)
        assert second.run_once() is True
        assert first.run_once() is False
        assert second.run_once() is True
        assert ran == [0, 1, 1]
    finally:
        first.stop()
        second.stop()


def test_a_failing_pass_keeps_the_leadership_and_the_next_pass_runs(database_url):
    conninfo = libpq_url(database_url)
    outcomes = iter([RuntimeError("boom"), None])

    def flaky() -> None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    name = f"test-{uuid.uuid4().hex[:8]}"
    task = PeriodicTaskMiddleware(name, 60, flaky, conninfo=conninfo)
    follower = PeriodicTaskMiddleware(name, 60, lambda: None, conninfo=conninfo)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            task.run_once()
        assert follower.run_once() is False  # a failed pass is not a dead leader
        assert task.run_once() is True
    finally:
        task.stop()
        follower.stop()


def test_the_leadership_lasts_three_intervals_and_at_least_ten_seconds(database_url):
    conninfo = libpq_url(database_url)
    short = PeriodicTaskMiddleware("x", 2, lambda: None, conninfo=conninfo)
    long = PeriodicTaskMiddleware("y", 300, lambda: None, conninfo=conninfo)
    assert (short.ttl, short.follow_interval) == (10.0, 10.0 / 3)
    assert (long.ttl, long.follow_interval) == (900.0, 300.0)
