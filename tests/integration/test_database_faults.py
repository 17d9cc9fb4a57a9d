"""A dropped database connection at each point of a loop's steps never ends the
loop (docs/decisions/0018-no-fault-ends-a-loop.md): the step is retried in
place, handed back, retried by its job, or left to its lease and the reaper,
and the loop completes with every call answered once. Each test drops the
real connection (tests/support/db_faults.py) under one statement."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select, text, update

from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Job, Loop, Message, ToolCall
from flask_solidloop.testing import drain

from ..support.db_faults import dropping_connections
from ..support.support_app import Assistant, SequentialAssistant


@pytest.fixture
def dropper(database_url):
    with dropping_connections(database_url) as dropper:
        yield dropper


def settle(app, session, loop_id: int, *, timeout: float = 60.0) -> str:
    """Run the loop to an end the way a fleet would: due jobs, then jobs put off
    (a retry's backoff, a hand-back's delay) made due, then, with nothing left
    to run, every lease lapsed and the reaper run, as the clock would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        drain(app, raise_errors=False)
        session.expire_all()
        status = session.get(Loop, loop_id).status
        if status in ("completed", "failed", "paused"):
            session.rollback()
            return status
        session.execute(update(Job).where(Job.state == "queued").values(eta=func.now()))
        if not session.scalar(select(func.count()).select_from(Job).where(
                Job.state == "queued")):
            session.execute(text(
                "UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 hour' "
                "WHERE lease_expires_at IS NOT NULL"))
            session.execute(text(
                "UPDATE solidloop_tool_calls SET leased_until = now() - interval '1 hour', "
                "updated_at = now() - interval '1 hour' WHERE response_message_id IS NULL"))
            session.commit()
            reap(app.extensions["solidloop"])
        session.commit()
    pytest.fail(f"loop {loop_id} did not end within {timeout}s")


def assert_answered_once(session, loop_id: int, calls: int) -> None:
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "completed", loop.error_message
    rows = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
    assert len(rows) == calls and all(c.response_message_id for c in rows)
    answers = [m.tool_call_id for m in session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "tool"))]
    assert sorted(answers) == sorted(c.id for c in rows)


def three_sums(llm):
    llm.script("three sums", {"tool_calls": [
        {"name": "add", "arguments": {"a": n, "b": n}} for n in (1, 2, 3)]})
    llm.script(lambda body: sum(m["role"] == "tool" for m in body["messages"]) == 3,
               {"content": "2, 4 and 6"})


def test_a_dropped_connection_at_a_tool_claim_retries_the_job(app, session, llm, dropper):
    three_sums(llm)
    loop = Assistant.start(message="three sums please")
    dropper.arm(r"UPDATE solidloop_tool_calls SET lease_token = coalesce")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=3)


def test_a_dropped_connection_at_a_sequential_claims_read_retries_the_job(
        app, session, llm, dropper):
    three_sums(llm)
    loop = SequentialAssistant.start(message="three sums please")
    # The sequential claim first reads the line (an ORM query: SQLAlchemy sees
    # the disconnect and hands the session a fresh connection).
    dropper.arm(r"FROM solidloop_tool_calls \nWHERE solidloop_tool_calls.message_id")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=3)


def one_sum(llm, message="one sum"):
    llm.script(message, {"tool_calls": [{"name": "add", "arguments": {"a": 20, "b": 22}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "42"})


def test_a_dropped_connection_at_a_delivered_turns_first_read_retries_the_job(
        app, session, llm, dropper):
    one_sum(llm)
    loop = Assistant.start(message="one sum")
    dropper.arm(r"SELECT \* FROM solidloop_loops WHERE id = ")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=1)


def test_a_dropped_connection_at_an_llm_claim_retries_the_job(app, session, llm, dropper):
    one_sum(llm)
    loop = Assistant.start(message="one sum")
    dropper.arm(r"^WITH seen AS \(SELECT xmin")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=1)


def test_a_dropped_connection_at_the_turns_end_is_retried_in_place(
        app, session, llm, dropper):
    one_sum(llm)
    loop = Assistant.start(message="one sum")
    dropper.arm(r"^WITH fenced AS \(UPDATE solidloop_loops", times=2)
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 2  # the first turn's end, then its first retry
    assert_answered_once(session, loop.id, calls=1)
    # Retried in place: the paid answer was recorded, no second request sent.
    assert len([r for r in llm.requests if r.method == "POST"]) == 2


def test_a_dropped_connection_at_a_tool_jobs_first_read_retries_the_job(
        app, session, llm, dropper):
    one_sum(llm)
    loop = Assistant.start(message="one sum")
    dropper.arm(r"FROM solidloop_tool_calls JOIN solidloop_loops")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=1)


def test_a_dropped_connection_at_a_tool_outcome_is_retried_in_place(
        app, session, llm, dropper):
    from ..support.support_app import SIDE_EFFECTS

    three_sums(llm)
    loop = Assistant.start(message="three sums please")
    dropper.arm(r"^WITH locked AS \(SELECT l.status")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert_answered_once(session, loop.id, calls=3)
    assert len(SIDE_EFFECTS) == 3  # no tool ran twice


def test_dropped_connections_at_a_checkpoint_and_at_its_answer(app, session, llm, dropper):
    from ..support.support_app import SIDE_EFFECTS, AuditedAssistant

    one_sum(llm)
    loop = AuditedAssistant.start(message="one sum")
    # The checkpoint (the result alone), then the answer (a statement of its own).
    dropper.arm(r"^WITH locked AS \(SELECT l.status", times=2, after=0)
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 2
    assert_answered_once(session, loop.id, calls=1)
    assert len(SIDE_EFFECTS) == 1


def test_a_dropped_connection_after_the_claim_before_the_tool_hands_the_call_back(
        app, session, llm, dropper, caplog):
    from ..support.support_app import SIDE_EFFECTS, AuditedAssistant

    one_sum(llm)
    loop = AuditedAssistant.start(message="one sum")
    dropper.arm(r"SELECT solidloop_tool_calls.id \nFROM solidloop_tool_calls \nWHERE "
                r"solidloop_tool_calls.loop_id")
    with caplog.at_level("WARNING", logger="flask_solidloop.turns"):
        assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert any("before the tool ran" in r.getMessage() and "queued again in 2s"
               in r.getMessage() for r in caplog.records)
    assert_answered_once(session, loop.id, calls=1)
    assert len(SIDE_EFFECTS) == 1


def test_a_dropped_connection_at_the_shell_hands_the_turn_back(app, session, llm, dropper):
    from ..support.support_app import BatchAgent

    llm.script("batch", {"content": "done"})
    loop = BatchAgent.start(message="batch please")
    dropper.arm(r"^INSERT INTO solidloop_messages \(loop_id, role, content, status, is_hidden\) "
                r"SELECT id")
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    assert len([r for r in llm.requests if r.method == "POST"]) == 1


def test_a_dropped_connection_at_a_partial_write_skips_that_partial(
        app, session, llm, dropper):
    from flask_solidloop.loops import control

    from ..support.admin_app import LiveAgent

    words = " ".join(f"w{i:02d}" for i in range(40))
    llm.fault_next("slow_stream", seconds=0.05)
    llm.script("speak", {"content": words})
    loop = LiveAgent.create(message="speak")
    state = app.extensions["solidloop"]
    control.observe(state, loop.id)  # deltas at SOLIDLOOP_STREAM_MAX_HZ
    control.resume(state, loop.id, from_="init")
    dropper.arm(r"^SELECT solidloop_stream_delta\(loop_id", times=1)
    assert settle(app, session, loop.id) == "completed"
    assert len(dropper.dropped) == 1
    session.expire_all()
    answer = session.scalars(select(Message).where(Message.loop_id == loop.id,
                                                   Message.role == "assistant")).one()
    assert answer.content == words  # one request, its whole text
    assert len([r for r in llm.requests if r.method == "POST"]) == 1


def test_renewals_that_fail_briefly_lose_no_turn(app, session, llm, dropper):
    state = app.extensions["solidloop"]

    def renew_through_a_blip(body):
        # The renewer's tick meets a dropped connection, and so does its
        # immediate retry: the lease was renewed a moment ago, so it still holds.
        dropper.arm(r"^\nUPDATE solidloop_loops AS l\n   SET lease_expires_at", times=2)
        state.renewer().renew_once()
        assert len(dropper.dropped) == 2
        return {"content": "kept"}

    llm.script("renew", renew_through_a_blip)
    loop = Assistant.start(message="renew please")
    assert settle(app, session, loop.id) == "completed"
    assert len([r for r in llm.requests if r.method == "POST"]) == 1
    session.expire_all()
    assert session.scalars(select(Message.content).where(
        Message.loop_id == loop.id, Message.role == "assistant")).all() == ["kept"]


def test_a_dropped_connection_as_a_turn_fails_is_retried_and_the_failure_recorded(
        app, session, llm, dropper):
    llm.fail_next(400, body={"error": {"message": "bad request"}})
    loop = Assistant.start(message="this one fails")
    dropper.arm(r"^WITH ended AS \(UPDATE solidloop_loops")
    assert settle(app, session, loop.id) == "failed"
    assert len(dropper.dropped) == 1
    session.expire_all()
    assert "400" in session.get(Loop, loop.id).error_message
