"""The host's commands (loops/store/commands.py, through the Agent facade and
loops/control.py): pause, stop, force stop, freeze, unfreeze, observe and
resume, each one locked transaction; and what a turn of the generation they
rotated away can still write (nothing)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from flask_solidloop import RESUMABLE_STATUSES
from flask_solidloop.models import Job, Loop, Message, ToolCall
from flask_solidloop.testing import drain as run

from ..support.support_app import SIDE_EFFECTS, Assistant, solidloop
from .loop_states import running_loop, tool_phase


def test_resume_rejects_statuses_that_can_never_resume(app):
    loop = Assistant.start(message="hi")
    for status in ("running", "queued"):
        with pytest.raises(ValueError, match="can never be resumed"):
            Assistant(loop).resume(from_=(status,))
    assert set(RESUMABLE_STATUSES) == {"init", "paused", "failed", "completed"}


def test_pause_resume_and_stop(app, session, llm, drain):
    llm.script("hi", {"content": "hello"})
    loop = Assistant.start(message="hi")
    agent = Assistant(loop)
    assert agent.pause() is True
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert agent.pause() is False  # not live any more
    drain()  # the old generation's job is a no-op
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert agent.resume(from_=("failed",)) is False
    assert agent.resume(from_=("paused", "failed")) is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    # narrowing from_ leaves finished runs alone
    assert agent.resume(from_=("paused", "failed")) is False
    # resuming a completed loop with a new message continues the conversation
    llm.script("again", {"content": "hello again"})
    assert agent.resume(message="again") is True
    drain()
    session.expire_all()
    contents = [m.content for m in session.scalars(
        select(Message).where(Message.loop_id == loop.id).order_by(Message.id))]
    assert contents[-2:] == ["again", "hello again"]
    assert agent.stop(reason="enough") is False  # completed is terminal
    llm.script("more", {"content": "x"})
    agent.resume(message="more")
    assert agent.stop(reason="enough") is True
    session.expire_all()
    stopped = session.get(Loop, loop.id)
    assert (stopped.status, stopped.error_message) == ("failed", "enough")


def test_resume_in_tool_phase_revokes_leases_and_reenqueues_tools(app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("tools", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})
    loop = Assistant.start(message="tools")
    run(app, queues=("solidloop_llm",))
    call = session.scalars(select(ToolCall)).one()
    # A dead worker's lease: it stopped being renewed, so it has lapsed. (A live
    # lease is left to its worker: see test_resume_leaves_a_running_tool_to_its_worker.)
    call.lease_token = __import__("uuid").uuid4()
    call.leased_until = __import__("datetime").datetime(2000, 1, 1, tzinfo=__import__(
        "datetime").timezone.utc)
    session.commit()
    Assistant(loop).pause()
    assert Assistant(loop).resume(from_=("paused",)) is True
    session.expire_all()
    call = session.get(ToolCall, call.id)
    assert call.lease_token is None and call.leased_until is None
    assert session.get(Loop, loop.id).status == "running"
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert len(list(session.scalars(select(Message).where(Message.role == "tool")))) == 1


def test_create_leaves_an_init_loop_that_resume_starts(app, session, llm, drain):
    llm.script("later", {"content": "now"})
    loop = Assistant.create(message="later")
    assert loop.status == "init"
    assert list(session.scalars(select(Job))) == []
    assert drain() == 0
    assert Assistant(loop).resume(from_=("init",)) is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


def test_limits_apply_per_run_so_resume_gets_a_fresh_budget(app, session, llm, drain):
    class OneStep(Assistant):
        max_steps = 1

    solidloop.agent("one_step")(OneStep)
    llm.script("again", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]})
    loop = OneStep.start(message="again and again")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"
    assert session.get(Loop, loop.id).step_count == 1
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "finally"})
    assert OneStep(loop).resume(from_=("paused",)) is True
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "completed", loop.error_message
    assert loop.step_count == 2


def test_resume_with_a_message_answers_pending_tool_calls_first(app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("pending", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("changed my mind", {"content": "ok, new plan"})
    loop = Assistant.start(message="pending work")
    run(app, queues=("solidloop_llm",))
    Assistant(loop).pause()
    assert Assistant(loop).resume(message="changed my mind") is True
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    roles = [m.role for m in session.scalars(
        select(Message).where(Message.loop_id == loop.id, Message.is_hidden.is_(False))
        .order_by(Message.id))]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant"]
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False and call.error_kind == "cancelled"
    sent = llm.requests[-1].json["messages"]
    assert [m["role"] for m in sent[-3:]] == ["assistant", "tool", "user"]
    assert "was not run" in sent[-2]["content"]


def test_resume_with_a_message_keeps_the_result_of_a_call_that_already_ran(
        app, session, llm, drain):
    from flask_solidloop.testing import drain as run

    llm.script("ran", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]})
    llm.script("new topic", {"content": "ok"})
    loop = Assistant.start(message="ran already")
    run(app, queues=("solidloop_llm",))
    call = session.scalars(select(ToolCall)).one()
    # the tool ran and checkpointed; its answer was never written (worker died)
    call.executed_at = __import__("datetime").datetime.now(__import__("datetime").UTC)
    call.is_success = True
    call.result = {"content": [{"type": "text", "text": "4"}], "isError": False}
    session.commit()
    Assistant(loop).pause()
    assert Assistant(loop).resume(message="new topic") is True
    drain()
    session.expire_all()
    answer = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert answer.content == "4"
    assert session.get(Loop, loop.id).status == "completed"


def test_force_stop_cancels_queued_jobs_and_revokes_tool_leases(app, state, session, llm):
    loop_id = tool_phase(app, session, llm, calls=2)
    session.execute(update(ToolCall).values(lease_token=uuid.uuid4(),
                                            leased_until=func.now() + timedelta(hours=1)))
    session.commit()
    assert Assistant(loop_id).force_stop(reason="operator") is True
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.error_message) == ("failed", "force stopped: operator")
    assert {c.lease_token for c in session.scalars(select(ToolCall))} == {None}
    assert session.scalar(select(func.count()).select_from(Job)
                          .where(Job.state == "queued")) == 0
    run(app)
    assert SIDE_EFFECTS == []
    assert Assistant(loop_id).force_stop() is False


def test_freeze_blocks_resume_until_unfrozen(app, session, llm):
    llm.script("frozen", {"content": "thawed"})
    loop = Assistant.start(message="frozen")
    agent = Assistant(loop)
    assert agent.freeze() is True
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert (row.status, row.frozen) == ("paused", True)
    assert agent.freeze() is False
    assert agent.resume() is False
    assert agent.unfreeze() is True
    assert agent.resume() is True
    run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


def test_observe_toggles_the_flag(app, session):
    loop = Assistant.start(message="watch me")
    assert Assistant(loop).observe() is True
    assert Assistant(loop).observe() is False  # already observed
    session.expire_all()
    assert session.get(Loop, loop.id).observed is True
    assert Assistant(loop).observe(False) is True


def test_stale_generation_cannot_complete_after_force_stop(app, state, session):
    from flask_solidloop.loops import store

    loop_id, token = running_loop(session)
    Assistant(loop_id).force_stop()
    assert not store.fenced_transition(session, loop_id, token, from_="running",
                                       to="completed")
    assert session.execute(text("SELECT status FROM solidloop_loops WHERE id = :i"),
                           {"i": loop_id}).scalar() == "failed"
