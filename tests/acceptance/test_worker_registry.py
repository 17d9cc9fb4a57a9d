"""The worker registry with real worker processes: each registers a heartbeat row,
``flask solidloop workers`` lists it with what it holds, ``status`` names the worker
holding a tool call, a clean stop and a SIGKILL are told apart, and dead rows
are pruned (issue 13)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal

import pytest
from sqlalchemy import text

from ..support.support_app import SlowAgent
from .test_e2e_workers import kill_group, spawn_workers
from .test_liveness import WORKER_CMD, holder_group, poll, running_calls, slow_calls

pytestmark = pytest.mark.e2e

# A worker is "lost" after three silent beats, so a beat of 1 s lets a loaded
# machine stall a worker for up to 3 s before "live" turns into "lost"; the
# tool's 6 s lease likewise outlasts a late renewal (no takeover is tested here).
HEARTBEAT = 1.0
CONFIG = {"SOLIDLOOP_LIVENESS_TTL": 6.0, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
          "SOLIDLOOP_LEASE_MARGIN": 1, "SOLIDLOOP_WORKER_HEARTBEAT": HEARTBEAT}


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(CONFIG))
    started = []

    def start(name: str):
        proc = spawn_workers(WORKER_CMD, log=tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        kill_group(proc)


def _rows(session):
    return session.execute(text(
        "SELECT identity, pid, threads, queues, stopped_at FROM solidloop_workers "
        "ORDER BY id")).all()


def test_workers_register_list_what_they_hold_and_are_told_apart_when_dead(
        app, session, llm, fleet, effects, tmp_path):
    app.extensions["solidloop"].config = dataclasses.replace(
        app.extensions["solidloop"].config, worker_heartbeat=HEARTBEAT)
    runner = app.test_cli_runner()
    first = fleet("first")
    (row,) = poll(session, lambda: _rows(session), what="the worker to register")
    assert row.threads == 2 and {"solidloop_llm", "solidloop_tool",
                                 "solidloop_maintenance"} <= set(row.queues)
    assert os.getpgid(row.pid) == first.pid and row.stopped_at is None

    slow_calls(llm, 4.0)
    loop = SlowAgent.start(message="slow please")
    call = poll(session, lambda: running_calls(session, loop.id), what="the tool to start")[0]
    listing = runner.invoke(args=["solidloop", "workers"])
    assert listing.exit_code == 0, listing.output
    line = next(x for x in listing.output.splitlines() if x.startswith(call.lease_holder))
    assert " live " in line and f"tool calls {call.id}" in line
    status = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert f"worker {call.lease_holder}: live, last heartbeat" in status.output

    # A SIGKILL leaves the row without stopped_at: after three silent beats it is lost.
    os.killpg(holder_group(call.lease_holder), signal.SIGKILL)
    first.wait()

    def lost():
        out = runner.invoke(args=["solidloop", "workers"]).output
        return " lost " in out and out

    out = poll(session, lost, timeout=30, what="the killed worker to be reported lost")
    assert call.lease_holder in out

    # The worker's log has a timestamped start line per job, with the loop and agent.
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert re.search(r"^\[20\d\d-\d\d-\d\d [\d:,]+\] .*job start llm_turn "
                     rf"loop={loop.id} agent=liveness", log, re.M), log[-2000:]
    assert re.search(rf"job done llm_turn loop={loop.id} agent=liveness job=\d+ in [\d.]+s", log)


    # A clean stop stamps stopped_at. SIGTERM to the master only, as `kill PID` does:
    # the master forwards it once (a second SIGTERM makes dramatiq exit at once).
    second = fleet("second")
    poll(session, lambda: len(_rows(session)) == 2, what="the second worker to register")
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=30)
    session.expire_all()
    stopped = [r for r in _rows(session) if r.stopped_at is not None]
    session.rollback()
    assert len(stopped) == 1 and os.path.exists(f"/proc/{stopped[0].pid}") is False
    assert " stopped " in runner.invoke(args=["solidloop", "workers"]).output


def test_dead_worker_rows_are_pruned(app, session):
    session.execute(text(
        "INSERT INTO solidloop_workers (identity, host, pid, threads, last_seen_at) VALUES "
        "('gone:1', 'gone', 1, 1, now() - interval '2 days'), "
        "('here:2', 'here', 2, 1, now())"))
    session.commit()
    result = app.test_cli_runner().invoke(args=["solidloop", "workers", "--recent", "10"])
    assert "here:2" in result.output and "gone:1" not in result.output
    state = app.extensions["solidloop"]
    state.config = dataclasses.replace(state.config, event_retention=3600)
    pruned = app.test_cli_runner().invoke(args=["solidloop", "prune"])
    assert "workers=1" in pruned.output, pruned.output
    assert [r.identity for r in _rows(session)] == ["here:2"]
