"""The admin blueprint served by Flask's test client against real PostgreSQL and
loops run by the in-process drain: access, CSRF, CSP, escaping, filters,
keyset pages, actions, bulk actions and the SSE stream's resume."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import re

import pytest
from sqlalchemy import event, select, text

from flask_solidloop import Agent
from flask_solidloop.loops import store
from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.mcp_server import store as inbound
from flask_solidloop.models import Loop, McpSession, Message
from flask_solidloop.testing import drain as run
from flask_solidloop.testing.mcp_emulator import MCPEmulator

from ..support.support_app import Assistant, llm_settings, solidloop
from .loop_states import running_loop

SAME = {"Sec-Fetch-Site": "same-origin"}
XSS = "<script>alert('pwned')</script>"


def mount(app, **kwargs):
    kwargs.setdefault("authorize", lambda request: True)
    app.register_blueprint(solidloop.admin_blueprint(**kwargs), url_prefix="/admin")
    return app.test_client()


@pytest.fixture
def client(app):
    def resolver(loop):
        return {"url": (loop.state or {}).get("subject_url", f"/users/{loop.subject_id}"),
                "label": (loop.state or {}).get("subject_label")}
    return mount(app, subject_resolver=resolver)


def test_without_authorize_everything_is_denied(app, session):
    loop = Assistant.start(message="hi")
    c = mount(app, authorize=None)
    for path in ("/admin/", "/admin/loops", f"/admin/loops/{loop.id}", "/admin/jobs",
                 f"/admin/loops/{loop.id}/stream", "/admin/_static/admin.css"):
        response = c.get(path)
        assert response.status_code == 403, path
        assert b"authorize=" in response.data
    assert c.post(f"/admin/loops/{loop.id}/act/pause", headers=SAME).status_code == 403
    session.expire_all()
    assert session.get(Loop, loop.id).status == "queued"


@pytest.mark.parametrize("verdict", [False, None, "yes", 1, "raise"])
def test_authorize_must_say_exactly_true(app, verdict):
    def authorize(request):
        if verdict == "raise":
            raise RuntimeError("broken hook")
        return verdict
    c = mount(app, authorize=authorize)
    assert c.get("/admin/").status_code == 403


def test_pages_carry_a_csp_that_allows_only_own_scripts(client):
    response = client.get("/admin/")
    assert response.status_code == 200
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert response.headers["X-Frame-Options"] == "DENY"
    html = response.get_data(as_text=True)
    assert "<script>" not in html  # no inline script at all
    assert re.search(r'src="/admin/_static/vendor/htmx-2\.\d+\.\d+\.min\.js"', html)
    assert client.get("/admin/_static/vendor/htmx-ext-sse-2.2.4.min.js").status_code == 200


def test_cross_site_posts_are_refused(app, session):
    app.config["SOLIDLOOP_ADMIN_TRUSTED_ORIGINS"] = ()
    loop = Assistant.start(message="hi")
    c = mount(app)
    url = f"/admin/loops/{loop.id}/act/pause"
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                    {"Origin": "https://evil.example"}, {"Referer": "https://evil.example/x"},
                    {}):
        response = c.post(url, headers=headers)
        assert response.status_code == 403, headers
        assert b"refused" in response.data
    session.expire_all()
    assert session.get(Loop, loop.id).status == "queued"
    assert c.post(url, headers={"Origin": "http://localhost"}).status_code == 303
    session.expire_all()
    assert session.get(Loop, loop.id).status == "paused"


def test_trusted_origins_and_the_optional_token(app, session):
    from flask_solidloop.config import Config

    state = app.extensions["solidloop"]
    state.config = Config.from_mapping({"SOLIDLOOP_ADMIN_TRUSTED_ORIGINS":
                                        "https://admin.example"})
    app.secret_key = "test-secret"
    loop = Assistant.start(message="hi")
    c = mount(app, require_token=True)
    url = f"/admin/loops/{loop.id}/act/pause"
    origin = {"Origin": "https://admin.example"}
    assert c.post(url, headers=origin).status_code == 403  # no token
    page = c.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    token = re.search(r'name="_csrf" value="([0-9a-f]+)"', page).group(1)
    assert c.post(url, headers=origin, data={"_csrf": "0" * 64}).status_code == 403
    assert c.post(url, headers=origin, data={"_csrf": token}).status_code == 303


def test_script_in_messages_results_and_subjects_is_text(app, session, llm, drain, client):
    llm.script(lambda req: req["messages"][-1]["role"] == "user",
               {"tool_calls": [{"name": "calc__lookup", "arguments": {"key": XSS}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "done " + XSS})
    loop = Assistant.start(message="hello " + XSS, subject=(XSS, "7"),
                           state={"subject_label": "label " + XSS})
    drain()
    html = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in html
    listing = client.get("/admin/loops").get_data(as_text=True)
    assert "<script>alert" not in listing and "label &lt;script&gt;" in listing


def _timeline(html: str) -> str:
    return html.split('<section id="timeline">')[1].split("</section>")[0]


def test_the_timeline_shows_a_turn_a_killed_worker_interrupted(app, state, session, llm,
                                                               client, pg):
    # A worker claimed the turn and streamed part of an answer into its shell, then
    # died: its lease lapses, the reaper hides the shell and queues the turn again.
    loop_id, _ = running_loop(session)
    session.add(Message(loop_id=loop_id, role="assistant", status="processing",
                        is_hidden=True, content="Let me che"))
    session.commit()
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second' "
               "WHERE id = %s", (loop_id,))
    assert reap(state).expired_llm == [loop_id]
    llm.script("hello there", {"content": "Checked: all good."})
    run(app)
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    interrupted, answered = session.scalars(select(Message.id).where(
        Message.loop_id == loop_id, Message.role == "assistant").order_by(Message.id)).all()

    timeline = _timeline(client.get(f"/admin/loops/{loop_id}").get_data(as_text=True))
    turns = re.findall(r'<li class="turn turn-(\w+)" data-turn="(\d+)">', timeline)
    assert turns == [("failed", str(interrupted)), ("completed", str(answered))]
    killed = timeline.split(f'data-turn="{interrupted}"')[1].split("</li>")[0]
    assert ">interrupted</span>" in killed and "10 characters of partial output" in killed
    # `status` shows the same turn: both read the same rows.
    status = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop_id)]).output
    assert f"[{interrupted}] assistant (failed, hidden)" in status


def test_the_loop_page_shows_its_mcp_sessions_and_their_tool_snapshots(app, session, llm,
                                                                      client):
    with MCPEmulator() as server:
        server.tool("find_ticket", description="Find a ticket " + XSS, result="ticket 7")
        server.tool("close_ticket", description="Close a ticket", result="closed")

        @solidloop.agent("admin_remote_desk")
        class RemoteDesk(Agent):
            system_prompt = "You use remote tools."
            mcps = [{"name": "desk", "url": server.url}]

            def llm(self):
                return llm_settings()

        llm.script("find", {"tool_calls": [{"name": "find_ticket", "arguments": {}}]})
        llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "found"})
        loop = RemoteDesk.start(message="find ticket 7")
        run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    (stored,) = session.scalars(select(McpSession).where(McpSession.loop_id == loop.id)).all()

    html = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    section = html.split('<section id="mcp-sessions">')[1].split("</section>")[0]
    assert "desk: 2 tool(s)" in section and "none (in-process" not in section
    assert re.findall(r"<li><code>(\w+)</code>", section) == ["find_ticket", "close_ticket"]
    # A remote server's descriptions are text, never markup.
    assert XSS not in section and "Find a ticket &lt;script&gt;" in section
    keys = ", ".join(stored.session_state)
    assert keys and f"session state keys: {keys}</p>" in section, stored.session_state


@pytest.mark.parametrize(("url", "clickable"), [
    ("javascript:alert(1)", False), ("//evil.example/x", False), ("/users/7", True),
    ("https://crm.example/u/7", True)])
def test_subject_links_only_for_relative_or_http_urls(session, client, url, clickable):
    loop = Assistant.start(message="hi", subject=("User", "7"), state={"subject_url": url})
    html = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert ('class="subject" href=' in html) is clickable
    assert "javascript:" not in html.split('id="loop-subject"')[1][:200]


def test_filters_live_in_the_url_and_combine(session, client):
    a = Assistant.start(message="find the needle here", subject=("User", "1"),
                        state={"customer": "acme", "tier": 2})
    b = Assistant.start(message="nothing", subject=("User", "2"), state={"customer": "beta"})
    store.stop(session, b.id, reason="ProviderHTTPError: HTTP 503 from upstream")
    c_ = Assistant.start(message="other")
    store.stop(session, c_.id, reason="TypeError: bad operand")

    def ids(query):
        response = client.get("/admin/loops?" + query)
        assert response.status_code == 200, response.data
        return [int(x) for x in re.findall(r'data-loop="(\d+)"', response.get_data(as_text=True))]

    assert ids("") == [c_.id, b.id, a.id]
    assert ids("status=failed") == [c_.id, b.id]
    assert ids("status=queued&status=failed") == [c_.id, b.id, a.id]
    assert ids("failure=infra:http") == [b.id]
    assert ids("failure=agent") == [c_.id]
    assert ids("agent=assistant&subject_type=User&subject_id=1") == [a.id]
    assert ids("agent=nobody") == []
    assert ids("q=NEEDLE") == [a.id]
    assert ids("q=%25") == []  # LIKE wildcards are literal
    assert ids("state=%7B%22customer%22%3A%22acme%22%7D") == [a.id]
    assert ids("from=2000-01-01&to=2999-01-01") == [c_.id, b.id, a.id]
    assert ids("to=2000-01-01") == []
    # a loop page keeps the list's filters for the way back
    page = client.get(f"/admin/loops/{b.id}?back=status%3Dfailed%26evil%3D1").get_data(
        as_text=True)
    assert 'href="/admin/loops?status=failed"' in page


@pytest.mark.parametrize(("query", "named"), [
    ("status=bogus", "status='bogus'"), ("failure=nope", "failure='nope'"),
    ("state=%7Bbad", "state is not valid JSON"), ("state=%5B1%5D", "state must be"),
    ("from=yesterday", "from='yesterday'")])
def test_bad_filters_get_a_clear_message(client, query, named):
    response = client.get("/admin/loops?" + query)
    assert response.status_code == 400
    assert named in response.get_data(as_text=True).replace("&#39;", "'")


def test_keyset_pages_walk_every_loop_once(app, session):
    made = [Assistant.start(message=f"m{i}").id for i in range(7)]
    c = mount(app, page_size=3)
    seen, url = [], "/admin/loops?agent=assistant"
    while url:
        html = c.get(url).get_data(as_text=True)
        seen += [int(x) for x in re.findall(r'data-loop="(\d+)"', html)]
        nxt = re.search(r'id="next-page" href="([^"]+)"', html)
        url = nxt.group(1).replace("&amp;", "&") if nxt else None
        if url:
            assert "agent=assistant" in url
    assert seen == sorted(made, reverse=True)


def _act(client, loop_id, action, **data):
    response = client.post(f"/admin/loops/{loop_id}/act/{action}", headers=SAME, data=data)
    assert response.status_code == 303, response.data
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    return re.search(r'id="result">([^<]+)<', page).group(1)


def test_each_action_changes_the_loop_and_says_so(session, client, llm, drain):
    loop = Assistant.start(message="hi")
    assert _act(client, loop.id, "observe").startswith("observe: Observing")
    assert _act(client, loop.id, "pause") == "pause: Paused."
    assert _act(client, loop.id, "pause").startswith("pause: Not paused")
    assert _act(client, loop.id, "freeze").startswith("freeze: Frozen")
    assert _act(client, loop.id, "resume").startswith("resume: Not resumed")
    assert _act(client, loop.id, "unfreeze") == "unfreeze: Unfrozen."
    assert _act(client, loop.id, "resume", message="and continue") == "resume: Resumed."
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "queued" and row.observed and not row.frozen
    assert session.scalars(select(Message.content).where(
        Message.loop_id == loop.id, Message.role == "user")).all()[-1] == "and continue"
    assert _act(client, loop.id, "stop") == "stop: Stopped."
    assert _act(client, loop.id, "resume", resume_from="paused").startswith("resume: Not")
    assert _act(client, loop.id, "resume", resume_from="failed") == "resume: Resumed."
    assert _act(client, loop.id, "force_stop").startswith("force_stop: Force stopped")
    assert _act(client, loop.id, "unobserve") == "unobserve: No longer observed."
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed" and not row.observed
    assert row.error_message.startswith("force stopped")


def test_bulk_resume_acts_on_the_filtered_set_after_a_count(app, session):
    app.config["SOLIDLOOP_ADMIN_BULK_BATCH"] = 2
    from flask_solidloop.config import Config

    app.extensions["solidloop"].config = Config.from_mapping({"SOLIDLOOP_ADMIN_BULK_BATCH": 2})
    c = mount(app)
    failed = [Assistant.start(message=f"f{i}").id for i in range(5)]
    for loop_id in failed:
        store.stop(session, loop_id, reason="ProviderHTTPError: HTTP 500")
    other = Assistant.start(message="keeps running").id
    form = {"action": "resume", "status": "failed", "agent": "assistant"}
    confirm = c.post("/admin/loops/bulk", headers=SAME, data=form)
    html = confirm.get_data(as_text=True)
    assert 'data-count="5"' in html
    max_id = int(re.search(r'name="max_id" value="(\d+)"', html).group(1))
    session.expire_all()
    assert all(session.get(Loop, i).status == "failed" for i in failed)  # nothing yet
    late = Assistant.start(message="late").id
    store.stop(session, late, reason="ProviderHTTPError: HTTP 500")
    token = re.search(r'name="token" value="(\w+)"', html).group(1)
    posted = c.post("/admin/loops/bulk", headers=SAME,
                    data={**form, "confirm": "1", "max_id": str(max_id),
                          "resume_from": "failed", "token": token})
    assert posted.status_code == 303
    assert run(app, queues=("solidloop_maintenance",)) == 3  # chunks of 2: 2, 2, 1
    page = c.get(posted.headers["Location"]).get_data(as_text=True)
    assert 'data-changed="5"' in page and 'data-status="done"' in page
    assert 'href="/admin/loops?status=failed&amp;agent=assistant"' in page
    session.expire_all()
    assert [session.get(Loop, i).status for i in failed] == ["queued"] * 5
    assert session.get(Loop, late).status == "failed"  # created after the confirmation
    assert session.get(Loop, other).status == "queued"


def test_dashboard_and_jobs_show_real_numbers(session, client, llm, drain):
    llm.script(lambda req: True, {"content": "ok", "usage": {"prompt_tokens": 11,
                                                             "completion_tokens": 5}})
    Assistant.start(message="one")
    drain()
    failed = Assistant.start(message="two")
    store.stop(session, failed.id, reason="McpTransportError: connection refused")
    html = client.get("/admin/").get_data(as_text=True)
    assert re.search(r'failure=infra:connect">infra:connect</a></th>\s*<td class="num">1', html)
    assert re.search(r"last hour</th><td class=\"num\">1</td>\s*<td class=\"num\">11", html)
    jobs = client.get("/admin/jobs")
    assert jobs.status_code == 200 and "solidloop_llm" in jobs.get_data(as_text=True)


def _events(body: str) -> list[tuple[str, str | None, str]]:
    out = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line
                      and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields.get("id"), fields.get("data", "")))
    return out


def test_stream_resumes_from_last_event_id_without_gap_or_duplicate(app, session):
    from flask_solidloop.config import Config

    # Streams of 1 s with a heartbeat every 0.1 s: the quiet one sends a heartbeat
    # even when its first read is slow.
    app.extensions["solidloop"].config = Config.from_mapping(
        {"SOLIDLOOP_ADMIN_STREAM_SECONDS": 1.0, "SOLIDLOOP_ADMIN_HEARTBEAT": 0.1})
    c = mount(app)
    loop = Assistant.start(message="stream")
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    shell = claim.shell_id
    store.record_delta(session, shell, "Hello, wor", 0)

    first = _events(c.get(f"/admin/loops/{loop.id}/stream?cursor=0").get_data(as_text=True))
    tokens = [e for e in first if e[0] == "token"]
    assert len(tokens) == 1 and f'data-m="{shell}" data-o="0">Hello, wor</span>' in tokens[0][2]
    assert [e[0] for e in first][-1] != "end"  # the loop runs: the stream only timed out
    store.record_delta(session, shell, "ld <b>!</b>", 10)
    again = _events(c.get(f"/admin/loops/{loop.id}/stream",
                          headers={"Last-Event-ID": tokens[0][1]}).get_data(as_text=True))
    tokens = [e for e in again if e[0] == "token"]
    assert len(tokens) == 1 and int(tokens[0][1]) > int(first[-1][1])
    assert 'data-o="10">ld &lt;b&gt;!&lt;/b&gt;</span>' in tokens[0][2]
    # nothing new: a resumed stream sends no token, only heartbeats, and ends
    quiet = c.get(f"/admin/loops/{loop.id}/stream",
                  headers={"Last-Event-ID": tokens[0][1]}).get_data(as_text=True)
    assert "event: token" not in quiet and ": heartbeat" in quiet


@contextlib.contextmanager
def after_first_content_read(app, *updates: tuple[str, dict]):
    """Commit ``updates`` (SQL, params) from another connection right after the
    first statement that reads the messages' content; yields a list that holds
    that statement once it ran."""
    engine = app.extensions["solidloop"].db.engine
    seen: list[str] = []

    def change(conn, cursor, statement, *args):
        if not seen and "solidloop_messages" in statement and "content" in statement:
            seen.append(statement)
            with engine.connect() as other:
                for sql, params in updates:
                    other.execute(text(sql), params)
                other.commit()

    event.listen(engine, "after_cursor_execute", change)
    try:
        yield seen
    finally:
        event.remove(engine, "after_cursor_execute", change)


def streaming_shell(session, text_so_far: str) -> tuple[int, int]:
    """A loop whose turn streams: (loop id, shell id) with ``text_so_far`` sent."""
    loop = Assistant.start(message="stream")
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    shell = claim.shell_id
    store.record_delta(session, shell, text_so_far, 0)
    session.commit()
    return loop.id, shell


def _tokens(events) -> str:
    return "".join(html.unescape(re.sub(r"<[^>]+>", "", data))
                   for name, _, data in events if name == "token")


def test_a_page_shows_exactly_the_text_before_its_streams_cursor(app, session, client):
    # A turn keeps streaming while the page renders. Its text and its stream's
    # cursor come from one read: here the text grows right after the page's
    # first read of the messages, and the page shows exactly what its cursor
    # says it has shown; its stream sends the rest, once.
    from flask_solidloop.config import Config

    app.extensions["solidloop"].config = Config.from_mapping(
        {"SOLIDLOOP_ADMIN_STREAM_SECONDS": 1.0, "SOLIDLOOP_ADMIN_HEARTBEAT": 0.1})
    loop_id, shell = streaming_shell(session, "w000 w001 ")
    with after_first_content_read(app, (
            "SELECT solidloop_stream_delta(:loop, :id, 'w002 w', 10, NULL, 0)",
            {"loop": loop_id, "id": shell})) as grown:
        page = client.get(f"/admin/loops/{loop_id}").get_data(as_text=True)
    assert grown, "the page never read the messages' content"
    cursor = re.search(r"cursor=(\d+)", page)
    shown = re.search(r'<pre id="live-tokens"[^>]*><span class="tok" data-m="(\d+)" '
                      r'data-o="0">([^<]*)</span>', page)
    assert cursor and shown, page
    assert int(shown.group(1)) == shell and shown.group(2) == "w000 w001 "
    rest = _events(client.get(f"/admin/loops/{loop_id}/stream?cursor={cursor.group(1)}")
                   .get_data(as_text=True))
    assert shown.group(2) + _tokens(rest) == "w000 w001 w002 w"


def test_a_stream_sends_the_last_text_of_a_turn_that_ends_while_it_reads(app, session):
    # The turn's last delta, its completion and the status that ends the stream
    # commit together right after the stream's first read: the stream must
    # still send every character before it ends.
    from flask_solidloop.config import Config

    app.extensions["solidloop"].config = Config.from_mapping(
        {"SOLIDLOOP_ADMIN_STREAM_SECONDS": 2, "SOLIDLOOP_ADMIN_HEARTBEAT": 0.1})
    c = mount(app)
    loop_id, shell = streaming_shell(session, "w000 w0")
    with after_first_content_read(
            app,
            ("SELECT solidloop_stream_delta(:loop, :id, '01', 7, NULL, 0)",
             {"loop": loop_id, "id": shell}),
            ("UPDATE solidloop_messages SET content = 'w000 w001', status = 'completed'"
             " WHERE id = :id", {"id": shell}),
            ("UPDATE solidloop_loops SET status = 'completed' WHERE id = :id",
             {"id": loop_id})) as finished:
        body = c.get(f"/admin/loops/{loop_id}/stream?cursor=0").get_data(as_text=True)
    assert finished, "the stream never read the messages' content"
    events = _events(body)
    assert _tokens(events) == "w000 w001", events
    assert events[-1][0] == "end" and "completed" in events[-1][2]


def test_waiting_streams_hold_no_connection_and_share_one_listen(app, session):
    import threading
    import time

    import psycopg

    from flask_solidloop.config import Config
    from flask_solidloop.streaming import LISTEN_APPLICATION_NAME, hub_for
    from flask_solidloop.urls import libpq_url

    state = app.extensions["solidloop"]
    state.config = Config.from_mapping({"SOLIDLOOP_ADMIN_STREAM_SECONDS": 5,
                                        "SOLIDLOOP_ADMIN_HEARTBEAT": 5})
    c = mount(app)
    loop_id = Assistant.start(message="watched").id
    session.remove()
    bodies: list[bytes] = []

    def watch() -> None:
        try:
            bodies.append(c.get(f"/admin/loops/{loop_id}/stream").get_data())
        except Exception as exc:  # surfaced by the assertions below
            bodies.append(repr(exc).encode())

    def listening() -> int:
        with psycopg.connect(libpq_url(state.database_url), autocommit=True) as conn:
            return conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                "AND datname = current_database()", (LISTEN_APPLICATION_NAME,)).fetchone()[0]

    # Hubs of earlier tests' apps in this process may still be retiring: count what
    # this test's five streams add.
    before = listening()
    # Count the streams inside the hub's wait (the one place a stream idles), so
    # the checks below run while all five wait, however slowly they got there.
    hub = hub_for(state)
    waiting = [0]
    counting = threading.Lock()
    real_wait = hub.wait

    def counted_wait(*args, **kwargs):
        with counting:
            waiting[0] += 1
        try:
            return real_wait(*args, **kwargs)
        finally:
            with counting:
                waiting[0] -= 1

    hub.wait = counted_wait
    streams = [threading.Thread(target=watch) for _ in range(5)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 10
    while waiting[0] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    if waiting[0] != 5:
        for t in streams:
            t.join(10)
        raise AssertionError(bodies)
    assert hub.streams == 5
    assert hub.connected.wait(10)
    assert state.db.engine.pool.checkedout() == 0
    now = listening()
    assert now >= 1 and now - before <= 1  # five streams, one LISTEN connection of theirs
    for t in streams:
        t.join(10)
    assert len(bodies) == 5 and all(b.startswith(b"retry: ") for b in bodies)


def _register_worker(session, identity, *, queues=("solidloop_llm",), threads=4,
                     silent=0.0, stopped=False):
    from flask_solidloop.queue import sql as qsql

    conn = session.connection().connection
    host, pid = identity.rsplit(":", 1)
    with conn.cursor() as cur:
        cur.execute(qsql.WORKER_REGISTER, {"identity": identity, "host": host, "pid": int(pid),
                                           "queues": json.dumps(list(queues)),
                                           "threads": threads})
        cur.execute("UPDATE solidloop_workers SET last_seen_at = now() - make_interval("
                    "secs => %s), stopped_at = CASE WHEN %s THEN now() END "
                    "WHERE identity = %s", (silent, stopped, identity))
    session.commit()


def test_workers_page_shows_live_lost_and_stopped_workers_and_what_they_hold(session, client):
    held = Assistant.start(message="held")
    idle = Assistant.start(message="idle")
    _register_worker(session, "alpha:101", queues=("solidloop_llm", "solidloop_tools"))
    _register_worker(session, "beta:202", silent=600)     # heartbeat silent: lost
    _register_worker(session, "gamma:303", stopped=True)  # clean shutdown
    _register_worker(session, "old:404", silent=7200)     # gone longer than an hour
    session.execute(text("UPDATE solidloop_loops SET status = 'running', lease_holder = "
                         "'alpha:101' WHERE id = :id"), {"id": held.id})
    session.commit()
    html = client.get("/admin/workers").get_data(as_text=True)
    rows = dict(re.findall(r'<tr data-worker="([^"]+)">(.*?)</tr>', html, re.S))
    assert set(rows) == {"alpha:101", "beta:202", "gamma:303"}
    assert "status-live" in rows["alpha:101"] and "solidloop_llm, solidloop_tools" in rows[
        "alpha:101"]
    assert f'href="/admin/loops/{held.id}">{held.id}</a>' in rows["alpha:101"]
    assert f"/admin/loops/{idle.id}\"" not in html
    assert "status-lost" in rows["beta:202"] and "status-stopped" in rows["gamma:303"]
    assert "old:404" in client.get("/admin/workers?recent=86400").get_data(as_text=True)
    assert 'href="/admin/workers"' in html  # in the navigation
    dashboard = client.get("/admin/").get_data(as_text=True)
    assert re.search(r'id="live-workers">1</a>', dashboard)
    assert "alpha:101</th><td class=\"num\">1 loops, 0 tool calls" in dashboard


def test_workers_page_without_workers_says_how_to_start_one(client):
    html = client.get("/admin/workers").get_data(as_text=True)
    assert "no workers registered" in html
    assert re.search(r'id="live-workers">0</a>', client.get("/admin/").get_data(as_text=True))


def test_inbound_mcp_page_lists_sessions_and_their_requests_newest_first(app, session):
    app.config["SOLIDLOOP_ADMIN_TRUSTED_ORIGINS"] = ()
    c = mount(app, page_size=2)
    inbound.create_session(session, session_id="sess-a" + "x" * 20, server_name="orders",
                                 principal_label=XSS, protocol_version="2025-06-18",
                                 client_info={"name": "probe", "version": "1.0"})
    inbound.record_events(session, [
        {"payload": {"server": "orders", "method": f"tools/call-{i}", "principal": XSS,
                     "session_id": "sess-a" + "x" * 20,
                     "headers": {"authorization": "[redacted]"}},
         "status_code": 200, "duration_ms": 3.0, "error": None} for i in range(3)
    ] + [{"payload": {"server": "orders", "method": "tools/list", "session_id": "other"},
          "status_code": 200, "duration_ms": 1.0, "error": None}], body_limit=1000)
    html = c.get("/admin/inbound").get_data(as_text=True)
    assert 'href="/admin/inbound"' in html and "probe 1.0" in html and "2025-06-18" in html
    assert XSS not in html and "&lt;script&gt;" in html
    assert "[redacted]" in html
    page = c.get("/admin/inbound?session=sess-a" + "x" * 20).get_data(as_text=True)
    assert re.findall(r"<td>(tools/call-\d)</td>", page) == ["tools/call-2", "tools/call-1"]
    assert "tools/list" not in page
    older = re.search(r'id="older" href="([^"]+)"', page).group(1).replace("&amp;", "&")
    rest = c.get(older).get_data(as_text=True)
    assert re.findall(r"<td>(tools/call-\d)</td>", rest) == ["tools/call-0"]
    assert 'id="older"' not in rest


def test_discard_closes_a_dead_job_and_says_so(session, client):
    session.execute(text(
        "INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state, "
        "attempts, last_error, finished_at) VALUES ('reports', 'build', gen_random_uuid(), "
        "'{}', 'dead', 3, 'boom', now())"))
    session.commit()
    row_id = session.execute(text("SELECT id FROM solidloop_jobs")).scalar_one()
    html = client.get("/admin/jobs").get_data(as_text=True)
    assert f"/admin/jobs/{row_id}/discard" in html
    response = client.post(f"/admin/jobs/{row_id}/discard", headers=SAME)
    assert response.status_code == 303
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert f"discard done for job row {row_id}." in page
    state, error = session.execute(text("SELECT state, last_error FROM solidloop_jobs")).one()
    assert state == "done" and error == "discarded; it had failed with: boom"
    assert session.execute(text("SELECT count(*) FROM solidloop_jobs")).scalar_one() == 1
    again = client.post(f"/admin/jobs/{row_id}/discard", headers=SAME)
    assert again.status_code == 409 and b"only dead jobs can be discarded" in again.data


def _maintenance_line(html: str, task: str) -> tuple[bool, str]:
    """(marked as a warning, the visible text) of the dashboard's line for ``task``."""
    match = re.search(rf'<div class="maint( warning)?" id="last-{task}"[^>]*>(.*?)</div>',
                      html, re.DOTALL)
    assert match, f"no maintenance line for {task}"
    words = re.sub(r"<[^>]+>", " ", match.group(2))
    return bool(match.group(1)), re.sub(r"\s+", " ", words).replace(" ,", ",").strip()


def test_dashboard_shows_the_last_reap_and_prune_from_the_database(app, session, client):
    from flask_solidloop.leases import worker_identity
    from flask_solidloop.maintenance.janitor import prune
    from flask_solidloop.maintenance.reaper import reap

    state = app.extensions["solidloop"]
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "reap")
    assert warned and line.startswith("Last reap: never")
    assert "is any worker running?" in line
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "prune")
    assert not warned and line.startswith("Last prune: never")
    assert "workers prune every 5 min" in line

    reap(state)
    prune(state)
    html = client.get("/admin/").get_data(as_text=True)
    warned, line = _maintenance_line(html, "reap")
    assert not warned, line
    assert re.fullmatch(rf"Last reap: (just now|[\d.]+ s ago) by {re.escape(worker_identity())}"
                        r", healed 0, \d+ ms", line), line
    warned, line = _maintenance_line(html, "prune")
    assert not warned, line
    assert re.fullmatch(rf"Last prune: (just now|[\d.]+ s ago) by {re.escape(worker_identity())}"
                        r", pruned 0, \d+ ms", line), line

    # No worker reaped for three minutes (5 x SOLIDLOOP_REAPER_INTERVAL is 10 s).
    session.execute(text("UPDATE solidloop_maintenance_runs SET last_finished_at = "
                         "last_finished_at - interval '3 minutes' WHERE task = 'reap'"))
    session.commit()
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "reap")
    assert warned and line.startswith("Last reap: 3 min ago by ")
    assert ("no worker has reaped for 3 min: is any worker running? "
            "SOLIDLOOP_REAPER_INTERVAL=0 turns the in-worker reaper off") in line

    # With the in-worker reaper off here, the hint says what to run instead.
    state.config = dataclasses.replace(state.config, reaper_interval=0)
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "reap")
    assert not warned and "the in-worker reaper is off here" in line  # 3 min is not stale
    session.execute(text("UPDATE solidloop_maintenance_runs SET last_finished_at = "
                         "last_finished_at - interval '1 hour' WHERE task = 'reap'"))
    session.commit()
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "reap")
    assert warned and "nothing has reaped for 1 h" in line
    assert "flask solidloop reap --every 5" in line


def test_dashboard_shows_a_failed_pass_and_its_redacted_error_as_text(
        app, session, client, monkeypatch):
    from flask_solidloop.maintenance.reaper import reap

    state = app.extensions["solidloop"]

    def broken(*args, **kwargs):
        raise RuntimeError("cannot reach postgresql://app:hunter2@db/x " + XSS)

    monkeypatch.setattr(store, "heal_orphan_shells", broken)
    with pytest.raises(RuntimeError):
        reap(state)
    html = client.get("/admin/").get_data(as_text=True)
    warned, line = _maintenance_line(html, "reap")
    assert warned and "failed (healed 0 before it failed)" in line
    assert "The last pass failed" in line and "postgresql://app:***@db/x" in line
    assert "hunter2" not in html and "<script>alert" not in html
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in html
    monkeypatch.undo()
    reap(state)
    warned, line = _maintenance_line(client.get("/admin/").get_data(as_text=True), "reap")
    assert not warned and ", healed 0," in line and "Last failure" in line


def test_the_loop_page_shows_its_trace_id_and_links_it_when_configured(app, session, client):
    from flask_solidloop.state import get_state

    loop = Assistant.start(message="hi")
    page = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    assert 'id="loop-trace"' not in page  # tracing was off: no context, no row
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    session.execute(text("UPDATE solidloop_loops SET trace = CAST(:t AS jsonb) WHERE id = :id"),
                    {"t": json.dumps({"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}),
                     "id": loop.id})
    session.commit()
    row = re.search(r'<tr id="loop-trace">.*?</tr>',
                    client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)).group(0)
    assert f"<code>{trace_id}</code>" in row and "href" not in row
    state = get_state(app)
    state.config = dataclasses.replace(state.config,
                                       trace_url="https://tempo.example/trace/{trace_id}")
    row = re.search(r'<tr id="loop-trace">.*?</tr>',
                    client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)).group(0)
    assert f'href="https://tempo.example/trace/{trace_id}"' in row
