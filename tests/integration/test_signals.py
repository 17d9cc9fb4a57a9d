"""Signals are sent after the commit that made the change, in the process that
made it, with the app as sender (issue 13)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from flask_solidloop import signals

from ..support.support_app import Assistant


@pytest.fixture
def received(app):
    """Every signal the app sent, with what a fresh connection saw at that moment."""
    got: list[tuple[str, dict, str | None]] = []
    engine = app.extensions["sqlalchemy"].engine

    def receiver_for(name):
        def receive(sender, **data):
            assert sender is app
            # Committed: another connection already sees the change.
            with engine.connect() as conn:
                status = conn.execute(text("SELECT status FROM solidloop_loops WHERE id = :i"),
                                      {"i": data["loop_id"]}).scalar()
            got.append((name, data, status))
        return receive

    receivers = {name: receiver_for(name) for name in
                 ("loop_started", "loop_completed", "loop_failed", "loop_paused",
                  "tool_call_answered")}
    for name, fn in receivers.items():
        getattr(signals, name).connect(fn, sender=app)
    yield got
    for name, fn in receivers.items():
        getattr(signals, name).disconnect(fn, sender=app)


def test_a_loop_sends_started_answered_completed_after_each_commit(llm, drain, received):
    llm.script("sig", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}]})
    llm.script("4", {"content": "four"})
    loop = Assistant.start(message="sig please")
    drain()
    names = [name for name, _, _ in received]
    assert names == ["loop_started", "tool_call_answered", "loop_completed"]
    started, answered, completed = received
    assert started[1] == {"loop_id": loop.id, "agent": "assistant"} and started[2] == "queued"
    assert answered[1]["is_error"] is False and answered[1]["tool_call_id"]
    assert completed[2] == "completed"


def test_pause_and_stop_send_paused_and_failed(session, received):
    loop = Assistant.start(message="x")
    Assistant(loop).pause()
    Assistant(loop).stop(reason="enough")
    assert [(n, s) for n, _, s in received] == [
        ("loop_started", "queued"), ("loop_paused", "paused"), ("loop_failed", "failed")]
    assert received[2][1]["error"] == "enough"


def test_nothing_is_sent_for_a_rolled_back_start(session, received):
    Assistant.start(message="never", commit=False)
    session.rollback()
    session.commit()
    assert received == []


def test_a_raising_receiver_is_logged_not_raised(app, llm, drain, caplog):
    def broken(sender, **data):
        raise RuntimeError("receiver bug")

    signals.loop_completed.connect(broken, sender=app)
    try:
        llm.script("plain", {"content": "done"})
        loop = Assistant.start(message="plain please")
        drain()
    finally:
        signals.loop_completed.disconnect(broken, sender=app)
    session = app.extensions["sqlalchemy"].session
    session.expire_all()
    assert session.scalar(text("SELECT status FROM solidloop_loops WHERE id = :i"),
                          {"i": loop.id}) == "completed"
    assert "a receiver of solidloop-loop-completed raised" in caplog.text
