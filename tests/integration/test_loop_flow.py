"""A loop from start to completion, driven in-process against the real emulator."""

from __future__ import annotations

import json

from sqlalchemy import select

from flask_solidloop.models import Event, Job, Loop, Message, ToolCall

from ..support.rows import visible
from ..support.support_app import SIDE_EFFECTS, Assistant, BatchAgent, SequentialAssistant


def test_start_writes_loop_messages_and_job_in_one_commit(app, session):
    loop = Assistant.start(message="hello", subject=("User", 7))
    assert loop.status == "queued"
    assert (loop.subject_type, loop.subject_id) == ("User", "7")
    roles = [m.role for m in visible(session, loop.id)]
    assert roles == ["system", "user"]
    jobs = list(session.scalars(select(Job)))
    assert [(j.actor_name, j.state, j.loop_id) for j in jobs] == [
        ("solidloop.llm_turn", "queued", loop.id)
    ]


def test_tool_loop_completes(app, session, llm, drain):
    llm.script("add 2 and 3", {"content": "Calling add.",
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "The sum is 5."})
    loop = Assistant.start(message="Please add 2 and 3")
    assert drain() == 3  # llm turn, tool call, llm turn
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "completed", loop.error_message
    assert loop.execution_token is None and loop.lease_expires_at is None
    assert loop.step_count == 2
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant", "tool", "assistant"]
    assert history[3].content == "5"
    assert history[4].content == "The sum is 5."
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is True and call.executed_at is not None
    assert call.response_message_id == history[3].id
    assert [("add", f"solidloop:tool_call:{call.id}")] == SIDE_EFFECTS
    # the second request carried the tool result back to the model in OpenAI shape
    second = llm.requests[1].json
    assert second["messages"][-2]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": json.dumps({"a": 2, "b": 3})}
    assert second["messages"][-1] == {"role": "tool", "content": "5",
                                      "tool_call_id": second["messages"][-2]["tool_calls"][0]["id"]}
    assert second["tools"][0]["function"]["name"] == "add"
    # every job marked done; the wire log has both LLM requests and the tool call
    assert {j.state for j in session.scalars(select(Job))} == {"done"}
    kinds = [e.kind for e in session.scalars(select(Event).order_by(Event.id))]
    assert kinds == ["llm_request", "tool_call", "llm_request"]


def test_parallel_tool_calls_enqueue_together_and_resolve_once(app, session, llm, drain):
    llm.script("two sums", {"tool_calls": [
        {"name": "add", "arguments": {"a": 1, "b": 1}},
        {"name": "add", "arguments": {"a": 2, "b": 2}},
    ]})
    llm.script("4", {"content": "2 and 4"})
    loop = Assistant.start(message="two sums please")
    from flask_solidloop.testing import drain as run

    run(app, queues=("solidloop_llm",))
    queued = list(session.scalars(select(Job).where(Job.state == "queued")))
    assert sorted(j.actor_name for j in queued) == ["solidloop.tool_call"] * 2
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    tool_messages = [m for m in visible(session, loop.id) if m.role == "tool"]
    assert sorted(m.content for m in tool_messages) == ["2", "4"]


def test_sequential_mode_runs_one_call_at_a_time(app, session, llm, drain):
    llm.script("seq", {"tool_calls": [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "add", "arguments": {"a": 3, "b": 4}},
    ]})
    llm.script("7", {"content": "done"})
    loop = SequentialAssistant.start(message="seq")
    from flask_solidloop.testing import drain as run

    run(app, queues=("solidloop_llm",))
    queued = list(session.scalars(select(Job).where(Job.state == "queued")))
    assert len(queued) == 1  # only the head of the line
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    assert calls[0].executed_at < calls[1].executed_at


def test_bad_tool_arguments_and_unknown_tool_become_tool_errors(app, session, llm, drain):
    llm.script("break things", {"tool_calls": [
        {"name": "add", "arguments": "{not json"},
        {"name": "no_such_tool", "arguments": {}},
        {"name": "add", "arguments": {"a": "x", "b": 1}},
        {"name": "explode", "arguments": {"reason": "boom"}},
    ]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "I see errors."})
    loop = Assistant.start(message="break things")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    assert [c.is_success for c in calls] == [False, False, False, False]
    texts = [session.get(Message, c.response_message_id).content for c in calls]
    assert "not a JSON object" in texts[0]
    assert "unknown tool 'no_such_tool'" in texts[1] and "add" in texts[1]
    assert "a" in texts[2] and "integer" in texts[2]
    assert "RuntimeError: exploded: boom" in texts[3]


def test_provider_http_error_fails_loop_with_status_and_body(app, session, llm, drain):
    llm.fail_next(403, body={"error": {"message": "model access denied"}})
    loop = Assistant.start(message="hi")
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "failed"
    assert "HTTP 403" in loop.error_message and "model access denied" in loop.error_message
    assert loop.execution_token is None
    shells = list(session.scalars(select(Message).where(Message.role == "assistant")))
    assert [(s.status, s.is_hidden) for s in shells] == [("failed", True)]
    event = session.scalars(select(Event)).one()
    assert event.status_code == 403


def test_transient_error_is_retried_honouring_retry_after(app, session, llm, drain):
    llm.fail_next(429, headers={"Retry-After": "0.1"}, times=2)
    llm.script("hi", {"content": "hello"})
    loop = Assistant.start(message="hi")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    event = session.scalars(select(Event)).one()
    attempts = event.payload["attempts"]
    assert [a.get("status") for a in attempts] == [429, 429, 200]
    # Retry-After is the floor; full jitter adds at most the backoff (0.05 s in tests)
    assert 0.1 <= attempts[0]["retry_in_s"] <= 0.1 + 0.05


def test_api_key_never_reaches_the_database(app, session, llm, drain):
    llm.script("secret", {"content": "ok"})
    Assistant.start(message="secret")
    drain()
    assert llm.requests[0].headers["authorization"] == "Bearer sk-test-secret-123"
    dump = session.connection().exec_driver_sql(
        "SELECT string_agg(t::text, '') FROM (SELECT * FROM solidloop_events) t "
        "UNION ALL SELECT string_agg(t::text, '') FROM (SELECT * FROM solidloop_llm_answers) t "
        "UNION ALL SELECT string_agg(t::text, '') FROM (SELECT * FROM solidloop_loops) t "
        "UNION ALL SELECT string_agg(t::text, '') FROM (SELECT * FROM solidloop_messages) t"
    ).scalars().all()
    text = "".join(d or "" for d in dump)
    assert "sk-test-secret-123" not in text
    assert "[redacted]" in text


def test_host_driven_completion_recipe_skips_the_final_request(app, session, llm, drain):
    llm.script("seed", {"tool_calls": [{"name": "lookup", "arguments": {"key": "ab"}},
                                       {"name": "add", "arguments": {"a": 1, "b": 1}}]})
    loop = BatchAgent.start(message="seed two records")
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "completed"
    assert loop.execution_token is None and loop.lease_expires_at is None
    assert not loop.error_message
    assert len(llm.requests) == 1  # the "done" request was never bought
    assert loop.step_count == 1
    assert not list(session.scalars(select(Message).where(Message.status == "processing")))
    assert {j.state for j in session.scalars(select(Job))} == {"done"}


def test_max_steps_pauses_the_loop(app, session, llm, drain):
    from ..support.support_app import solidloop

    class Limited(Assistant):
        max_steps = 1

    solidloop.agent("limited")(Limited)
    llm.script("loop", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]})
    loop = Limited.start(message="loop forever")
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "paused"
    assert "max_steps" in loop.error_message


IDLE_IN_TX = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
              "AND state LIKE 'idle in transaction%%'")


def test_no_transaction_stays_open_during_the_llm_call_or_a_tool_run(app, session, llm, drain,
                                                                     database_url):
    import psycopg

    from flask_solidloop import Agent, Toolset
    from flask_solidloop.queue.broker import libpq_url

    from ..support.support_app import solidloop

    seen = {}
    probe = Toolset("probe")

    def idle_transactions():
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            return conn.execute(IDLE_IN_TX).fetchone()[0]

    @probe.tool
    def look() -> str:
        seen["tool"] = idle_transactions()
        return "looked"

    def during_request(body):
        seen.setdefault("llm", idle_transactions())
        if body["messages"][-1]["role"] == "tool":
            return {"content": "done"}
        return {"tool_calls": [{"name": "look", "arguments": {}}]}

    emulator_url = llm.base_url

    class Probe(Agent):
        llm = {"base_url": emulator_url, "model": "m"}
        mcps = [{"name": "probe", "toolset": probe}]

    solidloop.agent("probe")(Probe)
    llm.script("probe", during_request)
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", during_request)
    session.commit()
    loop = Probe.start(message="probe")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert seen == {"llm": 0, "tool": 0}


def test_a_tool_that_breaks_the_session_gets_a_tool_error_not_a_failed_loop(
        app, session, llm, drain):
    from sqlalchemy import text

    from flask_solidloop import Agent, Toolset

    from ..support.support_app import db, solidloop

    bad = Toolset("bad_sql")

    @bad.tool
    def broken_query() -> str:
        db.session.execute(text("SELECT * FROM no_such_table"))
        return "unreachable"

    @bad.tool
    def uncommitted_write(note: str) -> str:
        db.session.add(Message(loop_id=1, role="user", content=note))
        db.session.flush()
        return "wrote without committing"

    emulator_url = llm.base_url

    class BadSql(Agent):
        llm = {"base_url": emulator_url, "model": "m"}
        mcps = [{"name": "bad", "toolset": bad}]

    solidloop.agent("bad_sql")(BadSql)
    llm.script("sql", {"tool_calls": [{"name": "broken_query", "arguments": {}},
                                      {"name": "uncommitted_write",
                                       "arguments": {"note": "kept with the result"}}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "noted"})
    loop = BadSql.start(message="sql please")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    assert [c.is_success for c in calls] == [False, True]
    assert "UndefinedTable" in calls[0].result["content"][0]["text"]
    # The failed query was rolled back with its tool's error; the uncommitted
    # write of the other tool committed with that call's result
    # (tests/integration/test_tool_writes.py has the whole contract).
    assert session.scalar(select(Message).where(Message.content == "kept with the result"))


def test_secret_looking_custom_headers_never_reach_the_database(app, session, llm, drain):
    from flask_solidloop import Agent

    from ..support.support_app import llm_settings, solidloop

    class Gateway(Agent):
        def llm(self):
            return {**llm_settings(), "headers": {"X-Portkey-Api-Key": "pk-very-secret",
                                                  "cf-aig-authorization": "Bearer cf-secret",
                                                  "X-Trace": "visible"}}

    solidloop.agent("gateway")(Gateway)
    llm.script("gateway", {"content": "ok"})
    Gateway.start(message="gateway")
    drain()
    assert llm.requests[-1].headers["x-portkey-api-key"] == "pk-very-secret"
    stored = session.connection().exec_driver_sql(
        "SELECT e.payload::text || coalesce(a.answer::text, '') FROM solidloop_events e "
        "LEFT JOIN solidloop_llm_answers a ON a.event_id = e.id").scalar_one()
    assert "pk-very-secret" not in stored and "cf-secret" not in stored
    assert "visible" in stored


def test_an_error_after_the_canonical_commit_does_not_fail_the_loop(app, session, llm, drain):
    from flask_solidloop import Agent
    from flask_solidloop.pipeline.llm_stack import ErrorHandling

    from ..support.support_app import llm_settings, solidloop

    class Explodes:
        def __init__(self, next_step):
            self.next_step = next_step

        def __call__(self, ctx):
            self.next_step(ctx)
            raise RuntimeError("after the fact")

    class Fragile(Agent):
        def llm(self):
            return llm_settings()

        def configure_llm_middlewares(self, builder):
            builder.insert_after(ErrorHandling, Explodes)

    solidloop.agent("fragile")(Fragile)
    llm.script("fragile", {"content": "fine"})
    loop = Fragile.start(message="fragile")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


def test_an_agent_that_cannot_even_build_its_settings_fails_visibly(app, session, drain):
    from flask_solidloop import Agent

    from ..support.support_app import llm_settings, solidloop

    class Flaky(Agent):
        _broken = False

        def llm(self):
            if Flaky._broken:  # fine at start(), broken in the worker
                raise KeyError("PROVIDER_URL")
            return llm_settings()

    solidloop.agent("flaky")(Flaky)
    loop = Flaky.start(message="flaky")
    Flaky._broken = True
    drain()
    session.expire_all()
    loop = session.get(Loop, loop.id)
    assert loop.status == "failed"
    assert "KeyError" in loop.error_message and "PROVIDER_URL" in loop.error_message
    assert {j.state for j in session.scalars(select(Job))} == {"done"}
