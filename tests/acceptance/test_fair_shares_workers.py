"""Fair shares and concurrency caps on real worker processes (decision 0023):
a small subject's loops finish before a big subject's backlog; a cap is never
passed, every held loop starts, and a fleet SIGKILLed while loops are held
strands none."""

from __future__ import annotations

import json
import signal
import sys
import time

import psycopg
import pytest

from flask_solidloop.queue.broker import libpq_url

from ..support.support_app import Assistant, CappedAgent, SlowAgent
from .test_e2e_workers import kill_group, script_tool_round_trip, spawn_workers

pytestmark = pytest.mark.e2e

WORKERS = [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "2",
           "--threads", "3"]


def wait_all(url, loop_ids, *, timeout, proc, log, sample=None):
    """Wait until every loop has ended, calling ``sample(conn)`` every 50 ms."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            if sample is not None:
                sample(conn)
            left = conn.execute(
                "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) "
                "AND status NOT IN ('completed', 'failed', 'paused')", (loop_ids,)).fetchone()[0]
            if left == 0:
                return
            if proc.poll() is not None:
                pytest.fail(f"workers exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{left} loops not finished after {timeout}s\n"
                            f"{log.read_text()[-4000:]}")
            time.sleep(0.05)


def test_a_small_subjects_loops_finish_before_a_big_backlog(app, session, llm, tmp_path,
                                                            database_url):
    script_tool_round_trip(llm)
    big = Assistant.start_many([{"message": f"add please A{i}", "subject": ("Team", "A")}
                                for i in range(200)])
    session.commit()
    small = Assistant.start_many([{"message": f"add please B{i}", "subject": ("Team", "B")}
                                  for i in range(5)])
    session.commit()
    log = tmp_path / "workers.log"
    proc = spawn_workers(WORKERS, log=log)  # 6 threads for 205 loops: saturated
    url = libpq_url(database_url)
    try:
        wait_all(url, big + small, timeout=90, proc=proc, log=log)
    finally:
        kill_group(proc)
    with psycopg.connect(url, autocommit=True) as conn:
        finished = dict(conn.execute(
            "SELECT id, finished_at FROM solidloop_loops WHERE id = ANY(%s) "
            "AND status = 'completed'", (big + small,)).fetchall())
    assert len(finished) == 205
    last_small = max(finished[i] for i in small)
    fiftieth_big = sorted(finished[i] for i in big)[49]
    assert last_small < fiftieth_big
    before = sum(1 for i in big if finished[i] < last_small)
    print(f"B's five loops finished after {before} of A's 200")


def script_naps(llm) -> None:
    llm.script("nap", {"content": "napping", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": 0.3}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "rested"})


IN_FLIGHT = ("SELECT count(*) FILTER (WHERE capped_at IS NOT NULL), "
             "count(*) FILTER (WHERE status IN ('running', 'waiting') "
             "OR (status = 'queued' AND step_count > 0)) "
             "FROM solidloop_loops WHERE id = ANY(%s)")


def run_capped(monkeypatch, llm, tmp_path, database_url, start, cap, *, kill=False):
    """Start loops with ``start()`` (the capped loops, and all of them), run them
    on two worker processes of three threads each, sample how many of the capped
    ones are in flight, and check the cap."""
    script_naps(llm)
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({
        # A recheck far past the wait below: every held loop that starts was
        # woken by a loop that left flight, never by the safety net.
        "SOLIDLOOP_MAX_CONCURRENT_PER_SUBJECT": 3, "SOLIDLOOP_HELD_LOOP_RECHECK": 600,
        "SOLIDLOOP_LIVENESS_TTL": 3, "SOLIDLOOP_REAPER_INTERVAL": 1}))
    loop_ids, every_loop = start()
    url = libpq_url(database_url)
    log = tmp_path / "workers.log"
    peaks = [0, 0]

    def sample(conn):
        admitted, flying = conn.execute(IN_FLIGHT, (loop_ids,)).fetchone()
        peaks[0], peaks[1] = max(peaks[0], admitted), max(peaks[1], flying)
        assert admitted <= cap and flying <= cap, (admitted, flying)

    proc = spawn_workers(WORKERS, log=log)
    try:
        if kill:
            deadline = time.monotonic() + 30
            with psycopg.connect(url, autocommit=True) as conn:
                while conn.execute(
                        "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) AND held_since "
                        "IS NOT NULL AND status = 'queued'", (loop_ids,)).fetchone()[0] < 1:
                    assert time.monotonic() < deadline, log.read_text()[-4000:]
                    sample(conn)
                    time.sleep(0.02)
            kill_group(proc, signal.SIGKILL)
            proc = spawn_workers(WORKERS, log=log)
        wait_all(url, every_loop, timeout=60, proc=proc, log=log, sample=sample)
    finally:
        kill_group(proc)
    with psycopg.connect(url, autocommit=True) as conn:
        statuses = [s for (s,) in conn.execute(
            "SELECT status FROM solidloop_loops WHERE id = ANY(%s)", (every_loop,))]
    assert statuses == ["completed"] * len(every_loop)
    assert peaks[0] == cap  # the cap was reached, and never passed


def test_a_subjects_cap_is_never_passed(monkeypatch, app, session, llm, tmp_path,
                                        database_url):
    def start():
        ids = SlowAgent.start_many([{"message": f"nap {i}", "subject": ("Team", "S")}
                                    for i in range(12)])
        others = SlowAgent.start_many([f"nap free {i}" for i in range(3)])  # not capped
        session.commit()
        return ids, ids + others
    run_capped(monkeypatch, llm, tmp_path, database_url, start, 3)


def test_an_agents_cap_is_never_passed(monkeypatch, app, session, llm, tmp_path,
                                       database_url):
    def start():
        ids = [CappedAgent.start(message=f"nap {i}").id for i in range(10)]
        session.commit()
        return ids, ids
    run_capped(monkeypatch, llm, tmp_path, database_url, start, 2)


def test_a_fleet_killed_while_loops_are_held_strands_none(monkeypatch, app, session, llm,
                                                          tmp_path, database_url):
    def start():
        ids = SlowAgent.start_many([{"message": f"nap {i}", "subject": ("Team", "K")}
                                    for i in range(20)])
        session.commit()
        return ids, ids
    run_capped(monkeypatch, llm, tmp_path, database_url, start, 3, kill=True)
