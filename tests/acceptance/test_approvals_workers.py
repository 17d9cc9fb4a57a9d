"""Waiting loops with real ``flask solidloop worker`` processes: a loop that waits
for an approval holds no job, lease, thread or open transaction; a decision
brings it back, and survives the death of the worker fleet that ran the loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import psycopg
import pytest
from sqlalchemy import select

from flask_solidloop.models import Job, Loop, ToolCall
from flask_solidloop.urls import libpq_url

from ..support.support_app import ShopAgent
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

WORKER_CONFIG = {"SOLIDLOOP_LIVENESS_TTL": 10.0, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
                 "SOLIDLOOP_LEASE_MARGIN": 1}
WORKER_CMD = [sys.executable, "-m", "flask", "solidloop", "worker", "--processes", "1",
              "--threads", "2"]


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    """Start worker fleets (each its own process group); all stopped at the end."""
    started = []

    def start(name: str, ttl: float | None = None):
        config = {**WORKER_CONFIG, **({"SOLIDLOOP_LIVENESS_TTL": ttl} if ttl else {})}
        monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(config))
        proc = spawn_workers(WORKER_CMD, log=tmp_path / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
        kill_group(proc)


def poll(session, check, *, timeout: float = 90.0, what: str):
    deadline = time.monotonic() + timeout
    while True:
        session.expire_all()
        value = check()
        session.rollback()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def status_of(session, loop_id):
    return session.get(Loop, loop_id).status


def live_jobs(session, loop_id):
    return list(session.scalars(select(Job).where(
        Job.loop_id == loop_id, Job.state.in_(("queued", "running")))))


def open_transactions(database_url: str, seconds: float = 1.5) -> list[tuple]:
    """Backends of the test database (ours aside) seen in a transaction held
    longer than half a second, sampled for ``seconds``: a loop that waits must
    keep none open."""
    seen = []
    deadline = time.monotonic() + seconds
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            seen += conn.execute(
                "SELECT pid, state, left(query, 80) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND xact_start < now() - interval '0.5 seconds'").fetchall()
            time.sleep(0.1)
    return seen


def script_shop(llm):
    llm.script("refund and look", {"content": "Checking.", "tool_calls": [
        {"name": "refund", "arguments": {"order": "42", "amount": 80}},
        {"name": "lookup_order", "arguments": {"order": "42"}}]})
    llm.script("email the ceo", {"content": "Drafting.", "tool_calls": [
        {"name": "send_email", "arguments": {"to": "ceo", "body": "hello"}}]})
    llm.script("refunded 80", {"content": "Refunded."})
    llm.script("we do not email the ceo", {"content": "Understood."})


def test_a_waiting_loop_holds_nothing_and_a_decision_brings_it_back(
        app, session, llm, fleet, effects, database_url):
    script_shop(llm)
    fleet("one"), fleet("two")
    approved = ShopAgent.start(message="refund and look")
    denied = ShopAgent.start(message="email the ceo")
    for loop in (approved, denied):
        poll(session, lambda loop=loop: status_of(session, loop.id) == "waiting",
             what=f"loop {loop.id} to wait")
    refund = session.scalars(select(ToolCall).where(ToolCall.name == "refund")).one()
    lookup = session.scalars(select(ToolCall).where(ToolCall.name == "lookup_order")).one()
    # The free call ran; the gated one did not.
    assert lookup.response_message_id is not None and refund.executed_at is None
    assert len(effects(f"solidloop:tool_call:{lookup.id}", "lookup")) == 1
    assert effects(f"solidloop:tool_call:{refund.id}", "refund") == []
    # Waiting costs nothing: no job queued or running (no worker thread), no
    # lease on the loop or the call, no transaction open anywhere.
    for loop in (approved, denied):
        row = session.get(Loop, loop.id)
        assert (row.lease_expires_at, row.lease_holder) == (None, None)
        assert live_jobs(session, loop.id) == []
    assert refund.lease_token is None
    session.rollback()  # this test's own reads end their transaction first
    held = open_transactions(database_url)
    assert held == [], held

    ShopAgent(approved).approve(refund.id, by="staff")
    email = session.scalars(select(ToolCall).where(ToolCall.name == "send_email")).one()
    ShopAgent(denied).deny(email.id, "we do not email the CEO", by="staff")
    for loop in (approved, denied):
        poll(session, lambda loop=loop: status_of(session, loop.id) == "completed",
             what=f"loop {loop.id} to complete after its decision")
    assert len(effects(f"solidloop:tool_call:{refund.id}", "refund")) == 1
    assert effects(f"solidloop:tool_call:{email.id}", "email") == []
    denied_request = next(r.json for r in llm.requests
                          if "we do not email the CEO" in json.dumps(r.json))
    assert denied_request["messages"][-1]["role"] == "tool"


def test_a_decision_outlives_the_fleet_that_ran_the_loop(
        app, session, llm, fleet, effects):
    script_shop(llm)
    first = fleet("first")
    loop = ShopAgent.start(message="refund and look")
    poll(session, lambda: status_of(session, loop.id) == "waiting", what="the loop to wait")
    refund = session.scalars(select(ToolCall).where(ToolCall.name == "refund")).one()
    # The fleet is frozen, the decision commits with the tool's job, and the
    # fleet is killed before it can act on it: the job is durable, and another
    # fleet runs the tool, once.
    os.killpg(first.pid, signal.SIGSTOP)
    ShopAgent(loop).approve(refund.id, by="staff")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    fleet("second")
    poll(session, lambda: status_of(session, loop.id) == "completed",
         what="another fleet to finish the approved call")
    assert len(effects(f"solidloop:tool_call:{refund.id}", "refund")) == 1
    session.expire_all()
    refund = session.get(ToolCall, refund.id)
    assert (refund.decision, refund.is_success) == ("approved", True)


def test_a_worker_killed_right_after_a_decision_is_taken_over_and_runs_the_tool_once(
        app, session, llm, fleet, effects):
    llm.script("slow refund", {"content": "Needs you.", "tool_calls": [
        {"name": "slow_refund", "arguments": {"order": "S1", "wait": 6}}]})
    llm.script("refunded S1", {"content": "Refunded."})
    fleet("one", ttl=4.0), fleet("two", ttl=4.0)
    loop = ShopAgent.start(message="slow refund please")
    poll(session, lambda: status_of(session, loop.id) == "waiting", what="the loop to wait")
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    key = f"solidloop:tool_call:{call.id}"
    ShopAgent(loop).approve(call.id, by="staff")
    # The decision's job is claimed by a worker, which dies before the tool acts
    # (its gateway takes six seconds to answer): the call is taken over by the
    # other fleet once the lease lapses, and the refund happens once.
    holder = poll(session, lambda: session.get(ToolCall, call.id).lease_holder,
                  what="a worker to claim the approved call")
    os.killpg(os.getpgid(int(holder.rsplit(":", 1)[1])), signal.SIGKILL)
    assert effects(key, "slow_refund") == []
    poll(session, lambda: status_of(session, loop.id) == "completed",
         what="the other fleet to take the call over")
    assert len(effects(key, "slow_refund")) == 1
    session.expire_all()
    done = session.get(ToolCall, call.id)
    assert (done.decision, done.is_success) == ("approved", True)
