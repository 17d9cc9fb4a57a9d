"""Shared rate limits on real ``flask solidloop worker`` processes, through a
SIGKILL: the fleet defers turns to their slots (holding nothing), the fleet is
killed mid-backlog, a new one takes over, every loop completes, and the
provider never saw more than the bucket allows."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import time

import pytest
from sqlalchemy import func, select

from flask_solidloop.limits.rates import origin_of
from flask_solidloop.models import Job, Loop, RateBucket

from ..support.support_app import Assistant
from .test_approvals_workers import poll
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

RPS = 4
WORKER_CMD = [sys.executable, "-m", "flask", "solidloop", "worker", "--processes", "2",
              "--threads", "4"]


@pytest.fixture
def no_collector_pauses():
    """The provider's view is the emulator's, which runs in this process: a
    full garbage collection of the test process's heap stopped every thread
    of it for up to a second on a loaded machine, and the requests that
    reached the socket meanwhile were timed together when it ended. The heap
    built so far is frozen out of the collections, and the collector is off
    until the test ends (reference counting still frees what it can)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()


@pytest.fixture
def fleet(monkeypatch, tmp_path, llm, no_collector_pauses):
    key = f"{origin_of(llm.base_url)} test-model"
    config = {"SOLIDLOOP_RATE_LIMITS": {key: {"rps": RPS}},
              "SOLIDLOOP_RATE_LIMIT_INLINE_WAIT": 0.1,
              "SOLIDLOOP_LIVENESS_TTL": 10.0, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
              "SOLIDLOOP_LEASE_MARGIN": 1}
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(config))
    started = []

    def start(name: str):
        proc = spawn_workers(WORKER_CMD, log=tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start, key
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
        kill_group(proc)


def test_deferred_turns_survive_a_killed_fleet_and_the_rate_holds(app, session, llm, fleet):
    start, key = fleet
    llm.script(lambda req: True, {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "done"})
    # Each request's arrival, as the server's handler sees it, before its answer
    # (the answers' own timing is not the limiter's). Newest first: it is asked
    # first, and never matches.
    arrivals: list[float] = []
    llm.script(lambda req: arrivals.append(time.monotonic()) or False, {"content": "-"})
    ids = Assistant.start_many([f"add {i}" for i in range(40)])
    first = start("first")

    def deferred() -> int:
        return int(session.scalar(select(func.sum(Loop.capacity_deferrals))) or 0)

    poll(session, lambda: deferred() >= 10, timeout=60, what="turns deferred to their slots")
    kill_group(first, signal.SIGKILL)
    start("second")
    poll(session, lambda: all(session.get(Loop, i).status == "completed" for i in ids),
         timeout=100, what="every loop to complete after the kill")
    assert session.scalar(select(func.count()).select_from(Job).where(Job.state == "dead")) == 0
    assert session.get(RateBucket, (key, "-")).deferrals >= 10
    # Every run of requests the provider saw fits the bucket: RPS at once, RPS a
    # second after (one more allowed for a deferred job claimed a little late).
    times = sorted(arrivals)
    assert len(times) >= 80
    worst = max(j - i + 1 - (RPS + RPS * (times[j] - times[i]))
                for i in range(len(times)) for j in range(i, len(times)))
    assert worst <= 1, worst
