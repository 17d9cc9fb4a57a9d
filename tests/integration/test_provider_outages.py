"""A provider outage defers the turn, never fails it, until it outlasts
SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT (docs/decisions/0018-no-fault-ends-a-loop.md):
the turn goes back to the queue due later, holding nothing, the outage kept
on the loop for status and the admin. Against the real LLM emulator."""

from __future__ import annotations

import socket

from sqlalchemy import func, select, text, update

from flask_solidloop.models import Event, Job, Loop
from flask_solidloop.testing import LLMEmulator, drain

from ..support.support_app import LLM_URL_ENV, Assistant


def loop_of(session, loop_id):
    session.expire_all()
    row = session.get(Loop, loop_id)
    session.rollback()
    return row


def make_due(session):
    session.execute(update(Job).where(Job.state == "queued").values(eta=func.now()))
    session.commit()


def test_a_provider_answering_503_past_its_retries_defers_the_turn(app, session, llm):
    llm.fail_next(503, body={"error": {"message": "overloaded"}}, times=3)  # 1 + 2 retries
    llm.script("hello", {"content": "back again"})
    loop = Assistant.start(message="hello")
    drain(app)
    held = loop_of(session, loop.id)
    assert held.status == "queued" and held.error_message is None
    assert held.provider_wait_since is not None and held.provider_wait_attempts == 1
    assert "503" in held.provider_wait_error and held.execution_token is None
    assert held.lease_expires_at is None  # no lease held while it waits
    (job,) = session.scalars(select(Job).where(Job.loop_id == loop.id,
                                               Job.state == "queued")).all()
    delay = session.scalar(select(job.eta - func.now()).select_from(Job).where(
        Job.id == job.id)).total_seconds()
    assert 3.0 < delay <= 7.0  # the first wait: 5 s, plus up to a quarter
    session.rollback()
    # The deferred attempt's wire record is kept, with its three attempts.
    event = session.scalars(select(Event).where(Event.loop_id == loop.id,
                                                Event.kind == "llm_request")).one()
    assert len(event.payload["attempts"]) == 3
    runner = app.test_cli_runner()
    status = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert "waiting for its provider since" in status.output and "1 deferred turn" \
        in status.output
    listed = runner.invoke(args=["solidloop", "list"])
    assert "waiting for its provider: ProviderHTTPError: HTTP 503" in listed.output
    assert drain(app) == 0  # not due yet: no thread spends the wait
    make_due(session)
    drain(app)
    done = loop_of(session, loop.id)
    assert done.status == "completed"
    assert (done.provider_wait_since, done.provider_wait_attempts,
            done.provider_wait_error) == (None, 0, None)


def test_429_defers_too_and_a_400_still_fails(app, session, llm):
    llm.fail_next(429, body={"error": {"message": "slow down"}}, times=3)
    limited = Assistant.start(message="limited")
    drain(app)
    assert loop_of(session, limited.id).provider_wait_attempts == 1
    llm.fail_next(400, body={"error": {"message": "bad request"}})
    broken = Assistant.start(message="broken")
    drain(app)
    failed = loop_of(session, broken.id)
    assert failed.status == "failed" and failed.provider_wait_since is None


def test_an_outage_past_its_max_wait_fails_the_loop_saying_how_long(app, session, llm):
    llm.fail_next(503, times=6)
    loop = Assistant.start(message="doomed")
    drain(app)
    assert loop_of(session, loop.id).provider_wait_attempts == 1
    # As if the outage had begun 20 minutes ago (SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT
    # is 15 by default): the next deferral fails the loop instead.
    session.execute(text("UPDATE solidloop_loops SET provider_wait_since = "
                         "now() - interval '20 minutes' WHERE id = :i"), {"i": loop.id})
    session.commit()
    make_due(session)
    drain(app)
    failed = loop_of(session, loop.id)
    assert failed.status == "failed"
    assert "the provider stayed out for 20.0 min (1 deferred turns)" in failed.error_message
    assert "SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT (900s)" in failed.error_message
    assert "HTTP 503" in failed.error_message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_provider_that_is_down_then_back_defers_then_completes(
        app, session, monkeypatch):
    port = free_port()
    monkeypatch.setenv(LLM_URL_ENV, f"http://127.0.0.1:{port}")  # nothing listens yet
    loop = Assistant.start(message="anyone there?")
    drain(app)
    held = loop_of(session, loop.id)
    assert held.status == "queued" and held.provider_wait_attempts == 1
    assert "ProviderUnavailableError: cannot connect" in held.provider_wait_error
    make_due(session)
    drain(app)
    assert loop_of(session, loop.id).provider_wait_attempts == 2
    server = LLMEmulator(port=port).start()
    try:
        server.script("anyone there?", {"content": "here now"})
        make_due(session)
        drain(app)
    finally:
        server.stop()
    done = loop_of(session, loop.id)
    assert done.status == "completed" and done.provider_wait_since is None


def test_a_resume_clears_the_outage(app, session, llm):
    llm.fail_next(503, times=3)
    loop = Assistant.start(message="pause me")
    drain(app)
    assert Assistant(loop.id).pause()
    llm.script("pause me", {"content": "ok"})
    assert Assistant(loop.id).resume(from_=("paused",))
    assert loop_of(session, loop.id).provider_wait_since is None
    drain(app)
    assert loop_of(session, loop.id).status == "completed"


def test_tool_calls_sharing_an_id_are_refused_never_run(app, session, llm):
    from flask_solidloop.models import ToolCall

    from ..support.support_app import SIDE_EFFECTS

    llm.script("split", {"tool_calls": [
        {"id": "toolu_same", "name": "add", "arguments": {"a": 1, "b": 1}},
        {"id": "toolu_same", "name": "add", "arguments": {"a": 2, "b": 2}}]})
    loop = Assistant.start(message="split call")
    drain(app)
    failed = loop_of(session, loop.id)
    assert failed.status == "failed"
    assert "2 tool calls of one answer share the id 'toolu_same'" in failed.error_message
    assert session.scalars(select(ToolCall)).all() == [] and SIDE_EFFECTS == []


def test_a_connection_that_breaks_mid_response_defers_three_times_then_fails(
        app, session, llm):
    """A provider restart mid-response is an outage; one that always breaks (a
    proxy cutting long answers) costs three more requests, not fifteen minutes."""
    llm.fault_next("disconnect_mid_stream", times=4)
    llm.script("cut", {"content": "an answer that never arrives whole"})
    loop = Assistant.start(message="cut")
    drain(app)
    for attempt in (1, 2, 3):
        held = loop_of(session, loop.id)
        assert held.status == "queued" and held.provider_wait_attempts == attempt
        assert "ProviderConnectionLostError: the connection to " in held.provider_wait_error
        make_due(session)
        drain(app)
    failed = loop_of(session, loop.id)
    assert failed.status == "failed"
    assert failed.error_message.startswith(
        "the connection to the provider broke mid-response again after 3 deferred turns")
    assert len(llm.requests) == 4


def test_a_connection_that_broke_once_completes_on_the_deferred_turn(app, session, llm):
    llm.fault_next("disconnect_mid_stream")
    llm.script("blip", {"content": "whole this time"})
    loop = Assistant.start(message="blip")
    drain(app)
    assert loop_of(session, loop.id).provider_wait_attempts == 1
    make_due(session)
    drain(app)
    done = loop_of(session, loop.id)
    assert done.status == "completed" and done.provider_wait_since is None
