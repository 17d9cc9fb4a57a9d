"""Conversations with real ``flask solidloop worker`` processes: a message sent
while an LLM turn streams or while tool calls run, under each
``on_new_message`` policy; a queued message that outlives a SIGKILLed fleet;
senders racing the workers (docs/decisions/0026-conversations.md)."""

from __future__ import annotations

import json
import signal
import threading
import uuid

import pytest
from sqlalchemy import select

from flask_solidloop import ConversationBusyError
from flask_solidloop.models import Job, Loop, Message, ToolCall

from ..support.support_app import ChatAgent, InterruptingChatAgent, RejectingChatAgent
from .test_approvals_workers import fleet, poll  # noqa: F401 - fleet is a fixture
from .test_e2e_workers import kill_group

pytestmark = pytest.mark.e2e

#: Partial text written onto the hidden shell (text deltas off) every 50 ms, so
#: a test sees a turn mid-stream quickly.
FAST_PARTIALS = {"SOLIDLOOP_STREAM_UPDATE_INTERVAL": 0.05, "SOLIDLOOP_STREAM_MAX_HZ": 0}
STORY = " ".join(f"word{n}" for n in range(60))


@pytest.fixture
def chat_fleet(fleet, monkeypatch):  # noqa: F811 - the imported fixture
    """Start a fleet whose workers write partial text every 50 ms."""
    from . import test_approvals_workers

    monkeypatch.setattr(test_approvals_workers, "WORKER_CONFIG",
                        {**test_approvals_workers.WORKER_CONFIG, **FAST_PARTIALS})
    return fleet


def visible(session, loop_id) -> list[tuple[str, str]]:
    session.expire_all()
    rows = [(m.role, m.content) for m in session.scalars(
        select(Message).where(Message.loop_id == loop_id, Message.is_hidden.is_(False))
        .order_by(Message.id))]
    session.rollback()
    return rows


def streaming_shell(session, loop_id) -> Message | None:
    """The loop's shell once some of its streamed text has been written."""
    return session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.status == "processing", Message.content != "")
    ).first()


def settled(session, loop_id) -> bool:
    """Completed, nothing in the inbox, no job left."""
    loop = session.get(Loop, loop_id)
    return loop.status == "completed" and loop.inbox is None and not session.scalars(
        select(Job.id).where(Job.loop_id == loop_id,
                             Job.state.in_(("queued", "running")))).first()


def user_rows(session, loop_id, text) -> list[Message]:
    """Every message row with ``text``, hidden ones included."""
    session.expire_all()
    rows = list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.content == text)))
    session.rollback()
    return rows


def test_a_queued_message_outlives_a_sigkilled_fleet_and_is_answered_once(
        app, session, llm, chat_fleet):
    """Queued while the turn streams; the fleet is SIGKILLed before the turn
    ends; another fleet takes the turn over and then answers the message,
    exactly once."""
    llm.fault_next("slow_stream", seconds=0.1)  # the first request only
    llm.script("tell me a story", {"content": STORY})
    llm.script("and then?", {"content": "The end."})
    first = chat_fleet("first")
    loop_id = ChatAgent.start(message="tell me a story").id
    poll(session, lambda: streaming_shell(session, loop_id), what="the story to stream")

    sent = ChatAgent(loop_id).send_message("and then?")
    assert (sent.outcome, sent.status, sent.waiting) == ("queued", "running", 1)
    kill_group(first, signal.SIGKILL)
    assert session.get(Loop, loop_id).inbox[0]["content"] == "and then?"
    session.rollback()

    chat_fleet("second")
    poll(session, lambda: settled(session, loop_id), timeout=120,
         what="the loop to take the turn over and answer the queued message")
    assert visible(session, loop_id)[1:] == [
        ("user", "tell me a story"), ("assistant", STORY), ("user", "and then?"),
        ("assistant", "The end.")]
    delivered = user_rows(session, loop_id, "and then?")
    assert [(m.role, m.is_hidden) for m in delivered] == [("user", False)]


def test_interrupt_while_streaming_discards_the_half_answer_and_answers(
        app, session, llm, chat_fleet):
    llm.fault_next("endless_stream", seconds=0.05)  # a generation that never ends
    llm.script("ramble", {"content": "blah blah blah"})
    llm.script("stop rambling", {"content": "Stopped."})
    chat_fleet("one")
    loop_id = InterruptingChatAgent.start(message="ramble").id
    shell = poll(session, lambda: streaming_shell(session, loop_id), what="the ramble")
    shell_id = shell.id
    session.rollback()

    sent = InterruptingChatAgent(loop_id).send_message("stop rambling")
    assert (sent.outcome, sent.status) == ("interrupted", "running")
    poll(session, lambda: settled(session, loop_id), timeout=120, what="the answer")
    assert visible(session, loop_id)[1:] == [
        ("user", "ramble"), ("user", "stop rambling"), ("assistant", "Stopped.")]
    session.expire_all()
    discarded = session.get(Message, shell_id)
    assert (discarded.status, discarded.is_hidden) == ("failed", True)


def test_reject_while_streaming_writes_nothing_and_the_turn_goes_on(
        app, session, llm, chat_fleet):
    llm.fault_next("slow_stream", seconds=0.1)
    llm.script("tell me a story", {"content": STORY})
    chat_fleet("one")
    loop_id = RejectingChatAgent.start(message="tell me a story").id
    poll(session, lambda: streaming_shell(session, loop_id), what="the story to stream")
    session.rollback()
    with pytest.raises(ConversationBusyError, match=(
            f'^loop {loop_id} is running; wait for it or set on_new_message="queue"$')):
        RejectingChatAgent(loop_id).send_message("hurry up")
    poll(session, lambda: settled(session, loop_id), timeout=120, what="the story")
    assert visible(session, loop_id)[1:] == [("user", "tell me a story"), ("assistant", STORY)]
    assert user_rows(session, loop_id, "hurry up") == []


def slow_call_started(session, effects, loop_id):
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)).first()
    return call is not None and effects(f"solidloop:tool_call:{call.id}", "start") and call


def test_queue_while_a_tool_runs_answers_after_the_tool_phase(
        app, session, llm, chat_fleet, effects):
    llm.script("nap", {"content": "Napping.", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": 2}}]})
    llm.script("slept 2", {"content": "Slept well."})
    llm.script("quick question", {"content": "Quick answer."})
    chat_fleet("one")
    loop_id = ChatAgent.start(message="nap").id
    poll(session, lambda: slow_call_started(session, effects, loop_id), what="the tool")
    session.rollback()

    sent = ChatAgent(loop_id).send_message("quick question")
    assert (sent.outcome, sent.status) == ("queued", "running")
    poll(session, lambda: settled(session, loop_id), timeout=120, what="both answers")
    history = visible(session, loop_id)[1:]
    assert [role for role, _ in history] == ["user", "assistant", "tool", "assistant", "user",
                                             "assistant"]
    assert history[-3:] == [("assistant", "Slept well."), ("user", "quick question"),
                            ("assistant", "Quick answer.")]


def test_interrupt_while_a_tool_runs_answers_it_as_interrupted_and_fences_its_result(
        app, session, llm, chat_fleet, effects):
    llm.script("nap", {"content": "Napping.", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": 2}}]})
    llm.script("wake up", {"content": "Awake."})
    chat_fleet("one")
    loop_id = InterruptingChatAgent.start(message="nap").id
    call = poll(session, lambda: slow_call_started(session, effects, loop_id), what="the tool")
    call_id = call.id
    session.rollback()

    sent = InterruptingChatAgent(loop_id).send_message("wake up")
    assert (sent.outcome, sent.status) == ("interrupted", "running")
    poll(session, lambda: settled(session, loop_id), timeout=120, what="the answer")
    # The tool ran to its end (its effect is at least once), and its result,
    # which came after the interrupt, was not recorded.
    poll(session, lambda: effects(f"solidloop:tool_call:{call_id}", "end"),
         what="the interrupted tool to end")
    history = visible(session, loop_id)[1:]
    assert history == [
        ("user", "nap"), ("assistant", "Napping."),
        ("tool", "tool call 'slow' was not run: the conversation was interrupted by a new "
                 "message"),
        ("user", "wake up"), ("assistant", "Awake.")]
    session.expire_all()
    settled_call = session.get(ToolCall, call_id)
    assert (settled_call.executed_at, settled_call.error_kind) == (None, "cancelled")


def test_senders_racing_the_workers_each_get_one_delivery(app, session, llm, chat_fleet):
    """Eight senders, three messages each, against a loop the workers run: each
    message is delivered once, in its sender's order, and the loop ends with
    an answer after the last."""
    llm.fault_next("slow_stream", seconds=0.02, times=200)
    llm.script("msg", {"content": "Noted."})
    chat_fleet("one")
    loop_id = ChatAgent.start(message="msg start").id
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    errors: list[BaseException] = []
    sent_by: dict[int, list[str]] = {}

    def send(n: int) -> None:
        with app.app_context():
            barrier.wait()
            texts = sent_by[n] = [f"msg {n}.{k} {uuid.uuid4().hex[:4]}" for k in range(3)]
            for text in texts:
                try:
                    outcomes.append(ChatAgent(loop_id).send_message(text).outcome)
                except BaseException as exc:  # reported below
                    errors.append(exc)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert set(outcomes) <= {"started", "appended", "queued"} and len(outcomes) == 24
    poll(session, lambda: settled(session, loop_id), timeout=180, what="every answer")
    history = visible(session, loop_id)
    users = [text for role, text in history if role == "user"]
    assert sorted(users) == sorted(["msg start", *(t for ts in sent_by.values() for t in ts)])
    for texts in sent_by.values():
        assert [u for u in users if u in texts] == texts  # a sender's order is kept
    assert history[-1] == ("assistant", "Noted.")
    print(json.dumps({o: outcomes.count(o) for o in set(outcomes)}))
