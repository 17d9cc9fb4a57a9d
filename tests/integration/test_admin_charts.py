"""The admin charts against real PostgreSQL: the rollup's per-minute sums
(maintenance/rollup.py), its percentiles, reruns, crashes and retention, the
24 h and 7 d series (loops/stats.py), and the dashboard and agent pages that
draw them (admin/charts.py)."""

from __future__ import annotations

import json
import math
import random
import re
from datetime import timedelta
from decimal import Decimal

import pytest

from flask_solidloop.loops import queries, stats
from flask_solidloop.maintenance import rollup as rollup_module
from flask_solidloop.maintenance.rollup import rollup
from flask_solidloop.models import MaintenanceRun

from ..support.support_app import solidloop


@pytest.fixture
def client(app):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    return app.test_client()


@pytest.fixture
def base(pg):
    """The start of the minute 20 minutes ago (database clock)."""
    return pg.execute("SELECT date_trunc('minute', now()) - interval '20 minutes'").fetchone()[0]


def add_loop(pg, agent, *, status="completed", finished_at=None, error=None):
    return pg.execute(
        "INSERT INTO solidloop_loops (agent_name, status, finished_at, error_message) "
        "VALUES (%s, %s, %s, %s) RETURNING id", (agent, status, finished_at, error)).fetchone()[0]


def add_turn(pg, loop_id, completed_at, *, usage=None, cost=None, duration_ms=None,
             took=timedelta(seconds=1), created_at=None):
    """An answered LLM turn: its shell created ``took`` before its answer."""
    meta = {"metrics": {"duration_ms": duration_ms}} if duration_ms is not None else {}
    pg.execute(
        "INSERT INTO solidloop_messages (loop_id, role, content, status, usage, cost, "
        "metadata, completed_at, created_at) VALUES (%s, 'assistant', 'ok', 'completed', "
        "%s, %s, %s, %s, %s)",
        (loop_id, json.dumps(usage) if usage is not None else None, cost, json.dumps(meta),
         completed_at, created_at if created_at is not None else completed_at - took))


def add_tool_answer(pg, loop_id, at):
    pg.execute("INSERT INTO solidloop_messages (loop_id, role, content, status, created_at, "
               "completed_at) VALUES (%s, 'tool', '3', 'completed', %s, %s)", (loop_id, at, at))


def rows(pg, span=60):
    return {(r[0], r[1]): r[2:] for r in pg.execute(
        "SELECT starts_at, agent_name, llm_turns, tool_turns, input_tokens, output_tokens, cost,"
        " failures FROM solidloop_turn_stats WHERE span_seconds = %s", (span,))}


def seed(pg, base):
    """Two agents over two minutes; the token keys both ways they are stored."""
    alpha = add_loop(pg, "alpha")
    beta = add_loop(pg, "beta", status="failed", finished_at=base + timedelta(seconds=40),
                    error="McpTransportError: connection refused")
    for second, tokens in ((10, 100), (20, 200)):
        add_turn(pg, alpha, base + timedelta(seconds=second), cost=Decimal("0.01"),
                 usage={"input_tokens": tokens, "output_tokens": tokens // 10})
    add_turn(pg, alpha, base + timedelta(minutes=1, seconds=5), cost=Decimal("0.03"),
             usage={"input_tokens": 300, "output_tokens": 30})
    add_tool_answer(pg, alpha, base + timedelta(seconds=15))
    add_tool_answer(pg, alpha, base + timedelta(seconds=16))
    for _ in range(2):
        add_turn(pg, beta, base + timedelta(seconds=30), cost=Decimal("0.005"),
                 usage={"prompt_tokens": 50, "completion_tokens": 5})
    # A fork's copy of an earlier turn: created now, its old completed_at, no usage.
    add_turn(pg, alpha, base + timedelta(seconds=10), created_at=base + timedelta(minutes=3))
    return alpha, beta


def test_the_rollup_sums_each_minute_per_agent(state, pg, base):
    seed(pg, base)
    report = rollup(state)
    assert report.rolled_to is not None and report.rolled_to > base
    minutes = rows(pg)
    one = base + timedelta(minutes=1)
    assert minutes[(base, "alpha")] == (2, 2, 300, 30, Decimal("0.02"), {})
    assert minutes[(one, "alpha")] == (1, 0, 300, 30, Decimal("0.03"), {})
    assert minutes[(base, "beta")] == (2, 0, 100, 10, Decimal("0.01"), {"infra:connect": 1})
    assert len(minutes) == 3
    hour = base.replace(minute=0)
    hours = rows(pg, 3600)
    if one.hour == base.hour:  # both minutes in one hour
        assert hours[(hour, stats.ALL_AGENTS)] == (5, 2, 700, 70, Decimal("0.06"),
                                                   {"infra:connect": 1})
    run = state.db.session.get(MaintenanceRun, "rollup")
    assert run.last_ok and run.total == 3


def test_p50_and_p95_from_the_buckets_are_within_a_buckets_error(state, pg, base):
    loop = add_loop(pg, "alpha")
    draw = random.Random(7)
    latencies = sorted(math.exp(draw.uniform(math.log(50), math.log(20_000)))
                       for _ in range(400))
    for i, ms in enumerate(latencies):
        add_turn(pg, loop, base + timedelta(seconds=i % 60), duration_ms=ms)
    rollup(state)
    total = stats.series(state.db.session, "24h").total
    ratio = 2 ** 0.25  # one bucket
    for q in (0.5, 0.95):
        exact = latencies[math.ceil(q * len(latencies)) - 1]
        found = total.percentile(q)
        assert exact / ratio <= found <= exact * ratio, (q, exact, found)


def test_without_a_recorded_duration_the_latency_is_shell_to_answer(state, pg, base):
    loop = add_loop(pg, "alpha")
    add_turn(pg, loop, base, took=timedelta(seconds=2.5))
    rollup(state)
    p50 = stats.series(state.db.session, "24h", "alpha").total.percentile(0.5)
    assert 2500 / 2 ** 0.25 <= p50 <= 2500 * 2 ** 0.25


def test_running_the_rollup_again_never_double_counts(state, pg, base):
    seed(pg, base)
    rollup(state)
    first, first_hours = rows(pg), rows(pg, 3600)
    rollup(state)  # nothing new: the mark is at the current minute
    # Walk the mark back an hour: those minutes are summed again, and replaced.
    pg.execute("UPDATE solidloop_rollup_marks SET rolled_to = rolled_to - interval '1 hour'")
    rollup(state)
    assert rows(pg) == first and rows(pg, 3600) == first_hours


def test_a_crash_between_the_steps_of_an_hour_leaves_nothing_half_done(state, pg, base,
                                                                        monkeypatch):
    seed(pg, base)
    real = rollup_module.write_hours
    calls = {"n": 0}

    def second_hour_crashes(session, since, until):
        calls["n"] += 1
        written = real(session, since, until)
        if calls["n"] == 2:  # minute and hour rows of the 2nd hour written, mark not moved
            raise RuntimeError("worker killed")
        return written

    monkeypatch.setattr(rollup_module, "write_hours", second_hour_crashes)
    with pytest.raises(RuntimeError, match="worker killed"):
        rollup(state)
    mark, start = pg.execute("SELECT rolled_to, date_trunc('hour', now() - interval '7 days')"
                             " FROM solidloop_rollup_marks").fetchone()
    # The first hour committed with its mark; the second rolled back whole.
    assert mark == start + timedelta(hours=1)
    assert pg.execute("SELECT count(*) FROM solidloop_turn_stats WHERE starts_at >= %s",
                      (mark,)).fetchone()[0] == 0
    run = state.db.session.get(MaintenanceRun, "rollup")
    assert not run.last_ok and "worker killed" in run.last_error
    monkeypatch.setattr(rollup_module, "write_hours", real)
    rollup(state)
    minutes = rows(pg)
    assert minutes[(base, "alpha")] == (2, 2, 300, 30, Decimal("0.02"), {})
    assert minutes[(base, "beta")][0] == 2


def test_a_turn_that_commits_after_its_minute_was_rolled_up_is_counted(state, pg, base):
    loop = add_loop(pg, "alpha")
    add_turn(pg, loop, base, usage={"input_tokens": 1, "output_tokens": 1})
    rollup(state)
    # Committed late: its completed_at is a minute the last pass already summed.
    add_turn(pg, loop, base + timedelta(minutes=18), usage={"input_tokens": 1,
                                                            "output_tokens": 1})
    pg.execute("UPDATE solidloop_rollup_marks SET rolled_to = date_trunc('minute', now())")
    rollup(state, until=pg.execute("SELECT date_trunc('minute', now()) + interval '1 minute'"
                                   ).fetchone()[0])
    assert sum(r[0] for r in rows(pg).values()) == 2


def test_the_retention_deletes_old_rows_only(state, pg, base):
    # Older than the retention (8 days), and older than the first pass's
    # backfill (7 days) but within the retention.
    for age in ("9 days", "7 days 12 hours"):
        pg.execute("INSERT INTO solidloop_turn_stats (span_seconds, starts_at, agent_name, "
                   "llm_turns) VALUES (3600, date_trunc('hour', now() - %s::interval), 'old', 1)",
                   (age,))
    report = rollup(state)
    assert report.pruned == 1
    left = pg.execute("SELECT count(*) FROM solidloop_turn_stats WHERE agent_name = 'old'"
                      ).fetchone()[0]
    assert left == 1


def test_24h_and_7d_sum_their_own_hours(state, pg):
    loop = add_loop(pg, "alpha")
    now = pg.execute("SELECT now()").fetchone()[0]
    two_hours = now - timedelta(hours=2)
    # Oldest first: ids grow with created_at, as they do when turns happen.
    add_turn(pg, loop, now - timedelta(days=8), usage={"input_tokens": 40, "output_tokens": 4})
    add_turn(pg, loop, now - timedelta(days=3), usage={"input_tokens": 20, "output_tokens": 2},
             cost=Decimal("2"))
    add_turn(pg, loop, two_hours, usage={"input_tokens": 10, "output_tokens": 1},
             cost=Decimal("1"))
    rollup(state)
    day = stats.series(state.db.session, "24h")
    week = stats.series(state.db.session, "7d")
    assert len(day.hours) == 24 and len(week.hours) == 168
    assert (day.total.llm_turns, day.total.input_tokens, day.total.cost) == (1, 10, 1)
    assert (week.total.llm_turns, week.total.input_tokens, week.total.cost) == (2, 30, 3)
    at = day.hours.index(two_hours.replace(minute=0, second=0, microsecond=0))
    assert day.points[at].llm_turns == 1 and day.points[at].output_tokens == 1
    assert day.hours == week.hours[-24:]


def test_the_minutes_past_the_mark_are_read_live(state, pg, base, client):
    loop = add_loop(pg, "alpha")
    rollup(state)
    now = pg.execute("SELECT now()").fetchone()[0]
    add_turn(pg, loop, now - timedelta(seconds=1), usage={"input_tokens": 7,
                                                          "output_tokens": 3})
    assert stats.series(state.db.session, "24h").total.llm_turns == 1
    state.db.session.rollback()
    html = client.get("/admin/").get_data(as_text=True)
    assert re.search(r"last hour</th><td class=\"num\">1</td>\s*<td class=\"num\">7", html)


def test_the_dashboard_draws_the_charts_with_the_rolled_up_values(state, pg, base, client):
    seed(pg, base)
    rollup(state)
    html = client.get("/admin/").get_data(as_text=True)
    assert html.count("<svg class=\"ch\"") == 5
    for chart in ("chart-turns", "chart-failures", "chart-tokens", "chart-cost",
                  "chart-latency"):
        assert f'id="{chart}"' in html
    assert "5 LLM turns and 2 tool turns in the last 24 hours" in html
    assert "1 failed loop in the last 24 hours: infra:connect 1" in html
    assert "700 input and 70 output tokens" in html
    # The turns chart's scale: the busiest hour's 7 turns round up to 10.
    assert re.search(r'id="chart-turns"[^>]*data-max="10"', html)
    assert 'aria-current="true">24h' in html
    assert re.search(r'failure=infra:connect">infra:connect</a></th>\s*<td class="num">1', html)
    assert 'href="/admin/agents/' in html
    week = client.get("/admin/?range=7d").get_data(as_text=True)
    assert 'aria-current="true">7d' in week and "in the last 7 days" in week
    assert 'data-points="168"' in week


def test_the_agent_page_shows_only_its_own_figures(state, pg, base, client):
    seed(pg, base)
    rollup(state)
    page = client.get("/admin/agents/alpha")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert "3 LLM turns and 2 tool turns in the last 24 hours" in html
    assert "0 failed loops" in html and 'href="/admin/loops?agent=alpha"' in html
    beta = client.get("/admin/agents/beta?range=7d").get_data(as_text=True)
    assert "2 LLM turns and 0 tool turns in the last 7 days" in beta
    assert "1 failed loop in the last 7 days: infra:connect 1" in beta
    assert client.get("/admin/agents/nobody").status_code == 404


def test_the_dashboard_works_before_any_rollup(state, pg, base, client):
    seed(pg, base)
    html = client.get("/admin/").get_data(as_text=True)
    assert "The rollup has not run yet" in html
    assert "5 LLM turns and 2 tool turns in the last 24 hours" in html


def test_status_counts_past_the_cap_are_estimated(state, pg, session):
    pg.execute("INSERT INTO solidloop_loops (agent_name, status) SELECT 'a', 'completed' "
               "FROM generate_series(1, 300)")
    pg.execute("INSERT INTO solidloop_loops (agent_name, status) VALUES ('a', 'paused')")
    pg.execute("ANALYZE solidloop_loops")
    counts = stats.status_counts(session, cap=100)
    assert counts.estimated == {"completed"}
    assert 250 <= counts.counts["completed"] <= 350
    assert counts.counts["paused"] == 1
    exact = stats.status_counts(session)
    assert exact.estimated == set() and exact.counts["completed"] == 300
    assert queries.dashboard(session).by_status["completed"] == 300


def test_workers_run_the_rollup_every_interval_unless_it_is_off(state, pg, base):
    import dataclasses

    from flask_solidloop.extension import _maintenance_in_workers

    seed(pg, base)
    tasks = {task.name: task for task in _maintenance_in_workers(state)}
    assert tasks["rollup"].interval == 60.0
    tasks["rollup"].task()  # what the leading worker's thread runs each interval
    assert rows(pg)[(base, "alpha")][0] == 2
    state.config = dataclasses.replace(state.config, rollup_interval=0)
    assert "rollup" not in {task.name for task in _maintenance_in_workers(state)}


def test_flask_solidloop_rollup_runs_one_pass(app, pg, base):
    seed(pg, base)
    result = app.test_cli_runner().invoke(args=["solidloop", "rollup"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("rollup: rolled up ") and "3 minute row(s)" in result.output
    first = rows(pg)
    assert app.test_cli_runner().invoke(args=["solidloop", "rollup"]).exit_code == 0
    assert rows(pg) == first and first[(base, "beta")][0] == 2
