"""Spend and limits in the admin, through Flask's test client against real
PostgreSQL: the loop page's Budget panel (a bar per limit, the subject's, the
deferrals), the list's spend indicator, the Limits page, and budget_exceeded in
the failure filter. Loops reach their budgets in-process as in test_limits.py."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from flask_solidloop.limits.rates import origin_of
from flask_solidloop.models import RateBucket

from ..support.support_app import solidloop
from . import test_limits
from .test_limits import MODEL, PRICES, agent_for, run_until_settled, script_adding

#: test_limits.py's fixture: an app made with the test's settings.
configured = test_limits.configured


def client_of(app):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    return app.test_client()


def bars(html, within):
    """(key, level, width) of each bar inside the element with id ``within``."""
    start = html.index(f'id="{within}"')
    end = html.index("</table>", start)
    return re.findall(r'class="bar bar-(\w+)[^"]*"[^>]*data-key="(\w+)"[^>]*'
                      r'data-width="([\d.]+)"', html[start:end])


def test_the_loop_page_shows_a_bar_per_limit_and_the_subjects(configured, llm):
    app = configured(SOLIDLOOP_PRICES=PRICES,
                     SOLIDLOOP_SUBJECT_BUDGET={"llm_turns": 4, "window": 3600})
    with app.app_context():
        agent = agent_for("admin_spend", llm, budget={"llm_turns": 3, "tool_calls": 100},
                          budget_warning=0.5)
        script_adding(llm, 10)
        loop_id = agent.start(message="add", subject=("Tenant", "acme")).id
        [loop] = run_until_settled(app, [loop_id])
        assert loop.status == "paused"
        loop.capacity_deferrals = 2
        app.extensions["sqlalchemy"].session.commit()
        c = client_of(app)
        html = c.get(f"/admin/loops/{loop_id}").get_data(as_text=True)
        regions = c.get(f"/admin/loops/{loop_id}/regions").get_data(as_text=True)
        listed = c.get("/admin/loops").get_data(as_text=True)
        found = c.get("/admin/loops?failure=budget_exceeded").get_data(as_text=True)
    # 3 of 3 turns: red and full; 3 tool calls of 100: blue, 3% wide.
    assert bars(html, "loop-budget") == [("over", "llm_turns", "100.0"),
                                         ("ok", "tool_calls", "3.0")]
    assert "amber at 50%" in html
    # The subject: 3 of its 4 turns, past the agent's warning share: amber, 75%.
    assert bars(html, "subject-budget") == [("warn", "llm_turns", "75.0")]
    assert "subject Tenant:acme over 1 h" in html
    assert 'id="capacity-deferrals" data-count="2"' in html
    assert bars(regions, "loop-budget") == bars(html, "loop-budget")  # it refreshes too
    # The list: the tightest limit, as a small bar and its share.
    row = listed[listed.index(f'data-loop="{loop_id}"'):]
    row = row[:row.index("</tr>")]
    assert 'class="bar bar-over mini"' in row and ">100%</span>" in row
    assert "budget_exceeded" in row  # the failure column names a budget's pause
    # budget_exceeded is offered by the failure filter and finds the paused loop.
    assert '<option value="budget_exceeded"' in listed
    assert f'data-loop="{loop_id}"' in found


def test_a_loop_without_budget_has_no_budget_panel(configured, llm):
    app = configured()
    with app.app_context():
        agent = agent_for("admin_spend_none", llm)
        llm.script(lambda req: True, {"content": "hi"})
        [loop] = run_until_settled(app, [agent.start(message="hello").id])
        html = client_of(app).get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert 'id="budget"' not in html


def test_the_limits_page_shows_keys_and_subjects_with_bars(configured, llm):
    key = f"{origin_of(llm.base_url)} {MODEL}"
    app = configured(SOLIDLOOP_PRICES=PRICES,
                     SOLIDLOOP_RATE_LIMITS={key: {"rpm": 600, "tpm": 100000},
                                            "tool:crm": {"per_minute": 30}},
                     SOLIDLOOP_SUBJECT_BUDGET={"llm_turns": 3, "window": 7200})
    with app.app_context():
        agent = agent_for("admin_limits", llm)
        script_adding(llm, 5)
        ids = [agent.start(message="add", subject=("Tenant", "acme<b>")).id]
        run_until_settled(app, ids)
        session = app.extensions["sqlalchemy"].session
        row = session.get(RateBucket, (key, "-"))
        row.blocked_until = datetime.now(UTC) + timedelta(seconds=60)
        row.deferrals, row.refusals = 7, 2
        tokens = session.get(RateBucket, (key, "tokens"))
        tokens.level, tokens.drained_at = 90000.0, datetime.now(UTC) + timedelta(seconds=5)
        session.commit()
        c = client_of(app)
        response = c.get("/admin/limits")
        nav = c.get("/admin/").get_data(as_text=True)
    assert response.status_code == 200
    assert "Content-Security-Policy" in response.headers
    html = response.get_data(as_text=True)
    assert 'href="/admin/limits"' in nav
    keyed = html[html.index(f'data-key="{key}" data-dimension="requests"'):]
    assert re.search(r'class="num deferrals">7</td>\s*<td rowspan="2" class="num refusals">2</td>',
                     keyed[:keyed.index("</tr>")])
    assert "left)" in keyed[:keyed.index("</tr>")]  # the block, while it lasts
    tokens_row = html[html.index(f'data-key="{key}" data-dimension="tokens"'):]
    tokens_row = tokens_row[:tokens_row.index("</tr>")]
    assert 'class="bar bar-warn"' in tokens_row and "90,000.0 (90%)" in tokens_row
    assert "100,000 per min" in tokens_row
    assert 'data-key="tool:crm" data-dimension="calls"' in html and "30 per min" in html
    # The subject, escaped, with its bar: 3 of 3 turns.
    assert "Tenant:acme&lt;b&gt;" in html and "<b>" not in html.split("<main>")[1]
    subject = html[html.index('id="subject-budgets"'):]
    assert 'class="bar bar-over"' in subject and "3 of 3" in subject and "2 h" in subject


def test_the_limits_page_with_nothing_configured(configured, llm):
    app = configured()
    with app.app_context():
        html = client_of(app).get("/admin/limits").get_data(as_text=True)
    assert "none configured (SOLIDLOOP_RATE_LIMITS) and none recorded" in html
    assert "No subject budget is configured" in html
