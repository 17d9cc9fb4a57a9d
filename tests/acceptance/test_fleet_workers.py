"""The worker fleet with real processes (decision 0029): a process claims no more
jobs than it has threads, the claims of a process whose threads are wedged run
elsewhere once they lapse, and the reaper has one leader that a killed or
frozen leader hands over to."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from sqlalchemy import text

from ..support.support_app import Assistant
from .test_e2e_workers import (
    assert_completed_once,
    kill_group,
    script_tool_round_trip,
    spawn_workers,
    wait_for,
)
from .test_liveness import poll, with_sigcont

pytestmark = pytest.mark.e2e

TTL = 4.0
THREADS = 2
CONFIG = {"SOLIDLOOP_LIVENESS_TTL": TTL, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
          "SOLIDLOOP_LEASE_MARGIN": 1}


def cmd(processes: int = 1) -> list[str]:
    return [sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
            "--processes", str(processes), "--threads", str(THREADS)]


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    started = []

    def start(name: str, **extra):
        monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({**CONFIG, **extra}))
        proc = spawn_workers(cmd(), log=tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with_sigcont(proc)
        kill_group(proc, signal.SIGKILL)


def claimed(session) -> list:
    return session.execute(text(
        "SELECT id, attempts FROM solidloop_jobs WHERE state = 'running' ORDER BY id")).all()


def test_a_wedged_process_claims_no_more_than_its_threads_and_they_run_elsewhere(
        app, session, llm, fleet, tmp_path):
    script_tool_round_trip(llm)
    wedged = fleet("wedged", TEST_WEDGE_WORKER_THREADS=True)
    loop_ids = [Assistant.start(message=f"add please #{i}").id for i in range(5)]
    first = poll(session, lambda: claimed(session), what="the wedged process to claim")
    # Its consumers (one per queue) claim for its threads, never beyond: the
    # other loops' jobs stay queued for someone else.
    time.sleep(1.0)
    held = claimed(session)
    session.rollback()
    assert len(held) == THREADS and all(attempts == 1 for _, attempts in held), held
    assert {job_id for job_id, _ in first} <= {job_id for job_id, _ in held}
    queued = session.execute(text("SELECT count(*) FROM solidloop_jobs WHERE state = "
                                  "'queued'")).scalar_one()
    session.rollback()
    assert queued == len(loop_ids) - THREADS

    # A healthy process arrives. The wedged one never renews claims no thread
    # started, so they lapse after one lease and run here.
    healthy = fleet("healthy")
    started = time.monotonic()
    wait_for(session, loop_ids, timeout=120, proc=healthy, log=tmp_path / "healthy.log")
    assert_completed_once(session, loop_ids)
    redelivered = session.execute(text(
        "SELECT id, attempts FROM solidloop_jobs WHERE id = ANY(:ids) ORDER BY id"),
        {"ids": [job_id for job_id, _ in held]}).all()
    session.rollback()
    assert all(attempts == 2 for _, attempts in redelivered), redelivered
    assert wedged.poll() is None  # still there, still wedged: nothing was run by it
    print(f"the wedged process's claims ran elsewhere {time.monotonic() - started:.1f}s "
          f"after a healthy process started (liveness TTL {TTL}s)")


def leader(session, name: str = "reaper"):
    row = session.execute(text("SELECT holder, until > now() FROM solidloop_leaders "
                               "WHERE name = :name"), {"name": name}).first()
    session.rollback()
    return row[0] if row and row[1] else None


def passes(session) -> tuple[int, str] | None:
    row = session.execute(text("SELECT passes, holder FROM solidloop_maintenance_runs "
                               "WHERE task = 'reap'")).first()
    session.rollback()
    return (row[0], row[1]) if row else None


def process_of(holder: str) -> int:
    """``host:pid:<instance>`` -> pid."""
    return int(holder.split(":")[1])


def worker_pids(proc) -> set[int]:
    """The dramatiq worker processes under the master ``proc`` (its process group)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == proc.pid and int(entry) != proc.pid:
                    pids.add(int(entry))
            except ProcessLookupError:
                continue
    return pids


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_the_reaper_has_one_leader_and_a_dead_or_frozen_one_is_replaced(
        app, session, fleet, fault):
    procs = {name: fleet(name) for name in ("one", "two")}
    holder = poll(session, lambda: leader(session), what="a reaper leader")
    # One leader runs the passes: every pass recorded is its own.
    first = poll(session, lambda: (p := passes(session)) and p[1] == holder.rsplit(":", 1)[0]
                 and p, what="the leader's passes")
    time.sleep(3.0)
    later = passes(session)
    assert later is not None and later[1] == first[1] and leader(session) == holder
    # At one pass per 0.5 s interval, not two (one per process).
    assert later[0] - first[0] <= 3.0 / 0.5 + 2, (first, later)

    pid = process_of(holder)
    assert any(pid in worker_pids(proc) for proc in procs.values())
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        # Its leadership lapses (10 s without a renewal) and another process leads.
        successor = poll(session, lambda: (h := leader(session)) and h != holder and h,
                         timeout=60, what="another leader")
        assert process_of(successor) != pid
        after = poll(session, lambda: (p := passes(session)) and p[1] != first[1] and p,
                     timeout=30, what="the successor's passes")
        assert after[0] > later[0]
    finally:
        if fault == "freeze":
            os.kill(pid, signal.SIGCONT)
    if fault == "freeze":
        # Thawed, the old leader stands by: the successor keeps the leadership.
        time.sleep(2.0)
        assert leader(session) == successor
