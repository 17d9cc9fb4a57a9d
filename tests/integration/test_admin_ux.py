"""The admin as an operator uses it, through Flask's test client against real
PostgreSQL: only the actions a loop's status allows, confirmations before
stop, force stop and freeze, unfreeze clearing the freeze's reason, times
shown relative with their UTC time, and a loop's conversation exported as
JSON (valid against its schema) and Markdown (safely fenced), from the admin
and from ``flask solidloop export``."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import jsonschema
import pytest
from sqlalchemy import select

from flask_solidloop.admin import format
from flask_solidloop.loops import control, export, store
from flask_solidloop.models import Loop, ToolCall

from ..support.support_app import Assistant, solidloop

SAME = {"Sec-Fetch-Site": "same-origin"}
ALL = {"pause", "resume", "stop", "force_stop", "freeze", "unfreeze", "observe", "unobserve"}
#: A message that tries to close its fence and start a heading of its own.
BREAKOUT = "look:\n```\n# injected heading\n````\nstill the message\n~~~"


def mount(app, **kwargs):
    kwargs.setdefault("authorize", lambda request: True)
    app.register_blueprint(solidloop.admin_blueprint(**kwargs), url_prefix="/admin")
    return app.test_client()


@pytest.fixture
def client(app):
    return mount(app)


def offered(html: str) -> set[str]:
    """The actions the loop page offers: buttons, and confirmations' openers."""
    section = re.search(r'<section class="actions" id="actions".*?</section>', html, re.S)
    assert section, "the loop page has no actions section"
    return set(re.findall(r'data-(?:action|open)="(\w+)"', section.group(0)))


def page(client, loop_id: int) -> str:
    response = client.get(f"/admin/loops/{loop_id}")
    assert response.status_code == 200
    return response.get_data(as_text=True)


def test_each_status_offers_only_the_actions_that_apply(app, session, client, llm, drain):
    state = app.extensions["solidloop"]
    llm.script(lambda req: "completes" in str(req["messages"][-1].get("content")),
               {"content": "done"})
    completed = Assistant.start(message="completes")
    drain()
    init = Assistant.create(message="not started")
    queued = Assistant.start(message="queued")
    paused = Assistant.start(message="paused")
    control.pause(state, paused.id)
    frozen = Assistant.start(message="frozen")
    control.freeze(state, frozen.id)
    failed = Assistant.create(message="failed")
    control.stop(state, failed.id, reason="stopped in a test")
    observed = Assistant.create(message="observed")
    control.observe(state, observed.id)
    want = {
        init.id: {"resume", "stop", "force_stop", "freeze", "observe"},
        queued.id: {"pause", "stop", "force_stop", "freeze", "observe"},
        paused.id: {"resume", "stop", "force_stop", "freeze", "observe"},
        frozen.id: {"stop", "force_stop", "unfreeze", "observe"},
        failed.id: {"resume", "observe"},
        observed.id: {"resume", "stop", "force_stop", "freeze", "unobserve"},
        completed.id: {"resume", "observe"},
    }
    session.expire_all()
    for loop_id, actions in want.items():
        row = session.get(Loop, loop_id)
        assert offered(page(client, loop_id)) == actions, (row.status, row.frozen)
        # one implementation: the page shows what the store's transitions allow
        assert set(control.applicable(row)) == actions
    # every listed action really applies: each changes its loop
    for loop_id, actions in want.items():
        for action in sorted(actions & {"pause", "freeze", "unfreeze", "observe", "unobserve"}):
            response = client.post(f"/admin/loops/{loop_id}/act/{action}", headers=SAME)
            assert "ok=1" in response.headers["Location"], (loop_id, action)
            break


def test_stop_force_stop_and_freeze_ask_for_confirmation_without_script(client, session):
    loop = Assistant.start(message="to be stopped")
    html = page(client, loop.id)
    for action in ("stop", "force_stop", "freeze"):
        box = re.search(rf'<details class="confirm" data-confirm="{action}">(.*?)</details>',
                        html, re.S)
        assert box, f"{action} is not behind a confirmation"
        assert f'data-open="{action}"' in box.group(1)  # the opener, a <summary>
        assert re.search(rf'<button type="submit"[^>]*data-action="{action}"', box.group(1))
        assert html.count(f'data-action="{action}"') == 1  # no submit outside it
    # pause and observe act at once
    section = re.search(r'<section class="actions".*?</section>', html, re.S).group(0)
    assert re.search(r'<form method="post"[^>]*/act/pause">\s*<input', section) or \
        'data-action="pause"' in section
    assert "<script" not in html.split("</head>")[1] and " onclick" not in html


def test_actions_live_in_the_regions_and_follow_a_change_made_elsewhere(app, client, session):
    loop = Assistant.start(message="watched")
    url = f"/admin/loops/{loop.id}/regions"
    assert offered(client.get(url).get_data(as_text=True)) >= {"pause", "freeze"}
    control.freeze(app.extensions["solidloop"], loop.id)  # say, from the CLI
    after = offered(client.get(url).get_data(as_text=True))
    assert "unfreeze" in after and "pause" not in after and "freeze" not in after


def test_unfreeze_clears_the_freezes_reason(app, client, session):
    state = app.extensions["solidloop"]
    loop = Assistant.start(message="frozen then thawed")
    assert control.freeze(state, loop.id)
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert (row.status, row.frozen, row.error_message) == ("paused", True, "frozen")
    assert 'class="error">frozen' in page(client, loop.id)
    assert control.unfreeze(state, loop.id)
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert (row.status, row.frozen, row.error_message) == ("paused", False, None)
    html = page(client, loop.id)
    assert 'class="error">frozen' not in html and "<tr><th>error</th>" not in html
    # a loop stopped while frozen keeps its own reason
    stopped = Assistant.start(message="frozen then stopped")
    control.freeze(state, stopped.id)
    control.stop(state, stopped.id, reason="stopped while frozen")
    assert store.unfreeze(session, stopped.id)
    session.expire_all()
    assert session.get(Loop, stopped.id).error_message == "stopped while frozen"


def test_times_read_relative_with_the_absolute_utc_time_on_hover(client, session):
    moment = datetime(2026, 12, 4, 3, 0, 0, tzinfo=UTC)
    assert str(format.at(moment, now=moment + timedelta(minutes=3))) == (
        '<time datetime="2026-12-04T03:00:00Z" title="2026-12-04 03:00:00 UTC">3 min ago</time>')
    assert "in 2 h" in format.at(moment, now=moment - timedelta(hours=2))
    assert format.when(moment.replace(tzinfo=None)) == "2026-12-04 03:00:00 UTC"
    loop = Assistant.start(message="when")
    for html in (page(client, loop.id), client.get("/admin/loops").get_data(as_text=True),
                 client.get("/admin/").get_data(as_text=True)):
        stamps = re.findall(r'<time datetime="([^"]+)" title="([^"]+)">([^<]+)</time>', html)
        for iso, title, text in stamps:
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", iso)
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", title)
            assert re.fullmatch(r"just now|[\d.]+ (s|min|h|d) ago|in [\d.]+ (s|min|h|d)", text)
        # every absolute time the page prints is labelled UTC
        text_only = re.sub(r"<[^>]+>", " ", html)
        assert not re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?! UTC)", text_only)
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">just now|[\d.]+ s ago',
                     page(client, loop.id))


def _tool_loop(llm, drain, text: str) -> Loop:
    llm.script(lambda req: req["messages"][-1]["role"] == "user",
               {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": text})
    loop = Assistant.start(message="add 2 and 3, then quote: " + BREAKOUT)
    drain()
    return loop


def test_export_json_is_a_documented_versioned_document(app, session, client, llm, drain):
    loop = _tool_loop(llm, drain, "5, and " + BREAKOUT)
    response = client.get(f"/admin/loops/{loop.id}/export.json")
    assert response.status_code == 200 and response.mimetype == "application/json"
    doc = json.loads(response.get_data(as_text=True))
    jsonschema.Draft202012Validator.check_schema(export.SCHEMA)
    jsonschema.Draft202012Validator(export.SCHEMA).validate(doc)
    assert doc["schema"] == "solidloop.conversation/1"
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert doc["loop"]["id"] == loop.id and doc["loop"]["status"] == "completed"
    assert doc["totals"] == {"steps": row.step_count, "input_tokens": row.input_tokens,
                             "output_tokens": row.output_tokens,
                             "cost_usd": None if row.cost is None else float(row.cost)}
    roles = [m["role"] for m in doc["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    asked = doc["messages"][2]
    assert asked["usage"]["output_tokens"] >= 0 and "cost_usd" in asked
    (call,) = asked["tool_calls"]
    stored = session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)).one()
    assert (call["id"], call["name"], call["arguments"], call["is_success"]) == (
        stored.id, "add", {"a": 2, "b": 3}, True)
    assert call["result"] == stored.result
    assert doc["messages"][3]["tool_call_id"] == stored.id
    assert doc["messages"][-1]["content"] == "5, and " + BREAKOUT
    assert f'/admin/loops/{loop.id}/export.json' in page(client, loop.id)
    assert f'/admin/loops/{loop.id}/export.md' in page(client, loop.id)


def outside_fences(markdown: str) -> list[str]:
    """The lines of ``markdown`` a CommonMark reader sees outside code fences:
    a fence closes only on a line of the same character, at least as long."""
    outside, open_ = [], None
    for line in markdown.splitlines():
        mark = re.match(r"^(`{3,}|~{3,})(.*)$", line)
        if open_ is None:
            if mark:
                open_ = mark.group(1)
            else:
                outside.append(line)
        elif mark and mark.group(1)[0] == open_[0] and len(mark.group(1)) >= len(open_) \
                and not mark.group(2).strip():
            open_ = None
    assert open_ is None, "a fence was left open"
    return outside


def test_export_markdown_keeps_every_message_inside_its_fence(client, llm, drain):
    loop = _tool_loop(llm, drain, "5, and " + BREAKOUT)
    response = client.get(f"/admin/loops/{loop.id}/export.md")
    assert response.status_code == 200 and response.mimetype == "text/markdown"
    md = response.get_data(as_text=True)
    assert md.count("# injected heading") == 2  # the user's message and the answer
    seen = outside_fences(md)
    assert not any("injected" in line or "still the message" in line for line in seen), seen
    headings = [line for line in seen if line.startswith("#")]
    assert headings[0].startswith(f"# Loop {loop.id}")
    assert [h for h in headings if h.startswith("## ")] == [
        f"## {role} (message {n})" for role, n in zip(
            ["system", "user", "assistant", "tool", "assistant"],
            sorted(int(x) for x in re.findall(r"^## \w+ \(message (\d+)\)", md, re.M)),
            strict=True)]
    assert "### Tool call `add`" in md and '"a": 2' in md
    assert "cost:" in md
    assert export.fence("a ````` b").startswith("``````")


@pytest.mark.parametrize("verdict", [None, False])
def test_export_is_access_controlled(app, session, verdict):
    loop = Assistant.create(message="private")
    closed = mount(app, authorize=None if verdict is None else (lambda request: verdict))
    for kind in ("json", "md"):
        response = closed.get(f"/admin/loops/{loop.id}/export.{kind}")
        assert response.status_code == 403
        assert b"private" not in response.data


def test_export_of_a_missing_loop_is_404(client):
    assert client.get("/admin/loops/987654321/export.json").status_code == 404
    assert client.get("/admin/loops/1/export.txt").status_code == 404


def test_the_export_command_prints_json_or_markdown(app, session, llm, drain):
    loop = _tool_loop(llm, drain, "5")
    runner = app.test_cli_runner()
    result = runner.invoke(args=["solidloop", "export", str(loop.id), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    jsonschema.Draft202012Validator(export.SCHEMA).validate(doc)
    assert doc["loop"]["id"] == loop.id
    result = runner.invoke(args=["solidloop", "export", str(loop.id), "--format", "md"])
    assert result.exit_code == 0 and result.output.startswith(f"# Loop {loop.id}")
    assert not any("injected" in line for line in outside_fences(result.output))
    missing = runner.invoke(args=["solidloop", "export", "987654321"])
    assert missing.exit_code == 1 and "no loop with id 987654321" in missing.output
