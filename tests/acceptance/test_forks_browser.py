"""The admin's "Fork here" in real headless Chromium, against gunicorn and a
real worker (the stack of tests/acceptance/test_admin_browser.py): a click on
a tool result's button opens the fork's page, which names its origin, and the
worker runs the fork with the request the original sent next."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message

from ..support.support_app import Assistant
from .test_admin_browser import browser, page, stack, wait_status  # noqa: F401 - fixtures

pytestmark = pytest.mark.e2e


def test_fork_here_opens_the_fork_which_sends_the_next_request(
        app, session, llm, stack, page):  # noqa: F811 - the imported fixtures
    base, _ = stack
    llm.script("add 2 and 3, and 4 and 5", {"content": "Adding.", "tool_calls": [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "add", "arguments": {"a": 4, "b": 5}}]})
    llm.script(lambda request: request["messages"][-1]["role"] == "tool",
               {"content": "5 and 9."})
    loop = Assistant.start(message="add 2 and 3, and 4 and 5")
    wait_status(session, loop.id, ("completed",))
    tool_result = session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.role == "tool").order_by(Message.id)).first()
    session.rollback()
    original = [r for r in llm.requests if r.json and "messages" in r.json]
    assert len(original) == 2

    page.goto(base + f"/admin/loops/{loop.id}")
    page.click(f'button[data-action="fork"][data-message="{tool_result.id}"]')
    page.wait_for_url(re.compile(rf"/admin/loops/(?!{loop.id}\b)\d+"))
    fork_id = int(re.search(r"/admin/loops/(\d+)", page.url).group(1))
    assert page.locator("#forked-from").inner_text() == (
        f"forked from #{loop.id} at message {tool_result.id}")
    wait_status(session, fork_id, ("completed",))
    sent = [r for r in llm.requests if r.json and "messages" in r.json][2:]
    assert [r.json for r in sent] == [original[1].json]
    session.expire_all()
    assert session.get(Loop, fork_id).forked_from_loop_id == loop.id
    page.click("#forked-from a")
    page.wait_for_url(re.compile(rf"/admin/loops/{loop.id}$"))
