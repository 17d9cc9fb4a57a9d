"""The admin's one stream per browser (``GET /admin/stream?loop=ID:CURSOR&...``):
many loops on one connection, each resuming from its own cursor, its 400s, a
newer stream of the same browser ending the older one (in this process and
from another), the watched mark it keeps while open, and the loop page showing
every assistant message of the current turn sequence. Real PostgreSQL; real
HTTP (a threaded WSGI server on 127.0.0.1) where a connection's end matters."""

from __future__ import annotations

import html
import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import httpx
import psycopg
import pytest
from sqlalchemy import text

from flask_solidloop.config import Config
from flask_solidloop.loops import store
from flask_solidloop.urls import libpq_url

from ..support.support_app import Assistant, solidloop

SHORT = {"SOLIDLOOP_ADMIN_STREAM_SECONDS": 1.0, "SOLIDLOOP_ADMIN_HEARTBEAT": 0.1}


def mount(app, **config):
    app.extensions["solidloop"].config = Config.from_mapping(config or SHORT)
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    return app.test_client()


@pytest.fixture
def served(app):
    """The admin behind a real threaded HTTP server on 127.0.0.1: its base URL."""
    from werkzeug.serving import make_server

    mount(app, SOLIDLOOP_ADMIN_STREAM_SECONDS=30.0, SOLIDLOOP_ADMIN_HEARTBEAT=0.2)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


def streaming_shell(session, text_so_far: str) -> tuple[int, int]:
    """A running loop whose turn streams: (loop id, shell id), ``text_so_far`` sent."""
    loop = Assistant.start(message="stream")
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    store.record_delta(session, claim.shell_id, text_so_far, 0)
    session.commit()
    return loop.id, claim.shell_id


def messages(body: str) -> list[dict]:
    """The stream's ``message`` events, decoded, plus its other events as
    ``{"event": name}``."""
    out = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines()
                      if ": " in line and not line.startswith(":"))
        if fields.get("event") == "message":
            out.append(json.loads(fields["data"]))
        elif "event" in fields:
            out.append({"event": fields["event"], "data": fields.get("data")})
    return out


def tokens(items: list[dict], loop_id: int) -> str:
    return "".join(html.unescape(re.sub(r"<[^>]+>", "", m["data"])) for m in items
                   if m.get("loop") == loop_id and m["event"] == "token")


def last_id(items: list[dict], loop_id: int, default: int) -> int:
    ids = [int(m["id"]) for m in items if m.get("loop") == loop_id and "id" in m]
    return max(ids, default=default)


def test_one_stream_carries_many_loops_each_resuming_from_its_own_cursor(app, session):
    c = mount(app)
    a, shell_a = streaming_shell(session, "a000 ")
    b, shell_b = streaming_shell(session, "b000 ")
    cursor_b = session.scalar(text("SELECT max(id) FROM solidloop_stream_events "
                                   "WHERE loop_id = :b"), {"b": b})
    store.record_delta(session, shell_b, "b001 ", 5)
    done, shell_done = streaming_shell(session, "d000")
    session.execute(text("UPDATE solidloop_messages SET content = 'd000', status = 'completed' "
                         "WHERE id = :id"), {"id": shell_done})
    session.execute(text("UPDATE solidloop_loops SET status = 'completed' WHERE id = :id"),
                    {"id": done})
    session.commit()

    body = c.get(f"/admin/stream?loop={a}:0&loop={b}:{cursor_b}&loop={done}:0&client=tab-1")
    assert body.status_code == 200 and body.mimetype == "text/event-stream"
    first = messages(body.get_data(as_text=True))
    assert tokens(first, a) == "a000 "
    assert tokens(first, b) == "b001 "  # only what came after its cursor
    # the completed loop: its text, then its end, on the same connection
    assert tokens(first, done) == "d000"
    ends = [m for m in first if m["event"] == "end"]
    assert ends == [{"loop": done, "event": "end", "data": "completed"}]

    # More text for both; a second stream from each loop's last id sends exactly it.
    store.record_delta(session, shell_a, "a001 ", 5)
    store.record_delta(session, shell_b, "b002 ", 10)
    session.commit()
    after_a, after_b = last_id(first, a, 0), last_id(first, b, cursor_b)
    again = messages(c.get(f"/admin/stream?loop={a}:{after_a}&loop={b}:{after_b}")
                     .get_data(as_text=True))
    assert tokens(again, a) == "a001 " and tokens(again, b) == "b002 "
    assert all(int(m["id"]) > {a: after_a, b: after_b}[m["loop"]]
               for m in again if "id" in m)
    # nothing new: heartbeats only, no message at all
    quiet = c.get(f"/admin/stream?loop={a}:{last_id(again, a, 0)}"
                  f"&loop={b}:{last_id(again, b, 0)}").get_data(as_text=True)
    assert messages(quiet) == [] and ": heartbeat" in quiet


def test_a_loop_without_a_cursor_starts_where_its_page_would_and_a_gone_one_ends(app, session):
    c = mount(app)
    a, _ = streaming_shell(session, "shown by the page ")
    items = messages(c.get(f"/admin/stream?loop={a}&loop=987654321").get_data(as_text=True))
    assert tokens(items, a) == ""  # the page shows that text already
    assert {"loop": 987654321, "event": "end", "data": "gone"} in items


@pytest.mark.parametrize(("query", "fix"), [
    ("", "give at least one loop=ID:CURSOR"),
    ("loop=abc", "is not ID:CURSOR"),
    ("loop=5:x", "e.g. loop=42:1200"),
    ("loop=5:1&loop=5:2", "give each loop once"),
    ("&".join(f"loop={i}:0" for i in range(1, 52)), "open a second stream for the rest"),
    ("loop=5:0&client=a%20b", "use 1-64 letters, digits"),
])
def test_bad_parameters_answer_one_line_400_naming_the_fix(app, query, fix):
    c = mount(app)
    response = c.get(f"/admin/stream?{query}")
    assert response.status_code == 400
    body = response.get_data(as_text=True)
    assert fix in body and body.count("\n") == 1, body


def test_fifty_loops_are_accepted(app, session):
    c = mount(app)
    loops = [Assistant.start(message=f"m{i}").id for i in range(50)]
    response = c.get("/admin/stream?" + "&".join(f"loop={i}:0" for i in loops))
    assert response.status_code == 200
    response.close()


class Reader:
    """A stream read on a thread of its own, over real HTTP."""

    def __init__(self, url: str) -> None:
        self.lines: list[str] = []
        self.ended = threading.Event()
        self.opened = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        try:
            with httpx.Client(timeout=60) as client, client.stream("GET", url) as response:
                self.status = response.status_code
                self.opened.set()
                for line in response.iter_lines():
                    self.lines.append(line)
                    if self.stop.is_set():
                        return  # the connection closes, as a closed tab's would
        finally:
            self.opened.set()
            self.ended.set()

    def saw(self, needle: str, timeout: float = 20) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in list(self.lines)):
                return True
            time.sleep(0.02)
        return False


@pytest.fixture
def readers() -> Iterator[list[Reader]]:
    made: list[Reader] = []
    yield made
    for reader in made:
        reader.stop.set()
    for reader in made:
        reader.ended.wait(60)


def test_a_newer_stream_of_the_same_browser_ends_the_older_one(app, session, served, readers):
    loop_id = Assistant.start(message="watched").id
    url = f"{served}/admin/stream?loop={loop_id}:0&client=browser-1"
    first = Reader(url)
    readers.append(first)
    assert first.saw(": heartbeat"), first.lines  # open and waiting (30 s to go)
    other = Reader(f"{served}/admin/stream?loop={loop_id}:0&client=browser-2")
    readers.append(other)
    assert other.saw(": heartbeat")
    assert not first.ended.is_set()  # another browser's stream leaves it alone

    second = Reader(url)
    readers.append(second)
    assert first.ended.wait(20), first.lines
    assert "event: superseded" in first.lines
    assert second.saw(": heartbeat") and not second.ended.is_set()
    assert not other.ended.is_set()

    # The browser's newer stream may land on another process: its notification
    # ends this one just the same.
    with psycopg.connect(libpq_url(app.extensions["solidloop"].database_url),
                         autocommit=True) as conn:
        conn.execute("SELECT pg_notify('solidloop_live', %s)",
                     (f"client browser-1\n{time.time_ns() + 10**9:020d}-ffff",))
    assert second.ended.wait(20), second.lines
    assert "event: superseded" in second.lines
    assert not other.ended.is_set()
    # An older token heard late changes nothing.
    with psycopg.connect(libpq_url(app.extensions["solidloop"].database_url),
                         autocommit=True) as conn:
        conn.execute("SELECT pg_notify('solidloop_live', %s)",
                     (f"client browser-2\n{0:020d}-0000",))
    count = len(other.lines)
    assert other.saw(": heartbeat") and len(other.lines) >= count
    assert not other.ended.is_set()


def test_an_open_stream_keeps_its_loops_watched_and_the_mark_expires_after(
        app, session, served, readers, monkeypatch):
    from flask_solidloop.streaming import many

    monkeypatch.setattr(many, "WATCH_SECONDS", 1.5)  # renewed every 0.5 s, for 1.5 s
    a = Assistant.start(message="a").id
    b = Assistant.start(message="b").id

    def watched() -> dict[int, bool]:
        rows = session.execute(text(
            "SELECT id, observed OR coalesce(watched_until > now(), false) AS watched "
            "FROM solidloop_loops WHERE id IN (:a, :b)"), {"a": a, "b": b}).all()
        session.rollback()
        return {row.id: row.watched for row in rows}

    def until(wanted: dict[int, bool], timeout: float = 20) -> dict[int, bool]:
        deadline = time.monotonic() + timeout
        seen = watched()
        while seen != wanted and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = watched()
        return seen

    assert watched() == {a: False, b: False}
    reader = Reader(f"{served}/admin/stream?loop={a}:0&loop={b}:0&client=watcher")
    readers.append(reader)
    assert until({a: True, b: True}) == {a: True, b: True}
    # Still watched after more than a whole mark's life: the stream renews it.
    marked = session.scalar(text("SELECT watched_until FROM solidloop_loops WHERE id = :a"),
                            {"a": a})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        later = session.scalar(text("SELECT watched_until FROM solidloop_loops WHERE id = :a"),
                               {"a": a})
        session.rollback()
        if later > marked + timedelta(seconds=1.6):
            break
        time.sleep(0.1)
    assert later > marked, "the open stream never renewed the mark"
    assert watched() == {a: True, b: True}

    # The page closes (its stream is superseded by one for b alone): a's mark
    # is no longer renewed and runs out by itself; b stays watched.
    readers.append(Reader(f"{served}/admin/stream?loop={b}:0&client=watcher"))
    assert reader.ended.wait(20)
    assert until({a: False, b: True}) == {a: False, b: True}


def test_the_page_shows_every_assistant_message_since_the_last_user_message(app, session):
    c = mount(app)
    loop = Assistant.start(message="first question")
    conn = session.connection()
    for role, content in (("assistant", "an older answer"), ("user", "second question"),
                          ("assistant", "let me look that up"),
                          ("tool", "the tool's result"),
                          ("assistant", "one more lookup")):
        conn.execute(text("INSERT INTO solidloop_messages (loop_id, role, content, status) "
                          "VALUES (:l, :r, :c, 'completed')"),
                     {"l": loop.id, "r": role, "c": content})
    session.commit()
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    store.record_delta(session, claim.shell_id, "and the answer so", 0)
    session.commit()
    page = c.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    live = re.search(r'<pre id="live-tokens"[^>]*>(.*?)</pre>', page, re.S)
    assert live, page
    parts = re.findall(r'<span class="tok" data-m="(\d+)" data-o="0">([^<]*)</span>',
                       live.group(1))
    assert [p[1] for p in parts] == ["let me look that up", "one more lookup",
                                     "and the answer so"]
    assert int(parts[-1][0]) == claim.shell_id
    assert "an older answer" not in live.group(1)
