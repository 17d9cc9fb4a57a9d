"""The admin charts in real headless Chromium against a real gunicorn and a
real worker (the stack of test_admin_browser.py): the dashboard and an agent
page draw their five SVG charts from loops the worker ran, with nothing the
CSP refuses, and neither page scrolls sideways on a 390 px wide phone.

The screenshot ``admin-dashboard-charts.png`` lands in
$SOLIDLOOP_SCREENSHOTS_DIR when set (docs/images/ holds the committed one).
"""

from __future__ import annotations

import pytest

from flask_solidloop.loops import store
from flask_solidloop.maintenance.rollup import rollup

from ..support.support_app import Assistant
from .test_admin_browser import browser, page, shot, stack, wait_status

pytestmark = pytest.mark.e2e
__all__ = ["browser", "page", "stack"]  # the fixtures, imported for this module

CHARTS = ("chart-turns", "chart-failures", "chart-tokens", "chart-cost", "chart-latency")


def no_sideways_scroll(page) -> None:
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 390, f"{page.url} is {width} px wide at 390 px"


def test_dashboard_and_agent_page_draw_the_charts_and_fit_a_phone(
        app, session, llm, stack, page, browser, tmp_path):
    stack, _ = stack
    llm.script(lambda req: True, {"content": "done", "usage": {"prompt_tokens": 1200,
                                                               "completion_tokens": 300}})
    done = [Assistant.start(message=f"hello {i}") for i in range(3)]
    for loop in done:
        assert wait_status(session, loop.id, ("completed", "failed")) == "completed"
    stopped = Assistant.create(message="never runs")
    store.stop(session, stopped.id, reason="McpTransportError: connection refused")
    rollup(app.extensions["solidloop"])
    session.rollback()
    refused: list[str] = []
    page.on("console", lambda m: "Content Security Policy" in m.text and refused.append(m.text))

    page.goto(stack + "/admin/")
    for chart in CHARTS:
        box = page.locator(f"svg#{chart}").bounding_box()
        assert box is not None and box["width"] > 250 and box["height"] > 60, (chart, box)
    summary = page.locator('[data-chart="chart-turns"] .summary').inner_text()
    assert summary.startswith("3 LLM turns"), summary
    assert "infra:connect 1" in page.locator('[data-chart="chart-failures"] .summary').inner_text()
    assert page.locator("svg#chart-turns rect.ch-bar").count() >= 1
    # The bars take their colours from admin.css (the CSP allows no inline style).
    fill = page.locator("svg#chart-turns rect.ch-bar.ch-s0").first.evaluate(
        "e => getComputedStyle(e).fill")
    assert fill == "rgb(47, 111, 223)"
    page.locator("#charts").scroll_into_view_if_needed()
    shot(page, "admin-dashboard-charts", tmp_path)

    page.click('#agent-links a[href$="/agents/assistant"]')
    page.wait_for_url("**/admin/agents/assistant")
    assert page.locator("svg.ch").count() == len(CHARTS)
    page.click('.range a[href$="range=7d"]')
    page.wait_for_url("**range=7d")
    assert "in the last 7 days" in page.locator('[data-chart="chart-turns"] .summary').inner_text()
    assert page.locator("svg#chart-turns").get_attribute("data-points") == "168"
    assert refused == [], "\n".join(refused)

    phone = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        small = phone.new_page()
        for path in ("/admin/", "/admin/agents/assistant", "/admin/agents/assistant?range=7d"):
            small.goto(stack + path)
            assert small.locator("svg.ch").count() == len(CHARTS)
            box = small.locator("svg#chart-cost").bounding_box()
            assert box is not None and 200 < box["width"] <= 390
            no_sideways_scroll(small)
    finally:
        phone.close()
