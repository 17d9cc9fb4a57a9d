"""An LLM turn's hard limits (docs/decisions/0018-no-fault-ends-a-loop.md, item 3):
``turn_timeout`` bounds the request's wall time, its stream and retries
included, and ``max_output_chars`` the answer's length. Past either, the
request is ended, what arrived is kept, and the turn fails with
TurnLimitError, never sent (and billed) a second time. Against the real LLM
emulator over HTTP."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import Agent, AgentDefinitionError
from flask_solidloop.models import Event, Loop, Message

from ..support.support_app import llm_settings, solidloop


@solidloop.agent("limited_stream")
class LimitedStream(Agent):
    system_prompt = "You talk."
    streaming = True
    turn_timeout = 1.5
    max_output_chars = None

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("short_answers")
class ShortAnswers(Agent):
    system_prompt = "You answer briefly."
    streaming = True
    max_output_chars = 300

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("limited_plain")
class LimitedPlain(Agent):
    system_prompt = "You talk."
    turn_timeout = 1.0
    max_output_chars = 40

    def llm(self) -> dict:
        return llm_settings()


def finished(session, loop_id):
    session.expire_all()
    loop = session.get(Loop, loop_id)
    session.rollback()
    return loop


def request_event(session, loop_id):
    return session.scalars(select(Event).where(Event.loop_id == loop_id,
                                               Event.kind == "llm_request")).one()


def test_a_stream_that_never_ends_stops_at_turn_timeout_with_one_request(
        app, session, llm, drain, monkeypatch):
    from flask_solidloop.llm import client

    # The turn's deadline and the attempt's start, as the send path saw them.
    seen: dict = {}
    starting_now = client.TurnLimits.starting_now.__func__
    post_init = client.Attempt.__post_init__

    def limits(cls, *args):
        seen["limits"] = starting_now(cls, *args)
        return seen["limits"]

    def attempt(self):
        post_init(self)
        seen["attempt_started"] = self.started

    monkeypatch.setattr(client.TurnLimits, "starting_now", classmethod(limits))
    monkeypatch.setattr(client.Attempt, "__post_init__", attempt)
    llm.script("go on", {"content": "and on "})
    llm.fault_next("endless_stream", seconds=0.02)
    loop = LimitedStream.start(message="go on")
    drain()
    failed = finished(session, loop.id)
    assert failed.status == "failed"
    assert failed.error_message.startswith("TurnLimitError: turn_timeout: the request ran "
                                           "past the turn's 1.5s")
    assert len(llm.requests) == 1  # never sent (and billed) twice
    # What arrived is kept: the wire log's summary, and the hidden partial text.
    event = request_event(session, loop.id)
    (attempt,) = event.payload["attempts"]
    assert attempt["error"].startswith("turn_timeout: ended after ") and attempt["events"] > 5
    # Ended at the deadline (less the send path's 50 ms margin), not before.
    ended = seen["attempt_started"] + attempt["duration_ms"] / 1000
    assert ended >= seen["limits"].deadline - 0.05 - 0.001
    summary = event.payload["response"]["body"]["stream_summary"]
    assert summary["ended_by"] == "turn_timeout" and summary["output_chars"] > 0
    shell = session.scalars(select(Message).where(Message.loop_id == loop.id,
                                                  Message.role == "assistant")).one()
    assert shell.is_hidden and shell.status == "failed"
    assert shell.content.startswith("andandand")  # the first chunk, over and over


def test_an_answer_past_max_output_chars_is_cut_there(app, session, llm, drain):
    llm.script("ramble", {"content": "blah "})
    llm.fault_next("endless_stream", seconds=0.001)
    loop = ShortAnswers.start(message="ramble")
    drain()
    failed = finished(session, loop.id)
    assert failed.status == "failed"
    assert failed.error_message.startswith("TurnLimitError: max_output_chars: the answer "
                                           "reached ")
    assert "past the turn's 300" in failed.error_message
    assert len(llm.requests) == 1
    summary = request_event(session, loop.id).payload["response"]["body"]["stream_summary"]
    assert summary["ended_by"] == "max_output_chars"
    assert 300 < summary["output_chars"] <= 300 + len("blah ")


def test_a_slow_whole_answer_stops_at_turn_timeout(app, session, llm, drain):
    llm.script("slow", {"content": "late"})
    llm.fault_next("slow_prefill", seconds=4)
    loop = LimitedPlain.start(message="slow")
    drain()
    failed = finished(session, loop.id)
    assert failed.error_message.startswith("TurnLimitError: turn_timeout")
    assert len(llm.requests) == 1  # a read timeout is never repeated


def test_a_whole_answer_past_max_output_chars_is_not_taken(app, session, llm, drain):
    llm.script("long", {"content": "x" * 41})
    loop = LimitedPlain.start(message="long")
    drain()
    failed = finished(session, loop.id)
    assert failed.error_message.startswith("TurnLimitError: max_output_chars: the answer "
                                           "reached 41 characters, past the turn's 40")
    visible = session.scalars(select(Message).where(Message.loop_id == loop.id,
                                                    Message.is_hidden.is_(False))).all()
    assert [m.role for m in visible] == ["system", "user"]  # the answer never joined


def test_within_the_limits_a_turn_is_untouched(app, session, llm, drain):
    llm.script("short", {"content": "x" * 40})
    loop = LimitedPlain.start(message="short")
    drain()
    assert finished(session, loop.id).status == "completed"


@pytest.mark.parametrize(("option", "value", "says"), [
    ("turn_timeout", 0, "turn_timeout must be a positive number of seconds or None"),
    ("turn_timeout", "10", "turn_timeout must be a positive number of seconds or None"),
    ("max_output_chars", 1.5, "max_output_chars must be a positive int or None"),
])
def test_a_bad_limit_is_refused_at_start(app, option, value, says):
    bad = type(f"Bad_{option}_{value!s}", (Agent,), {option: value, "llm": llm_settings()})
    solidloop.agent(f"bad_{option}_{str(value).replace('.', '_')}")(bad)
    with pytest.raises(AgentDefinitionError, match=says):
        bad.start(message="x")
