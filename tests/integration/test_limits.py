"""Budgets and shared rate limits through real turns: the emulator over HTTP,
the jobs drained in-process, every reservation in PostgreSQL."""

from __future__ import annotations

import itertools
import time
from decimal import Decimal

import pytest
from sqlalchemy import select, text

from flask_solidloop import Agent, Toolset
from flask_solidloop.limits.rates import origin_of
from flask_solidloop.loops import store
from flask_solidloop.loops.queries import classify_failure
from flask_solidloop.models import Loop, RateBucket, Spend
from flask_solidloop.testing import drain

from ..support.support_app import calc, create_app, solidloop

MODEL = "limits-model"
PRICES = {MODEL: {"input": 1000.0, "output": 2000.0}}  # per million: a turn costs cents


def agent_for(name, llm, **options):
    class LimitedAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]
        llm = {"dialect": "openai", "base_url": "", "model": MODEL,
               "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 5}

    LimitedAgent.llm = {**LimitedAgent.llm, "base_url": llm.base_url}
    for key, value in options.items():
        setattr(LimitedAgent, key, value)
    return solidloop.agent(name)(LimitedAgent)


@pytest.fixture
def configured(database_url, llm):
    """An app made with the test's settings; closed after it."""
    made = []

    def make(**config):
        llm.reset()
        app = create_app(**config)
        made.append(app)
        return app

    yield make
    for app in made:
        with app.app_context():
            app.extensions["sqlalchemy"].session.remove()
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
        app.extensions["solidloop"].stop_renewer()
        app.extensions["solidloop"].broker.close()


def loop_of(app, loop_id):
    session = app.extensions["sqlalchemy"].session
    session.expire_all()
    return session.get(Loop, loop_id)


def run_until_settled(app, loop_ids, *, timeout=60.0):
    """Drain due jobs until no loop is queued or running (deferred jobs come due)."""
    deadline = time.monotonic() + timeout
    while True:
        drain(app)
        loops = [loop_of(app, loop_id) for loop_id in loop_ids]
        if all(loop.status not in ("queued", "running") for loop in loops):
            return loops
        assert time.monotonic() < deadline, [(loop.id, loop.status) for loop in loops]
        time.sleep(0.05)


def script_adding(llm, turns):
    """Each request asks for one more addition, up to ``turns`` LLM turns."""
    # Scripts match newest first: the last turn's answer is checked before the call.
    llm.script(lambda req: True, {"tool_calls": [{"name": "add",
                                                  "arguments": {"a": 1, "b": 2}}]})
    llm.script(lambda req: sum(1 for m in req.get("messages", []) if m.get("role") == "tool")
               >= turns - 1, {"content": "done"})


# -- a loop's budget ------------------------------------------------------------------


def test_a_loop_pauses_at_its_budget_and_resume_raises_it(configured, llm):
    app = configured()
    with app.app_context():
        agent = agent_for("budget_turns", llm, budget={"llm_turns": 2})
        script_adding(llm, 5)
        loop_id = agent.start(message="add").id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "paused"
        assert loop.error_message.startswith("BudgetExceededError: the loop's budget llm_turns "
                                             "is spent: 2 LLM turns of 2 LLM turns")
        assert classify_failure(loop.error_message) == "budget_exceeded"
        assert len(llm.requests) == 2  # the third request was never sent
        assert agent(loop_id).resume(budget={"llm_turns": 10})
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "completed"
        assert loop.budget["llm_turns"] == 10
        assert loop.step_count == 5


def test_start_budget_overrides_the_agents_and_bad_budgets_are_refused(configured, llm):
    from flask_solidloop.errors import InvalidArgumentError

    app = configured()
    with app.app_context():
        agent = agent_for("budget_override", llm, budget={"llm_turns": 1})
        script_adding(llm, 3)
        with pytest.raises(InvalidArgumentError, match="unknown budget limit 'dollars'"):
            agent.start(message="add", budget={"dollars": 1})
        with pytest.raises(InvalidArgumentError, match="budget tokens must be a number > 0"):
            agent.start(message="add", budget={"tokens": -5})
        loop_id = agent.start(message="add", budget={"llm_turns": 5}).id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "completed", loop.error_message


def test_the_soft_warning_is_in_the_request_the_model_receives(configured, llm):
    app = configured()
    with app.app_context():
        agent = agent_for("budget_warning", llm, budget={"llm_turns": 4}, budget_warning=0.5)
        script_adding(llm, 4)
        loop_id = agent.start(message="add").id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "completed"
        systems = [req.json["messages"][0]["content"] for req in llm.requests]
        assert len(systems) == 4
        # Turns 1 and 2 were sent at 0 and 1 of 4 turns spent; 3 and 4 at half or more.
        assert ["Budget notice" in s for s in systems] == [False, False, True, True]
        assert "2 LLM turns of 4 LLM turns used, 2 LLM turns left" in systems[2]
        # The note is in the request only, never in the stored history.
        session = app.extensions["sqlalchemy"].session
        stored = session.execute(text(
            "SELECT content FROM solidloop_messages WHERE loop_id = :id AND role = 'system'"),
            {"id": loop_id}).scalar_one()
        assert "Budget notice" not in stored


def test_a_cost_budget_counts_priced_turns(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES)
    with app.app_context():
        agent = agent_for("budget_cost", llm, budget={"cost_usd": 0.5})
        script_adding(llm, 50)
        loop_id = agent.start(message="add").id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "paused"
        assert "cost_usd is spent" in loop.error_message
        # At most one turn's estimate past the limit (each turn costs cents).
        assert Decimal("0.5") <= loop.cost < Decimal("0.5") + Decimal("0.2")


# -- a subject's budget ----------------------------------------------------------------


def test_a_subjects_loops_together_stop_at_its_budget(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES,
                     SOLIDLOOP_SUBJECT_BUDGET={"cost_usd": 0.3, "window": 3600})
    with app.app_context():
        agent = agent_for("budget_subject", llm)
        script_adding(llm, 50)
        ids = [agent.start(message="add", subject=("Tenant", "acme")).id for _ in range(3)]
        other = agent.start(message="add", subject=("Tenant", "globex"),
                            budget={"llm_turns": 2}).id
        loops = run_until_settled(app, [*ids, other])
        for loop in loops[:3]:
            assert loop.status == "paused"
            assert loop.error_message.startswith(
                "BudgetExceededError: subject Tenant:acme's 1 h budget cost_usd is spent")
        # Another subject is not stopped by acme's spend (its own loop budget stops it).
        assert "the loop's budget llm_turns" in loops[3].error_message
        session = app.extensions["sqlalchemy"].session
        rows = session.scalars(select(Spend).where(Spend.subject == "Tenant:acme")).all()
        assert rows and all(row.settled for row in rows)
        total = sum(row.cost for row in rows)
        assert total == sum(loop.cost for loop in loops[:3])
        assert Decimal("0.3") <= total < Decimal("0.3") + Decimal("0.2")
        # A resume with a budget releases the loop from the subject's budget.
        agent(ids[0]).resume(budget={"llm_turns": 60})
        [loop] = run_until_settled(app, [ids[0]])
        assert loop.status == "completed"


def test_a_subject_budget_hook_replaces_the_setting(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES)
    seen = []

    @solidloop.subject_budget
    def budget_of(subject_type, subject_id):
        seen.append((subject_type, subject_id))
        return {"llm_turns": 2} if subject_id == "small" else None

    try:
        with app.app_context():
            agent = agent_for("budget_hook", llm)
            script_adding(llm, 4)
            small = agent.start(message="add", subject=("Tenant", "small")).id
            large = agent.start(message="add", subject=("Tenant", "large")).id
            loops = run_until_settled(app, [small, large])
            assert [loop.status for loop in loops] == ["paused", "completed"]
            assert ("Tenant", "small") in seen and ("Tenant", "large") in seen
    finally:
        solidloop.subject_budget_hook = None


# -- shared rate limits ------------------------------------------------------------------


def test_a_rate_limited_key_defers_turns_to_their_slots(configured, llm):
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rps": 1}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.1)
    with app.app_context():
        agent = agent_for("rate_rps", llm)
        times = []
        llm.script(lambda req: times.append(time.monotonic()) or True, {"content": "hi"})
        ids = [agent.start(message="hello").id for _ in range(5)]
        loops = run_until_settled(app, ids)
        assert all(loop.status == "completed" for loop in loops)
        # One goes at once; each of the other four reserved a slot a second after
        # the one before (a wait well past the inline 0.1 s) and was deferred to
        # it. (A loaded machine may defer one more: a turn handed back before
        # its request, or a job claimed past its slot, reserves again.)
        deferrals = sorted(loop.capacity_deferrals for loop in loops)
        assert sum(deferrals) >= 4 and deferrals[-1] <= 2, deferrals
        assert len(times) == 5
        # Any run of requests fits the bucket: one at once, one more a second
        # (one more allowed: a slot's job may be claimed a little late, and the
        # first request reaches the server after its slot).
        assert all(j - i + 1 <= 1 + (times[j] - times[i]) + 1
                   for i in range(len(times)) for j in range(i, len(times)))
        session = app.extensions["sqlalchemy"].session
        assert session.get(RateBucket, (key, "-")).deferrals >= 4


def test_a_deferred_turn_whose_job_comes_early_never_sends_before_its_slot(configured, llm):
    # A delayed job falls due by its transaction's start, a little before the
    # slot the reservation computed; a worker's clock may lag the database's.
    # Either way the request waits for its slot: early by a tenth of a second
    # here, the job made due at once.
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rps": 1}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.0)
    with app.app_context():
        agent = agent_for("rate_early", llm)
        sent = []
        llm.script(lambda req: sent.append(time.time()) or True, {"content": "hi"})
        first, second = (agent.start(message="hello").id for _ in range(2))
        drain(app)
        assert loop_of(app, first).status == "completed"
        loop = loop_of(app, second)
        assert loop.status == "queued" and loop.capacity_deferrals == 1
        due = float(loop.capacity_slot["due"])
        session = app.extensions["sqlalchemy"].session
        session.execute(text("UPDATE solidloop_jobs SET eta = now() WHERE loop_id = :id "
                             "AND state = 'queued'"), {"id": second})
        session.commit()
        while time.time() < due - 0.1:
            time.sleep(0.01)
        [loop] = run_until_settled(app, [second])
        assert loop.status == "completed" and loop.capacity_deferrals == 1
        assert len(sent) == 2 and sent[1] >= due, (sent[1], due)


def test_a_request_sent_past_its_slot_reserves_again(configured, llm, monkeypatch):
    # Between a turn's reservation and its send come the request's record and
    # whatever the machine makes the thread wait for (a fresh process building
    # its HTTP client, a slow write). The buckets drained the first request
    # from its slot on, so sent a second and a half late it would meet the
    # next turn's at the provider, two requests at once on one request per
    # second. Sent late, it reserves again: the next turn waits its second.
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rps": 1}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.0)
    slow = [1.5]
    real = store.record_request

    def slow_record(*args, **kwargs):
        if slow:
            time.sleep(slow.pop())
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "record_request", slow_record)
    with app.app_context():
        agent = agent_for("rate_late", llm)
        sent = []
        llm.script(lambda req: sent.append(time.monotonic()) or True, {"content": "hi"})
        ids = [agent.start(message="hello").id for _ in range(2)]
        loops = run_until_settled(app, ids)
        assert all(loop.status == "completed" for loop in loops)
        assert not slow and len(sent) == 2
        assert sent[1] - sent[0] >= 0.9, sent[1] - sent[0]


def test_a_refusal_with_retry_after_blocks_the_key_and_defers_the_turn(configured, llm):
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rpm": 1000}})
    with app.app_context():
        agent = agent_for("rate_block", llm)
        llm.fault_next("status", status=429, retry_after=2)
        times = []
        llm.script(lambda req: times.append(time.monotonic()) or True, {"content": "hi"})
        loop_id = agent.start(message="hello").id
        started = time.monotonic()
        drain(app)
        # The worker did not sleep through the two seconds: the turn is queued
        # again, due at the block's end, and the key is blocked for everyone.
        assert time.monotonic() - started < 1.9
        loop = loop_of(app, loop_id)
        assert loop.status == "queued" and loop.capacity_deferrals == 1
        session = app.extensions["sqlalchemy"].session
        row = session.get(RateBucket, (key, "-"))
        assert row.refusals == 1 and row.blocked_until is not None
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "completed"
        assert len(llm.requests) == 2 and times[0] - started >= 1.9


def test_unlimited_keys_write_nothing(configured, llm):
    app = configured()
    with app.app_context():
        agent = agent_for("rate_none", llm)
        llm.script(lambda req: True, {"content": "hi"})
        [loop] = run_until_settled(app, [agent.start(message="hello").id])
        assert loop.status == "completed"
        session = app.extensions["sqlalchemy"].session
        assert session.scalars(select(RateBucket)).all() == []
        assert session.scalars(select(Spend)).all() == []


# -- a tool's rate limit -------------------------------------------------------------------

crm = Toolset("crm")
CRM_CALLS: list[float] = []


@crm.tool(rate_limit="crm")
def lookup(customer: str) -> str:
    """Look a customer up in the CRM."""
    CRM_CALLS.append(time.monotonic())
    return f"{customer}: gold"


def test_a_tools_rate_limit_defers_its_calls(configured, llm):
    app = configured(SOLIDLOOP_RATE_LIMITS={"tool:crm": {"per_second": 2}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.1)
    with app.app_context():
        agent = agent_for("rate_tool", llm)
        agent.mcps = [{"name": "crm", "toolset": crm}]
        CRM_CALLS.clear()
        llm.script(lambda req: True, {"tool_calls": [
            {"name": "lookup", "arguments": {"customer": f"c{i}"}} for i in range(6)]})
        llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "done"})
        [loop] = run_until_settled(app, [agent.start(message="look them up").id])
        assert loop.status == "completed", loop.error_message
        assert len(CRM_CALLS) == 6
        times = sorted(CRM_CALLS)
        # Two at once, then two a second: the six took two seconds at least.
        assert times[-1] - times[0] >= 2.0 - 0.1
        assert all(j - i + 1 <= 2 + 2 * (times[j] - times[i]) + 1
                   for i in range(len(times)) for j in range(i, len(times)))
        session = app.extensions["sqlalchemy"].session
        assert session.get(RateBucket, ("tool:crm", "-")).deferrals >= 1


def test_a_bad_rate_limit_is_refused_with_its_fix():
    from flask_solidloop.config import Config
    from flask_solidloop.errors import ConfigurationError, ToolDefinitionError

    with pytest.raises(ConfigurationError, match=r"unknown limit 'rpd'.*takes rpm, tpm, rps"):
        Config.from_mapping({"SOLIDLOOP_RATE_LIMITS": {"https://api.openai.com": {"rpd": 5}}})
    with pytest.raises(ConfigurationError, match="a tool key takes per_second, per_minute"):
        Config.from_mapping({"SOLIDLOOP_RATE_LIMITS": {"tool:crm": {"rpm": 5}}})
    with pytest.raises(ConfigurationError, match="window must be seconds > 0"):
        Config.from_mapping({"SOLIDLOOP_SUBJECT_BUDGET": {"cost_usd": 1, "window": 0}})
    with pytest.raises(ToolDefinitionError, match="rate_limit= must be a non-empty string"):
        Toolset("bad").tool(lambda: "x", name="x", rate_limit="")


def test_the_janitor_prunes_ledger_rows_past_retention_but_never_inside_the_window(
        configured):
    from flask_solidloop.maintenance.janitor import prune
    from flask_solidloop.state import get_state

    app = configured(SOLIDLOOP_SPEND_RETENTION=86400,
                     SOLIDLOOP_SUBJECT_BUDGET={"cost_usd": 1, "window": 3 * 86400})
    with app.app_context():
        session = app.extensions["sqlalchemy"].session
        for days in (1, 2, 4, 40):
            session.execute(text("INSERT INTO solidloop_spend (subject, at, cost, settled) "
                                 "VALUES ('T:a', now() - make_interval(days => :d), 0.1, true)"),
                            {"d": days})
        session.commit()
        report = prune(get_state(app))
        # The retention is a day, but the window is three: only rows past it go.
        assert report.spend == 2
        left = session.execute(text("SELECT count(*) FROM solidloop_spend")).scalar_one()
        assert left == 2


def test_a_subjects_spend_sums_its_window(configured):
    from flask_solidloop.limits.budgets import subject_spend

    app = configured()
    with app.app_context():
        session = app.extensions["sqlalchemy"].session
        for days, cost in ((0, 0.25), (0, 0.5), (3, 9.0)):
            session.execute(text(
                "INSERT INTO solidloop_spend (subject, at, cost, tokens, llm_turns, tool_calls, "
                "settled) VALUES ('T:a', now() - make_interval(days => :d), :c, 100, 1, 2, true)"),
                {"d": days, "c": cost})
        session.commit()
        assert subject_spend(session, "T:a", 86400) == {
            "cost_usd": 0.75, "tokens": 200.0, "llm_turns": 2.0, "tool_calls": 4.0}
        assert subject_spend(session, "T:none", 86400)["cost_usd"] == 0.0


def test_a_slot_beyond_the_horizon_reserves_nothing(configured):
    from flask_solidloop.limit_spec import rate_limits_setting
    from flask_solidloop.limits import rates

    app = configured()
    with app.app_context():
        session = app.extensions["sqlalchemy"].session
        table = rate_limits_setting("SOLIDLOOP_RATE_LIMITS", {"k": {"rps": 1}})

        def level():
            session.expire_all()
            value = session.get(RateBucket, ("k", "requests_per_second")).level
            session.rollback()
            return value

        first = rates.reserve(session, table, ("k",), tokens=0, inline_wait=0.1, horizon=1.5)
        second = rates.reserve(session, table, ("k",), tokens=0, inline_wait=0.1, horizon=1.5)
        assert (first.wait, first.held) == (0.0, True)
        # The second's slot is a second away: within the horizon, it holds it.
        assert 0.8 < second.wait <= 1.0 and second.held
        before = level()
        assert 1.9 < before <= 2.0
        third = rates.reserve(session, table, ("k",), tokens=0, inline_wait=0.1, horizon=1.5)
        # Two seconds away, past the horizon: nothing reserved, a deferral counted.
        assert 1.8 < third.wait <= 2.0 and not third.held
        assert level() <= before
        assert session.get(RateBucket, ("k", "-")).deferrals == 2


# -- a compaction's summary request is admitted like any other ---------------------------


def compacting_agent_for(name, llm, **options):
    """An agent whose history is compacted past 1,000 tokens by its own model
    (tests/support/support_app.QUICK_COMPACTION)."""
    from flask_solidloop.pipeline import AgentInitialization

    from ..support.support_app import QUICK_COMPACTION, pages

    def configure_llm_middlewares(self, builder) -> None:
        builder.insert_after(AgentInitialization, QUICK_COMPACTION)

    return agent_for(name, llm, **{"mcps": [{"name": "pages", "toolset": pages}],
                                   "configure_llm_middlewares": configure_llm_middlewares,
                                   **options})


def script_pages(llm, turns, sent=None):
    """A page a turn up to ``turns`` turns, then an answer; the summarizer
    answers its requests. Returns the summary requests' count, as it grows;
    ``sent`` collects each request's arrival (time.monotonic())."""
    from flask_solidloop.pipeline.compaction import DEFAULT_INSTRUCTIONS

    summaries = [0]
    asked = [0]

    def reply(body):
        if body["messages"][0]["content"] == DEFAULT_INSTRUCTIONS:
            summaries[0] += 1
            return {"content": "Pages were read."}
        if asked[0] == turns:
            return {"content": "done"}
        asked[0] += 1
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[0]}}]}

    llm.script(lambda body: sent is None or sent.append(time.monotonic()) or True, reply)
    return summaries


def test_a_spent_budget_pauses_the_loop_before_its_summary_request(configured, llm):
    app = configured()
    with app.app_context():
        # A probe: how many turns go before the first summary request.
        probe = compacting_agent_for("compacting_probe", llm)
        summaries = script_pages(llm, 8)
        [loop] = run_until_settled(app, [probe.start(message="read").id])
        assert loop.status == "completed" and summaries[0] >= 1
        first = next(i for i, r in enumerate(llm.requests)
                     if r.json["messages"][0]["content"] != "You add numbers.")
        # Its budget is spent exactly when the summary would be asked for.
        llm.reset()
        agent = compacting_agent_for("compacting_budget", llm, budget={"llm_turns": first})
        summaries = script_pages(llm, 8)
        [loop] = run_until_settled(app, [agent.start(message="read").id])
        assert loop.status == "paused"
        assert loop.error_message.startswith("BudgetExceededError: the loop's budget "
                                             "llm_turns is spent")
        assert summaries[0] == 0  # the summarizer was never asked
        assert len(llm.requests) == first


def summary_turn_setup(configured, llm, name):
    """A compaction middleware (3,000 tokens, keep one turn) and, from a probe
    run, how many turns go before the first summary request."""
    from flask_solidloop import Compaction
    from flask_solidloop.pipeline import AgentInitialization
    from flask_solidloop.pipeline.compaction import DEFAULT_INSTRUCTIONS

    compaction = Compaction(trigger_tokens=3000, keep_last_turns=1)

    def configure_llm_middlewares(self, builder) -> None:
        builder.insert_after(AgentInitialization, compaction)

    probe_app = configured()
    with probe_app.app_context():
        probe = compacting_agent_for(f"{name}_probe", llm,
                                     configure_llm_middlewares=configure_llm_middlewares)
        script_pages(llm, 30)
        [loop] = run_until_settled(probe_app, [probe.start(message="read").id])
        assert loop.status == "completed"
        first = next(i for i, r in enumerate(llm.requests)
                     if r.json["messages"][0]["content"] == DEFAULT_INSTRUCTIONS)
    assert first >= 4
    llm.reset()
    return configure_llm_middlewares, first


def test_summary_requests_take_their_slots_in_the_rate_limit(configured, llm):
    # The provider and the key allow exactly as many requests at once as go
    # before the first summary request (one more every 60/N s): the burst is
    # spent when the summary is due, which must wait for its slot rather than
    # be sent and refused.
    configure_llm_middlewares, first = summary_turn_setup(configured, llm, "compacting_rates")
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rpm": first}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.1)
    with app.app_context():
        llm.rate_limit(rpm=first)
        agent = compacting_agent_for("compacting_rates", llm,
                                     configure_llm_middlewares=configure_llm_middlewares)
        summaries = script_pages(llm, first)
        [loop] = run_until_settled(app, [agent.start(message="read").id], timeout=120)
        assert loop.status == "completed"
        assert summaries[0] >= 1
        stats = llm.rate_limit_stats()
        assert stats.count_429 == 0, stats
        assert loop.capacity_deferrals >= 1


def test_a_summary_request_sent_past_its_slot_reserves_again(configured, llm, monkeypatch):
    # The summary request shares the turn's admission: its record written
    # a second and a half late (a slow write), it reserves again rather than
    # go out at once, where it would meet the next turn's request (the
    # buckets drained from its first slot on) on one request per second.
    from flask_solidloop.pipeline.compaction import DEFAULT_INSTRUCTIONS

    configure_llm_middlewares, first = summary_turn_setup(configured, llm, "compacting_late")
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_RATE_LIMITS={key: {"rps": 1}},
                     SOLIDLOOP_RATE_LIMIT_INLINE_WAIT=0.0)
    slow = [1.5]
    real = store.record_request

    def slow_summary_record(*args, **kwargs):
        if slow and DEFAULT_INSTRUCTIONS in str(kwargs["wire"].request_body):
            time.sleep(slow.pop())
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "record_request", slow_summary_record)
    with app.app_context():
        agent = compacting_agent_for("compacting_late", llm,
                                     configure_llm_middlewares=configure_llm_middlewares)
        sent: list[float] = []
        summaries = script_pages(llm, first, sent)
        [loop] = run_until_settled(app, [agent.start(message="read").id], timeout=120)
        assert loop.status == "completed"
        assert not slow and summaries[0] >= 1
        gaps = [b - a for a, b in itertools.pairwise(sent)]
        assert len(sent) == len(llm.requests) and min(gaps) >= 0.9, gaps
