"""Paths no test walked before issue 27: a tool middleware between execution and
answer, a tool turn that fails after its tool ran, the sequential out-of-order
redirect, the tool lease's renewal ceiling on a hung in-process tool, a host's
own ``transport=`` object in a loop, and an admin subject resolver that raises.
Real PostgreSQL, the LLM emulator over HTTP, the in-process drain (the worker's
claim SQL and middleware)."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import delete, select

from flask_solidloop import Agent, ToolResult, Toolset
from flask_solidloop.mcp.transport import IDEMPOTENCY_META_KEY
from flask_solidloop.models import Job, Loop, McpSession, Message, ToolCall
from flask_solidloop.pipeline.tool_stack import ToolExecution
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing import drain as run

from ..support.support_app import (
    SIDE_EFFECTS,
    Assistant,
    SequentialAssistant,
    calc,
    create_app,
    llm_settings,
    solidloop,
)


def loop_row(session, loop_id: int) -> Loop:
    session.expire_all()
    return session.get(Loop, loop_id)


def calls_of(session, loop_id: int) -> list[ToolCall]:
    session.expire_all()
    return list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)
                                .order_by(ToolCall.position)))


def tool_messages(session, loop_id: int) -> list[Message]:
    session.expire_all()
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "tool").order_by(Message.id)))


def runs_of(key: str) -> int:
    return sum(1 for _, k in SIDE_EFFECTS if k == key)


# ------------------------------------- a middleware between execution and answer

#: What the middleware saw, from a connection of its own (so: what was committed).
SEEN: list[dict[str, Any]] = []
#: Set by a test: the middleware raises instead of passing the call on.
BREAK: list[str] = []


class AuditBetween:
    """Sits between ToolExecution and ResponseCreation (the audit/redaction spot)."""

    database_url = ""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        with psycopg.connect(libpq_url(self.database_url), autocommit=True) as conn:
            executed, result = conn.execute(
                "SELECT executed_at IS NOT NULL, result FROM solidloop_tool_calls "
                "WHERE id = %s", (ctx.tool_call_id,)).fetchone()
            (answers,) = conn.execute(
                "SELECT count(*) FROM solidloop_messages WHERE tool_call_id = %s",
                (ctx.tool_call_id,)).fetchone()
        SEEN.append({"executed": executed, "stored": result, "answers": answers,
                     "result_text": ctx.result.text() if ctx.result else None})
        if BREAK:
            raise RuntimeError(BREAK[0])
        return self.next_step(ctx)


@solidloop.agent("audited_between")
class Audited(Agent):
    system_prompt = "You add numbers."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_tool_middlewares(self, builder) -> None:
        builder.insert_after(ToolExecution, AuditBetween)


@pytest.fixture
def audit(database_url):
    AuditBetween.database_url = database_url
    SEEN.clear()
    BREAK.clear()
    yield
    BREAK.clear()


def script_one_add(llm) -> None:
    llm.script("add 2 and 3", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "It is 5."})


def test_a_middleware_between_sees_the_recorded_result_before_the_answer_commits(
        app, session, llm, drain, audit):
    script_one_add(llm)
    loop = Audited.start(message="add 2 and 3")
    drain()
    assert loop_row(session, loop.id).status == "completed"
    (call,) = calls_of(session, loop.id)
    # ToolExecution committed the result on its own; the answer was not there yet.
    (seen,) = SEEN
    assert seen == {"executed": True, "stored": call.result, "answers": 0, "result_text": "5"}
    assert [m.content for m in tool_messages(session, loop.id)] == ["5"]
    assert runs_of(call.idempotency_key) == 1


def test_a_tool_turn_failing_after_its_tool_ran_keeps_the_result_and_resume_answers_it(
        app, session, llm, drain, audit):
    script_one_add(llm)
    BREAK.append("the audit store is down")
    loop = Audited.start(message="add 2 and 3")
    drain()
    row = loop_row(session, loop.id)
    (call,) = calls_of(session, loop.id)
    assert row.status == "failed"
    assert row.error_message == \
        f"tool call {call.id}: RuntimeError: the audit store is down"
    # The result is recorded, no answer written.
    assert call.executed_at is not None
    assert tool_messages(session, loop.id) == []

    BREAK.clear()
    assert Audited(loop.id).resume(from_=("failed",)) is True
    drain()
    assert loop_row(session, loop.id).status == "completed"
    assert [m.content for m in tool_messages(session, loop.id)] == ["5"]
    # Answered from the recorded result: the tool body ran once in all.
    assert runs_of(call.idempotency_key) == 1


@solidloop.agent("audited_before")
class AuditedBefore(Agent):
    system_prompt = "You add numbers."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_tool_middlewares(self, builder) -> None:
        builder.insert_before(ToolExecution, AuditBetween)  # an authorization's spot


def test_a_tool_turn_failing_before_its_tool_ran_can_be_resumed_at_once(
        app, session, llm, drain, audit):
    script_one_add(llm)
    BREAK.append("not authorized")
    loop = AuditedBefore.start(message="add 2 and 3")
    drain()
    (call,) = calls_of(session, loop.id)
    assert loop_row(session, loop.id).status == "failed" and call.executed_at is None
    BREAK.clear()
    assert AuditedBefore(loop.id).resume(from_=("failed",)) is True
    drain()
    assert loop_row(session, loop.id).status == "completed"
    assert runs_of(calls_of(session, loop.id)[0].idempotency_key) == 1


# --------------------------------------------- the sequential out-of-order redirect


def test_a_sequential_call_delivered_out_of_order_runs_the_head_of_the_line_first(
        app, state, session, llm):
    llm.script("three sums", {"tool_calls": [
        {"name": "add", "arguments": {"a": i, "b": 10}} for i in range(3)]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "done"})
    loop = SequentialAssistant.start(message="three sums please")
    run(app, queues=("solidloop_llm",))
    head, second, third = calls_of(session, loop.id)
    # Only the head's job is queued. Lose it, and deliver the third call's job
    # instead: the out-of-order delivery must bring the head back, not run.
    session.execute(delete(Job).where(Job.state == "queued"))
    state.dispatch.tool_call(session, third.id, loop_row(session, loop.id).execution_token,
                             loop_id=loop.id)
    session.commit()
    run(app)
    assert loop_row(session, loop.id).status == "completed"
    head, second, third = calls_of(session, loop.id)
    assert head.executed_at < second.executed_at < third.executed_at
    assert [runs_of(c.idempotency_key) for c in (head, second, third)] == [1, 1, 1]
    assert [m.content for m in tool_messages(session, loop.id)] == ["10", "11", "12"]


# ----------------------------- the renewal ceiling of a hung in-process tool's lease

watch = Toolset("watch")
#: Where the watching tool reads its own lease from.
WATCH_DATABASE: list[str] = []


@watch.tool(timeout=60)
def watch_own_lease(ctx) -> str:
    """Hang (busy, far within its 60 s timeout) until this call's lease lapses,
    counting the renewals seen; give up after 30 s."""
    call_id = int(str(ctx.idempotency_key).rsplit(":", 1)[1])
    stamps: list[Any] = []
    with psycopg.connect(WATCH_DATABASE[0], autocommit=True) as conn:
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            until, lapsed = conn.execute(
                "SELECT leased_until, leased_until < now() FROM solidloop_tool_calls "
                "WHERE id = %s", (call_id,)).fetchone()
            if until not in stamps:
                stamps.append(until)
            if lapsed:
                return f"lapsed after {len(stamps) - 1} renewal(s)"
            time.sleep(0.1)
    return f"still leased after {len(stamps) - 1} renewal(s)"


@solidloop.agent("lease_watcher")
class LeaseWatcher(Agent):
    system_prompt = "You watch leases."
    mcps = [{"name": "watch", "toolset": watch}]
    max_duration = 3600

    def llm(self) -> dict:
        return llm_settings()


def test_a_hung_in_process_tools_lease_stops_being_renewed_at_its_ceiling(
        session, llm, database_url, caplog):
    WATCH_DATABASE[:] = [libpq_url(database_url)]
    # A 2 s lease (renewed every second), 1 s of leak grace.
    app = create_app(SOLIDLOOP_LIVENESS_TTL=2, SOLIDLOOP_LEASE_LEAK_GRACE=1)
    llm.script("watch", {"tool_calls": [{"name": "watch_own_lease", "arguments": {}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "seen"})
    try:
        with app.app_context():
            loop_id = LeaseWatcher.start(message="watch your lease").id
            run(app, queues=("solidloop_llm",))
            # The call's ceiling is min(max_duration, tool timeout) + grace: lowered
            # to 4 + 1 s now, after the first turn, which is then never near it.
            LeaseWatcher.max_duration = 4
            caplog.set_level(logging.WARNING, logger="flask_solidloop.renewer")
            run(app)
    finally:
        LeaseWatcher.max_duration = 3600
        app.extensions["solidloop"].broker.close()
    (call,) = calls_of(session, loop_id)
    # Renewed while under its ceiling, then left to lapse with the tool still in
    # its body (its own 60 s timeout far off): a stuck call cannot hold its
    # lease forever. Nobody took it over meanwhile, so its result was kept.
    answer = tool_messages(session, loop_id)[0].content
    assert answer.startswith("lapsed after ") and not answer.startswith("lapsed after 0 ")
    assert call.is_success is True
    assert any(f"lease renewer dropped tool {call.id}: registered for longer than its "
               "ceiling (5s" in r.getMessage() for r in caplog.records)


# ------------------------------------------------- a host's own transport= object


class InventoryTransport:
    """A host's transport: two tools, every call and listing recorded."""

    def __init__(self) -> None:
        self.listings = 0
        self.calls: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []

    def list_tools(self) -> list[dict[str, Any]]:
        self.listings += 1
        return [{"name": "stock", "description": "Units in stock for a SKU.",
                 "inputSchema": {"type": "object", "properties": {"sku": {"type": "string"}},
                                 "required": ["sku"]}}]

    def call_tool(self, name: str, arguments: dict[str, Any], *,
                  meta: dict[str, Any] | None = None) -> ToolResult:
        self.calls.append((name, arguments, meta))
        return ToolResult(content=[{"type": "text", "text": f"{arguments['sku']}: 7 units"}],
                          structured_content={"sku": arguments["sku"], "units": 7})

    def session_state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


INVENTORY = InventoryTransport()


@solidloop.agent("inventory_transport_clerk")
class InventoryClerk(Agent):
    system_prompt = "You check stock."
    mcps = [{"name": "inventory", "transport": INVENTORY, "prefix": "inv"}]

    def llm(self) -> dict:
        return llm_settings()


def test_a_host_transport_object_serves_a_loops_tool_calls(app, session, llm, drain):
    INVENTORY.listings, INVENTORY.calls = 0, []
    llm.script("stock", {"tool_calls": [{"name": "inv__stock", "arguments": {"sku": "A1"}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool",
               {"content": "There are 7."})
    loop = InventoryClerk.start(message="how much stock of A1?")
    drain()
    assert loop_row(session, loop.id).status == "completed"
    (call,) = calls_of(session, loop.id)
    assert (call.name, call.server_name, call.tool_name) == ("inv__stock", "inventory", "stock")
    assert INVENTORY.calls == [("stock", {"sku": "A1"},
                                {IDEMPOTENCY_META_KEY: f"solidloop:tool_call:{call.id}"})]
    assert [m.content for m in tool_messages(session, loop.id)] == ["A1: 7 units"]
    # Listed once, at the first turn; the second turn advertised the snapshot.
    assert INVENTORY.listings == 1 and len(llm.requests) == 2
    assert llm.requests[1].json["tools"][0]["function"]["name"] == "inv__stock"
    snapshot = session.scalars(select(McpSession).where(McpSession.loop_id == loop.id)).one()
    assert snapshot.server_name == "inventory" and snapshot.tools[0]["name"] == "stock"


# ------------------------------------------------- a subject resolver that raises


def test_a_subject_resolver_that_raises_leaves_the_label_as_text(app, session, caplog):
    def resolver(loop):
        raise LookupError("the CRM is down")

    app.register_blueprint(solidloop.admin_blueprint(
        authorize=lambda request: True, subject_resolver=resolver), url_prefix="/admin")
    loop = Assistant.start(message="hi", subject=("User", "7"))
    caplog.set_level(logging.WARNING, logger="flask_solidloop.admin")
    client = app.test_client()
    page = client.get(f"/admin/loops/{loop.id}")
    listing = client.get("/admin/loops")
    assert page.status_code == 200 and listing.status_code == 200
    cell = page.get_data(as_text=True).split('id="loop-subject"')[1].split("</td>")[0]
    assert '<span class="subject">User #7</span>' in cell and "href" not in cell
    assert '<span class="subject">' in listing.get_data(as_text=True)
    assert any(f"subject_resolver raised for loop {loop.id}" in r.getMessage()
               and r.exc_info and "the CRM is down" in str(r.exc_info[1])
               for r in caplog.records)
