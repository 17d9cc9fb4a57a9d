"""The admin in real headless Chromium (Debian's ``chromium``, driven by
Playwright from PyPI; never ``playwright install``) against a real gunicorn
(gthread) serving the blueprint, with real ``flask solidloop worker``
processes running the loops it shows.

Screenshots land in $SOLIDLOOP_SCREENSHOTS_DIR when set (docs/images/ holds
the committed ones), else in the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop.loops import control, store
from flask_solidloop.models import Loop, StreamEventRow

from ..support.support_app import Assistant
from .test_e2e_workers import kill_group, spawn_workers

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
XSS = "<script>alert('pwned')</script>"
APP_CONFIG = {"SOLIDLOOP_ADMIN_STREAM_SECONDS": 1.0, "SOLIDLOOP_ADMIN_HEARTBEAT": 0.5,
              "SOLIDLOOP_OBSERVED_STREAM_UPDATE_INTERVAL": 0.2}
#: What the streaming loop says: numbered words, so order, gaps and duplicates show.
WORDS = " ".join(f"w{i:03d}" for i in range(90))

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=True)
playwright_sync = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gunicorn exited:\n{log.read_text()[-3000:]}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    pytest.fail(f"gunicorn did not answer at {url}:\n{log.read_text()[-3000:]}")


@pytest.fixture
def stack(app, llm, tmp_path, monkeypatch):
    """gunicorn (1 process, 4 threads) + one worker process, both on tests.support.admin_app."""
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(APP_CONFIG))
    port = free_port()
    web_log, worker_log = tmp_path / "gunicorn.log", tmp_path / "worker.log"
    access = tmp_path / "access.log"
    web = spawn_workers([sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "1",
                         "--threads", "4", "-b", f"127.0.0.1:{port}", "--timeout", "30",
                         "--access-logfile", str(access),
                         "--access-logformat", "%(r)s|%({last-event-id}i)s|%(s)s",
                         "tests.support.admin_app:create_app()"], log=web_log)
    worker = spawn_workers([sys.executable, "-m", "flask", "--app",
                            "tests.support.admin_app:create_app()", "solidloop", "worker",
                            "--processes", "1", "--threads", "2"], log=worker_log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/admin/", web, web_log)
        yield base, access
    finally:
        kill_group(worker)
        kill_group(web)


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module (each test opens its own context, so no
    cookie, storage or page carries over); not session-wide, so playwright's
    event loop is gone before another module's asyncio code runs."""
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.dialogs = []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.console_errors = []
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
    yield page
    context.close()


def shot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("SOLIDLOOP_SCREENSHOTS_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"), full_page=False)


def wait_text(page, selector: str, needle: str, timeout: float = 20) -> None:
    """Poll from Python: the page's CSP forbids the eval wait_for_function needs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in (page.locator(selector).text_content() or ""):
            return
        page.wait_for_timeout(100)
    pytest.fail(f"{needle!r} never appeared in {selector}: "
                f"{page.locator(selector).text_content()!r}")


def wait_status(session, loop_id: int, statuses: tuple[str, ...], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        session.expire_all()
        row = session.get(Loop, loop_id)
        status, error = row.status, row.error_message
        session.rollback()
        if status in statuses:
            return status
        time.sleep(0.1)
    pytest.fail(f"loop {loop_id} still {status} ({error}), wanted {statuses}")


def test_pages_render_real_runs_and_stream_tokens_across_reconnects(
        app, session, llm, stack, page, tmp_path):
    stack, access = stack
    from ..support import admin_app  # noqa: F401  (registers the streaming agent here too)
    from ..support.admin_app import LiveAgent

    # Real runs first: a tool round trip, a failure, an XSS-laden subject.
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "add" in str(req["messages"][-1].get("content")),
               {"tool_calls": [{"name": "calc__add", "arguments": {"a": 2, "b": 3}},
                               {"name": "calc__lookup", "arguments": {"key": XSS}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "5 " + XSS})
    done = Assistant.start(message="please add 2 and 3 " + XSS, subject=("User<b>", "1"),
                           state={"subject_label": "Ada " + XSS,
                                  "subject_url": "javascript:alert(1)"})
    assert wait_status(session, done.id, ("completed", "failed")) == "completed"
    llm.fail_next(503, times=3)
    broken = Assistant.start(message="this one fails")
    wait_status(session, broken.id, ("failed",))

    page.goto(stack + "/admin/workers")  # the stack's real worker process, registered
    assert page.locator("#workers tr[data-worker] .status-live").count() >= 1
    worker = page.locator("#workers tr[data-worker]").first.get_attribute("data-worker")

    page.goto(stack + "/admin/")
    assert page.locator("#by-status").inner_text().count("completed") == 1
    assert "infra:http" in page.locator("#failures").inner_text()
    # The worker's own reaper thread recorded its passes; the dashboard (which
    # refreshes itself) names that worker, with no staleness warning.
    wait_text(page, "#last-reap", f"by {worker}, healed")
    # The card refreshes itself; a render from the worker's first seconds may still
    # carry a warning (seen in 2 of 8 local runs, not yet explained: see the
    # issue note). A live worker's card must settle without one.
    deadline = time.monotonic() + 20
    while page.locator("#last-reap.warning").count() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert page.locator("#last-reap.warning").count() == 0, \
        page.locator("#maintenance").evaluate("e => e.outerHTML")
    assert "Last prune: never" in page.locator("#last-prune").inner_text()
    shot(page, "admin-dashboard", tmp_path)
    page.goto(stack + "/admin/inbound")
    assert page.locator("h1").inner_text() == "Inbound MCP"
    assert page.locator("#inbound-sessions").count() == 1

    page.goto(stack + "/admin/loops")
    assert page.locator(f'tr[data-loop="{done.id}"]').count() == 1
    assert "Ada <script>" in page.locator(f'tr[data-loop="{done.id}"]').inner_text()
    page.select_option("select[name=failure]", "infra:http")
    page.click("#filters button[type=submit]")
    page.wait_for_url(re.compile(r"failure=infra%3Ahttp"))
    assert page.locator("tr[data-loop]").count() == 1
    page.goto(stack + "/admin/loops")
    shot(page, "admin-loops", tmp_path)

    page.goto(stack + f"/admin/loops/{done.id}")
    body = page.locator("main").inner_text()
    assert body.count("<script>alert('pwned')</script>") >= 3  # message, result, subject
    assert page.locator("#loop-subject a").count() == 0  # javascript: is not clickable
    assert "Ada <script>" in page.locator("#loop-subject").inner_text()
    assert "solidloop:tool_call:" in page.locator("#tool-calls").inner_text()
    assert page.locator("#timeline .parallel .step").count() == 2  # side by side
    assert page.dialogs == []

    # The live stream: observed, so partials flush every 0.2 s; the server ends
    # each stream after 1 s, so the browser reconnects with Last-Event-ID. The
    # reply trickles for about 8 s (57 pieces, 0.15 s apart): long enough for
    # several reconnects on each side of the reload even on a loaded machine.
    llm.fault_next("slow_stream", seconds=0.15)
    llm.script(lambda req: "speak" in str(req["messages"][-1].get("content")),
               {"content": WORDS})
    live = LiveAgent.create(message="speak")
    control.observe(app.extensions["solidloop"], live.id)
    control.resume(app.extensions["solidloop"], live.id, from_="init")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the answer has begun to stream
        streamed = session.scalar(select(StreamEventRow.id).where(
            StreamEventRow.loop_id == live.id, StreamEventRow.kind == "text_delta").limit(1))
        session.rollback()
        if streamed is not None:
            break
        time.sleep(0.05)
    page.goto(stack + f"/admin/loops/{live.id}")
    wait_text(page, "#live-tokens", "w040")
    shot(page, "admin-live-loop", tmp_path)
    # a forced reload mid-stream: the new page renders the text so far and resumes
    page.reload()
    wait_text(page, "#live-tokens", "w089", timeout=30)
    text = page.locator("#live-tokens").text_content()
    assert text == WORDS, text
    offsets = page.eval_on_selector_all(
        "#live-tokens .tok", "els => els.map(e => [+e.dataset.o, e.textContent.length])")
    position = 0
    for offset, length in offsets:
        assert offset == position  # contiguous: no gap, no duplicate
        position += length
    # the server saw the browser's one stream reopen, each time resuming the
    # loop from the cursor it had reached (carried in the query)
    streams = [line.split("|") for line in access.read_text().splitlines()
               if "/admin/stream?" in line]
    resumed = [s for s in streams if re.search(rf"loop={live.id}:[1-9]\d*", s[0])]
    assert len(resumed) >= 2 and all(s[2] == "200" for s in resumed), streams
    wait_status(session, live.id, ("completed",))
    wait_text(page, "#loop-status", "completed")
    assert page.dialogs == []


def test_actions_bulk_resume_csrf_and_closed_mount(app, session, llm, stack, page):
    stack, _ = stack
    state = app.extensions["solidloop"]
    llm.script(lambda req: True, {"content": "ok"})
    # each action, clicked
    target = Assistant.create(message="to be driven")
    page.goto(stack + f"/admin/loops/{target.id}")

    def click(action: str) -> str:
        opener = page.locator(f'summary[data-open="{action}"]')
        if opener.count():  # stop, force stop and freeze are confirmed first
            opener.click()
        page.click(f'button[data-action="{action}"]')
        page.wait_for_selector("#result")
        return page.locator("#result").inner_text()

    assert "Observing" in click("observe")
    assert "Frozen" in click("freeze")
    assert "Unfrozen" in click("unfreeze")
    assert page.locator('[data-action="pause"]').count() == 0  # an init loop is not live
    page.check('input[name="resume_from"][value="init"]')
    assert "Resumed" in click("resume")
    wait_status(session, target.id, ("completed",))
    stopping = Assistant.create(message="to be stopped")
    page.goto(stack + f"/admin/loops/{stopping.id}")
    assert "Stopped" in click("stop")
    forced = Assistant.create(message="to be force stopped")
    page.goto(stack + f"/admin/loops/{forced.id}")
    assert "Force stopped" in click("force_stop")
    session.expire_all()
    assert session.get(Loop, stopping.id).status == "failed"
    assert session.get(Loop, forced.id).error_message.startswith("force stopped")

    # bulk: resume every failed loop of one agent, not only the checked rows
    failed = []
    for i in range(4):
        loop = Assistant.create(message=f"bulk {i}")
        store.stop(session, loop.id, reason="ProviderHTTPError: HTTP 502")
        failed.append(loop.id)
    page.goto(stack + "/admin/loops?status=failed&agent=assistant&failure=infra%3Ahttp")
    page.click('#bulk button[value="resume"]')
    assert page.locator("#bulk-count").get_attribute("data-count") == "4"
    page.click("#bulk-go")
    page.wait_for_url(re.compile(r"/admin/bulk/\d+$"))  # a job walks them; its progress page
    page.wait_for_selector('#bulk-progress[data-status="done"]', timeout=60_000)
    assert page.locator("#bulk-result").get_attribute("data-changed") == "4"
    for loop_id in failed:
        wait_status(session, loop_id, ("completed",))
    page.click("#back-to-list")
    page.wait_for_url(re.compile(r"/admin/loops\?"))  # the click navigates
    assert "failure=infra%3Ahttp" in page.url

    # a cross-site form post is refused (the browser says Sec-Fetch-Site: cross-site)
    victim = Assistant.create(message="victim")
    control.freeze(state, victim.id)
    evil_page = (f'<form id="f" method="post" action="{stack}/admin/loops/{victim.id}/act/'
                 f'unfreeze"></form><script>document.getElementById("f").submit()</script>')

    class Evil(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(evil_page.encode())

        def log_message(self, *args):
            pass

    evil = HTTPServer(("localhost", 0), Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with page.expect_response(re.compile(r"/act/unfreeze")) as answer:
            page.goto(f"http://localhost:{evil.server_address[1]}/")
        assert answer.value.status == 403
    finally:
        evil.shutdown()
    session.expire_all()
    assert session.get(Loop, victim.id).frozen

    # a mount with no authorize denies everything
    response = page.goto(stack + "/closed/")
    assert response.status == 403
    assert page.goto(stack + f"/closed/loops/{victim.id}").status == 403


def test_staff_approve_one_call_and_bulk_deny_a_hundred_while_loop_pages_follow(
        app, session, llm, stack, browser, tmp_path):
    from ..support.support_app import ShopAgent

    stack, _ = stack
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "refund" in str(req["messages"][-1].get("content")),
               {"content": "Needs a person.", "tool_calls": [
                   {"name": "refund", "arguments": {"order": "77", "amount": 99}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "mail" in str(req["messages"][-1].get("content")),
               {"content": "Drafted.", "tool_calls": [
                   {"name": "send_email", "arguments": {"to": "customer", "body": "sorry"}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "Handled."})
    refund = ShopAgent.start(message="refund order 77")
    mails = [ShopAgent.start(message=f"mail customer {n}") for n in range(100)]
    for loop in [refund, *mails]:
        wait_status(session, loop.id, ("waiting",), timeout=120)

    context = browser.new_context(viewport={"width": 1360, "height": 900})
    try:
        errors: list[str] = []
        staff, watch, watch_mail = (context.new_page() for _ in range(3))
        for each in (staff, watch, watch_mail):
            # CSP refusals and uncaught exceptions (not the browser's own notes on
            # a favicon it could not find, or on a stream the server ended).
            each.on("console", lambda m: "Content Security Policy" in m.text
                    and errors.append(m.text))
            each.on("pageerror", lambda exc: errors.append(str(exc)))
            each.on("response", lambda r: r.status >= 400 and errors.append(r.url))
        # Two loop pages stay open: they follow the decisions taken elsewhere.
        watch.goto(stack + f"/admin/loops/{refund.id}")
        assert watch.locator("#loop-status").inner_text().strip() == "waiting"
        assert watch.locator(".decide button[data-decision='approve']").count() == 1
        watch_mail.goto(stack + f"/admin/loops/{mails[0].id}")

        staff.goto(stack + "/admin/")
        assert staff.locator("#awaiting-approval").inner_text().strip() == "101"
        staff.click("#waiting-card a[href$='/approvals']")
        staff.wait_for_url("**/admin/approvals")  # the click navigates: count the new page
        assert staff.locator("#approvals tr[data-call]").count() == 50  # one page
        staff.goto(stack + "/admin/approvals?tool=refund")
        row = staff.locator("#approvals tr[data-call]")
        assert row.count() == 1 and "99" in row.inner_text()
        shot(staff, "admin-approvals", tmp_path)
        row.locator("button[data-decision='approve']").click()
        staff.wait_for_url(re.compile(r"/admin/approvals\?"))
        assert "approved" in staff.locator("#decided").inner_text()
        # The open loop page sees it live: the tool ran and the loop completed.
        wait_text(watch, "#loop-status", "completed", timeout=30)
        wait_text(watch, "#tool-calls", "approved by admin", timeout=30)

        staff.goto(stack + "/admin/approvals?tool=send_email")
        staff.fill("#bulk-approvals input[name=reason]", "we never email customers from here")
        staff.click("#bulk-approvals button[value=deny]")
        assert staff.locator("#bulk-count").get_attribute("data-count") == "100"
        staff.click("#bulk-go")
        assert staff.locator("#bulk-result").get_attribute("data-decided") == "100"
        wait_text(watch_mail, "#tool-calls", "we never email customers from here", timeout=30)
        wait_text(watch_mail, "#loop-status", "completed", timeout=60)
        for loop in mails:
            assert wait_status(session, loop.id, ("completed",), timeout=120) == "completed"
        staff.goto(stack + "/admin/approvals")
        assert staff.locator("#none-waiting").count() == 1
        assert errors == [], "\n".join(errors)
    finally:
        context.close()


def test_budget_bars_render_to_scale_in_their_colours(app, session, llm, stack, page):
    """A loop a real worker ran into its budget: the Budget panel's bars are as
    wide as the share spent (an SVG rect, as the CSP allows no inline style),
    amber at the warning share and red at the limit; the list and the Limits
    page show them too, with nothing refused by the CSP."""
    stack, _ = stack
    llm.script(lambda req: "budget" in str(req["messages"][-1].get("content")),
               {"tool_calls": [{"name": "calc__add", "arguments": {"a": n, "b": 1}}
                               for n in range(4)]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "4 sums"})
    loop = Assistant.start(message="budget please", budget={"llm_turns": 1, "tool_calls": 5})
    assert wait_status(session, loop.id, ("paused", "completed", "failed")) == "paused"
    errors: list[str] = []
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    page.goto(stack + f"/admin/loops/{loop.id}")
    assert "BudgetExceededError" in page.locator("#summary").inner_text()
    panel = page.locator("#loop-budget")
    expected = {"llm_turns": ("over", 1.0, "rgb(179, 38, 30)"),
                "tool_calls": ("warn", 0.8, "rgb(224, 138, 0)")}
    for key, (level, share, colour) in expected.items():
        bar = panel.locator(f'.bar[data-key="{key}"]')
        assert bar.get_attribute("data-level") == level
        track = bar.locator("svg").bounding_box()
        fill = bar.locator(".bar-fill").bounding_box()
        assert track["width"] > 100  # drawn, at its CSS size
        assert abs(fill["width"] / track["width"] - share) < 0.02, (key, fill, track)
        assert bar.locator(".bar-fill").evaluate("e => getComputedStyle(e).fill") == colour
    assert "100%" in panel.locator('tr[data-limit="llm_turns"]').inner_text()
    assert "80%" in panel.locator('tr[data-limit="tool_calls"]').inner_text()

    page.goto(stack + "/admin/loops?failure=budget_exceeded")
    row = page.locator(f'tr[data-loop="{loop.id}"]')
    assert row.count() == 1 and "budget_exceeded" in row.inner_text()
    mini = row.locator(".bar.mini")
    assert mini.get_attribute("data-level") == "over"
    assert mini.locator(".bar-fill").bounding_box()["width"] == \
        pytest.approx(mini.locator("svg").bounding_box()["width"], abs=0.5)

    page.click('header.top nav a[href$="/limits"]')
    page.wait_for_url("**/admin/limits")  # the click navigates: read the new page
    assert page.locator("h1").inner_text() == "Limits"
    assert page.locator("#rate-keys").count() == 1 and page.locator("#subject-budgets").count() == 1
    assert errors == [], "\n".join(errors)
