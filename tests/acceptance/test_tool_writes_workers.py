"""Exactly-once host writes on real workers (docs/decisions/0021-tool-writes-and-
loop-ends.md): 50 loops each close a ticket with a tool that writes through
its lent session; on each call's first run the worker is SIGKILLed after the
tool's body, before its commit. Every ticket's counter ends at exactly one.
For contrast, 10 loops use a tool that commits on its own: their counters
count every run that got past that commit (at least once, so twice here).
Each loop's end enqueued its notification job in its final commit: exactly
one job per loop, each run."""

from __future__ import annotations

import json
import os
import time

import psycopg
import pytest

from flask_solidloop.testing.chaos import (
    Fleet,
    ProgressWatch,
    chaos_env,
    progress_marker,
    verify_contract,
)
from flask_solidloop.urls import libpq_url

from ..support.support_app import TICKETS_DDL, TicketAgent

pytestmark = pytest.mark.e2e

EXACT = 50
CONTRAST = 10
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def answer(body):
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"content": "closed"}
    kind, _, number = (last.get("content") or "").rpartition(" ")
    tool = "close_ticket_committing" if kind.startswith("contrast") else "close_ticket"
    return {"tool_calls": [{"name": tool, "arguments": {"ticket": int(number)}}]}


def test_a_tool_killed_before_its_commit_applies_its_write_exactly_once(
        app, database_url, llm, tmp_path):
    url = libpq_url(database_url)
    with psycopg.connect(url, autocommit=True) as pg:
        for statement in TICKETS_DDL.split(";"):
            pg.execute(statement)
        pg.execute("TRUNCATE chaos_tickets, chaos_ticket_runs, chaos_ticket_kills, "
                   "chaos_ticket_closed")
        pg.execute("INSERT INTO chaos_tickets (id) SELECT generate_series(1, %s)",
                   (EXACT + CONTRAST,))
    llm.script(lambda body: True, answer)
    # A SIGKILL takes every call in flight in its process, not only the one that
    # asked for it: a call's later runs die too when they share a process with
    # another call's first run, and on a loaded machine some die twice before
    # their body. SOLIDLOOP_TOOL_MAX_ATTEMPTS (3) would then answer the call
    # with an error, by design; what is tested here is the write, so the cap is
    # out of the way.
    config = {"SOLIDLOOP_LIVENESS_TTL": 3.0, "SOLIDLOOP_LEASE_MARGIN": 1,
              "SOLIDLOOP_JOB_LEASE": 4, "SOLIDLOOP_QUEUED_REAP_THRESHOLD": 4,
              "SOLIDLOOP_TOOL_MAX_ATTEMPTS": 20}
    env = chaos_env("tests.support.support_app:create_app()", database_url, liveness_ttl=3.0,
                    extra={"SOLIDLOOP_TEST_APP_CONFIG": json.dumps(config)})
    fleet = Fleet(3, threads=4, env=env, log_dir=tmp_path, cwd=ROOT)
    kills = killed_runs = 0
    watch = ProgressWatch(90)
    try:
        fleet.start_all()
        loops = [TicketAgent.start(message=f"close ticket {n}").id for n in range(1, EXACT + 1)]
        loops += [TicketAgent.start(message=f"contrast ticket {n}").id
                  for n in range(EXACT + 1, EXACT + CONTRAST + 1)]
        with psycopg.connect(url, autocommit=True) as pg:
            while True:
                # Each kill request: a tool's body is done, its commit is not.
                for request_id, pid in pg.execute(
                        "SELECT id, pid FROM chaos_ticket_kills WHERE NOT handled "
                        "ORDER BY id").fetchall():
                    group = _group_of(pid)
                    index = next((i for i, proc in enumerate(fleet.procs)
                                  if proc is not None and proc.pid == group), None)
                    if index is not None and fleet.procs[index].poll() is None:
                        fleet.kill(index)
                        kills += 1
                        fleet.start(index)
                    killed_runs += 1
                    pg.execute("UPDATE chaos_ticket_kills SET handled = true WHERE id = %s",
                               (request_id,))
                marker = progress_marker(pg, loops)
                done = pg.execute("SELECT count(*) FROM chaos_ticket_closed").fetchone()[0]
                watch.update((*marker, done))
                if marker[0] == len(loops) and done == len(loops):
                    break
                assert not watch.stalled, f"no progress for 90 s: {marker}; logs in {tmp_path}"
                time.sleep(0.1)
            assert verify_contract(database_url, loops) == []
            touches = dict(pg.execute("SELECT id, touches FROM chaos_tickets").fetchall())
            runs = dict(pg.execute(
                "SELECT t.arguments->>'ticket', count(r.*) FROM solidloop_tool_calls t "
                "JOIN chaos_ticket_runs r ON r.key = 'solidloop:tool_call:' || t.id "
                "GROUP BY 1").fetchall())
            notices = dict(pg.execute(
                "SELECT (message->'args'->>0)::bigint, count(*) FROM solidloop_jobs "
                "WHERE actor_name = 'ticket_closed_notice' AND state = 'done' "
                "GROUP BY 1").fetchall())
            jobs = pg.execute("SELECT count(*) FROM solidloop_jobs "
                              "WHERE actor_name = 'ticket_closed_notice'").fetchone()[0]
            closed = dict(pg.execute("SELECT loop_id, runs FROM chaos_ticket_closed").fetchall())
            lapsed = dict(pg.execute(
                "SELECT (arguments->>'ticket')::int, lapsed_runs FROM solidloop_tool_calls "
                "WHERE loop_id = ANY(%s)", (loops,)).fetchall())
    finally:
        fleet.stop_all()
    exact, contrast = range(1, EXACT + 1), range(EXACT + 1, EXACT + CONTRAST + 1)
    print(f"\n[tool writes] {kills} SIGKILLs, {killed_runs} tool runs killed after their "
          f"body; runs per call: exactly-once tool {sorted(runs[str(n)] for n in exact)}; "
          f"contrast touches {[touches[n] for n in contrast]}; lapsed runs per call "
          f"{sorted(lapsed.values())}")
    # Every call of the lent-session tool was killed once before its commit ...
    assert all(runs[str(n)] >= 2 for n in exact)
    # ... and its write landed exactly once.
    assert [touches[n] for n in exact] == [1] * EXACT
    # The tool that commits on its own: one write per run past its commit.
    assert all(touches[n] >= 2 for n in contrast)
    # One notification job per loop, enqueued with its end, and each one ran.
    assert jobs == len(loops) and sorted(notices) == sorted(loops)
    assert set(notices.values()) == {1} and sorted(closed) == sorted(loops)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None  # already gone with a fleet killed for another request
