"""The wire log keeps what each LLM request adds, not the whole conversation again
(SOLIDLOOP_EVENT_REPEAT_HISTORY off, the default): a loop's log grows with its
turns, and the omitted part is named by count and SHA-256 of what was sent."""

from __future__ import annotations

from sqlalchemy import select

from flask_solidloop.loops.storable import HISTORY_OMITTED, TOOLS_OMITTED, history_digest
from flask_solidloop.models import Event
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant, create_app


def script_three_turns(llm) -> None:
    llm.script("chain", {"tool_calls": [{"name": "add", "arguments": {"a": 0, "b": 1}}]})
    llm.script(lambda body: body["messages"][-1].get("content") == "1",
               {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]})
    llm.script(lambda body: body["messages"][-1].get("content") == "2", {"content": "done"})


def request_bodies(session, loop_id: int) -> list[dict]:
    session.expire_all()
    return [e.payload["request"]["body"] for e in session.scalars(
        select(Event).where(Event.kind == "llm_request", Event.loop_id == loop_id)
        .order_by(Event.id))]


def test_each_event_keeps_the_conversation_from_the_last_answer_on(app, session, llm, drain):
    script_three_turns(llm)
    loop = Assistant.start(message="chain")
    drain()
    sent = [request.json for request in llm.requests]
    logged = request_bodies(session, loop.id)
    assert len(sent) == len(logged) == 3
    assert logged[0] == sent[0]  # a first request has no answer before it: whole
    assert sent[0]["tools"]
    for body, as_sent in zip(logged[1:], sent[1:], strict=True):
        messages = as_sent["messages"]
        last_answer = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        assert body["messages"] == messages[last_answer:]  # the answer and what follows
        assert body[HISTORY_OMITTED] == {"field": "messages", "count": last_answer,
                                         "sha256": history_digest(messages[:last_answer])}
        # The tools the first event holds are named by count and SHA-256.
        assert body[TOOLS_OMITTED] == {"field": "tools", "count": len(as_sent["tools"]),
                                       "sha256": history_digest(as_sent["tools"])}
        assert history_digest(as_sent["tools"]) == history_digest(logged[0]["tools"])
        # Everything else in the body is kept as sent.
        omitted = ("messages", HISTORY_OMITTED, "tools", TOOLS_OMITTED)
        assert {k: v for k, v in body.items() if k not in omitted} \
            == {k: v for k, v in as_sent.items() if k not in omitted}
    # What the log holds per request stays the same size however long the loop gets.
    assert len(logged[2]["messages"]) == len(logged[1]["messages"]) == 2


def test_repeat_history_keeps_every_request_whole(database_url, llm):
    llm.reset()  # the suite's emulator is reset by the app fixture, unused here
    script_three_turns(llm)
    app = create_app(SOLIDLOOP_EVENT_REPEAT_HISTORY=True)
    with app.app_context():
        loop_id = Assistant.start(message="chain").id
        run(app)
        session = app.extensions["sqlalchemy"].session
        assert request_bodies(session, loop_id) == [request.json for request in llm.requests]
        session.remove()
        for engine in app.extensions["sqlalchemy"].engines.values():
            engine.dispose()


def test_tools_that_change_are_logged_whole_again():
    """A request's tools are left out only when they are the ones the loop's
    log already holds (by digest): other tools, or none known, are kept."""
    from flask_solidloop.loops.store import wirelog
    from flask_solidloop.wire import WireRecord

    def body(tools):
        return {"model": "m", "tools": tools, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "r", "tool_call_id": "c"}]}

    first = [{"type": "function", "function": {"name": "add"}}]
    other = [*first, {"type": "function", "function": {"name": "sub"}}]

    def logged(tools, known):
        wire = WireRecord(url="u", request_headers={}, request_body=body(tools))
        params = wirelog.llm_event(wire, body_limit=65536, tools_logged=known)
        return params["payload"].obj["request"]["body"]

    same = logged(first, history_digest(first))
    assert "tools" not in same
    assert same[TOOLS_OMITTED] == {"field": "tools", "count": 1, "sha256": history_digest(first)}
    assert logged(other, history_digest(first))["tools"] == other
    assert logged(first, None)["tools"] == first


def test_summary_wire_log_keeps_metadata_and_digests_and_no_text(database_url, llm):
    """SOLIDLOOP_WIRE_LOG = "summary": each event keeps the exchange's metadata
    (URL, status, attempts, model, token usage) and every body part as its
    size and SHA-256; no text the model, the user or a tool wrote is in the
    log, and the conversation is whole on the loop's messages. The admin's
    wire log says what a summary keeps."""
    import json

    from flask_solidloop.loops.store.wirelog import digest
    from flask_solidloop.models import Message, ToolCall

    llm.reset()
    llm.script("secret question", {"tool_calls": [{"name": "add",
                                                   "arguments": {"a": 20, "b": 22}}]})
    llm.script(lambda body: body["messages"][-1].get("content") == "42",
               {"content": "the private answer is 42"})
    app = create_app(SOLIDLOOP_WIRE_LOG="summary")
    from ..support.support_app import solidloop

    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    with app.app_context():
        loop_id = Assistant.start(message="a secret question").id
        run(app)
        session = app.extensions["sqlalchemy"].session
        events = list(session.scalars(select(Event).where(Event.loop_id == loop_id)
                                      .order_by(Event.id)))
        assert [e.kind for e in events] == ["llm_request", "tool_call", "llm_request"]
        sent = [request.json for request in llm.requests]
        for event, as_sent in zip([events[0], events[2]], sent, strict=True):
            payload = event.payload
            assert payload["detail"] == "summary" and event.status_code == 200
            assert event.duration_ms is not None and payload["attempts"]
            body = payload["request"]["body"]
            assert body["model"] == as_sent["model"]
            assert body["messages"] == digest(as_sent["messages"])
            assert body["messages"]["count"] == len(as_sent["messages"])
            assert body["tools"]["count"] == len(as_sent["tools"])
            response = payload["response"]["body"]
            assert response["usage"] and response["choices"]["count"] == 1
        call = events[1].payload
        assert (call["detail"], call["name"], call["result"]["isError"]) == \
            ("summary", "add", False)
        assert call["arguments"] == digest({"a": 20, "b": 22})
        logged = json.dumps([e.payload for e in events])
        for text in ("secret", "private", "You are", '"text"'):
            assert text not in logged, text
        # the conversation itself is kept whole
        contents = [m.content for m in session.scalars(
            select(Message).where(Message.loop_id == loop_id).order_by(Message.id))]
        assert "a secret question" in contents and "the private answer is 42" in contents
        assert session.scalars(select(ToolCall.arguments).where(
            ToolCall.loop_id == loop_id)).one() == {"a": 20, "b": 22}
        page = app.test_client().get(f"/admin/loops/{loop_id}").get_data(as_text=True)
        assert page.count('class="muted wire-summary"') == 3
        session.remove()
        for engine in app.extensions["sqlalchemy"].engines.values():
            engine.dispose()
