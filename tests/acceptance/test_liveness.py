"""Recovery by liveness, with real worker processes and nothing else running.

Workers run with a short liveness TTL (4 s where a takeover is the point, 10 s
where it must not happen: a loaded machine may starve a renewer for a second
or two, and that must make a test slower, not red) and their own reaper every
half second; no ``flask solidloop reap`` runs anywhere. Each test kills, freezes or
pauses the worker that holds a tool call and checks what the durability
contract promises: the loop finishes, each call has one canonical result and
one answer, and a tool whose worker is alive is never run a second time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from flask_solidloop.loops import wire_reads
from flask_solidloop.models import Event, Job, Loop, Message, ToolCall

from ..support.support_app import Assistant, SlowAgent, SlowSequentialAgent
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

TTL = 4.0
#: For tests where no takeover may happen: far above any renewer stall.
CALM_TTL = 10.0
#: DEBUG job lines: the tests that kill an inline step find its start line.
WORKER_CONFIG = {"SOLIDLOOP_LIVENESS_TTL": TTL, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
                 "SOLIDLOOP_LEASE_MARGIN": 1, "TEST_JOBS_LOG_LEVEL": "DEBUG"}
WORKER_CMD = [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "1",
              "--threads", "2"]


@pytest.fixture
def fleets(monkeypatch, tmp_path):
    """Start named worker fleets (each its own process group); all stopped at the end."""
    started: dict[str, subprocess.Popen] = {}

    def start(name: str, ttl: float = TTL) -> subprocess.Popen:
        config = {**WORKER_CONFIG, "SOLIDLOOP_LIVENESS_TTL": ttl}
        monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(config))
        started[name] = spawn_workers(WORKER_CMD, log=tmp_path / f"{name}.log")
        return started[name]

    yield start
    for proc in started.values():
        with_sigcont(proc)
        kill_group(proc)


def with_sigcont(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)


def slow_calls(llm, *seconds: float) -> None:
    llm.script("slow please", {"content": "sleeping", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": s}} for s in seconds]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "all slept"})


def poll(session, check, *, timeout: float = 90.0, what: str = "condition"):
    """Wait for ``check()`` to return something truthy (a guard, not a speed assertion)."""
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


def running_calls(session, loop_id: int) -> list[ToolCall]:
    return list(session.scalars(select(ToolCall).where(
        ToolCall.loop_id == loop_id, ToolCall.lease_token.is_not(None),
        ToolCall.executed_at.is_(None), ToolCall.leased_until > func.now())))


def holder_group(holder: str) -> int:
    """The process group of the worker process named ``host:pid``."""
    return os.getpgid(int(holder.rsplit(":", 1)[1]))


def assert_finished_once(session, loop_id: int, calls: int) -> list[ToolCall]:
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "completed", loop.error_message
    rows = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
    assert len(rows) == calls and all(c.is_success and c.executed_at for c in rows)
    answers = list(session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                         Message.role == "tool")))
    assert sorted(m.tool_call_id for m in answers) == sorted(c.id for c in rows)
    return rows


def test_a_killed_workers_tool_is_taken_over_with_only_workers_running(
        app, session, llm, fleets, effects):
    slow_calls(llm, 5.0)
    first, second = fleets("first"), fleets("second")
    loop = SlowAgent.start(message="slow please")
    call = poll(session, lambda: running_calls(session, loop.id), what="the tool to start")[0]
    holder = call.lease_holder
    assert holder and holder.split(":")[0]
    # Kill it mid-body: the lease is claimed a moment before the body records its start.
    poll(session, lambda: effects(call.idempotency_key), what="the tool body to start")
    os.killpg(holder_group(holder), signal.SIGKILL)
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the loop to complete after the kill")
    (done,) = assert_finished_once(session, loop.id, calls=1)
    survivor = next(p for p in (first, second) if p.poll() is None)
    assert survivor is not None
    # At least once: the body ran again elsewhere, under the same key; one result.
    starts = effects(done.idempotency_key)
    assert len(starts) == 2 and starts[0] == int(holder.rsplit(":", 1)[1])
    assert len(effects(done.idempotency_key, "end")) == 1
    assert f"in {starts[1]}" in json.dumps(done.result)


def test_a_frozen_worker_loses_its_tool_and_writes_nothing_after_it_thaws(
        app, session, llm, fleets, effects):
    slow_calls(llm, 3.0)
    fleets("first"), fleets("second")
    loop = SlowAgent.start(message="slow please")
    call = poll(session, lambda: running_calls(session, loop.id), what="the tool to start")[0]
    frozen_pid = int(call.lease_holder.rsplit(":", 1)[1])
    group = holder_group(call.lease_holder)
    os.killpg(group, signal.SIGSTOP)
    try:
        # Frozen for two TTLs: its lease lapses and another worker takes the call.
        poll(session, lambda: session.get(Loop, loop.id).status == "completed",
             what="another worker to finish the frozen worker's loop")
        time.sleep(2 * TTL)
    finally:
        os.killpg(group, signal.SIGCONT)
    # The thawed worker finishes its sleep (its external effect happens) but its
    # checkpoint finds the lease taken: nothing it wrote reached our tables.
    poll(session, lambda: len(effects(call.idempotency_key, "end")) == 2,
         what="the thawed worker's tool body to end")
    time.sleep(1.0)
    (done,) = assert_finished_once(session, loop.id, calls=1)
    assert f"in {frozen_pid}" not in json.dumps(done.result)
    assert done.lease_holder is None
    events = session.scalar(select(func.count()).select_from(Message).where(
        Message.loop_id == loop.id, Message.role == "tool"))
    assert events == 1


@pytest.mark.parametrize("resume_while_running", [False, True],
                         ids=["resumed-after-the-tools-ran", "resumed-while-they-run"])
def test_pausing_during_tools_never_runs_them_twice(
        app, session, llm, fleets, effects, resume_while_running):
    slow_calls(llm, 2.0, 2.0)
    fleets("only", ttl=CALM_TTL)
    loop = SlowAgent.start(message="slow please")
    poll(session, lambda: len(running_calls(session, loop.id)) == 2, what="both tools to run")
    assert SlowAgent(loop.id).pause()
    if not resume_while_running:
        # Both finish while the loop is paused: their results are recorded, no
        # answer is written and no turn is queued.
        poll(session, lambda: all(c.executed_at for c in session.scalars(
            select(ToolCall).where(ToolCall.loop_id == loop.id))), what="checkpoints")
        session.expire_all()
        assert session.get(Loop, loop.id).status == "paused"
        assert session.scalar(select(func.count()).select_from(Message).where(
            Message.loop_id == loop.id, Message.role == "tool")) == 0
    assert SlowAgent(loop.id).resume(from_=("paused",))
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the resumed loop to complete")
    for call in assert_finished_once(session, loop.id, calls=2):
        assert len(effects(call.idempotency_key)) == 1, "a live worker's tool ran twice"


def test_a_sequential_phase_is_not_healed_behind_its_head(app, session, llm, fleets, tmp_path):
    slow_calls(llm, 1.5, 1.5, 1.5)  # each longer than the reaper's 1 s grace
    fleets("only", ttl=CALM_TTL)
    loop = SlowSequentialAgent.start(message="slow please")
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the sequential loop to complete")
    assert_finished_once(session, loop.id, calls=3)
    jobs = list(session.scalars(select(Job).where(Job.loop_id == loop.id)))
    # Fault-free, on one thread: the delivered first turn is the only job; every
    # later call and turn was adopted by the commit before it. A heal or a
    # redirect would have enqueued a job of its own.
    assert [j.actor_name for j in jobs] == ["solidloop.llm_turn"]
    assert "reaper healed" not in Path(tmp_path / "only.log").read_text()


def test_a_worker_killed_in_an_inline_tool_job_is_taken_over(
        app, session, llm, fleets, effects, tmp_path):
    """Inline continuation (runtime/inline.py): the thread that ran the LLM turn
    ran its tool call itself, under the lease the turn's commit wrote (no job
    row). SIGKILL it there: recovery follows the call's lease, as for a
    consumer-delivered job; a second fleet finishes the loop, one answer."""
    slow_calls(llm, 5.0)
    first = fleets("first")
    loop = SlowAgent.start(message="slow please")
    call = poll(session, lambda: running_calls(session, loop.id), what="the tool to start")[0]
    log = tmp_path / "first.log"
    poll(session, lambda: effects(call.idempotency_key), what="the tool body to start")
    # The log line travels through dramatiq's master process: it may land after
    # the tool's own effect does.
    started = poll(session, lambda: [
        line for line in log.read_text().splitlines()
        if "job start tool_call" in line and f"tool_call={call.id} " in line],
        timeout=15, what="the tool's start line in the worker log")
    assert started[0].endswith(" inline"), started  # ran on the turn's thread
    os.killpg(holder_group(call.lease_holder), signal.SIGKILL)
    first.wait(10)
    fleets("second")
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the loop to complete after the kill")
    (done,) = assert_finished_once(session, loop.id, calls=1)
    assert len(effects(done.idempotency_key, "end")) == 1
    session.expire_all()
    states = {j.state for j in session.scalars(select(Job).where(Job.loop_id == loop.id))}
    assert states == {"done"}


def test_a_worker_killed_in_an_adopted_llm_turn_is_taken_over(
        app, session, llm, fleets, effects, tmp_path):
    """The tool turn's commit claimed the loop's next LLM turn for its own thread
    (adopted: a fresh generation and LLM lease, no job row). SIGKILL the worker
    while that turn's request hangs: recovery follows the loop's LLM lease (the
    reaper's expired_llm case), a second fleet finishes the loop, and the dead
    turn's shell never enters the history."""
    slow_calls(llm, 1.0)
    first = fleets("first")
    loop = SlowAgent.start(message="slow please")
    call = poll(session, lambda: running_calls(session, loop.id), what="the tool to start")[0]
    poll(session, lambda: effects(call.idempotency_key), what="the tool body to start")
    requests_before = len([r for r in llm.requests if r.method == "POST"])
    llm.fault_next("slow_prefill", seconds=60)  # the next request: the adopted turn's
    poll(session, lambda: len([r for r in llm.requests if r.method == "POST"]) > requests_before,
         what="the adopted turn's request")
    session.expire_all()
    held = session.get(Loop, loop.id)
    assert held.status == "running" and held.lease_expires_at is not None, held.status
    assert session.get(ToolCall, call.id).response_message_id is not None
    session.rollback()
    log = tmp_path / "first.log"

    def llm_starts():
        lines = [line for line in log.read_text().splitlines()
                 if "job start llm_turn" in line and f"loop={loop.id} " in line]
        return lines if len(lines) >= 2 else None

    started = poll(session, llm_starts, timeout=15,
                   what="both LLM turns' start lines in the worker log")
    assert len(started) == 2 and started[1].endswith(" inline"), started
    os.killpg(holder_group(held.lease_holder), signal.SIGKILL)
    first.wait(10)
    fleets("second")
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the loop to complete after the kill")
    assert_finished_once(session, loop.id, calls=1)
    assert len(effects(call.idempotency_key, "end")) == 1  # the tool did not run again
    session.expire_all()
    assistants = list(session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.role == "assistant").order_by(Message.id)))
    visible = [m for m in assistants if not m.is_hidden]
    assert [m.content for m in visible] == ["sleeping", "all slept"]
    # The dead turn's shell: failed and hidden, never completed.
    assert [m.status for m in assistants if m.is_hidden] == ["failed"]
    jobs = list(session.scalars(select(Job).where(Job.loop_id == loop.id)))
    assert {j.state for j in jobs} == {"done"}
    assert sorted(j.actor_name for j in jobs) == ["solidloop.llm_turn"] * 2  # first + heal


def test_a_worker_killed_mid_request_leaves_its_request_unanswered(app, session, llm, fleets):
    """SIGKILL the worker while its LLM request hangs. The request's event, on
    record before it was sent, shows in flight while the worker's lease holds,
    and as unanswered once it lapsed, with no worker up (no reaper ran: the
    display alone tells). A second fleet finishes the loop with a request of
    its own, on record and completed; the dead one's row stays unanswered."""
    llm.script("hang on", {"content": "answered"})
    llm.fault_next("slow_prefill", seconds=60)  # the first request hangs
    first = fleets("first")
    loop = Assistant.start(message="hang on")
    flying = poll(session, lambda: wire_reads.request_in_flight(session, loop.id),
                  what="the request in flight")
    # On record before it is sent: the kill must also wait until the request
    # reached the provider (and drew the fault that makes it hang).
    poll(session, lambda: [r for r in llm.requests if r.method == "POST"],
         what="the request at the provider")
    held = session.get(Loop, loop.id)
    assert held.status == "running" and held.lease_holder
    holder = held.lease_holder
    session.rollback()
    os.killpg(holder_group(holder), signal.SIGKILL)
    first.wait(10)
    left = poll(session, lambda: [r for r in wire_reads.pending_requests(session, loop.id)
                                  if not r.in_flight],
                timeout=30, what="the dead worker's request shown as not in flight")
    assert [r.event_id for r in left] == [flying.event_id]
    fleets("second")
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the loop to complete after the kill")
    session.expire_all()
    events = list(session.scalars(select(Event).where(
        Event.loop_id == loop.id, Event.kind == "llm_request").order_by(Event.id)))
    dead, answered = events
    assert dead.id == flying.event_id
    assert dead.duration_ms is None and dead.status_code is None  # nothing wrote it after
    assert answered.status_code == 200 and answered.duration_ms is not None
    assert answered.payload["response"]["body"]["choices"][0]["message"]["content"] \
        == "answered"
    (unanswered,) = wire_reads.pending_requests(session, loop.id)
    assert unanswered.event_id == dead.id and unanswered.state == "unanswered"
    session.rollback()
    shown = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop.id)]).output
    assert "1 LLM request(s) unanswered" in shown and "in flight" not in shown
