"""A sole call's outcome in one statement (loops/store.py ``_answer_alone``): the
row locks, the lease and executed checks, the checkpoint, the answer, the next
LLM turn's claim, its shell and its history, as one autocommit statement.

These drive the store directly against real PostgreSQL, with a second real
connection holding the loop row where a race needs it: the statement's
snapshot is taken before it waits for the lock, so what that holder commits
meanwhile is what each test checks the statement still sees.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import func, select, update

from flask_solidloop.errors import LostLeaseError
from flask_solidloop.loops import queries, store
from flask_solidloop.mcp.toolset import ToolResult
from flask_solidloop.models import Event, Job, Loop, Message, ToolCall
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.queue.dispatch import Adopted

from ..support.support_app import Assistant
from .row_locks import hold_loop_while, loop_row_locked


def tool_phase(session, *, calls: int = 1) -> tuple[int, uuid.UUID, list[int], uuid.UUID]:
    """A running loop whose model asked for ``calls`` calls; the first is leased
    to this (pretend) thread, as the turn's commit leaves an adopted call."""
    loop = Assistant.start(message="add please")
    token, lease = uuid.uuid4(), uuid.uuid4()
    session.execute(update(Job).where(Job.loop_id == loop.id).values(state="done"))
    session.execute(update(Loop).where(Loop.id == loop.id).values(
        status="running", execution_token=token, started_at=func.now(),
        run_started_at=func.now()))
    asked = Message(loop_id=loop.id, role="assistant", content="", status="completed")
    session.add(asked)
    session.flush()
    rows = [ToolCall(loop_id=loop.id, message_id=asked.id, position=n, name="add",
                     call_id=f"c{n}", arguments={"a": n, "b": 1},
                     arguments_raw=f'{{"a": {n}, "b": 1}}') for n in range(calls)]
    session.add_all(rows)
    session.flush()
    session.execute(update(ToolCall).where(ToolCall.id == rows[0].id).values(
        lease_token=lease, lease_holder="test", leased_until=func.now() + timedelta(seconds=60)))
    session.commit()
    return loop.id, token, [r.id for r in rows], lease


def answer(state, session, loop_id, token, call_id, lease, *, shell=True, history=True,
           seen=None):
    """The built-in tool stack's outcome call, with the call as the step knew it
    (held, as the step holds it). ``seen``: a :func:`statements_of` list, cut to
    the statements of the outcome alone."""
    held = session.get(ToolCall, call_id)
    known = store.KnownCall.of(held)
    session.commit()  # the tool's run ends the step's transaction
    if seen is not None:
        seen.clear()
    state.dispatch.capture(adopt=True)
    try:
        _, _, answered = store.checkpoint_and_answer_tool_call(
            state, session, loop_id=loop_id, token=token, tool_call_id=call_id,
            lease_token=lease, result=ToolResult(content=[{"type": "text", "text": "2"}]),
            duration_ms=1.0,
            body_limit=10_000, answer_text=lambda stored: stored.text(), sequential=False,
            open_next_shell=shell, read_next_history=history, known=known)
        return answered, state.dispatch.take_captured()
    finally:
        state.dispatch.take_captured()


def statements_of(monkeypatch) -> list[tuple[str, bool]]:
    """Every statement the test process sends from here on (but the pool's
    pings), with its connection's autocommit mode."""
    seen: list[tuple[str, bool]] = []
    execute = psycopg.Cursor.execute

    def observed(cursor, query, *args, **kwargs):
        text = query if isinstance(query, str) else str(query)
        if text != ";":  # the test app's pool_pre_ping, on checkout
            seen.append((text, cursor.connection.autocommit))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    return seen


def test_a_sole_calls_answer_and_the_next_claim_are_one_autocommit_statement(
        state, session, monkeypatch):
    loop_id, token, (call_id,), lease = tool_phase(session)
    seen = statements_of(monkeypatch)
    answered, adopted = answer(state, session, loop_id, token, call_id, lease, seen=seen)
    monkeypatch.undo()
    assert answered
    assert len(seen) == 1 and seen[0][1] is True, seen  # one statement, in autocommit
    assert isinstance(adopted, Adopted) and adopted.execution_token not in (None, token)
    session.expire_all()
    loop = session.get(Loop, loop_id)
    call = session.get(ToolCall, call_id)
    assert loop.status == "running" and loop.execution_token == adopted.execution_token
    assert loop.lease_expires_at is not None and loop.lease_holder
    assert call.executed_at is not None and call.lease_token is None
    reply = session.get(Message, call.response_message_id)
    assert (reply.role, reply.content, reply.tool_call_id) == ("tool", "2", call_id)
    shell = session.get(Message, adopted.shell_id)
    assert shell.status == "processing" and shell.is_hidden and shell.id > reply.id
    events = session.scalars(select(Event).where(Event.tool_call_id == call_id)).all()
    assert len(events) == 1 and events[0].payload["result"]["content"][0]["text"] == "2"
    # The history it carried is the one a fresh read gives now.
    assert adopted.history == queries.history(session, loop_id)
    assert adopted.history[-1].role == "tool" and adopted.history[-1].content == "2"
    session.rollback()


def test_without_the_history_or_the_shell_the_statement_leaves_them_to_the_turn(
        state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    answered, adopted = answer(state, session, loop_id, token, call_id, lease,
                               shell=False, history=False)
    assert answered and adopted.history is None and adopted.shell_id is None
    session.expire_all()
    assert session.scalars(select(func.count()).select_from(Message).where(
        Message.loop_id == loop_id, Message.status == "processing")).one() == 0


def test_a_reclaimed_lease_writes_nothing(state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    # The reaper took the call over while the tool ran: another lease now.
    session.execute(update(ToolCall).where(ToolCall.id == call_id).values(
        lease_token=uuid.uuid4()))
    session.commit()
    with pytest.raises(LostLeaseError, match="reclaimed"):
        answer(state, session, loop_id, token, call_id, lease)
    assert_untouched(session, loop_id, call_id, token)


def test_an_executed_call_writes_nothing(state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    session.execute(update(ToolCall).where(ToolCall.id == call_id).values(
        executed_at=func.now()))
    session.commit()
    with pytest.raises(LostLeaseError, match="already executed"):
        answer(state, session, loop_id, token, call_id, lease)
    session.expire_all()
    assert session.get(ToolCall, call_id).response_message_id is None
    assert session.get(Loop, loop_id).execution_token == token


def assert_untouched(session, loop_id, call_id, token):
    session.expire_all()
    call = session.get(ToolCall, call_id)
    assert call.executed_at is None and call.response_message_id is None
    assert session.get(Loop, loop_id).execution_token == token
    assert session.scalars(select(Event).where(Event.tool_call_id == call_id)).all() == []
    assert session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                 Message.role == "tool")).all() == []
    session.rollback()


def test_a_call_with_siblings_takes_the_two_step_path(state, session, monkeypatch):
    """Told wrongly that its call is alone, the statement finds the sibling,
    writes nothing, and the two-step path answers it (the sibling unanswered:
    no claim, the loop waits for it)."""
    loop_id, token, (call_id, sibling), lease = tool_phase(session, calls=2)
    seen = statements_of(monkeypatch)
    answered, adopted = answer(state, session, loop_id, token, call_id, lease, seen=seen)
    monkeypatch.undo()
    assert answered and adopted is None
    assert any(q.startswith("SELECT l.status") for q, _ in seen)  # the two-step lock
    session.expire_all()
    assert session.get(ToolCall, call_id).response_message_id is not None
    assert session.get(ToolCall, sibling).response_message_id is None
    assert session.get(Loop, loop_id).execution_token == token  # not claimed
    session.rollback()


def test_a_pause_committed_while_the_statement_waits_records_the_result_only(
        app, state, session, database_url):
    """The loop is paused while the answer waits for its row: the statement sees
    the paused row (not its snapshot's), checkpoints the result under the
    call's lease and neither answers nor claims."""
    loop_id, token, (call_id,), lease = tool_phase(session)

    def run():
        with app.app_context():
            return answer(state, state.db.session, loop_id, token, call_id, lease)

    outcome = hold_loop_while(
        database_url, loop_id, "WITH locked AS", lambda holder: holder.execute(
            "UPDATE solidloop_loops SET status = 'paused' WHERE id = %s", (loop_id,)), run)
    assert "error" not in outcome, outcome
    answered, adopted = outcome["value"]
    assert not answered and adopted is None
    session.expire_all()
    call = session.get(ToolCall, call_id)
    assert call.executed_at is not None and call.response_message_id is None
    assert call.lease_token == lease  # kept: the call is checkpointed, not answered
    loop = session.get(Loop, loop_id)
    assert loop.status == "paused" and loop.execution_token == token
    assert len(session.scalars(select(Event).where(Event.tool_call_id == call_id)).all()) == 1


def test_a_reclaim_committed_while_the_statement_waits_writes_nothing(
        app, state, session, database_url):
    """The call's lease moves on (the reaper's takeover takes the loop row
    first) while the answer waits: the statement sees the new lease."""
    loop_id, token, (call_id,), lease = tool_phase(session)

    def run():
        with app.app_context():
            return answer(state, state.db.session, loop_id, token, call_id, lease)

    outcome = hold_loop_while(
        database_url, loop_id, "WITH locked AS", lambda holder: holder.execute(
            "UPDATE solidloop_tool_calls SET lease_token = gen_random_uuid() WHERE id = %s",
            (call_id,)), run)
    assert isinstance(outcome.get("error"), LostLeaseError), outcome
    assert_untouched(session, loop_id, call_id, token)


def test_the_statement_locks_the_loop_row_before_the_call(app, state, session, database_url):
    """While another connection holds the call's row, the statement waits holding
    the loop's: every writer takes the loop first."""
    loop_id, token, (call_id,), lease = tool_phase(session)
    outcome: dict[str, object] = {}
    with psycopg.connect(libpq_url(database_url)) as holder, \
            psycopg.connect(libpq_url(database_url), autocommit=True) as probe:
        holder.execute("SELECT 1 FROM solidloop_tool_calls WHERE id = %s FOR UPDATE",
                       (call_id,))

        def run() -> None:
            with app.app_context():
                outcome["value"] = answer(state, state.db.session, loop_id, token, call_id,
                                          lease)

        waiter = threading.Thread(target=run)
        waiter.start()
        try:
            assert loop_row_locked(probe, loop_id), "the statement did not take the loop row first"
            assert "value" not in outcome  # and it waits for the call's
        finally:
            holder.rollback()
            waiter.join(10)
    answered, adopted = outcome["value"]
    assert answered and adopted is not None


def test_objects_the_session_holds_read_what_the_statement_wrote(state, session):
    """The statement commits on a pooled connection of its own, outside the
    session; what the session holds is expired as its commit would expire it,
    so the loop and the call read back as written, not as loaded."""
    loop_id, token, (call_id,), lease = tool_phase(session)
    loop = session.get(Loop, loop_id)
    assert loop.execution_token == token
    answered, adopted = answer(state, session, loop_id, token, call_id, lease)
    assert answered
    assert not session().in_transaction()  # the session was never used for it
    call = session.get(ToolCall, call_id)
    assert loop.execution_token == adopted.execution_token
    assert call.response_message_id is not None and call.lease_token is None
    session.rollback()
