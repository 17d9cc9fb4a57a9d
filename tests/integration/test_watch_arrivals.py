"""A watcher's arrival: the store notifies it once, and a streaming turn that
hears it on the process's listener flushes its text at once
(pipeline/watch_arrivals.py)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from flask_solidloop import streaming
from flask_solidloop.loops import sql as loops_sql
from flask_solidloop.loops import store
from flask_solidloop.pipeline import watch_arrivals
from flask_solidloop.testing import drain as drain_jobs
from flask_solidloop.urls import libpq_url

from ..support.support_app import Assistant, StreamingAssistant, create_app

WORDS = " ".join(f"w{n:03d}" for n in range(150))


def watch_notes(conn: psycopg.Connection, timeout: float) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout)
            if n.channel == loops_sql.WATCH_CHANNEL]


def test_only_the_first_watcher_of_a_running_loop_is_notified(app, session, database_url):
    state = app.extensions["solidloop"]
    idle = Assistant.start(message="nobody runs me")
    running = Assistant.start(message="speak")
    claim = store.claim_llm_turn(session, running.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    session.commit()
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(f"LISTEN {loops_sql.WATCH_CHANNEL}")
        streaming.mark_watched(state, idle.id)  # queued: no turn streams it
        streaming.mark_watched(state, running.id)
        streaming.mark_watched(state, running.id, seconds=3600)  # a later mark: no arrival
        assert watch_notes(conn, 1.0) == [str(running.id)]
        # The admin's Observe is an arrival too, unless a stream watches already.
        assert store.set_observed(session, running.id, True) is True
        assert watch_notes(conn, 0.5) == []
        other = Assistant.start(message="observe me")
        claim = store.claim_llm_turn(session, other.id, lease_seconds=30, open_shell=True,
                                     read_history=False)
        assert claim is not None
        session.commit()
        assert store.set_observed(session, other.id, True) is True
        assert watch_notes(conn, 1.0) == [str(other.id)]


def test_a_listener_hands_other_channels_to_their_handler(app):
    state = app.extensions["solidloop"]
    heard: list[str] = []
    got = threading.Event()
    listener = state.broker.listener
    listener.on_notify("solidloop_test_channel", lambda payload: (heard.append(payload),
                                                                  got.set()))
    assert listener.subscribe("solidloop_llm")
    try:
        deadline = time.monotonic() + 10
        while "solidloop_test_channel" not in listener.listening():
            assert time.monotonic() < deadline, "the handler's channel was never LISTENed"
            time.sleep(0.05)
        with psycopg.connect(libpq_url(state.database_url), autocommit=True) as conn:
            conn.execute("SELECT pg_notify('solidloop_test_channel', 'hello')")
        assert got.wait(10)
        assert heard == ["hello"]
    finally:
        listener.unsubscribe("solidloop_llm")


@pytest.mark.parametrize("deltas", [True, False])
def test_a_watcher_arriving_mid_answer_gets_the_text_so_far_at_once(llm, database_url, deltas):
    # Nobody watches when the request goes out, and the slow pace is far longer
    # than the test: without the arrival the turn would write its text once, at
    # its end. The emulator holds the answer mid-way twice: while the arrival
    # reaches the turn, then while the test reads what the arrival flushed.
    app = create_app(SOLIDLOOP_STREAM_UPDATE_INTERVAL=1000.0,
                     SOLIDLOOP_STREAM_MAX_HZ=20.0 if deltas else 0.0,
                     SOLIDLOOP_OBSERVED_STREAM_UPDATE_INTERVAL=0.1)
    state = app.extensions["solidloop"]
    listener = state.broker.listener
    assert listener.subscribe("solidloop_llm")  # what a worker's consumers do
    llm.fault_next("held_stream", after=3, again=60)
    llm.script("tell me", {"content": WORDS})
    errors: list[BaseException] = []
    try:
        with app.app_context():
            loop_id = StreamingAssistant.start(message="tell me").id

        def run() -> None:
            try:
                drain_jobs(app)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while not conn.execute(
                    "SELECT 1 FROM solidloop_events WHERE loop_id = %s AND kind = 'llm_request'",
                    (loop_id,)).fetchone():
                assert time.monotonic() < deadline, "the request never went on record"
                time.sleep(0.02)
            while llm.held() != 1:  # three events in, the answer waits
                assert time.monotonic() < deadline, "the stream never reached its stop"
                time.sleep(0.02)
            streaming.mark_watched(state, loop_id)
            while not watch_arrivals.pending(loop_id):
                assert time.monotonic() < deadline, "the arrival never reached the turn"
                time.sleep(0.02)
            llm.release_held()  # the next token flushes what the turn has
            if deltas:
                first = None
                for event in state.extension.events(loop_id, timeout=30, app=app):
                    if event.kind == "text_delta":
                        first = event
                        break
                    assert event.kind != "message_completed", "no delta before the answer"
                assert first is not None and first.data["offset"] == 0
                assert 0 < len(first.text) < len(WORDS) and WORDS.startswith(first.text)
            else:
                partial = ""
                while not partial:
                    assert time.monotonic() < deadline, "no partial text before the answer"
                    row = conn.execute(
                        "SELECT content, status FROM solidloop_messages WHERE loop_id = %s "
                        "AND role = 'assistant'", (loop_id,)).fetchone()
                    assert row is not None and row[1] == "processing"
                    partial = row[0] or ""
                    time.sleep(0.02)
                assert 0 < len(partial) < len(WORDS) and WORDS.startswith(partial)
            llm.release_held()
        worker.join(60)
        assert not worker.is_alive() and not errors, errors
        if deltas:
            events = list(state.extension.events(loop_id, timeout=5, app=app))
            kinds = [e.kind for e in events]
            before = kinds[:kinds.index("message_completed")]
            # The arrival's flush, then the fast pace: several deltas, not one.
            assert before.count("text_delta") >= 2
            assert "".join(e.text for e in events if e.kind == "text_delta") == WORDS
    finally:
        llm.release_held()
        llm.release_held()
        listener.unsubscribe("solidloop_llm")
        state.stop_renewer()
