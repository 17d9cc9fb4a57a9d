"""The LLM turn's writes (loops/store/llm_turn.py). Its claim is one statement
(loops/sql.CLAIM_TURN): the claim, the job marked done, the shell and the
history, in autocommit after the turn's autocommit read, committed before the
turn's stack runs; when the loop changed since the statement's snapshot, the
same statement runs again after the loop row is locked.

These drive the store against real PostgreSQL. Where a race matters, a second
real connection holds the loop row while the claim waits for it: the
statement's snapshot is older than what that holder commits, and each test
checks what the claim does with the row it finds.
"""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from sqlalchemy import func, select, update

from flask_solidloop import Agent
from flask_solidloop.loops import queries, store
from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.models import Job, Loop, Message
from flask_solidloop.queue.current_job import (
    CurrentJob,
    job_done_committed,
    set_current_job,
)
from flask_solidloop.state import get_state

from ..support.support_app import Assistant, calc, llm_settings, solidloop
from .row_locks import hold_loop_while


class RenewWhileClaiming:
    """A middleware before AgentInitialization that makes the process's lease
    renewer run a pass right then (the turn's claim has committed by then)."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        get_state().renewer().renew_once()
        return self.next_step(ctx)


@solidloop.agent("renew_while_claiming")
class RenewWhileClaimingAgent(Agent):
    system_prompt = "You answer."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import AgentInitialization

        builder.insert_before(AgentInitialization, RenewWhileClaiming)


def statements_of(monkeypatch, *, thread: int | None = None) -> list[tuple[str, bool]]:
    """What this thread (or the thread named) sends from here on (but the pool's
    pings), with its connection's autocommit mode. Other threads (the lease
    renewer) are left out."""
    seen: list[tuple[str, bool]] = []
    execute = psycopg.Cursor.execute
    me = thread if thread is not None else threading.get_ident()

    def observed(cursor, query, *args, **kwargs):
        text = query if isinstance(query, str) else str(query)
        if text != ";" and threading.get_ident() == me:
            seen.append((text, cursor.connection.autocommit))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    return seen


@pytest.fixture
def running_job(session):
    """A queued loop whose job this thread runs, as a consumer's claim leaves it."""
    loop_id = Assistant.start(message="hello there").id
    lease = uuid.uuid4()
    job_id = session.scalars(select(Job.id).where(Job.loop_id == loop_id)).one()
    session.execute(update(Job).where(Job.id == job_id).values(
        state="running", lease_token=lease, started_at=func.now(), attempts=1))
    session.commit()  # the session holds nothing now, as at a job's start
    set_current_job(CurrentJob(job_id, lease, 1))
    yield loop_id, job_id
    set_current_job(None)


def claim(session, loop_id, *, shell=True, history=True):
    return store.claim_llm_turn(session, loop_id, lease_seconds=30, open_shell=shell,
                                read_history=history)


def claim_in_another_session(app, state, session, loop_id, job_id):
    """The claim as a worker thread makes it: its own app context and session,
    running the job (``running_job``'s)."""
    lease = session.get(Job, job_id).lease_token

    def run():
        with app.app_context():
            set_current_job(CurrentJob(job_id, lease, 1))
            return claim(state.db.session, loop_id)

    return run


def add_a_message_and_rewrite(loop_id):
    """What a holder of the loop row commits: a message added, the row rewritten,
    the loop still queued (as a stop and a resume with a message leave it)."""
    def change(holder):
        holder.execute("INSERT INTO solidloop_messages (loop_id, role, content, status) "
                       "VALUES (%s, 'user', 'sent while you waited', 'completed')", (loop_id,))
        holder.execute("UPDATE solidloop_loops SET updated_at = now() WHERE id = %s",
                       (loop_id,))

    return change


def test_the_claim_the_job_the_shell_and_the_history_are_one_autocommit_statement(
        session, running_job, monkeypatch):
    loop_id, job_id = running_job
    seen = statements_of(monkeypatch)
    delivered = claim(session, loop_id)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0][0].startswith("WITH seen AS") and seen[0][1], seen
    assert delivered is not None and delivered.shell_id is not None
    assert job_done_committed(job_id)  # the consumer's ack would match nothing
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "running" and loop.execution_token == delivered.token
    assert loop.lease_expires_at is not None and loop.lease_holder
    assert session.get(Job, job_id).state == "done"
    shell = session.get(Message, delivered.shell_id)
    assert shell.status == "processing" and shell.is_hidden
    history = delivered.history
    assert history == queries.history(session, loop_id)  # what a fresh read gives
    assert [m.role for m in history] == ["system", "user"] and history[-1].content == "hello there"
    session.rollback()


def test_without_the_shell_or_the_history_the_turn_makes_them(session, running_job):
    loop_id, _ = running_job
    delivered = claim(session, loop_id, shell=False, history=False)
    assert delivered is not None
    assert delivered.shell_id is None and delivered.history is None
    session.expire_all()
    assert session.get(Loop, loop_id).status == "running"
    assert session.scalars(select(func.count()).select_from(Message).where(
        Message.loop_id == loop_id, Message.status == "processing")).one() == 0


def assert_unclaimed(session, loop_id, job_id, status="queued"):
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == status and loop.lease_expires_at is None
    assert session.get(Job, job_id).state == "running"  # not marked done
    assert session.scalars(select(func.count()).select_from(Message).where(
        Message.loop_id == loop_id, Message.status == "processing")).one() == 0
    assert not job_done_committed(job_id)


def test_a_loop_that_is_not_queued_is_not_claimed(session, running_job):
    loop_id, job_id = running_job
    session.execute(update(Loop).where(Loop.id == loop_id).values(status="paused"))
    session.commit()
    assert claim(session, loop_id) is None
    assert_unclaimed(session, loop_id, job_id, status="paused")


def test_a_loop_rewritten_while_the_claim_waits_is_claimed_again_under_the_lock(
        app, state, session, running_job, database_url, monkeypatch):
    """Someone holding the loop row adds a message and rewrites the row, and the
    loop is still queued when they commit (a stop and a resume with a message
    look like this to a claim that waited through both). The statement's
    snapshot misses that message, so it must not claim; run again after the
    loop row is locked, its snapshot has the message, and so has the history
    it reads."""
    loop_id, job_id = running_job
    claimed = claim_in_another_session(app, state, session, loop_id, job_id)
    seen: list[tuple[str, bool]] = []

    def run():
        # What the claim's own thread sends.
        observed = statements_of(monkeypatch, thread=threading.get_ident())
        try:
            return claimed()
        finally:
            seen.extend(observed)

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS",
                              add_a_message_and_rewrite(loop_id), run)
    monkeypatch.undo()
    assert "error" not in outcome, outcome
    delivered = outcome["value"]
    assert delivered is not None and delivered.shell_id is not None
    assert delivered.history[-1].content == "sent while you waited"
    # Alone first (nothing written), then the lock and the same statement in a
    # transaction.
    kinds = [(text.split(" ")[0] + " " + text.split(" ")[1], auto) for text, auto in seen
             if text.startswith(("WITH seen", "SELECT status, frozen"))]
    assert kinds == [("WITH seen", True), ("SELECT status,", False), ("WITH seen", False)], kinds
    session.expire_all()
    assert session.get(Loop, loop_id).execution_token == delivered.token
    assert session.get(Job, job_id).state == "done"


def test_a_pause_committed_while_the_claim_waits_claims_nothing(
        app, state, session, running_job, database_url):
    loop_id, job_id = running_job

    run = claim_in_another_session(app, state, session, loop_id, job_id)

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS", lambda holder: holder.execute(
        "UPDATE solidloop_loops SET status = 'paused' WHERE id = %s", (loop_id,)), run)
    assert outcome == {"value": None}, outcome
    assert_unclaimed(session, loop_id, job_id, status="paused")


def test_a_lock_held_without_a_change_lets_the_claim_through(
        app, state, session, running_job, database_url):
    """A holder that only locks the row (and writes nothing) leaves the version
    the snapshot saw: the claim goes through once the lock is free."""
    loop_id, job_id = running_job

    claimed = claim_in_another_session(app, state, session, loop_id, job_id)

    def run():
        delivered = claimed()
        return delivered.token if delivered else None

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS", lambda holder: None, run)
    assert isinstance(outcome.get("value"), uuid.UUID), outcome
    session.expire_all()
    assert session.get(Loop, loop_id).execution_token == outcome["value"]
    assert session.get(Job, job_id).state == "done"


def test_a_delivered_turn_reads_once_and_claims_once_before_its_request(
        app, session, llm, drain, monkeypatch):
    """Through the drain (a consumer's claim, the job log, the turn): between the
    job's claim and the turn's end, the turn sends three statements, all in
    autocommit (the claim, its request put on record before it is sent, the
    turn's end); the job's acknowledgement is skipped (its claim marked it)."""
    llm.script("hello", {"content": "hi"})
    loop = Assistant.start(message="hello")
    seen = statements_of(monkeypatch)
    drain()
    monkeypatch.undo()
    first = next(i for i, (sql, _) in enumerate(seen)
                 if sql.startswith("SELECT * FROM solidloop_loops"))
    end = next(i for i, (sql, _) in enumerate(seen) if sql.startswith("WITH fenced"))
    assert [(sql.split(" AS")[0], auto) for sql, auto in seen[first:end + 1]] == [
        ("SELECT * FROM solidloop_loops WHERE id = %(loop_id)s", True), ("WITH seen", True),
        (loop_sql.RECORD_REQUEST.split(" AS")[0], True), ("WITH fenced", True)],\
        seen[first:end + 1]
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert {j.state for j in session.scalars(select(Job).where(Job.loop_id == loop.id))} \
        == {"done"}


def test_a_middleware_before_the_initialization_gets_the_history_read_after_the_claim(
        app, session, llm, drain):
    """The stack has a host middleware before AgentInitialization, so the claim
    statement writes the shell but leaves the history to the initialization."""
    llm.script("hello", {"content": "hi"})
    loop = RenewWhileClaimingAgent.start(message="hello")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    (request,) = [r for r in llm.requests if r.method == "POST"]
    assert request.json["messages"][-1]["content"] == "hello"


class DatabaseBlipOnce:
    """A host middleware before AgentInitialization whose first run meets a
    database error (as its own query would), after the turn's claim committed."""

    failed = False

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        if not DatabaseBlipOnce.failed:
            DatabaseBlipOnce.failed = True
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return self.next_step(ctx)


@solidloop.agent("database_blip")
class DatabaseBlipAgent(Agent):
    system_prompt = "You answer."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import AgentInitialization

        builder.insert_before(AgentInitialization, DatabaseBlipOnce)


def test_a_database_error_before_the_request_hands_the_claimed_turn_back(
        app, session, llm, drain, caplog):
    """The delivered claim committed before the stack ran, so a rollback does not
    undo it: the turn goes back to the queue (due a little later) instead of
    failing the loop, and its next delivery completes it."""
    DatabaseBlipOnce.failed = False
    llm.script("hello", {"content": "hi"})
    loop = DatabaseBlipAgent.start(message="hello")
    with caplog.at_level("WARNING", logger="flask_solidloop.turns"):
        drain()
    assert DatabaseBlipOnce.failed and not llm.requests
    assert any("queued again in 2s" in r.getMessage() for r in caplog.records)
    session.expire_all()
    held = session.get(Loop, loop.id)
    assert held.status == "queued" and held.error_message is None, held.error_message
    queued = session.scalars(select(Job).where(Job.loop_id == loop.id,
                                               Job.state == "queued")).all()
    assert len(queued) == 1
    assert session.scalar(select(func.count()).select_from(Message).where(
        Message.loop_id == loop.id, Message.status == "processing")) == 0
    # Due now (the test does not wait out the delay): the next delivery runs it.
    session.execute(update(Job).where(Job.id == queued[0].id).values(eta=func.now()))
    session.commit()
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert len([r for r in llm.requests if r.method == "POST"]) == 1


def test_a_turn_whose_claim_met_a_rewritten_loop_sends_what_was_added(
        app, state, session, llm, drain, database_url):
    """End to end through the drain: the loop is rewritten, with a message added,
    while the turn's claim waits for its row; the turn claims under the lock
    and its request carries that message."""
    llm.script(lambda body: True, {"content": "hi"})
    loop_id = Assistant.start(message="hello").id

    def run():
        with app.app_context():
            return drain()

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS",
                              add_a_message_and_rewrite(loop_id), run)
    assert "error" not in outcome, outcome
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    (request,) = [r for r in llm.requests if r.method == "POST"]
    assert request.json["messages"][-1]["content"] == "sent while you waited"
    assert {j.state for j in session.scalars(select(Job).where(Job.loop_id == loop_id))} \
        == {"done"}


def test_a_renewal_right_after_the_claim_does_not_lose_the_turn(app, session, llm, drain):
    """A renewal reads committed rows; the claim commits before the stack runs and
    its lease is registered then, so a renewal during the stack renews it."""
    llm.script("hello", {"content": "hi"})
    loop = RenewWhileClaimingAgent.start(message="hello")
    drain()
    session.expire_all()
    done = session.get(Loop, loop.id)
    assert done.status == "completed", (done.status, done.error_message)
    assert len(llm.requests) == 1


def test_a_shell_opened_on_its_own_is_fenced(session, running_job):
    """A stack with a step between its initialization and its request opens the
    turn's shell itself: on the claimed generation only."""
    from flask_solidloop.errors import LostLeaseError

    loop_id, _ = running_job
    delivered = claim(session, loop_id, shell=False, history=False)
    shell_id = store.open_shell(session, loop_id, delivered.token)
    session.expire_all()
    shell = session.get(Message, shell_id)
    assert (shell.status, shell.is_hidden, shell.role) == ("processing", True, "assistant")
    session.rollback()
    with pytest.raises(LostLeaseError):
        store.open_shell(session, loop_id, uuid.uuid4())


def test_a_turns_exit_fails_its_loop_and_hides_its_shell_once(session, running_job):
    from flask_solidloop.wire import WireRecord

    loop_id, _ = running_job
    delivered = claim(session, loop_id)
    wire = WireRecord(url="http://llm/v1", request_headers={}, request_body={"model": "m"},
                      status=503, response_body={"error": "busy"})
    assert not store.end_turn(session, loop_id, uuid.uuid4(), to="failed",
                              error_message="stale")  # another generation: nothing
    assert store.end_turn(session, loop_id, delivered.token, to="failed",
                          error_message="ProviderHTTPError: HTTP 503", wire=wire,
                          shell_id=delivered.shell_id, body_limit=1000)
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.error_message) == ("failed", "ProviderHTTPError: HTTP 503")
    assert loop.execution_token is None and loop.finished_at is not None
    shell = session.get(Message, delivered.shell_id)
    assert (shell.status, shell.is_hidden) == ("failed", True)
    from flask_solidloop.models import Event

    (event,) = session.scalars(select(Event).where(Event.loop_id == loop_id)).all()
    assert (event.kind, event.status_code, event.message_id) == (
        "llm_request", 503, delivered.shell_id)
    assert not store.end_turn(session, loop_id, delivered.token, to="failed",
                              error_message="again")  # once
    session.rollback()


def test_a_middleware_transition_sets_the_columns_it_names(session, running_job):
    loop_id, _ = running_job
    delivered = claim(session, loop_id)
    assert store.fenced_transition(session, loop_id, delivered.token, from_="running",
                                   to="paused", error_message="waiting for a human")
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.error_message, loop.execution_token) == (
        "paused", "waiting for a human", None)
    session.rollback()
    from flask_solidloop.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="unknown loop status"):
        store.fenced_transition(session, loop_id, delivered.token, from_="running", to="done")
    with pytest.raises(InvalidArgumentError, match="no column"):
        store.fenced_transition(session, loop_id, delivered.token, from_="paused",
                                to="failed", colour="red")
