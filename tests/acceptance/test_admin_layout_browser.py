"""The admin's layout and accessibility in real headless Chromium against a real
gunicorn and worker (the stack of test_admin_browser.py): axe-core finds no
serious or critical violation on any page; a 10,000-character word (in an
error, a message, a tool's arguments and result) and a 390 px phone leave no
sideways page scroll; the keyboard reaches the list's rows and the loop's
actions, with the focus visible.

axe-core is the npm package ``scripts/setup.sh --tests`` installs into the
gitignored ``.test-js/`` (pinned there); it is injected into each page, in a
browser context that lets the test's own script in past the admin's CSP.
"""

from __future__ import annotations

import os
import re

import pytest

from flask_solidloop.loops import control

from ..support.support_app import Assistant
from .test_admin_browser import ROOT, WORDS, browser, shot, stack, wait_status  # noqa: F401 - fixtures

pytestmark = pytest.mark.e2e
AXE = ROOT / ".test-js" / "node_modules" / "axe-core" / "axe.min.js"
LONG = "W" * 10_000
PHONE = {"width": 390, "height": 844}

if not AXE.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{AXE} is missing: run bash scripts/setup.sh --tests")
    pytest.skip(f"{AXE} missing (bash scripts/setup.sh --tests installs axe-core)",
                allow_module_level=True)

#: Every serious or critical violation: rule, impact, and the first nodes.
AXE_RUN = """() => axe.run(document, {resultTypes: ['violations']}).then(r => r.violations
  .filter(v => v.impact === 'serious' || v.impact === 'critical')
  .map(v => ({id: v.id, impact: v.impact, count: v.nodes.length,
              nodes: v.nodes.slice(0, 3).map(n => n.target.join(' ') + ': '
                                             + (n.failureSummary || '').slice(0, 200))})))"""
#: The elements sticking out past the viewport's right edge (for a failure's message).
WIDE = """() => Array.from(document.querySelectorAll('body *'))
  .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
  .slice(0, 6).map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
                   + (e.className && e.className.baseVal === undefined ? '.' + e.className : '')
                   + ' ' + Math.round(e.getBoundingClientRect().right))"""


@pytest.fixture
def loops(app, session, llm, stack):  # noqa: F811 - the imported fixture
    """Real runs with long words everywhere: a completed loop whose tool call got
    a 10,000-character argument and result, a failed one whose error is one
    10,000-character word, and a paused one (so every action shows on one page)."""
    base, _ = stack
    state = app.extensions["solidloop"]
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "look" in str(req["messages"][-1].get("content")),
               {"tool_calls": [{"name": "lookup", "arguments": {"key": LONG}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "found " + LONG})
    done = Assistant.start(message="look this up: " + LONG, subject=("User", LONG[:190]),
                           state={"subject_label": LONG})
    assert wait_status(session, done.id, ("completed", "failed")) == "completed"
    broken = Assistant.create(message="fails")
    control.stop(state, broken.id, reason=LONG)
    held = Assistant.create(message="held " + LONG)
    return base, {"done": done.id, "broken": broken.id, "held": held.id}


def _violations(page) -> list[dict]:
    page.add_script_tag(path=str(AXE))
    return page.evaluate(AXE_RUN)


def test_axe_finds_no_serious_or_critical_violation_on_any_page(browser, loops, tmp_path):  # noqa: F811 - the imported fixture
    base, ids = loops
    context = browser.new_context(viewport={"width": 1360, "height": 900}, bypass_csp=True)
    try:
        page = context.new_page()
        found = {}
        for path in ("/admin/", "/admin/loops", f"/admin/loops/{ids['done']}",
                     f"/admin/loops/{ids['broken']}", f"/admin/loops/{ids['held']}",
                     "/admin/loops?status=failed&q=zzz", "/admin/jobs", "/admin/workers",
                     "/admin/inbound", "/admin/limits", "/admin/approvals",
                     "/admin/?range=7d", "/admin/agents/assistant"):
            page.goto(base + path)
            page.wait_for_load_state("load")
            bad = _violations(page)
            if bad:
                found[path] = bad
        # a bulk action's confirmation and its progress page, reached as an operator does
        page.goto(base + "/admin/loops")
        page.locator(f'tr[data-loop="{ids["held"]}"] td.pick input').check()
        page.locator('button[name="selected_action"][value="pause"]').click()
        page.wait_for_selector("#bulk-confirm")
        found.update({"bulk confirmation": bad} if (bad := _violations(page)) else {})
        page.locator("#bulk-go").click()
        page.wait_for_url(re.compile(r"/admin/bulk/\d+"))
        page.wait_for_load_state("load")
        found.update({"bulk progress": bad} if (bad := _violations(page)) else {})
        assert found == {}, found
    finally:
        context.close()


def _no_sideways_scroll(page) -> None:
    widths = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], (page.url, widths, page.evaluate(WIDE))


def test_a_long_word_and_a_phone_leave_no_sideways_scroll(browser, loops, tmp_path):  # noqa: F811 - the imported fixture
    base, ids = loops
    for viewport in (PHONE, {"width": 1360, "height": 900}):
        context = browser.new_context(viewport=viewport)
        try:
            page = context.new_page()
            for path in ("/admin/loops", f"/admin/loops/{ids['done']}",
                         f"/admin/loops/{ids['broken']}", f"/admin/loops/{ids['held']}"):
                page.goto(base + path)
                _no_sideways_scroll(page)
            if viewport is PHONE:
                # below 720 px the rows are cards: one per loop, cells labelled
                page.goto(base + "/admin/loops")
                row = page.locator(f'tr[data-loop="{ids["broken"]}"]')
                assert row.evaluate("e => getComputedStyle(e).display") == "block"
                assert page.locator("#loops-table thead").bounding_box()["height"] <= 1
                shot(page, "admin-loops-390", tmp_path)
                page.goto(base + f"/admin/loops/{ids['done']}")
                # the long argument is in the page, wrapped, not cut
                assert LONG in (page.locator("#tool-calls").text_content() or "")
                page.goto(base + f"/admin/loops/{ids['held']}")
                shot(page, "admin-loop-390", tmp_path)
        finally:
            context.close()


def _tab_until(page, selector: str, limit: int = 120) -> int:
    """Press Tab until the focused element matches ``selector``; how many presses."""
    for presses in range(1, limit + 1):
        page.keyboard.press("Tab")
        if page.evaluate(f"() => !!document.activeElement.closest({selector!r})"):
            return presses
    pytest.fail(f"Tab never reached {selector} in {limit} presses")


def _focus_is_visible(page) -> None:
    style = page.evaluate("() => { const s = getComputedStyle(document.activeElement);"
                          " return [s.outlineStyle, s.outlineWidth]; }")
    assert style[0] != "none" and style[1] != "0px", style


def test_the_keyboard_reaches_the_rows_and_the_actions_with_focus_visible(browser, loops):  # noqa: F811 - the imported fixture
    base, ids = loops
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    try:
        page = context.new_page()
        page.goto(base + "/admin/loops")
        page.keyboard.press("Tab")  # first stop: the skip link
        assert page.evaluate("() => document.activeElement.className") == "skip"
        _focus_is_visible(page)
        page.keyboard.press("Enter")
        assert page.evaluate("() => document.activeElement.id") == "content"
        # a row's first stop is its checkbox: Space selects the row for a bulk action
        _tab_until(page, "tr[data-loop] td.pick")
        _focus_is_visible(page)
        page.keyboard.press("Space")
        assert page.evaluate("() => document.activeElement.checked") is True
        _tab_until(page, "tr[data-loop] a", limit=3)
        _focus_is_visible(page)
        href = page.evaluate("() => document.activeElement.getAttribute('href')")
        assert re.search(r"/admin/loops/\d+", href)
        page.keyboard.press("Enter")
        page.wait_for_url(re.compile(r"/admin/loops/\d+"))

        page.goto(base + f"/admin/loops/{ids['held']}")
        # the actions come before the page's long content, in reading order
        presses = _tab_until(page, "#actions")
        assert presses < 25, presses
        _focus_is_visible(page)
        _tab_until(page, 'summary[data-open="stop"]', limit=20)
        _focus_is_visible(page)
        page.keyboard.press("Enter")  # opens the confirmation
        assert page.locator('details[data-confirm="stop"]').get_attribute("open") is not None
        _tab_until(page, 'button[data-action="stop"]', limit=5)
        page.keyboard.press("Enter")
        page.wait_for_selector("#result")
        assert "Stopped" in page.locator("#result").inner_text()
        # the actions now are those of a failed loop
        offered = set(page.eval_on_selector_all(
            "#actions [data-action], #actions [data-open]",
            "els => els.map(e => e.dataset.action || e.dataset.open)"))
        assert offered == {"resume", "observe"}, offered
    finally:
        context.close()


def _offered(page) -> set[str]:
    return set(page.eval_on_selector_all(
        "#actions [data-action], #actions [data-open]",
        "els => els.map(e => e.dataset.action || e.dataset.open)"))


def test_the_actions_follow_the_loop_live_without_a_reload(app, llm, browser, loops):  # noqa: F811 - the imported fixture
    from ..support import admin_app  # noqa: F401  (registers the streaming agent here too)
    from ..support.admin_app import LiveAgent

    base, _ = loops
    state = app.extensions["solidloop"]
    # a reply that trickles for a few seconds: the page opens while it runs
    llm.fault_next("slow_stream", seconds=0.1)
    llm.script(lambda req: "speak" in str(req["messages"][-1].get("content")),
               {"content": WORDS})
    live = LiveAgent.create(message="speak")
    control.observe(state, live.id)
    control.resume(state, live.id, from_="init")
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    try:
        page = context.new_page()
        page.goto(base + f"/admin/loops/{live.id}")
        url = page.url
        first = _offered(page)
        assert "pause" in first and "resume" not in first, first  # a live loop's actions
        offered = first
        for _ in range(400):  # the stream's refresh re-renders the regions
            offered = _offered(page)
            if offered == {"resume", "unobserve"}:
                break
            page.wait_for_timeout(100)
        assert offered == {"resume", "unobserve"}, offered
        assert page.url == url  # no navigation: the regions were swapped in place
        assert "completed" in page.locator("#loop-status").inner_text()
    finally:
        context.close()
