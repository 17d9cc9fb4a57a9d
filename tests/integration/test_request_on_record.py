"""An LLM request is on record before it is sent (decision 0025): its
``llm_request`` event is written pending (the redacted request, no answer),
shows while the request runs (``flask solidloop status``, the admin's loop
page), and the turn's end completes that same row, whichever way it ends; a
turn that lost its loop writes nothing, and its row shows as unanswered.

Real PostgreSQL, real HTTP to the LLM emulator. A request is held open by a
script whose reply waits for the test (``Gate``), so "in flight" is a state
the test is in, not a moment it tries to catch.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from flask_solidloop.errors import LostLeaseError
from flask_solidloop.loops import store, wire_reads
from flask_solidloop.models import Event, Loop, Message
from flask_solidloop.testing import drain as run_jobs
from flask_solidloop.wire import WireRecord

from ..support.support_app import Assistant, solidloop
from .row_locks import hold_loop_while

SECRET = "sk-test-secret-123"  # the suite's API key (tests/conftest.py)


@pytest.fixture
def admin(app):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    return app.test_client()


def loop_page(admin, loop_id: int) -> str:
    response = admin.get(f"/admin/loops/{loop_id}")
    assert response.status_code == 200
    return response.get_data(as_text=True)


class Gate:
    """A script reply that holds its request open until the test opens the gate."""

    def __init__(self, reply: dict) -> None:
        self.reply = reply
        self.arrived = threading.Event()
        self.opened = threading.Event()

    def __call__(self, request: dict) -> dict:
        self.arrived.set()
        # Bounded, so a failed test never leaves the emulator's thread behind.
        self.opened.wait(60)
        return self.reply


class Turns:
    """The app's due jobs run on a thread of their own (a worker), so the test
    can look at the database while a request is held open."""

    def __init__(self, app) -> None:
        self.app = app
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.app.app_context():
                run_jobs(self.app)
                self.app.extensions["sqlalchemy"].session.remove()
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the turn did not end"
        if self.error is not None:
            raise self.error


def llm_events(pg, loop_id: int) -> list[dict]:
    """The loop's requests on record as a reader sees them: each row with its
    answer's row merged in (models/event.py reads them the same way)."""
    cursor = pg.execute(
        "SELECT e.id, e.message_id, coalesce(a.status_code, e.status_code) AS status_code, "
        "coalesce(a.duration_ms, e.duration_ms) AS duration_ms, "
        "coalesce(a.error, e.error) AS error, e.payload || coalesce(a.answer, '{}') AS payload "
        "FROM solidloop_events e LEFT JOIN solidloop_llm_answers a ON a.event_id = e.id "
        "WHERE e.loop_id = %s AND e.kind = 'llm_request' ORDER BY e.id", (loop_id,))
    names = [c.name for c in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def status_output(app, loop_id: int) -> str:
    result = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop_id)])
    assert result.exit_code == 0, result.output
    app.extensions["sqlalchemy"].session.remove()  # hold no snapshot while the turn runs
    return result.output


def test_a_slow_answer_is_on_record_and_shown_in_flight_then_completed(app, llm, pg, admin):
    gate = Gate({"content": "at last"})
    llm.script("take your time", gate)
    loop_id = Assistant.start(message="take your time").id
    app.extensions["sqlalchemy"].session.remove()
    turns = Turns(app)
    try:
        assert gate.arrived.wait(60), "the request never reached the provider"
        # The request is being answered: its event is on record, pending.
        (pending,) = llm_events(pg, loop_id)
        assert pending["status_code"] is None and pending["duration_ms"] is None
        assert pending["error"] is None
        (sent,) = [r for r in llm.requests if r.method == "POST"]
        assert pending["payload"]["request"]["body"] == sent.json  # as sent, redacted
        headers = pending["payload"]["request"]["headers"]
        assert SECRET not in str(pending["payload"]) and "Authorization" in headers
        assert pending["payload"]["url"].endswith("/v1/chat/completions")
        shell = pg.execute("SELECT status, is_hidden FROM solidloop_messages WHERE id = %s",
                           (pending["message_id"],)).fetchone()
        assert shell == ("processing", True)
        (version,) = pg.execute("SELECT xmin::text FROM solidloop_events WHERE id = %s",
                                (pending["id"],)).fetchone()

        with Session(app.extensions["sqlalchemy"].engine) as session:
            (flying,) = wire_reads.pending_requests(session, loop_id)
        assert flying.in_flight and flying.event_id == pending["id"]
        assert flying.model == "test-model" and flying.seconds >= 0
        shown = status_output(app, loop_id)
        assert "LLM request in flight for " in shown
        assert f"(model test-model, endpoint {pending['payload']['url']})" in shown
        page = loop_page(admin, loop_id)
        assert 'id="llm-in-flight"' in page and "model test-model" in page
        assert f'data-event="{pending["id"]}" class="request-in-flight"' in page
        assert 'id="turn-poll"' in page  # the page follows the request while it runs
    finally:
        gate.opened.set()
    turns.join()

    # The same row, completed with the answer.
    (done,) = llm_events(pg, loop_id)
    assert done["id"] == pending["id"] and done["message_id"] == pending["message_id"]
    assert done["status_code"] == 200 and done["duration_ms"] is not None
    assert done["error"] is None
    payload = done["payload"]
    assert payload["request"] == pending["payload"]["request"]
    assert payload["response"]["status"] == 200
    assert payload["response"]["body"]["choices"][0]["message"]["content"] == "at last"
    assert [a["status"] for a in payload["attempts"]] == [200]
    assert payload["duration_ms"] == done["duration_ms"]
    # The request's row was not written again: the answer is a row of its own.
    own = pg.execute("SELECT xmin::text, status_code, duration_ms, payload FROM solidloop_events "
                     "WHERE id = %s", (pending["id"],)).fetchone()
    assert own == (version, None, None, pending["payload"])
    assert pg.execute("SELECT count(*) FROM solidloop_llm_answers WHERE event_id = %s",
                      (pending["id"],)).fetchone() == (1,)
    with Session(app.extensions["sqlalchemy"].engine) as session:
        (event,) = session.scalars(select(Event).where(Event.id == pending["id"])).all()
        assert (event.status_code, event.duration_ms, event.error, event.payload) == (
            200, done["duration_ms"], None, payload)
    assert pg.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                      (loop_id,)).fetchone() == ("completed",)
    shown = status_output(app, loop_id)
    assert "in flight" not in shown and "unanswered" not in shown
    page = loop_page(admin, loop_id)
    assert 'id="llm-in-flight"' not in page and 'id="turn-poll"' not in page


def test_a_provider_error_completes_the_row_it_recorded(app, session, llm, drain, pg):
    llm.fail_next(400)  # never retried: the turn fails on it
    loop_id = Assistant.start(message="refused").id
    drain()
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "failed" and "400" in loop.error_message
    (event,) = llm_events(pg, loop_id)
    assert event["status_code"] == 400 and event["duration_ms"] is not None
    assert event["error"] == loop.error_message
    assert event["payload"]["response"]["status"] == 400
    assert event["payload"]["request"]["body"]["messages"][-1]["content"] == "refused"
    assert wire_reads.pending_requests(session, loop_id) == []


def test_deleted_events_take_their_answers_and_no_others(app, session, llm, drain, pg):
    """No foreign key joins an answer to its request (migration 0027): the
    events table's statement trigger deletes the answers of the events a
    statement deletes, a loop's cascade (the loop retention) or the janitor's
    delete by age alike."""
    llm.script("one", {"content": "1"})
    llm.script("two", {"content": "2"})
    llm.script("three", {"content": "3"})
    ids = [Assistant.start(message=m).id for m in ("one", "two", "three")]
    drain()
    events = {i: [e["id"] for e in llm_events(pg, i)] for i in ids}
    assert all(len(found) == 1 for found in events.values()), events

    def answered(loop_id):
        return pg.execute("SELECT count(*) FROM solidloop_llm_answers WHERE event_id = ANY(%s)",
                          (events[loop_id],)).fetchone()[0]

    assert [answered(i) for i in ids] == [1, 1, 1]
    pg.execute("DELETE FROM solidloop_loops WHERE id = %s", (ids[0],))  # cascades to its events
    pg.execute("DELETE FROM solidloop_events WHERE id = ANY(%s)", (events[ids[1]],))
    assert [answered(i) for i in ids] == [0, 0, 1]
    assert pg.execute("SELECT count(*) FROM solidloop_llm_answers").fetchone() == (1,)


def test_an_outage_deferral_completes_the_row_and_the_next_try_writes_its_own(
        app, session, llm, drain, pg):
    """503 past the request's own retries: the turn goes back to the queue with
    its event completed; the next try is a request of its own, on record too."""
    llm.fail_next(503, times=3)  # the first try and its two retries
    llm.script("outage", {"content": "back"})
    loop_id = Assistant.start(message="outage").id
    drain()  # the first try only: the deferred turn is due seconds later
    first = llm_events(pg, loop_id)
    assert [(e["status_code"], e["duration_ms"] is not None) for e in first] == [(503, True)]
    assert first[0]["error"].startswith("ProviderHTTPError")
    assert [a["status"] for a in first[0]["payload"]["attempts"]] == [503, 503, 503]
    session.expire_all()
    assert session.get(Loop, loop_id).status == "queued"
    assert wire_reads.pending_requests(session, loop_id) == []


def test_a_turn_abandoned_mid_request_leaves_its_row_unanswered(app, llm, pg, admin):
    """The loop is paused while its request is held open: the turn is no longer
    the loop's, so when the answer comes it writes nothing, not even its event's
    completion; the row shows as unanswered, never as in flight."""
    gate = Gate({"content": "too late"})
    llm.script("pause me", gate)
    loop_id = Assistant.start(message="pause me").id
    app.extensions["sqlalchemy"].session.remove()
    turns = Turns(app)
    try:
        assert gate.arrived.wait(60), "the request never reached the provider"
        with Session(app.extensions["sqlalchemy"].engine) as session:
            assert [r.in_flight for r in wire_reads.pending_requests(session, loop_id)] == [True]
        assert Assistant(loop_id).pause()
        app.extensions["sqlalchemy"].session.remove()
    finally:
        gate.opened.set()
    turns.join()
    (event,) = llm_events(pg, loop_id)
    assert event["status_code"] is None and event["duration_ms"] is None  # nothing written
    with Session(app.extensions["sqlalchemy"].engine) as session:
        (left,) = wire_reads.pending_requests(session, loop_id)
        assert not left.in_flight and left.state == "unanswered"
        assert session.get(Loop, loop_id).status == "paused"
        assert [m.content for m in session.scalars(select(Message).where(
            Message.loop_id == loop_id, Message.role == "assistant",
            Message.is_hidden.is_(False)))] == []  # the late answer never joined
    shown = status_output(app, loop_id)
    assert "in flight" not in shown
    assert "1 LLM request(s) unanswered" in shown and f"#{event['id']}" in shown
    page = loop_page(admin, loop_id)
    assert f'data-event="{event["id"]}" class="request-unanswered"' in page
    assert 'id="llm-in-flight"' not in page


def claimed(session, loop_id: int):
    claim = store.claim_llm_turn(session, loop_id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    return claim


def record(engine, loop_id: int, token: uuid.UUID, shell_id: int) -> int:
    """The turn's request put on record, as NetworkCalling does, on a session of
    its own (a worker's)."""
    wire = WireRecord(url="http://llm.invalid/v1/chat/completions",
                      request_headers={"Authorization": "[REDACTED]"},
                      request_body={"model": "m", "messages": [{"role": "user",
                                                                "content": "hi"}]})
    with Session(engine) as session:
        return store.record_request(session, loop_id, token, shell_id=shell_id, wire=wire,
                                    body_limit=65536, repeat_history=False).event_id


def test_a_reclaim_committed_while_the_record_waits_writes_nothing(
        app, session, database_url, pg):
    """The record is fenced under the loop row's lock: a reclaim (the reaper's
    requeue and a new generation's claim) that holds the row while the record's
    statement waits makes it write nothing, and the stale turn learns it has
    lost the loop before it sends anything."""
    loop_id = Assistant.start(message="hello").id
    claim = claimed(session, loop_id)
    session.remove()  # the test's session holds nothing while the row is locked
    engine = app.extensions["sqlalchemy"].engine

    def reclaim(holder) -> None:
        holder.execute("UPDATE solidloop_loops SET execution_token = %s WHERE id = %s",
                       (uuid.uuid4(), loop_id))

    outcome = hold_loop_while(database_url, loop_id, "WITH owner AS (SELECT id, observed",
                              reclaim, lambda: record(engine, loop_id, claim.token,
                                                      claim.shell_id))
    assert isinstance(outcome.get("error"), LostLeaseError), outcome
    assert llm_events(pg, loop_id) == []
    # The generation that holds the loop records its own.
    token = pg.execute("SELECT execution_token FROM solidloop_loops WHERE id = %s",
                       (loop_id,)).fetchone()[0]
    event_id = record(engine, loop_id, token, claim.shell_id)
    assert [e["id"] for e in llm_events(pg, loop_id)] == [event_id]


def test_a_turn_end_completes_the_row_it_recorded(app, session, pg):
    """The turn's end merges the answer into the row its request was recorded
    in: the request stays as recorded, the response, the status and the
    timings join it; no second row."""
    loop_id = Assistant.start(message="hello").id
    claim = claimed(session, loop_id)
    engine = app.extensions["sqlalchemy"].engine
    event_id = record(engine, loop_id, claim.token, claim.shell_id)
    wire = WireRecord(url="u", request_headers={}, request_body={}, status=500,
                      response_body={"error": "boom"}, duration_ms=12.5, error="boom")
    assert store.end_turn(session, loop_id, claim.token, to="failed", error_message="boom",
                          wire=wire, event_id=event_id, shell_id=claim.shell_id,
                          body_limit=65536)
    (event,) = llm_events(pg, loop_id)
    assert (event["status_code"], event["duration_ms"], event["error"]) == (500, 12.5, "boom")
    assert event["payload"]["request"]["body"]["messages"][0]["content"] == "hi"
    assert event["payload"]["response"] == {"status": 500, "body": {"error": "boom"}}


def test_a_row_settled_without_a_record_keeps_its_request(app, session, pg):
    """An unhandled error after the request (no response to keep) completes the
    row with the error alone: its request stays, its duration is the database's
    time since it was written."""
    loop_id = Assistant.start(message="hello").id
    claim = claimed(session, loop_id)
    event_id = record(app.extensions["sqlalchemy"].engine, loop_id, claim.token,
                      claim.shell_id)
    assert store.end_turn(session, loop_id, claim.token, to="failed",
                          error_message="RuntimeError: a bug", event_id=event_id)
    (event,) = llm_events(pg, loop_id)
    assert event["status_code"] is None and event["duration_ms"] >= 0
    assert event["error"] == "RuntimeError: a bug"
    assert event["payload"]["request"]["body"]["messages"][0]["content"] == "hi"
