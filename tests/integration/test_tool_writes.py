"""An in-process tool's database writes commit with its result, exactly once
(docs/decisions/0021-tool-writes-and-loop-ends.md, item 1): the tool is lent
the worker's session (``ctx.session``, and ``db.session`` on its thread); what
it leaves uncommitted there commits in the transaction that records the call's
outcome. A tool that raises has its writes rolled back; one that commits on
its own commits at once (at least once); one that leaves writes on a session
of its own is warned about. Real PostgreSQL, the real LLM emulator, the
worker's real tool threads."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from flask_solidloop import Agent, CallContext, Toolset
from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Loop, ToolCall
from flask_solidloop.pipeline import tool_threads

from ..support.support_app import AuditBeforeTool, PassAfterTool, db, llm_settings, solidloop

TICKETS_DDL = ("CREATE TABLE IF NOT EXISTS helpdesk_tickets (id integer PRIMARY KEY, "
               "status text NOT NULL DEFAULT 'new', touches integer NOT NULL DEFAULT 0)")


class Ticket(db.Model):
    __tablename__ = "helpdesk_tickets"
    id = db.Column(db.Integer, primary_key=True)
    status = db.Column(db.Text, nullable=False, default="new")
    touches = db.Column(db.Integer, nullable=False, default=0)


desk = Toolset("desk")
SEEN: dict[str, object] = {}
#: Released at the end of each test, so no hung tool outlives it.
RELEASE = threading.Event()


@desk.tool
def triage(ticket: int) -> str:
    """Mark a ticket triaged through db.session, without committing."""
    row = db.session.get(Ticket, ticket)
    row.status = "triaged"
    row.touches += 1
    return f"ticket {ticket} triaged"


@desk.tool
def touch(ticket: int, ctx: CallContext) -> str:
    """Count a touch through ctx.session, in SQL."""
    SEEN["same_session"] = ctx.session is db.session()
    ctx.session.execute(text("UPDATE helpdesk_tickets SET touches = touches + 1 "
                             "WHERE id = :id"), {"id": ticket})
    return "touched"


@desk.tool
def touch_then_raise(ticket: int) -> str:
    """Write, then fail."""
    db.session.get(Ticket, ticket).touches += 1
    db.session.flush()
    raise RuntimeError("the mail server refused the notification")


@desk.tool
def touch_and_commit(ticket: int) -> str:
    """Write and commit on its own (at least once)."""
    db.session.get(Ticket, ticket).touches += 1
    db.session.commit()
    return "committed by the tool"


@desk.tool
def touch_elsewhere(ticket: int) -> str:
    """Write on a session of its own, and forget to commit."""
    other = Session(db.engine)
    other.get(Ticket, ticket).touches += 1
    other.flush()
    SEEN["other"] = other  # kept alive: its writes are pending, not lost yet
    return "touched elsewhere"


@desk.tool
def touch_then_swallow(ticket: int) -> str:
    """Write, then catch a database error and return as if all went well."""
    db.session.get(Ticket, ticket).touches += 1
    db.session.flush()
    with contextlib.suppress(Exception):
        db.session.execute(text("SELECT * FROM no_such_table"))
    return "carried on"


@desk.tool(timeout=0.5)
def touch_then_hang(ticket: int) -> str:
    """Write, then outlive the call's timeout until the test releases it."""
    db.session.get(Ticket, ticket).touches += 1
    db.session.flush()
    RELEASE.wait(30)
    return "returned at last"


@desk.tool
def peek(ticket: int) -> str:
    """Read a ticket through db.session, writing nothing."""
    SEEN["peeks"] = int(SEEN.get("peeks", 0)) + 1
    return db.session.get(Ticket, ticket).status


@desk.tool
def whoami(ctx: CallContext) -> str:
    return f"principal={ctx.principal}"


@solidloop.agent("helpdesk")
class Helpdesk(Agent):
    system_prompt = "You triage tickets."
    mcps = [{"name": "desk", "toolset": desk}]

    def llm(self) -> dict:
        return llm_settings()

    def mcp_principal(self):
        return f"helpdesk-loop-{self.loop.id}"


@solidloop.agent("helpdesk_audited")
class AuditedHelpdesk(Helpdesk):
    """A middleware between the tool's run and its answer: the result is
    recorded (with the tool's writes) before the answer."""

    def configure_tool_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline import ResponseCreation, ToolExecution

        builder.insert_before(ToolExecution, AuditBeforeTool)
        builder.insert_before(ResponseCreation, PassAfterTool)


@pytest.fixture(autouse=True)
def tickets(pg):
    pg.execute(TICKETS_DDL)
    pg.execute("TRUNCATE helpdesk_tickets")
    pg.execute("INSERT INTO helpdesk_tickets (id) VALUES (1), (2)")
    SEEN.clear()
    RELEASE.clear()
    yield
    RELEASE.set()
    pool = tool_threads.pool()
    deadline = time.monotonic() + 10
    while pool.quarantined and time.monotonic() < deadline:
        time.sleep(0.02)
    other = SEEN.pop("other", None)
    if other is not None:
        other.close()


def ticket(pg, ticket_id=1):
    return pg.execute("SELECT status, touches, xmin::text FROM helpdesk_tickets WHERE id = %s",
                      (ticket_id,)).fetchone()


def outcome_xmin(pg, loop_id):
    """The transaction that recorded the loop's (one) tool call's result."""
    return pg.execute("SELECT e.xmin::text FROM solidloop_events e JOIN solidloop_tool_calls t "
                      "ON t.id = e.tool_call_id WHERE t.loop_id = %s", (loop_id,)).fetchone()[0]


def answered_by_tools(body):
    return body["messages"][-1]["role"] == "tool"


def run_tool(llm, drain, session, name, agent=Helpdesk, arguments=None):
    llm.script(f"please {name}", {"tool_calls": [
        {"name": name, "arguments": {"ticket": 1} if arguments is None else arguments}]})
    llm.script(answered_by_tools, {"content": "done"})
    loop = agent.start(message=f"please {name}")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    session.rollback()
    return loop, call


def test_a_tools_uncommitted_orm_writes_commit_with_its_result(app, session, llm, drain, pg):
    loop, call = run_tool(llm, drain, session, "triage")
    status, touches, xmin = ticket(pg)
    assert (status, touches) == ("triaged", 1) and call.is_success
    # One transaction wrote the ticket and the call's recorded result.
    assert xmin == outcome_xmin(pg, loop.id)


def test_ctx_session_is_the_lent_session_and_its_sql_commits_with_the_result(
        app, session, llm, drain, pg):
    loop, _ = run_tool(llm, drain, session, "touch")
    assert SEEN["same_session"] is True
    _, touches, xmin = ticket(pg)
    assert touches == 1 and xmin == outcome_xmin(pg, loop.id)


def test_with_a_middleware_between_the_writes_commit_with_the_checkpoint(
        app, session, llm, drain, pg):
    loop, call = run_tool(llm, drain, session, "triage", agent=AuditedHelpdesk)
    _, touches, xmin = ticket(pg)
    assert touches == 1 and call.is_success
    assert xmin == outcome_xmin(pg, loop.id)


def test_a_tool_that_raises_has_its_writes_rolled_back(app, session, llm, drain, pg):
    _, call = run_tool(llm, drain, session, "touch_then_raise")
    assert not call.is_success
    assert "the mail server refused" in call.result["content"][0]["text"]
    assert ticket(pg)[1] == 0


def test_a_tool_that_commits_on_its_own_commits_at_once(app, session, llm, drain, pg):
    loop, call = run_tool(llm, drain, session, "touch_and_commit")
    _, touches, xmin = ticket(pg)
    assert touches == 1 and call.is_success
    assert xmin != outcome_xmin(pg, loop.id)  # its own commit, before the outcome's


def test_writes_left_on_another_session_are_warned_about(app, session, llm, drain, pg, caplog):
    run_tool(llm, drain, session, "touch_elsewhere")
    assert "tool 'touch_elsewhere' left writes on a database session of its own that it " \
        "did not commit" in caplog.text
    assert "Write through ctx.session (or db.session)" in caplog.text


def test_a_tool_that_swallows_a_database_error_has_its_writes_rolled_back(
        app, session, llm, drain, pg, caplog):
    _, call = run_tool(llm, drain, session, "touch_then_swallow")
    assert call.is_success and call.result["content"][0]["text"] == "carried on"
    assert ticket(pg)[1] == 0
    assert "tool 'touch_then_swallow' returned with its database transaction failed" \
        in caplog.text


def test_a_timed_out_tools_writes_never_land(app, session, llm, drain, pg):
    _, call = run_tool(llm, drain, session, "touch_then_hang")
    assert call.error_kind == "timeout"
    # The worker went on with a fresh session: the loop completed meanwhile.
    RELEASE.set()
    pool = tool_threads.pool()
    deadline = time.monotonic() + 10
    while pool.quarantined and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.quarantined == 0
    assert ticket(pg)[1] == 0  # rolled back when the abandoned tool returned


def test_the_agents_mcp_principal_reaches_its_tools(app, session, llm, drain):
    loop, call = run_tool(llm, drain, session, "whoami", arguments={})
    assert call.result["content"][0]["text"] == f"principal=helpdesk-loop-{loop.id}"


@pytest.fixture
def outcome_fails_once(pg, session):
    """The first tool answer's statement fails as a lost transaction would
    (a serialization failure: transient); the sequence's count survives the
    rollback that undoes everything else."""
    from ..support.db_faults import failing_once

    with failing_once(pg, "tool_writes_fail_once", table="solidloop_messages",
                      when="NEW.role = 'tool'",
                      trigger="CREATE TRIGGER {name} BEFORE INSERT ON {table} "
                              "FOR EACH ROW EXECUTE FUNCTION {name}()"):
        yield
        session.rollback()  # its read locks would hold the DROP up


def test_an_outcome_that_fails_to_commit_leaves_neither_and_the_rerun_applies_it_once(
        app, state, session, llm, drain, pg, outcome_fails_once, caplog):
    llm.script("please touch", {"tool_calls": [{"name": "touch", "arguments": {"ticket": 1}}]})
    llm.script(answered_by_tools, {"content": "done"})
    loop = Helpdesk.start(message="please touch")
    drain()
    session.expire_all()
    call = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    # Neither the write nor the result: the outcome was not retried in place
    # (its rollback undid the tool's write), the call is left to its lease.
    assert call.executed_at is None and ticket(pg)[1] == 0
    assert "the database failed after the tool ran" in caplog.text
    session.rollback()
    # Its worker is gone (as after a kill): the lease lapses, the reaper takes over.
    pg.execute("UPDATE solidloop_tool_calls SET leased_until = now() - interval '1 second' "
               "WHERE id = %s", (call.id,))
    assert reap(state).stalled_tools == [call.id]
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert ticket(pg)[1] == 1  # the tool ran twice; its write landed once
    _, _, xmin = ticket(pg)
    assert xmin == outcome_xmin(pg, loop.id)


def test_a_tool_that_only_read_leaves_its_outcome_retried_in_place(
        app, session, llm, drain, pg, outcome_fails_once, caplog):
    """Reads are not writes: the outcome of a tool that only read through the
    session is retried in place on a database error, never the tool."""
    _, call = run_tool(llm, drain, session, "peek")
    assert call.result["content"][0]["text"] == "new"
    assert SEEN["peeks"] == 1
    assert "the result and its answer: the database failed" in caplog.text
