"""One live stream per browser, in real headless Chromium against a real
gunicorn (gthread) and a real worker process (the stack of
test_admin_browser.py): thirty tabs on one running loop all stream, while the
dashboard still loads in another tab, and a reload mid-stream shows the answer
with no gap and no duplicate. With one EventSource per page, the browser's six
connections per host would leave most tabs silent and the dashboard hanging.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, StreamEventRow

from .test_admin_browser import (  # noqa: F401  (fixtures)
    browser,
    stack,
    wait_status,
    wait_text,
)

pytestmark = pytest.mark.e2e
TABS = 30
#: A long answer of numbered words: order, gaps and duplicates show, and it
#: streams for over a minute, long after every tab is open.
WORDS = " ".join(f"w{i:04d}" for i in range(1000))


def text_of(page) -> str:
    return page.locator("#live-tokens").text_content() or ""


@pytest.mark.timeout(600)
def test_thirty_tabs_on_one_running_loop_all_stream_and_other_pages_still_load(
        app, session, llm, stack, browser):  # noqa: F811 - the imported fixtures
    base, access = stack
    from ..support import admin_app  # noqa: F401  (registers the streaming agent here too)
    from ..support.admin_app import LiveAgent

    llm.fault_next("slow_stream", seconds=0.1)
    llm.script(lambda req: "speak" in str(req["messages"][-1].get("content")),
               {"content": WORDS})
    live = LiveAgent.start(message="speak")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the answer has begun to stream
        streamed = session.scalar(select(StreamEventRow.id).where(
            StreamEventRow.loop_id == live.id, StreamEventRow.kind == "text_delta").limit(1))
        session.rollback()
        if streamed is not None:
            break
        time.sleep(0.05)
    assert streamed is not None, "the loop never began to stream"

    context = browser.new_context(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    try:
        tabs = []
        opening = time.monotonic()
        for _ in range(TABS):  # all thirty load at once, as after a browser restart
            tab = context.new_page()
            tab.on("console", lambda m: m.type == "error" and errors.append(m.text))
            tab.goto(f"{base}/admin/loops/{live.id}", timeout=120_000, wait_until="commit")
            tabs.append(tab)
        for tab in tabs:
            tab.wait_for_load_state("load", timeout=120_000)
        print(f"thirty tabs open in {time.monotonic() - opening:.1f} s")

        # Another admin page loads while the thirty are open and the loop runs.
        other = context.new_page()
        other.goto(f"{base}/admin/", timeout=120_000)
        assert other.locator("#by-status").count() == 1
        assert session.get(Loop, live.id).status == "running", "the answer ended too soon"
        session.rollback()

        # A reload mid-stream: the page renders the text so far and resumes.
        assert not text_of(tabs[0]).endswith("w0999"), "the answer ended too soon"
        tabs[0].reload(timeout=120_000)
        for tab in tabs:
            wait_text(tab, "#live-tokens", "w0999", timeout=300)
        # Each tab rendered part of the answer (pieces at offset 0) and received
        # the rest from the stream, all while the last tab was open (it too
        # rendered only part), in order: no gap, no duplicate.
        for i, tab in enumerate(tabs):
            assert text_of(tab) == WORDS, f"tab {i}: {text_of(tab)[:200]!r}..."
            pieces = tab.eval_on_selector_all(
                "#live-tokens .tok", "els => els.map(e => [+e.dataset.o, e.textContent.length])")
            assert pieces[0][0] == 0 and pieces[0][1] < len(WORDS), f"tab {i} rendered it all"
            assert len(pieces) > 1, f"tab {i} received no token"
            position = 0
            for offset, length in pieces:
                assert offset == position, f"tab {i}: a gap or a duplicate at {position}"
                position += length
        wait_status(session, live.id, ("completed",))
        wait_text(tabs[-1], "#loop-status", "completed")
        assert [e for e in errors if "404" not in e] == []  # a 404 is the favicon: below
    finally:
        context.close()

    # One stream per browser: the per-page stream was never asked for, and the
    # browser's streams carried the loop from a cursor each time they reopened.
    lines = access.read_text().splitlines()
    failed = [line for line in lines if not line.rsplit("|", 1)[-1].startswith(("2", "3"))]
    assert all("/favicon.ico" in line for line in failed), failed
    assert not [line for line in lines if f"/admin/loops/{live.id}/stream" in line]
    shared = [line for line in lines if "/admin/stream?" in line and f"loop={live.id}:" in line]
    assert shared and all(line.split("|")[2] == "200" for line in shared), shared[:5]


def test_without_shared_worker_a_page_streams_on_its_own_and_resumes_by_last_event_id(
        app, session, llm, stack, browser):  # noqa: F811 - the imported fixtures
    base, access = stack
    from ..support import admin_app  # noqa: F401  (registers the streaming agent here too)
    from ..support.admin_app import LiveAgent

    words = " ".join(f"w{i:03d}" for i in range(120))
    llm.fault_next("slow_stream", seconds=0.1)
    llm.script(lambda req: "talk" in str(req["messages"][-1].get("content")),
               {"content": words})
    live = LiveAgent.start(message="talk")
    context = browser.new_context()
    context.add_init_script("delete window.SharedWorker;")  # a browser without it
    try:
        page = context.new_page()
        page.goto(f"{base}/admin/loops/{live.id}", timeout=120_000)
        wait_text(page, "#live-tokens", "w119", timeout=180)
        assert page.locator("#live-tokens").text_content() == words
    finally:
        context.close()
    lines = [line.split("|") for line in access.read_text().splitlines()]
    assert not [line for line in lines if "/admin/stream?" in line[0]]
    own = [line for line in lines if f"/admin/loops/{live.id}/stream" in line[0]]
    resumed = [line for line in own if line[1] != "-"]
    assert resumed and all(line[1].isdigit() for line in resumed), own
