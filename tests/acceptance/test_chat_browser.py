"""The example app's chat page (example_app/chat.py) in real headless Chromium
(Debian's ``chromium``, driven by Playwright; never ``playwright install``),
served by a real gunicorn (gthread) with real ``flask solidloop worker``
processes, the example agent's model pointed at the LLM emulator.

The page is built from the loop's event stream only, so what it shows after
reloads, in a second tab and across the stream's own reconnects must be the
stored conversation, with nothing duplicated or missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message

from .test_admin_browser import CHROMIUM, free_port, wait_http
from .test_e2e_workers import kill_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
#: Numbered words: a gap, a duplicate or a reordering shows in any prefix.
WORDS = " ".join(f"w{i:03d}" for i in range(150))
AGAIN = " ".join(f"v{i:03d}" for i in range(60))

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=True)
playwright_sync = pytest.importorskip("playwright.sync_api")


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "wb")  # noqa: SIM115 - closed when the process is reaped
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def stack(database_url, llm, tmp_path):
    """example_app itself under gunicorn (1 process, 6 threads) plus one worker
    process, on the test database, its model the emulator; streams end after
    1.5 s so the browser reconnects (Last-Event-ID) several times per answer."""
    llm.reset()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DEMO_LLM_", "FLASK_", "SOLIDLOOP_OFFLINE"))}
    env.update(DATABASE_URL=database_url, DEMO_LLM_BASE_URL=llm.base_url,
               DEMO_LLM_MODEL="test-model", FLASK_SECRET_KEY=json.dumps("chat-test"),
               FLASK_SOLIDLOOP_STREAM_SECONDS="1.5", FLASK_SOLIDLOOP_STREAM_HEARTBEAT="0.5",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    port = free_port()
    web_log, worker_log = tmp_path / "gunicorn.log", tmp_path / "worker.log"
    access = tmp_path / "access.log"
    web = spawn([sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "1", "--threads", "6",
                 "-b", f"127.0.0.1:{port}", "--timeout", "30", "--access-logfile", str(access),
                 "--access-logformat", "%(r)s|%({last-event-id}i)s|%(s)s", "example_app:app"],
                env, web_log)
    worker = spawn([sys.executable, "-m", "flask", "--app", "example_app", "solidloop", "worker",
                    "--processes", "1", "--threads", "2"], env, worker_log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/chat/", web, web_log)
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


def watch_errors(page, errors: list[str]) -> None:
    """CSP refusals and uncaught exceptions (not the browser's notes on a
    favicon, or on a stream the server ended)."""
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.on("pageerror", lambda exc: errors.append(str(exc)))


def until(condition, what: str, timeout: float = 60):
    """Poll ``condition`` until it returns something truthy (conditions, never
    durations, are what the test asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.1)


def assistant_messages(session, loop_id: int) -> list[Message]:
    session.expire_all()
    rows = list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "assistant").order_by(Message.id)))
    session.rollback()
    return rows


def bubble_text(page, message_id: int) -> str | None:
    bubble = page.locator(f"#msg-{message_id}-text")
    return bubble.text_content() if bubble.count() else None


def start_chat(page, base: str, message: str) -> int:
    page.goto(base + "/chat/")
    page.fill("#composer textarea", message)
    page.click("#composer button[type=submit]")
    page.wait_for_url(re.compile(r"/chat/\d+$"))
    return int(page.url.rstrip("/").rsplit("/", 1)[1])


def wait_status(page, status: str, timeout: float = 60) -> None:
    until(lambda: page.locator(f'#status[data-status="{status}"]').count() == 1,
          f"status {status} on the page", timeout)


def follow_stream(page, message_id: int, expected: str, samples: list[str]) -> None:
    """Sample the bubble while it streams: each sample must be a prefix of the
    answer (numbered words: a duplicate or a gap breaks that)."""
    text = bubble_text(page, message_id)
    if text:
        samples.append(text)
        assert expected.startswith(text), f"not a prefix of the answer: {text!r}"


def test_a_streamed_answer_survives_reloads_a_second_tab_and_goes_on_after_a_follow_up(
        app, session, llm, stack, browser):
    stack, access = stack
    llm.fault_next("slow_stream", seconds=0.15)
    llm.script(lambda req: "count" in str(req["messages"][-1].get("content")),
               {"content": WORDS})
    context = browser.new_context()
    errors: list[str] = []
    page = context.new_page()
    watch_errors(page, errors)
    loop_id = start_chat(page, stack, "Please count for me")
    user_bubbles = page.locator("#conversation .bubble.user")
    until(lambda: user_bubbles.count() == 1, "the user's message on the page")
    assert user_bubbles.first.text_content() == "Please count for me"
    reply = until(lambda: (assistant_messages(session, loop_id) or [None])[0],
                  "the assistant's message")
    samples: list[str] = []
    mid_stream = 0
    for marker in ("w020", "w060", "w100"):
        until(lambda m=marker: (follow_stream(page, reply.id, WORDS, samples)
                                or m in (bubble_text(page, reply.id) or "")),
              f"{marker} streamed into the bubble")
        still = assistant_messages(session, loop_id)[0].status == "processing"
        page.reload()  # mid-stream (while the model still writes): replay, then live
        mid_stream += still
        assert user_bubbles.count() <= 1
    assert mid_stream >= 1, "every reload came after the answer had ended"

    # A second tab of the same user follows the same loop.
    second = context.new_page()
    watch_errors(second, errors)
    second.goto(f"{stack}/chat/{loop_id}")
    for each in (page, second):
        until(lambda p=each: (follow_stream(p, reply.id, WORDS, samples)
                              or p.locator(f"#msg-{reply.id}.done").count() == 1),
              "the answer completed in the tab")
        wait_status(each, "completed")
    stored = assistant_messages(session, loop_id)[0].content
    assert stored == WORDS
    for each in (page, second):
        assert bubble_text(each, reply.id) == stored
        assert each.locator("#conversation .bubble").count() == 2  # one question, one answer
    assert any(len(s) < len(WORDS) for s in samples), "the answer never showed partly"
    # The server ended each stream after 1.5 s: the browser resumed by Last-Event-ID.
    streams = [line.split("|") for line in access.read_text().splitlines()
               if f"/chat/{loop_id}/events" in line]
    resumed = [s for s in streams if s[1] != "-"]
    assert len(resumed) >= 2 and all(s[1].isdigit() for s in resumed), streams

    # A follow-up continues the conversation and streams its answer. (The other
    # tab's stream closed when the loop finished; a reload brings it up to date.)
    llm.fault_next("slow_stream", seconds=0.1)
    llm.script(lambda req: "again" in str(req["messages"][-1].get("content")),
               {"content": AGAIN})
    page.fill("#composer textarea", "Count again, please")
    page.click("#composer button[type=submit]")
    until(lambda: user_bubbles.count() == 2, "the follow-up on the page")
    assert user_bubbles.nth(1).text_content() == "Count again, please"
    assert page.locator("#composer textarea").input_value() == ""
    second_reply = until(lambda: (assistant_messages(session, loop_id)[1:] or [None])[0],
                         "the second answer's message")
    until(lambda: (follow_stream(page, second_reply.id, AGAIN, samples)
                   or page.locator(f"#msg-{second_reply.id}.done").count() == 1),
          "the second answer completed")
    wait_status(page, "completed")
    second.reload()
    wait_status(second, "completed")
    stored_again = assistant_messages(session, loop_id)[1].content
    assert stored_again == AGAIN
    for each in (page, second):
        assert bubble_text(each, second_reply.id) == stored_again
        assert bubble_text(each, reply.id) == stored
        assert each.locator("#conversation .bubble").count() == 4
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    assert errors == [], "\n".join(errors)
    context.close()


def test_a_tool_call_card_an_approval_and_another_users_loop_answers_403(
        app, session, llm, stack, browser):
    stack, _ = stack
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "Paris" in str(req["messages"][-1].get("content")),
               {"content": "Let me look.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "user"
               and "umbrella" in str(req["messages"][-1].get("content")),
               {"tool_calls": [{"name": "order_umbrella", "arguments": {"city": "London"}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool",
               lambda req: {"content": "Done: " + str(req["messages"][-1].get("content"))})
    context = browser.new_context()
    errors: list[str] = []
    page = context.new_page()
    watch_errors(page, errors)
    loop_id = start_chat(page, stack, "What is the weather in Paris?")

    card = page.locator("#conversation .tool-call").first
    until(lambda: card.count() == 1, "the tool call's card")
    assert "get_weather" in card.locator(".tool-name").text_content()
    assert json.loads(card.locator(".arguments").text_content()) == {"city": "Paris"}
    result = card.locator(".result")
    until(lambda: result.get_attribute("data-done") == "1", "the tool's result in its card")
    assert result.text_content() == "Sunny, 21°C, light wind from the west in Paris."
    wait_status(page, "completed")
    answers = assistant_messages(session, loop_id)
    assert page.locator(f"#msg-{answers[-1].id}-text").text_content() == answers[-1].content
    assert answers[-1].content.startswith("Done: Sunny")

    # A tool that needs a person: Approve / Deny in the card, then its result.
    page.fill("#composer textarea", "Order an umbrella in London")
    page.click("#composer button[type=submit]")
    umbrella = page.locator("#conversation .tool-call").nth(1)
    until(lambda: umbrella.locator("button[data-decision=approve]").count() == 1,
          "the approval buttons")
    wait_status(page, "waiting")
    assert umbrella.locator("button[data-decision=deny]").count() == 1
    umbrella.locator("button[data-decision=approve]").click()
    until(lambda: umbrella.locator(".approval.decided").count() == 1, "the decision shown")
    assert umbrella.locator(".approval").get_attribute("data-decision") == "approved"
    until(lambda: umbrella.locator(".result").get_attribute("data-done") == "1",
          "the approved call's result")
    assert "Umbrella ordered for delivery in London" in umbrella.locator(".result").text_content()
    wait_status(page, "completed")
    page.reload()  # a replay draws the decided call, with no buttons left
    until(lambda: page.locator("#conversation .tool-call").count() == 2, "both cards replayed")
    wait_status(page, "completed")
    assert page.locator("button[data-decision]").count() == 0

    # Another browser is another user: the loop's page and its stream answer 403.
    other = browser.new_context()
    stranger = other.new_page()
    assert stranger.goto(f"{stack}/chat/{loop_id}").status == 403
    assert stranger.request.get(f"{stack}/chat/{loop_id}/events").status == 403
    denied = stranger.request.post(f"{stack}/chat/{loop_id}/messages", form={"message": "hi"})
    assert denied.status == 403
    assert stranger.goto(f"{stack}/chat/{loop_id + 1000}").status == 404
    other.close()
    assert errors == [], "\n".join(errors)
    context.close()
