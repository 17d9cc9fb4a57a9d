"""A conversation continued with ``Agent(loop).send_message``, and the agent's
``on_new_message`` policy for a message that finds the loop busy
(docs/guides/agents.md#conversations, docs/decisions/0026-conversations.md).
Driven in-process (drain) against the strict LLM emulator and PostgreSQL; the
races and the kills with real workers are in
tests/acceptance/test_conversations_workers.py."""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import select

from flask_solidloop import (
    Agent,
    AgentDefinitionError,
    ConversationBusyError,
    DecisionConflictError,
    InvalidArgumentError,
)
from flask_solidloop.llm.types import AssistantTurn, Usage
from flask_solidloop.loops import sql, store
from flask_solidloop.models import Job, Message, ToolCall

from ..support.rows import loop_of
from ..support.support_app import (
    ChatAgent,
    InterruptingChatAgent,
    RejectingChatAgent,
    llm_settings,
)
from .loop_states import running_loop
from .row_locks import hold_loop_while


def conversation(session, loop_id) -> list[tuple[str, str]]:
    """The visible history, as (role, text)."""
    session.expire_all()
    return [(m.role, m.content) for m in session.scalars(
        select(Message).where(Message.loop_id == loop_id, Message.is_hidden.is_(False))
        .order_by(Message.id))]


def message_rows(session, loop_id) -> int:
    session.expire_all()
    return len(session.scalars(select(Message.id).where(Message.loop_id == loop_id)).all())


def live_jobs(session, loop_id):
    return list(session.scalars(select(Job).where(
        Job.loop_id == loop_id, Job.state.in_(("queued", "running")))))


def roles_sent(llm) -> list[list[str]]:
    """The roles of each chat request's messages, in order."""
    return [[m["role"] for m in r.json["messages"]] for r in llm.requests
            if r.json and "messages" in r.json]


def waiting_for_email(llm, drain, agent=ChatAgent):
    """A loop whose turn asked for an email, which waits for its approval."""
    llm.script("tell the ceo", {"content": "Drafting.", "tool_calls": [
        {"name": "send_email", "arguments": {"to": "ceo", "body": "hello"}}]})
    loop = agent.start(message="tell the ceo")
    drain()
    return loop


# -- continuing a conversation ----------------------------------------------------------


def test_a_completed_conversation_is_continued_twice(app, session, llm, drain):
    llm.script("hello", {"content": "Hi! How can I help?"})
    llm.script("the weather", {"content": "It is sunny."})
    llm.script("thanks", {"content": "You are welcome."})
    loop = ChatAgent.start(message="hello")
    drain()
    assert loop_of(session, loop.id).status == "completed"

    sent = ChatAgent(loop).send_message("what is the weather")
    assert (sent.loop_id, sent.outcome, sent.status) == (loop.id, "started", "completed")
    assert loop_of(session, loop.id).status == "queued"
    drain()
    sent = ChatAgent(loop.id).send_message("thanks")
    assert sent.outcome == "started"
    drain()

    assert loop_of(session, loop.id).status == "completed"
    assert conversation(session, loop.id)[1:] == [
        ("user", "hello"), ("assistant", "Hi! How can I help?"),
        ("user", "what is the weather"), ("assistant", "It is sunny."),
        ("user", "thanks"), ("assistant", "You are welcome.")]
    assert ChatAgent(loop).result() == "You are welcome."
    # Each turn read the whole conversation so far.
    assert roles_sent(llm)[-1] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_a_message_to_a_queued_loop_joins_its_next_turn(app, session, llm, drain):
    llm.script("third thought", {"content": "All three noted."})
    loop = ChatAgent.start(message="first thought")
    sent = ChatAgent(loop).send_message("second thought")
    assert (sent.outcome, sent.status) == ("appended", "queued")
    assert conversation(session, loop.id)[-1] == ("user", "second thought")
    assert ChatAgent(loop).send_message("third thought").outcome == "appended"
    assert len(live_jobs(session, loop.id)) == 1  # the turn's own job reads them all
    drain()
    assert loop_of(session, loop.id).status == "completed"
    assert roles_sent(llm) == [["system", "user", "user", "user"]]
    assert conversation(session, loop.id)[-1] == ("assistant", "All three noted.")


def test_send_message_checks_its_arguments(app, session, llm):
    loop = ChatAgent.start(message="hi")
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        ChatAgent(loop).send_message("  ")
    with pytest.raises(InvalidArgumentError, match="there is no loop 999999"):
        ChatAgent(999999).send_message("hello?")


def test_on_new_message_is_checked_when_the_agent_is_declared():
    with pytest.raises(AgentDefinitionError) as caught:
        class Typo(Agent):
            on_new_message = "queued"
    assert str(caught.value) == (
        "agent class Typo: on_new_message must be one of 'queue', 'interrupt', 'reject', "
        "got 'queued'")

    class Computed(Agent):
        llm = llm_settings()

        def on_new_message(self) -> str:
            return "drop"

    Computed.agent_name = "computed"
    with pytest.raises(AgentDefinitionError, match="on_new_message must be one of"):
        Computed().validate()


# -- "queue": kept in the inbox, delivered when the current work ends -------------------


def test_queue_while_waiting_keeps_the_message_outside_the_history_until_the_answer(
        app, session, llm, drain):
    loop = waiting_for_email(llm, drain)
    assert loop_of(session, loop.id).status == "waiting"
    rows = message_rows(session, loop.id)

    sent = ChatAgent(loop).send_message("also cc the board")
    assert (sent.outcome, sent.status, sent.waiting) == ("queued", "waiting", 1)
    sent = ChatAgent(loop).send_message("and sign it")
    assert sent.waiting == 2
    # No message row (nothing sees it as part of the conversation), no job: the
    # loop still waits, holding nothing.
    assert message_rows(session, loop.id) == rows
    waiting = loop_of(session, loop.id)
    assert waiting.status == "waiting" and live_jobs(session, loop.id) == []
    assert [m["content"] for m in waiting.inbox] == ["also cc the board", "and sign it"]

    llm.script("sent to ceo", {"content": "Email sent."})
    llm.script("and sign it", {"content": "Done: cc'd the board and signed."})
    call = ChatAgent(loop).pending_approvals()[0]
    ChatAgent(loop).approve(call.id, by="alice")
    drain()

    done = loop_of(session, loop.id)
    assert (done.status, done.inbox) == ("completed", None)
    assert conversation(session, loop.id)[1:] == [
        ("user", "tell the ceo"), ("assistant", "Drafting."), ("tool", "sent to ceo: hello"),
        ("assistant", "Email sent."), ("user", "also cc the board"), ("user", "and sign it"),
        ("assistant", "Done: cc'd the board and signed.")]
    delivered = session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.content == "and sign it")).one()
    assert delivered.meta.get("queued_at")


def test_a_final_answer_that_finds_the_inbox_filled_while_it_waited_for_the_lock_requeues(
        app, state, session, database_url):
    """The turn's end is one statement whose snapshot is taken before it waits
    for the loop row: a message queued by the lock's holder meanwhile must
    still stop the loop from completing (the inbox is read from the row it
    locked), and its turn's job must commit with the end."""
    loop_id, token = running_loop(session)
    shell_id = store.open_shell(session, loop_id, token)
    session.commit()

    def finish():
        with app.app_context():
            return store.finish_llm_turn(
                state, state.db.session, loop_id=loop_id, token=token, shell_id=shell_id,
                response=AssistantTurn(content="first answer", tool_calls=[],
                                       finish_reason="stop",
                                       usage=Usage(input_tokens=3, output_tokens=2)),
                meta={}, turn_cost=None, calls=[], wire=None, sequential=False, adopt=False)

    def queue_a_message(holder):
        holder.execute(sql.QUEUE_MESSAGE, {"loop_id": loop_id, "content": "one more thing",
                                           "meta": "{}"})

    outcome = hold_loop_while(database_url, loop_id, "WITH fenced AS", queue_a_message, finish)
    assert "error" not in outcome, outcome
    loop = loop_of(session, loop_id)
    assert (loop.status, loop.inbox, loop.execution_token) == ("queued", None, None)
    assert loop.finished_at is None and loop.run_step_base == loop.step_count == 1
    assert conversation(session, loop_id)[-2:] == [("assistant", "first answer"),
                                                   ("user", "one more thing")]
    assert [j.actor_name for j in live_jobs(session, loop_id)] == ["solidloop.llm_turn"]


def test_a_final_answer_with_nothing_queued_still_completes_alone(app, state, session):
    loop_id, token = running_loop(session)
    shell_id = store.open_shell(session, loop_id, token)
    session.commit()
    store.finish_llm_turn(
        state, session, loop_id=loop_id, token=token, shell_id=shell_id,
        response=AssistantTurn(content="done", tool_calls=[], finish_reason="stop"),
        meta={}, turn_cost=None, calls=[], wire=None, sequential=False, adopt=False)
    loop = loop_of(session, loop_id)
    assert loop.status == "completed" and loop.finished_at is not None
    assert live_jobs(session, loop_id) == []


def test_a_queued_message_of_a_paused_loop_is_delivered_by_its_resume(
        app, session, llm, drain):
    loop = waiting_for_email(llm, drain)
    ChatAgent(loop).send_message("are you there?")
    assert ChatAgent(loop).pause()
    call = ChatAgent(loop).pending_approvals()[0]
    ChatAgent(loop).deny(call.id, "no emails today", by="bob")
    llm.script("not run", {"content": "Understood, no email."})
    llm.script("are you there", {"content": "Yes, still here."})
    # The resume answers the denied call first (it goes back to the tool
    # phase), so the message waits for the answer that ends it.
    assert ChatAgent(loop).resume(from_=("paused",))
    drain()
    assert loop_of(session, loop.id).status == "completed"
    assert conversation(session, loop.id)[-3:] == [
        ("assistant", "Understood, no email."), ("user", "are you there?"),
        ("assistant", "Yes, still here.")]


def test_a_message_to_a_frozen_loop_waits_for_its_resume(app, session, llm, drain):
    loop = waiting_for_email(llm, drain)
    assert ChatAgent(loop).freeze()
    sent = ChatAgent(loop).send_message("hello?")
    assert (sent.outcome, sent.status) == ("queued", "paused")
    assert ChatAgent(loop).resume(from_=("paused",)) is False  # frozen
    assert ChatAgent(loop).unfreeze()
    sent = ChatAgent(loop).send_message("still there?")
    # Resumed with a message: the waiting call is answered, the inbox delivered
    # before the new message.
    assert sent.outcome == "started"
    llm.script("still there", {"content": "Here."})
    drain()
    history = conversation(session, loop.id)
    assert history[-4:] == [
        ("tool", "tool call 'send_email' was not run: the loop was resumed with a new message"),
        ("user", "hello?"), ("user", "still there?"), ("assistant", "Here.")]


# -- "interrupt": the work is cancelled and the message answered -------------------------


def test_interrupt_while_waiting_settles_the_waiting_call_and_answers(
        app, session, llm, drain, effects):
    loop = waiting_for_email(llm, drain, agent=InterruptingChatAgent)
    token = loop_of(session, loop.id).execution_token
    assert token is not None
    call = InterruptingChatAgent(loop).pending_approvals()[0]

    sent = InterruptingChatAgent(loop).send_message("never mind, do not email")
    assert (sent.outcome, sent.status) == ("interrupted", "waiting")
    after = loop_of(session, loop.id)
    # The waiting phase's generation is gone: anything of it writes nothing.
    assert (after.status, after.execution_token) == ("queued", None)
    assert InterruptingChatAgent(loop).pending_approvals() == []
    with pytest.raises(DecisionConflictError, match="answered already"):
        InterruptingChatAgent(loop).approve(call.id, by="alice")

    llm.script("do not email", {"content": "OK, no email."})
    drain()
    assert loop_of(session, loop.id).status == "completed"
    assert conversation(session, loop.id)[1:] == [
        ("user", "tell the ceo"), ("assistant", "Drafting."),
        ("tool", "tool call 'send_email' was not run: the conversation was interrupted by a "
                 "new message"),
        ("user", "never mind, do not email"), ("assistant", "OK, no email.")]
    session.expire_all()
    settled = session.get(ToolCall, call.id)
    assert (settled.is_success, settled.error_kind) == (False, "cancelled")
    assert effects(f"solidloop:tool_call:{call.id}", "email") == []


def test_interrupt_during_the_tool_phase_answers_every_call_and_fences_the_phase(
        app, session, llm, drain):
    llm.script("two things", {"content": "Working.", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": 0}},
        {"name": "slow", "arguments": {"seconds": 0}}]})
    loop = InterruptingChatAgent.start(message="two things")
    drain(queues=("solidloop_llm",))  # the turn; its two calls' jobs are queued, not run
    phase = loop_of(session, loop.id)
    assert phase.status == "running" and len(live_jobs(session, loop.id)) == 2

    sent = InterruptingChatAgent(loop).send_message("stop, something else")
    assert (sent.outcome, sent.status) == ("interrupted", "running")
    llm.script("something else", {"content": "Sure."})
    drain()  # the calls' stale jobs find their calls answered and write nothing
    assert loop_of(session, loop.id).status == "completed"
    history = conversation(session, loop.id)
    assert [role for role, _ in history[-5:]] == ["assistant", "tool", "tool", "user",
                                                  "assistant"]
    assert all("interrupted by a new message" in text for _, text in history[-4:-2])
    calls = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).all()
    assert all(c.executed_at is None and c.error_kind == "cancelled" for c in calls)


# -- "reject" ----------------------------------------------------------------------------


def test_reject_names_the_fix_and_writes_nothing(app, session, llm, drain):
    loop = waiting_for_email(llm, drain, agent=RejectingChatAgent)
    rows, before = message_rows(session, loop.id), loop_of(session, loop.id)
    token, updated = before.execution_token, before.updated_at
    with pytest.raises(ConversationBusyError) as caught:
        RejectingChatAgent(loop).send_message("hello?")
    assert str(caught.value) == (
        f'loop {loop.id} is waiting; wait for it or set on_new_message="queue"')
    assert (caught.value.loop_id, caught.value.status) == (loop.id, "waiting")
    after = loop_of(session, loop.id)
    assert (after.status, after.inbox, after.execution_token, after.updated_at) == (
        "waiting", None, token, updated)
    assert message_rows(session, loop.id) == rows


# -- races --------------------------------------------------------------------------------


def test_racing_messages_to_a_completed_loop_are_each_delivered_once(
        app, state, session, llm, drain):
    llm.script("start", {"content": "Started."})
    llm.script("msg", {"content": "Noted."})
    loop = ChatAgent.start(message="start")
    drain()
    loop_id = loop.id  # not read from the test's session by the threads
    texts = [f"msg {n} {uuid.uuid4().hex[:6]}" for n in range(8)]
    outcomes: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(texts))

    def send(text):
        with app.app_context():
            barrier.wait()
            try:
                outcomes.append(ChatAgent(loop_id).send_message(text).outcome)
            except BaseException as exc:  # reported below
                errors.append(exc)

    threads = [threading.Thread(target=send, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # One resumed the loop; the others found it queued and joined its turn.
    assert sorted(outcomes) == ["appended"] * 7 + ["started"]
    drain()
    assert loop_of(session, loop.id).status == "completed"
    delivered = [text for role, text in conversation(session, loop.id) if role == "user"]
    assert sorted(delivered) == sorted(["start", *texts])
    assert conversation(session, loop.id)[-1] == ("assistant", "Noted.")


def test_a_queued_message_enters_the_event_stream_when_it_is_delivered(
        app, session, llm, drain):
    """The events contract: a user message is part of the conversation's
    stream once a visible user row exists; a queued one has no row, so its
    ``message_started`` comes with its delivery, once."""
    from sqlalchemy import text

    def user_events(loop_id):
        session.rollback()
        return session.execute(text(
            "SELECT e.message_id FROM solidloop_stream_events e JOIN solidloop_messages m "
            "ON m.id = e.message_id WHERE e.loop_id = :loop AND e.kind = 'message_started' "
            "AND m.role = 'user' ORDER BY e.id"), {"loop": loop_id}).scalars().all()

    loop = waiting_for_email(llm, drain)
    first = user_events(loop.id)
    ChatAgent(loop).send_message("one more thing")
    assert user_events(loop.id) == first
    llm.script("sent to ceo", {"content": "Sent."})
    llm.script("one more thing", {"content": "Sure."})
    ChatAgent(loop).approve(ChatAgent(loop).pending_approvals()[0].id, by="alice")
    drain()
    delivered = session.scalars(select(Message.id).where(
        Message.loop_id == loop.id, Message.content == "one more thing")).one()
    assert user_events(loop.id) == [*first, delivered]
