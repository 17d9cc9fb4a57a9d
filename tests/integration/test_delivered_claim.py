"""A delivered LLM turn's claim in one statement (loops/store.py
``claim_delivered_llm_turn``): the claim, the job marked done, the shell and
the history, in autocommit after the job log's autocommit read.

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
from flask_solidloop.models import Job, Loop, Message
from flask_solidloop.queue.current_job import (
    CurrentJob,
    job_done_committed,
    set_current_job,
)

from ..support.support_app import Assistant, calc, llm_settings, solidloop
from .row_locks import hold_loop_while
from .test_turn_claim import RenewWhileClaimingAgent


def statements_of(monkeypatch) -> list[tuple[str, bool]]:
    """What this thread sends from here on (but the pool's pings), with its
    connection's autocommit mode. Other threads (the lease renewer) are left out."""
    seen: list[tuple[str, bool]] = []
    execute = psycopg.Cursor.execute
    me = threading.get_ident()

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
    return store.claim_delivered_llm_turn(session, loop_id, lease_seconds=30,
                                          open_shell=shell, read_history=history)


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
    assert loop.status == "running" and loop.execution_token == delivered.claim.token
    assert loop.lease_expires_at is not None and loop.lease_holder
    assert session.get(Job, job_id).state == "done"
    shell = session.get(Message, delivered.shell_id)
    assert shell.status == "processing" and shell.is_hidden
    history = delivered.claim.history
    assert history == queries.history(session, loop_id)  # what a fresh read gives
    assert [m.role for m in history] == ["system", "user"] and history[-1].content == "hello there"
    session.rollback()


def test_without_the_shell_or_the_history_the_turn_makes_them(session, running_job):
    loop_id, _ = running_job
    delivered = claim(session, loop_id, shell=False, history=False)
    assert delivered is not None
    assert delivered.shell_id is None and delivered.claim.history is None
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


def test_a_loop_rewritten_while_the_claim_waits_is_left_to_the_classic_claim(
        app, state, session, running_job, database_url):
    """Someone holding the loop row adds a message and rewrites the row, and the
    loop is still queued when they commit (a stop and a resume with a message
    look like this to a claim that waited through both). The statement's
    snapshot misses that message, so it must not claim; the classic claim,
    whose history read starts after the lock is held, then sends it."""
    loop_id, job_id = running_job

    run = claim_in_another_session(app, state, session, loop_id, job_id)

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS",
                              add_a_message_and_rewrite(loop_id), run)
    assert outcome == {"value": None}, outcome
    assert_unclaimed(session, loop_id, job_id)
    # What the turn does next: the classic claim, and the history read after it.
    classic = store.start_llm_turn(session, loop_id, lease_seconds=30)
    assert classic is not None
    assert queries.history(session, loop_id)[-1].content == "sent while you waited"
    store.commit_claim(session, classic)


def test_a_pause_committed_while_the_claim_waits_claims_nothing(
        app, state, session, running_job, database_url):
    loop_id, job_id = running_job

    run = claim_in_another_session(app, state, session, loop_id, job_id)

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS", lambda holder: holder.execute(
        "UPDATE solidloop_loops SET status = 'paused' WHERE id = %s", (loop_id,)), run)
    assert outcome == {"value": None}, outcome
    assert_unclaimed(session, loop_id, job_id, status="paused")
    assert store.start_llm_turn(session, loop_id, lease_seconds=30) is None


def test_a_lock_held_without_a_change_lets_the_claim_through(
        app, state, session, running_job, database_url):
    """A holder that only locks the row (and writes nothing) leaves the version
    the snapshot saw: the claim goes through once the lock is free."""
    loop_id, job_id = running_job

    claimed = claim_in_another_session(app, state, session, loop_id, job_id)

    def run():
        delivered = claimed()
        return delivered.claim.token if delivered else None

    outcome = hold_loop_while(database_url, loop_id, "WITH seen AS", lambda holder: None, run)
    assert isinstance(outcome.get("value"), uuid.UUID), outcome
    session.expire_all()
    assert session.get(Loop, loop_id).execution_token == outcome["value"]
    assert session.get(Job, job_id).state == "done"


def test_a_delivered_turn_reads_once_and_claims_once_before_its_request(
        app, session, llm, drain, monkeypatch):
    """Through the drain (a consumer's claim, the job log, the turn): between the
    job's claim and the turn's end, the turn sends two statements, both in
    autocommit; the job's acknowledgement is skipped (its claim marked it)."""
    llm.script("hello", {"content": "hi"})
    loop = Assistant.start(message="hello")
    seen = statements_of(monkeypatch)
    drain()
    monkeypatch.undo()
    first = next(i for i, (sql, _) in enumerate(seen)
                 if sql.startswith("SELECT * FROM solidloop_loops"))
    end = next(i for i, (sql, _) in enumerate(seen) if sql.startswith("WITH fenced"))
    assert [(sql.split(" AS")[0], auto) for sql, auto in seen[first:end + 1]] == [
        ("SELECT * FROM solidloop_loops WHERE id = %s", True), ("WITH seen", True),
        ("WITH fenced", True)], seen[first:end + 1]
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
        from flask_solidloop.pipeline.llm_stack import AgentInitialization

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
    while the turn's claim waits for its row; the turn claims the classic way
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
