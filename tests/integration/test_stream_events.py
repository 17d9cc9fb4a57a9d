"""A loop's event stream (flask_solidloop.streaming): what the triggers and the
partial writer record, in order, and ``after=`` resuming exactly."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text

from flask_solidloop import streaming
from flask_solidloop.errors import InvalidArgumentError
from flask_solidloop.loops import store
from flask_solidloop.models import Loop, Message

from ..support.support_app import Assistant, ShopAgent, StreamingAssistant

WORDS = " ".join(f"w{n:03d}" for n in range(60))


def all_events(state, loop_id, after=None, *, reasoning=True):
    """Every event after ``after`` of a loop that has finished (no wait)."""
    return list(state.extension.events(loop_id, after=after, timeout=5, reasoning=reasoning,
                                       app=state.app))


def streamed_tool_loop(state, llm, drain):
    """A finished streaming loop: an answer with a tool call, its result, a final answer."""
    llm.fault_next("slow_stream", seconds=0.02, times=2)
    llm.script("add 2 and 3", {"content": "Let me add. " + WORDS,
                               "reasoning_content": "thinking about sums",
                               "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "The sum is 5. " + WORDS})
    loop = StreamingAssistant.start(message="Please add 2 and 3")
    streaming.mark_watched(state, loop.id)  # deltas at SOLIDLOOP_STREAM_MAX_HZ
    drain()
    return loop


def test_a_tool_loop_streams_its_events_in_order(app, session, llm, drain):
    state = app.extensions["solidloop"]
    loop = streamed_tool_loop(state, llm, drain)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    events = all_events(state, loop.id)
    kinds = [e.kind for e in events]
    ids = [e.seq for e in events]
    assert ids == sorted(set(ids))  # strictly increasing, no duplicate
    assert kinds[0] == "status_changed" and events[0].data["status"] == "queued"
    assert kinds[-1] == "completed" and events[-1].data["previous"] == "running"
    structural = [k for k in kinds if k not in ("status_changed", "text_delta",
                                                "reasoning_delta")]
    assert structural == ["message_started", "message_started", "message_completed",
                          "tool_call", "tool_result", "message_started", "message_completed",
                          "completed"]
    user = events[kinds.index("message_started")]
    assert (user.data["role"], user.text) == ("user", "Please add 2 and 3")
    replies = list(session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.role == "assistant").order_by(Message.id)))
    for reply in replies:
        deltas = [e for e in events if e.kind == "text_delta" and e.message_id == reply.id]
        # the deltas add up to the stored text, each at the offset it continues
        assert "".join(e.text or "" for e in deltas) == reply.content
        offset = 0
        for delta in deltas:
            assert delta.data["offset"] == offset
            offset += len(delta.text or "")
        assert len(deltas) >= 2, "a slow answer streamed while watched comes in pieces"
        done = next(e for e in events if e.kind == "message_completed"
                    and e.message_id == reply.id)
        assert done.text == reply.content and done.seq > deltas[-1].seq
    thought = [e for e in events if e.kind == "reasoning_delta"]
    assert "".join(e.text or "" for e in thought) == "thinking about sums"
    call = events[kinds.index("tool_call")]
    assert (call.data["name"], call.data["arguments"]) == ("add", {"a": 2, "b": 3})
    result = events[kinds.index("tool_result")]
    assert (result.tool_call_id, result.text, result.data["is_error"]) == \
        (call.tool_call_id, "5", False)
    # without reasoning=, the reasoning deltas are left out and nothing else
    plain = all_events(state, loop.id, reasoning=False)
    assert [e.id for e in plain] == [e.id for e in events if e.kind != "reasoning_delta"]


def test_after_every_id_of_a_finished_loop_returns_exactly_the_rest(app, session, llm, drain):
    state = app.extensions["solidloop"]
    loop = streamed_tool_loop(state, llm, drain)
    events = all_events(state, loop.id)
    assert len(events) > 10
    for n, event in enumerate(events):
        rest = all_events(state, loop.id, after=event.id)
        assert rest == events[n + 1:], (n, event)
    assert all_events(state, loop.id, after=None) == events
    # an id between two of the loop's (another loop's, say) resumes after the lower
    gap = next(n for n in range(1, len(events)) if events[n].seq - events[n - 1].seq > 1) \
        if any(events[n].seq - events[n - 1].seq > 1 for n in range(1, len(events))) else None
    if gap is not None:
        assert all_events(state, loop.id, after=events[gap].seq - 1) == events[gap:]


def test_bad_after_is_one_clear_error(app):
    state = app.extensions["solidloop"]
    with pytest.raises(InvalidArgumentError, match="after must be an event id"):
        state.extension.events(1, after="12:3", app=app)


def test_a_stream_waits_holding_no_connection_and_gets_events_as_they_commit(
        app, session, llm, drain):
    state = app.extensions["solidloop"]
    loop_id = Assistant.start(message="hello there").id
    session.commit()
    seen: list = []
    done = threading.Event()

    def read() -> None:
        try:
            for event in state.extension.events(loop_id, timeout=30, app=app):
                seen.append(event)
        finally:
            done.set()

    # Count the reader inside the hub's wait (the one place a stream idles), so
    # the check below runs while it waits, however slowly it got there.
    hub = streaming.hub_for(state)
    waiting: list[int] = []  # the version the reader waits past, while it waits
    real_wait = hub.wait

    def counted_wait(loop, seen_version, timeout):
        waiting.append(seen_version)
        try:
            return real_wait(loop, seen_version, timeout)
        finally:
            waiting.remove(seen_version)

    hub.wait = counted_wait  # type: ignore[method-assign]
    reader = threading.Thread(target=read)
    reader.start()
    assert hub.connected.wait(10)
    # Idle for real: inside the wait with nothing new to wake it (the LISTEN
    # connection's arrival makes every stream read once).
    deadline = time.monotonic() + 10
    while not (waiting and waiting[0] == hub.version(loop_id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting and seen  # the backlog (created, user message) came first
    assert state.db.engine.pool.checkedout() == 0  # waiting, it holds no connection
    hub.wait = real_wait  # type: ignore[method-assign]
    llm.script("hello there", {"content": "General Kenobi."})
    drain()
    assert done.wait(20), "the stream did not end after the loop completed"
    reader.join()
    kinds = [e.kind for e in seen]
    assert kinds[-1] == "completed" and "message_completed" in kinds
    assert next(e for e in seen if e.kind == "message_completed").text == "General Kenobi."


def test_approval_events_carry_the_request_and_the_decision(app, session, llm, drain):
    state = app.extensions["solidloop"]
    llm.script("email ann", {"content": "Asking first.", "tool_calls": [
        {"name": "send_email", "arguments": {"to": "ann", "body": "hi"}}]})
    loop = ShopAgent.start(message="email ann")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "waiting"
    before = list(state.extension.events(loop.id, timeout=0.5, app=app))
    kinds = [e.kind for e in before]
    asked = before[kinds.index("approval_requested")]
    assert asked.data["name"] == "send_email" and asked.data["arguments"] == {"to": "ann",
                                                                               "body": "hi"}
    # the wait's status follows the request it waits for (statuses fire at commit)
    assert before[-1].kind == "status_changed" and before[-1].data["status"] == "waiting"
    assert kinds.index("approval_requested") < len(kinds) - 1
    llm.script("sent to ann", {"content": "Done."})
    ShopAgent(loop).approve(asked.tool_call_id, by="ops@example.com")
    drain()
    after = list(state.extension.events(loop.id, after=before[-1].id, timeout=5, app=app))
    decided = next(e for e in after if e.kind == "approval_decided")
    assert decided.data == {"decision": "approved", "by": "ops@example.com", "reason": None}
    assert decided.tool_call_id == asked.tool_call_id
    assert [e.kind for e in after][-1] == "completed"


def test_a_turn_retried_after_its_worker_died_discards_its_message(app, session):
    state = app.extensions["solidloop"]
    loop = StreamingAssistant.start(message="speak")
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    assert store.record_delta(session, claim.shell_id, "Hello, wor", 0) is False  # unwatched
    # the worker is gone: its lease lapses and the reaper requeues the loop
    session.execute(text("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 s' "
                         "WHERE id = :id"), {"id": loop.id})
    session.commit()
    from flask_solidloop.maintenance.reaper import reap

    reap(state)
    events = list(state.extension.events(loop.id, timeout=0.5, app=app))
    kinds = [e.kind for e in events]
    assert kinds.count("text_delta") == 1 and "message_discarded" in kinds
    discarded = events[kinds.index("message_discarded")]
    assert discarded.message_id == claim.shell_id
    assert kinds.index("text_delta") < kinds.index("message_discarded")
    assert events[-1].kind == "status_changed" and events[-1].data["status"] == "queued"


def test_a_delta_is_notified_with_its_text_only_while_the_loop_is_watched(app, session):
    import psycopg

    from flask_solidloop.urls import libpq_url

    state = app.extensions["solidloop"]
    loop = Assistant.start(message="speak")
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=True,
                                 read_history=False)
    assert claim is not None
    with psycopg.connect(libpq_url(state.database_url), autocommit=True) as listener:
        listener.execute("LISTEN solidloop_live")
        assert store.record_delta(session, claim.shell_id, "quiet", 0) is False
        assert list(listener.notifies(timeout=0.3)) == []  # nobody watches: nothing sent
        streaming.mark_watched(state, loop.id)
        assert store.record_delta(session, claim.shell_id, " loud", 5) is True
        notes = list(listener.notifies(timeout=2, stop_after=1))
    head, body = notes[0].payload.split("\n", 1)
    loop_id, seq, prev = (int(part) for part in head.split(":"))
    assert loop_id == loop.id and prev < seq
    assert '"t": " loud"' in body and '"offset": 5' in body
    rows = session.execute(text("SELECT id FROM solidloop_stream_events WHERE loop_id = :id "
                                "ORDER BY id DESC LIMIT 2"), {"id": loop.id}).scalars().all()
    assert rows == [seq, prev]  # prev is the loop's event just before it


def sse_events(body: str) -> list[tuple[str | None, str, str]]:
    """(id, event, data) of each event of an SSE body (comments left out)."""
    out = []
    for block in body.split("\n\n"):
        fields: dict[str, list[str]] = {}
        for line in block.splitlines():
            if line.startswith(":") or ": " not in line:
                continue
            key, value = line.split(": ", 1)
            fields.setdefault(key, []).append(value)
        if "event" in fields:
            out.append((fields.get("id", [None])[0], fields["event"][0],
                        "\n".join(fields.get("data", []))))
    return out


def test_sse_response_replays_resumes_authorizes_and_ends(app, session, llm, drain):
    import json

    from flask_solidloop.config import Config

    state = app.extensions["solidloop"]
    state.config = Config.from_mapping({"SOLIDLOOP_STREAM_SECONDS": 2,
                                        "SOLIDLOOP_STREAM_HEARTBEAT": 0.2})
    allowed = {"ok": True}
    app.add_url_rule("/events/<int:loop_id>", "events", lambda loop_id: state.extension
                     .sse_response(loop_id, authorize=lambda loop: allowed["ok"]))
    llm.script("hello there", {"content": "General\rKenobi."})
    loop_id = Assistant.start(message="hello there").id
    drain()
    client = app.test_client()
    whole = client.get(f"/events/{loop_id}")
    assert whole.headers["Cache-Control"] == "no-store"
    assert whole.headers["X-Accel-Buffering"] == "no"
    assert whole.mimetype == "text/event-stream"
    frames = sse_events(whole.get_data(as_text=True))
    expected = all_events(state, loop_id)
    assert [(f[0], f[1]) for f in frames[:-1]] == [(e.id, e.kind) for e in expected]
    assert frames[-1][1:] == ("end", "completed")
    done = json.loads(next(f[2] for f in frames if f[1] == "message_completed"))
    assert done["text"] == "General\rKenobi." and done["loop_id"] == loop_id
    # the browser reconnects with Last-Event-ID: exactly the rest, then end
    middle = expected[len(expected) // 2]
    rest = sse_events(client.get(f"/events/{loop_id}",
                                 headers={"Last-Event-ID": middle.id}).get_data(as_text=True))
    assert [f[0] for f in rest[:-1]] == [e.id for e in expected if e.seq > middle.seq]
    assert rest[-1][1] == "end"
    # nothing new for a finished loop: end at once, so the page stops reconnecting
    last = sse_events(client.get(f"/events/{loop_id}?last_event_id={expected[-1].id}")
                      .get_data(as_text=True))
    assert last == [(None, "end", "completed")]
    bad = client.get(f"/events/{loop_id}", headers={"Last-Event-ID": "7:3"})
    assert bad.status_code == 400 and b"after must be an event id" in bad.data
    assert client.get("/events/999999999").status_code == 404
    allowed["ok"] = False
    assert client.get(f"/events/{loop_id}").status_code == 403


def test_a_stream_of_a_running_loop_ends_without_end_and_heartbeats(app, session):
    from flask_solidloop.config import Config

    state = app.extensions["solidloop"]
    state.config = Config.from_mapping({"SOLIDLOOP_STREAM_SECONDS": 0.6,
                                        "SOLIDLOOP_STREAM_HEARTBEAT": 0.1})
    app.add_url_rule("/events/<int:loop_id>", "events",
                     lambda loop_id: state.extension.sse_response(loop_id))
    loop_id = Assistant.start(message="nobody answers").id
    body = app.test_client().get(f"/events/{loop_id}").get_data(as_text=True)
    assert body.startswith("retry: ") and ": heartbeat" in body
    frames = sse_events(body)
    assert frames and all(f[1] != "end" for f in frames)  # the browser reconnects
    assert Agent_wait(app, loop_id, 0.3) == "queued"  # not settled: the status at the timeout


def Agent_wait(app, loop_id: int, timeout: float) -> str | None:
    with app.app_context():
        return Assistant(loop_id).wait(timeout)


def test_wait_returns_once_the_loop_settles(app, session, llm, drain):
    llm.script("wait for me", {"content": "Done."})
    loop_id = Assistant.start(message="wait for me").id
    session.commit()
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(Agent_wait(app, loop_id, 30)))
    waiter.start()
    drain()
    waiter.join(30)
    assert results == ["completed"]
    assert Agent_wait(app, 999999999, 1) is None


def test_an_event_holds_the_loop_row_until_commit_whether_or_not_it_wrote_it(
        app, session, database_url):
    """Ids of one loop commit in order because every event's transaction holds
    the loop row until it commits: one that wrote the row holds it already
    (migration 0024: no second lock), any other locks it. Either way another
    transaction's event of the loop waits, and its id comes after."""
    import psycopg

    from flask_solidloop.queue.broker import libpq_url

    from .row_locks import loop_row_locked

    loop = Assistant.start(message="hello")
    url = libpq_url(database_url)
    emit = "SELECT solidloop_stream_emit(%s, %s, NULL, NULL, NULL, NULL)"
    for wrote_row in (True, False):
        with psycopg.connect(url) as writer, psycopg.connect(url) as other, \
                psycopg.connect(url, autocommit=True) as probe:
            if wrote_row:  # as a turn's end does, before its events
                writer.execute("UPDATE solidloop_loops SET updated_at = now() WHERE id = %s",
                               (loop.id,))
            writer.execute(emit, (loop.id, "tool_call"))
            writer.execute(emit, (loop.id, "tool_call"))
            assert loop_row_locked(probe, loop.id, timeout=1), wrote_row

            def emit_other(other=other) -> None:
                other.execute(emit, (loop.id, "tool_result"))
                other.commit()

            waiter = threading.Thread(target=emit_other)
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive(), "another transaction's event waits for the row"
            writer.commit()
            waiter.join(10)
            assert not waiter.is_alive()
            assert not loop_row_locked(probe, loop.id, timeout=0.2)
        kinds = [e.kind for e in all_events(app.extensions["solidloop"], loop.id)]
        # the waiting transaction's event comes after the holder's two
        assert kinds[-3:] == ["tool_call", "tool_call", "tool_result"], wrote_row
    assert kinds.count("tool_call") == 4


def test_deleting_loops_deletes_their_events_and_no_others(app, session):
    """Stream events leave with their loop (a statement trigger on the loops
    table since migration 0024, in place of a cascading foreign key)."""
    gone = [Assistant.start(message=f"gone {n}").id for n in range(3)]
    kept = Assistant.start(message="kept").id
    count = ("SELECT loop_id, count(*) FROM solidloop_stream_events "
             "WHERE loop_id = ANY(:ids) GROUP BY loop_id")
    before = dict(session.execute(text(count), {"ids": [*gone, kept]}).all())
    assert set(before) == {*gone, kept}
    session.execute(text("DELETE FROM solidloop_loops WHERE id = ANY(:ids)"), {"ids": gone})
    session.commit()
    after = dict(session.execute(text(count), {"ids": [*gone, kept]}).all())
    assert after == {kept: before[kept]}
