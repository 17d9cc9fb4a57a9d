"""The tool turn's writes (loops/store/tool_turn.py): a call's outcome is one
statement family (loops/sql.TOOL_OUTCOME) with its checks in SQL. For a call
alone in its message, adopted by its thread, the row locks, the lease and
executed checks, the checkpoint, the answer, the next LLM turn's claim, its
shell and its history are one autocommit statement; a call with siblings
takes the locks first; a stack with a step between the two writes records
first and answers after.

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
from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.mcp.toolset import ToolResult
from flask_solidloop.models import Event, Job, Loop, Message, ToolCall
from flask_solidloop.queue.broker import libpq_url

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


def facts(session, call_id):
    """The call as the step knew it before its tool ran (the step's transaction
    then ends), and its object, which the step holds (``ctx.tool_call``): the
    outcome hands it back without a SELECT."""
    held = session.get(ToolCall, call_id)
    known = store.CallFacts.of(held)
    session.commit()
    return known, held


def answer(state, session, loop_id, token, call_id, lease, *, shell=True, history=True,
           seen=None, adopt=True, sole=True, sequential=False):
    """The built-in tool stack's outcome call (the default stack: the result and
    its answer in one statement). ``seen``: a :func:`statements_of` list, cut to
    the statements of the outcome alone."""
    known, held = facts(session, call_id)
    if seen is not None:
        seen.clear()
    outcome = store.checkpoint_and_answer_tool_call(
        state, session, known, token=token, lease=lease,
        result=ToolResult(content=[{"type": "text", "text": "2"}]), duration_ms=1.0,
        body_limit=10_000, answer_text=lambda stored: stored.text(), sequential=sequential,
        adopt=adopt, next_turn=store.NextTurn(open_shell=shell, read_history=history),
        sole_call=sole)
    assert outcome.call is held
    return outcome.answered, outcome.adopted


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
    assert isinstance(adopted, store.AdoptedLlmTurn)
    assert adopted.claim.token not in (None, token)
    session.expire_all()
    loop = session.get(Loop, loop_id)
    call = session.get(ToolCall, call_id)
    assert loop.status == "running" and loop.execution_token == adopted.claim.token
    assert loop.lease_expires_at is not None and loop.lease_holder
    assert call.executed_at is not None and call.lease_token is None
    reply = session.get(Message, call.response_message_id)
    assert (reply.role, reply.content, reply.tool_call_id) == ("tool", "2", call_id)
    shell = session.get(Message, adopted.claim.shell_id)
    assert shell.status == "processing" and shell.is_hidden and shell.id > reply.id
    events = session.scalars(select(Event).where(Event.tool_call_id == call_id)).all()
    assert len(events) == 1 and events[0].payload["result"]["content"][0]["text"] == "2"
    # The history it carried is the one a fresh read gives now.
    assert adopted.claim.history == queries.history(session, loop_id)
    assert adopted.claim.history[-1].role == "tool" and adopted.claim.history[-1].content == "2"
    session.rollback()


def test_without_the_history_or_the_shell_the_statement_leaves_them_to_the_turn(
        state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    answered, adopted = answer(state, session, loop_id, token, call_id, lease,
                               shell=False, history=False)
    assert answered and adopted.claim.history is None and adopted.claim.shell_id is None
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
    assert any(q.startswith("SELECT 1 FROM solidloop_loops l JOIN") for q, _ in seen)  # the lock
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
    assert loop.execution_token == adopted.claim.token
    assert call.response_message_id is not None and call.lease_token is None
    session.rollback()


# -- the statement family: recorded first and answered after, or answered alone -------


def record_only(state, session, loop_id, token, call_id, lease):
    """ToolExecution's own checkpoint, for a stack with a step before ResponseCreation."""
    return store.checkpoint_tool_call(
        state, session, facts(session, call_id)[0], token=token, lease=lease,
        result=ToolResult(content=[{"type": "text", "text": "2"}]), duration_ms=1.0,
        body_limit=10_000)


def answer_only(state, session, call_id, *, token, lease, adopt=True):
    """ResponseCreation after a recorded result (the step between, or a job that
    found the call executed: ``lease`` None, fenced on the generation)."""
    return store.answer_tool_call(
        state, session, facts(session, call_id)[0], token=token, lease=lease, content="2",
        is_error=False, sequential=False, adopt=adopt,
        next_turn=store.NextTurn(open_shell=True, read_history=True))


def test_a_recorded_result_is_answered_by_the_same_family_with_the_answer_after(
        state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    recorded = record_only(state, session, loop_id, token, call_id, lease)
    assert not recorded.answered and recorded.adopted is None
    assert recorded.result.text() == "2"
    session.expire_all()
    call = session.get(ToolCall, call_id)
    # The result and its event, the lease kept, no answer yet.
    assert call.executed_at is not None and call.lease_token == lease
    assert call.response_message_id is None
    assert len(session.scalars(select(Event).where(Event.tool_call_id == call_id)).all()) == 1
    session.rollback()
    # A second record finds it executed and writes nothing.
    with pytest.raises(LostLeaseError, match="already executed"):
        record_only(state, session, loop_id, token, call_id, lease)
    answered = answer_only(state, session, call_id, token=token, lease=lease)
    assert answered.answered and isinstance(answered.adopted, store.AdoptedLlmTurn)
    session.expire_all()
    call = session.get(ToolCall, call_id)
    assert call.lease_token is None and call.response_message_id is not None
    assert session.get(Loop, loop_id).execution_token == answered.adopted.claim.token
    assert len(session.scalars(select(Event).where(Event.tool_call_id == call_id)).all()) == 1
    session.rollback()
    # A duplicate answer writes nothing.
    again = answer_only(state, session, call_id, token=answered.adopted.claim.token, lease=None)
    assert not again.answered and again.adopted is None


def test_a_job_without_a_lease_answers_on_the_generation_fence(state, session):
    """A resumed phase's job for a call that ran before (no lease): the loop's
    current generation is its fence; a stale one writes nothing."""
    loop_id, token, (call_id,), lease = tool_phase(session)
    record_only(state, session, loop_id, token, call_id, lease)
    with pytest.raises(LostLeaseError, match="changed generation"):
        answer_only(state, session, call_id, token=uuid.uuid4(), lease=None)
    session.expire_all()
    assert session.get(ToolCall, call_id).response_message_id is None
    session.rollback()
    assert answer_only(state, session, call_id, token=token, lease=None).answered


def test_without_adoption_the_last_answer_queues_the_next_turn_with_its_job(state, session):
    loop_id, token, (call_id,), lease = tool_phase(session)
    answered, adopted = answer(state, session, loop_id, token, call_id, lease, adopt=False,
                               sole=False)
    assert answered and adopted is None
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "queued" and loop.execution_token is None
    jobs = session.scalars(select(Job).where(Job.loop_id == loop_id, Job.state == "queued"))
    assert [job.actor_name for job in jobs] == ["solidloop.llm_turn"]
    session.rollback()


@pytest.mark.parametrize("adopt", [True, False], ids=["adopted", "a-job"])
def test_a_sequential_line_passes_to_its_next_call(state, session, adopt):
    """In sequential mode an answer that leaves calls unanswered hands the line
    to the next: leased to this thread in the same commit, or its job."""
    loop_id, token, (first, second), lease = tool_phase(session, calls=2)
    answered, adopted = answer(state, session, loop_id, token, first, lease, adopt=adopt,
                               sole=False, sequential=True)
    assert answered
    session.expire_all()
    nxt = session.get(ToolCall, second)
    jobs = session.scalars(select(Job).where(Job.loop_id == loop_id, Job.state == "queued",
                                             Job.actor_name == "solidloop.tool_call")).all()
    if adopt:
        assert isinstance(adopted, store.AdoptedToolCall) and adopted.tool_call_id == second
        assert nxt.lease_token == adopted.lease_token and jobs == []
    else:
        assert adopted is None and nxt.lease_token is None
        assert [job.message["args"][0] for job in jobs] == [second]
    assert session.get(Loop, loop_id).execution_token == token  # still the phase's
    session.rollback()


def test_the_lock_takes_the_loop_row_before_the_call(app, session, database_url):
    """LOCK_CALL (the statement a call with siblings takes first) locks both rows,
    the loop's first (the order every writer takes them in): while the call's
    row is held elsewhere, it waits holding the loop's."""
    loop_id, _, (call_id,), _ = tool_phase(session)
    url = libpq_url(database_url)
    with psycopg.connect(url) as holder, psycopg.connect(url) as locker, \
            psycopg.connect(url, autocommit=True) as probe:
        holder.execute("SELECT 1 FROM solidloop_tool_calls WHERE id = %s FOR UPDATE",
                       (call_id,))
        done = threading.Event()

        def run() -> None:
            locker.execute(loop_sql.LOCK_CALL, {"loop_id": loop_id, "call_id": call_id})
            done.set()

        waiter = threading.Thread(target=run)
        waiter.start()
        try:
            assert loop_row_locked(probe, loop_id), "the lock did not take the loop row first"
            assert not done.is_set()  # and it waits for the call's
        finally:
            holder.rollback()
            waiter.join(10)
        assert done.is_set()
        locker.rollback()
