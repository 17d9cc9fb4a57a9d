"""Spend and limits on the command line: `status` shows a loop's budgets and its
subject's, `list` the share of the tightest limit, `limits` the rate-limit keys
and the subjects' budgets. Loops are driven to their budgets in-process, as
test_limits.py drives them, against the emulator and real PostgreSQL."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from flask_solidloop.limits.rates import origin_of
from flask_solidloop.models import RateBucket

from . import test_limits
from .test_limits import MODEL, PRICES, agent_for, run_until_settled, script_adding

#: test_limits.py's fixture: an app made with the test's settings.
configured = test_limits.configured


def cli(app, *args):
    result = app.test_cli_runner().invoke(args=["solidloop", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_status_shows_the_loop_and_subject_budgets_and_deferrals(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES,
                     SOLIDLOOP_SUBJECT_BUDGET={"llm_turns": 30, "window": 3600})
    with app.app_context():
        agent = agent_for("spend_status", llm, budget={"llm_turns": 2, "tokens": 1_000_000})
        script_adding(llm, 5)
        loop_id = agent.start(message="add", subject=("Tenant", "acme")).id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "paused"
        loop.capacity_deferrals = 3  # as a rate limit would have counted them
        app.extensions["sqlalchemy"].session.commit()
        tokens = loop.input_tokens + loop.output_tokens
        out = cli(app, "status", str(loop_id))
    assert "error: BudgetExceededError: the loop's budget llm_turns is spent" in out
    share = round(tokens / 1_000_000 * 100)
    assert f"  budget: tokens {tokens:,} of 1,000,000 ({share}%), llm_turns 2 of 2 (100%)\n" \
        in out
    assert "  subject Tenant:acme budget over 1 h: llm_turns 2 of 30 (7%)\n" in out
    assert "  capacity deferrals: 3 (turns a rate limit deferred" in out


def test_status_of_a_loop_without_budget_shows_none(configured, llm):
    app = configured()
    with app.app_context():
        agent = agent_for("spend_none", llm)
        llm.script(lambda req: True, {"content": "hi"})
        [loop] = run_until_settled(app, [agent.start(message="hello").id])
        out = cli(app, "status", str(loop.id))
    assert "budget" not in out and "capacity deferrals" not in out


def test_list_shows_the_share_of_the_tightest_limit(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES)
    with app.app_context():
        limited = agent_for("spend_list", llm, budget={"llm_turns": 4, "cost_usd": 100})
        free = agent_for("spend_list_free", llm)
        script_adding(llm, 3)
        ids = [limited.start(message="add").id, free.start(message="add").id]
        loops = run_until_settled(app, ids)
        assert [loop.status for loop in loops] == ["completed", "completed"]
        lines = cli(app, "list").splitlines()
    assert lines[0].split() == ["id", "agent", "status", "steps", "tokens", "cost", "budget",
                                "age", "reason"]
    rows = {int(line.split()[0]): line for line in lines[1:]}
    # 3 of 4 turns is the tightest: 75%, far above the cost's share.
    assert rows[ids[0]].split()[6:8] == ["75%", "turns"]
    assert rows[ids[1]].split()[6] == "-"
    # The budget column lines up under its header.
    assert rows[ids[0]].index("75% turns") + len("75% turns") == lines[0].index("budget") + 6


def test_limits_lists_rate_keys_drained_to_now_and_subjects_by_share(configured, llm):
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_PRICES=PRICES,
                     SOLIDLOOP_RATE_LIMITS={key: {"rpm": 600, "tpm": 100000},
                                            "tool:crm": {"per_second": 2}},
                     SOLIDLOOP_SUBJECT_BUDGET={"llm_turns": 3, "window": 7200})
    with app.app_context():
        agent = agent_for("spend_limits", llm)
        script_adding(llm, 5)
        ids = [agent.start(message="add", subject=("Tenant", "acme")).id,
               agent.start(message="add", subject=("Tenant", "globex"),
                           budget={"llm_turns": 1}).id]
        loops = run_until_settled(app, ids)
        assert [loop.status for loop in loops] == ["paused", "paused"]
        session = app.extensions["sqlalchemy"].session
        # A block in the future, and counts as the workers would have left them.
        row = session.get(RateBucket, (key, "-"))
        row.blocked_until = datetime.now(UTC) + timedelta(seconds=30)
        row.deferrals, row.refusals = 4, 1
        # A level written long ago has drained away; a fresh one has not.
        session.get(RateBucket, (key, "requests")).drained_at = \
            datetime.now(UTC) - timedelta(hours=1)
        tokens = session.get(RateBucket, (key, "tokens"))
        tokens.level, tokens.drained_at = 50000.0, datetime.now(UTC) + timedelta(seconds=5)
        session.commit()
        out = cli(app, "limits")
        top1 = cli(app, "limits", "--top", "1")
    lines = out.splitlines()
    assert lines[0] == "rate limits (levels drained to now):"
    head = next(line for line in lines if line.startswith(f"  {key}  "))
    assert re.search(r"deferrals 4  refusals 1  blocked until \d\d:\d\d:\d\d UTC "
                     r"\((29|30)s left\)$", head), head
    at = lines.index(head)
    assert lines[at + 1].split() == ["requests", "0.0", "of", "600", "per", "min", "(0%)"]
    assert lines[at + 2].split() == ["tokens", "50,000.0", "of", "100,000", "per", "min",
                                     "(50%)"]
    assert "  tool:crm  deferrals 0  refusals 0" in lines
    assert lines[lines.index("  tool:crm  deferrals 0  refusals 0") + 1].split() == [
        "calls_per_second", "0.0", "of", "2", "per", "s", "(0%)"]
    subjects = lines[lines.index("subjects with a budget, nearest their limit first "
                                 "(top 10):") + 1:]
    # acme spent its 3 turns (100%); globex's loop stopped at its own 1 (33%).
    assert subjects == ["  Tenant:acme  over 2 h: llm_turns 3 of 3 (100%)",
                        "  Tenant:globex  over 2 h: llm_turns 1 of 3 (33%)"]
    assert top1.splitlines()[-1] == "  Tenant:acme  over 2 h: llm_turns 3 of 3 (100%)"
    assert all(len(line) <= 100 for line in lines if key not in line)


def test_limits_with_nothing_configured(configured, llm):
    app = configured()
    with app.app_context():
        out = cli(app, "limits")
    assert out.splitlines() == [
        "rate limits: none configured (SOLIDLOOP_RATE_LIMITS) and none recorded",
        "subjects: none with a budget has spent anything in its window"]
