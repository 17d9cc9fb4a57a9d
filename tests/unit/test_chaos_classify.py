"""The chaos harness's account of duplicate side effects (tests/support/chaos.py):
each extra run is put down to the fault that hit the first run's process, or
the server, between the two runs; ``other`` when none did."""

from __future__ import annotations

from ..support.chaos import classify_duplicates


def test_each_extra_run_follows_the_fault_that_hit_the_first_runs_process():
    runs = [
        ("k1", 100, 10.0), ("k1", 200, 14.0),   # pid 100 killed at 11: a kill
        ("k2", 300, 20.0), ("k2", 400, 30.0),   # pid 300 frozen at 21: a freeze
        ("k3", 500, 40.0), ("k3", 600, 45.0),   # a restart at 42
        ("k4", 700, 50.0), ("k4", 800, 52.0),   # nothing: other
        ("k5", 900, 60.0),                      # ran once
    ]
    faults = [
        (11.0, "kill", frozenset({99, 100})),
        (21.0, "freeze", frozenset({300, 301})),
        (42.0, "restart", frozenset()),
        (51.0, "kill", frozenset({123})),        # another process: not k4's cause
    ]
    assert classify_duplicates(runs, faults) == {"kill": 1, "freeze": 1, "restart": 1,
                                                 "other": 1}


def test_a_fault_after_the_second_run_explains_nothing():
    runs = [("k", 1, 10.0), ("k", 2, 11.0)]
    assert classify_duplicates(runs, [(12.0, "kill", frozenset({1}))]) == {"other": 1}
