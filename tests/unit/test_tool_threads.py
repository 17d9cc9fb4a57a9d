"""The tool-thread pool (pipeline/tool_threads.py): a call's value or error comes
back on the caller's thread; one that outruns its timeout is abandoned and its
thread quarantined until it returns; the limit is reported once."""

from __future__ import annotations

import threading
import time

import pytest

from flask_solidloop.pipeline.tool_threads import ToolThreads, ToolTimeoutError


def test_values_and_errors_come_back_and_threads_are_reused():
    pool = ToolThreads()
    assert pool.run(lambda: 42, timeout=5) == 42
    first = pool.run(lambda: threading.current_thread().name, timeout=5)
    assert first.startswith("solidloop-tool-") and first != threading.current_thread().name
    assert pool.run(lambda: threading.current_thread().name, timeout=5) == first  # reused

    def boom():
        raise KeyError("inside the tool")

    with pytest.raises(KeyError, match="inside the tool"):
        pool.run(boom, timeout=5)
    assert pool.quarantined == 0


def test_a_call_past_its_timeout_is_abandoned_and_its_thread_quarantined_until_it_returns():
    pool = ToolThreads()
    release = threading.Event()
    with pytest.raises(ToolTimeoutError) as caught:
        pool.run(lambda: release.wait(30), timeout=0.1)
    assert caught.value.quarantined == 1 and pool.quarantined == 1
    # The pool still serves, on another thread.
    assert pool.run(lambda: "next", timeout=5) == "next"
    release.set()
    deadline = time.monotonic() + 5
    while pool.quarantined and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.quarantined == 0


def test_the_limit_is_reported_once():
    pool = ToolThreads()
    pool.quarantine_limit = 2
    reported: list[int] = []
    pool.on_limit = reported.append
    release = threading.Event()
    for _ in range(3):
        with pytest.raises(ToolTimeoutError):
            pool.run(lambda: release.wait(30), timeout=0.05)
    assert reported == [2] and pool.quarantined == 3
    release.set()
