"""Forks and replays run by real ``flask solidloop worker`` processes
(docs/decisions/0039-forks.md): a fork at a tool result sends the request the
original sent next, and a replay whose fleet is SIGKILLed mid-turn is taken
over by another fleet and still runs against its own model."""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import select

from flask_solidloop.loops import control
from flask_solidloop.models import Loop, Message
from flask_solidloop.state import get_state

from ..support.support_app import Assistant, StreamingAssistant
from .test_approvals_workers import fleet, poll  # noqa: F401 - fleet is a fixture
from .test_conversations_workers import (  # noqa: F401 - chat_fleet is a fixture
    STORY,
    chat_fleet,
    settled,
    streaming_shell,
)
from .test_e2e_workers import kill_group

pytestmark = pytest.mark.e2e


def visible(session, loop_id) -> list[Message]:
    session.expire_all()
    rows = list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.is_hidden.is_(False)).order_by(Message.id)))
    session.rollback()
    return rows


def chat_requests(llm) -> list:
    return [r for r in llm.requests if r.json and "messages" in r.json]


def test_a_fork_on_workers_sends_the_request_the_original_sent_next(
        app, session, llm, fleet):  # noqa: F811 - the imported fixture
    llm.script("add 2 and 3, and 4 and 5", {"content": "Adding.", "tool_calls": [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "add", "arguments": {"a": 4, "b": 5}}]})
    llm.script(lambda request: request["messages"][-1]["role"] == "tool",
               {"content": "5 and 9."})
    fleet("one")
    loop_id = Assistant.start(message="add 2 and 3, and 4 and 5").id
    poll(session, lambda: settled(session, loop_id), what="the original to complete")
    original = chat_requests(llm)
    assert len(original) == 2
    first_result = visible(session, loop_id)[3]
    assert first_result.role == "tool"

    fork_id = Assistant(loop_id).fork(first_result.id).id
    poll(session, lambda: settled(session, fork_id), what="the fork to complete")
    sent = chat_requests(llm)[2:]
    assert [r.json for r in sent] == [original[1].json]
    assert [m.content for m in visible(session, fork_id)] == [
        m.content for m in visible(session, loop_id)]


def test_a_replay_sigkilled_mid_turn_is_taken_over_with_its_model(
        app, session, llm, chat_fleet):  # noqa: F811 - the imported fixture
    llm.script("tell me a story", {"content": STORY})
    first = chat_fleet("first")
    loop_id = StreamingAssistant.start(message="tell me a story").id
    poll(session, lambda: settled(session, loop_id), what="the original to complete")
    assert [r.json["model"] for r in chat_requests(llm)] == ["test-model"]

    llm.fault_next("slow_stream", seconds=0.1)  # the replay's first request
    replay_id = control.replay(get_state(), loop_id, model="other-model").id
    poll(session, lambda: streaming_shell(session, replay_id), what="the replay to stream")
    kill_group(first, signal.SIGKILL)

    chat_fleet("second")
    poll(session, lambda: settled(session, replay_id), timeout=120,
         what="another fleet to take the replay over")
    replayed = chat_requests(llm)[1:]
    assert len(replayed) >= 2  # the killed turn's request, and the takeover's
    assert {r.json["model"] for r in replayed} == {"other-model"}
    assert [m["content"] for m in replayed[-1].json["messages"]] == [
        "You are a test assistant.", "tell me a story"]
    loop = session.get(Loop, replay_id)
    assert (loop.forked_from_loop_id, loop.llm_override) == (loop_id, {"model": "other-model"})
    assert [(m.role, m.content) for m in visible(session, replay_id)][1:] == [
        ("user", "tell me a story"), ("assistant", STORY)]
