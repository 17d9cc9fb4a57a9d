"""Issue 16: loops whose model writes its tool calls as text, against the strict
emulator over real HTTP, drained in process (the worker runs are in
tests/acceptance/test_xml_tools_workers.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from sqlalchemy import select

from flask_solidloop.llm import tool_text
from flask_solidloop.models import Loop, Message, ToolCall

from ..support.support_app import (
    XmlPromptedAgent,
    XmlPromptedStreamingAgent,
    XmlToolsAgent,
    XmlToolsStreamingAgent,
    create_app,
)


def calls_text(*calls: tuple[str, object]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                     for n, a in calls)


TWO_CALLS = "I'll add and look up.\n" + calls_text(("add", {"a": 20, "b": 22}),
                                                   ("lookup", {"key": "abc"}))
MALFORMED = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2,}}\n</tool_call>'
CORRECTED = "Fixed.\n" + calls_text(("add", {"a": 1, "b": 2}))


def last(body: dict) -> dict:
    return body["messages"][-1]


def answered(body: dict) -> bool:
    """The last message carries tool results: a tool message, or <tool_response> text."""
    message = last(body)
    return message["role"] == "tool" or "<tool_response>" in (message.get("content") or "")


def script_parallel(llm) -> None:
    llm.script(lambda body: not answered(body), {"content": TWO_CALLS})
    llm.script(answered, {"content": "42, done"})


def script_malformed(llm) -> None:
    def reply(body: dict) -> dict:
        turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
        return {"content": [MALFORMED, CORRECTED, "3, done"][min(turns, 2)]}

    llm.script(lambda body: True, reply)


def tool_messages(session, loop_id: int) -> list[Message]:
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "tool").order_by(Message.id)))


def visible_assistants(session, loop_id: int) -> list[Message]:
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "assistant",
        Message.is_hidden.is_(False)).order_by(Message.id)))


def calls_of(session, loop_id: int) -> list[ToolCall]:
    return list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)
                                .order_by(ToolCall.id)))


def chat_requests(llm) -> list[dict]:
    return [r.json for r in llm.requests if r.path.endswith("/chat/completions")]


@pytest.mark.parametrize("agent", [XmlToolsAgent, XmlToolsStreamingAgent],
                         ids=["plain", "streaming"])
def test_two_text_calls_then_an_answer(app, session, llm, drain, agent):
    script_parallel(llm)
    loop = agent.start(message="add please")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    calls = calls_of(session, loop.id)
    assert [c.name for c in calls] == ["add", "lookup"] and all(c.is_success for c in calls)
    assert [c.arguments for c in calls] == [{"a": 20, "b": 22}, {"key": "abc"}]
    first, final = visible_assistants(session, loop.id)
    # The call text is gone from the visible answer; the ids derive from the message.
    assert first.content == "I'll add and look up." and final.content == "42, done"
    assert "<tool_call>" not in (first.content or "")
    assert first.finish_reason == "tool_calls"
    assert [c.call_id for c in calls] == [tool_text.call_id(f"{loop.id}:{first.id}", i)
                                         for i in range(2)]
    assert first.meta["tool_call_text"] == {"format": "hermes", "calls": 2, "errors": []}
    # One tool message per call, each answering its own call.
    answers = tool_messages(session, loop.id)
    assert sorted(m.tool_call_id for m in answers) == sorted(c.id for c in calls)
    assert len(answers) == 2 and answers[0].content == "42"
    # Tools went natively; the results went back as tool messages naming the ids.
    sent = chat_requests(llm)
    assert len(sent) == 2 and sent[0]["tools"]
    replay = sent[1]["messages"]
    assert [c["id"] for c in replay[2]["tool_calls"]] == [c.call_id for c in calls]
    assert [m["tool_call_id"] for m in replay[3:]] == [c.call_id for c in calls]
    if agent.streaming:
        assert first.meta["metrics"]["output_tokens"] > 0


@pytest.mark.parametrize("agent", [XmlToolsAgent, XmlToolsStreamingAgent],
                         ids=["plain", "streaming"])
def test_a_malformed_text_call_is_corrected_next_turn(app, session, llm, drain, agent):
    script_malformed(llm)
    loop = agent.start(message="add one and two")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed", session.get(Loop, loop.id)
    bad, good = calls_of(session, loop.id)
    assert bad.name == "add" and bad.is_success is False
    error = bad.result["content"][0]["text"]
    assert "not a JSON object" in error  # the same correctable error as a native call
    assert good.is_success and good.arguments == {"a": 1, "b": 2}
    assert [m.content for m in visible_assistants(session, loop.id)] == \
        ["Adding.", "Fixed.", "3, done"]
    assert len(tool_messages(session, loop.id)) == 2
    assert "not valid JSON" in visible_assistants(session, loop.id)[0] \
        .meta["tool_call_text"]["errors"][0]
    # The model saw the error as the result of its call.
    second = chat_requests(llm)[1]["messages"]
    assert second[-1]["role"] == "tool" and "not a JSON object" in second[-1]["content"]


@pytest.fixture
def no_tools(llm):
    """The shared strict emulator, for one test, as a server whose chat format has no
    tool support (it rejects the ``tools`` field)."""
    llm.tool_support = "reject"
    yield llm
    llm.tool_support = "native"


@pytest.mark.parametrize("agent", [XmlPromptedAgent, XmlPromptedStreamingAgent],
                         ids=["plain", "streaming"])
def test_tool_prompting_completes_a_loop_on_a_server_without_tools(app, session, no_tools,
                                                                   drain, agent):
    llm = no_tools
    script_parallel(llm)
    loop = agent.start(message="add please")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed", session.get(Loop, loop.id)
    calls = calls_of(session, loop.id)
    assert [c.name for c in calls] == ["add", "lookup"] and all(c.is_success for c in calls)
    assert len(tool_messages(session, loop.id)) == 2
    sent = chat_requests(llm)
    assert len(sent) == 2 and all("tools" not in body for body in sent)
    system = sent[0]["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("You write tool calls")
    assert "<tools>" in system["content"] and '"name": "add"' in system["content"]
    # The history goes back as text: the calls in the assistant message, both results
    # in one user message of <tool_response> blocks.
    replay = sent[1]["messages"]
    assert [m["role"] for m in replay] == ["system", "user", "assistant", "user"]
    assert "tool_calls" not in replay[2] and replay[2]["content"].count("<tool_call>") == 2
    assert replay[3]["content"].count("<tool_response>") == 2
    assert '"content": "42"' in replay[3]["content"]


def test_the_no_tools_server_refuses_an_agent_that_sends_tools(app, session, no_tools, drain):
    script_parallel(no_tools)
    loop = XmlToolsAgent.start(message="add please")
    drain()
    session.expire_all()
    failed = session.get(Loop, loop.id)
    assert failed.status == "failed" and "does not support tools" in failed.error_message


def test_tool_prompting_completes_where_the_server_drops_tools(app, session, llm, drain):
    llm.tool_support = "drop"
    try:
        script_parallel(llm)
        loop = XmlPromptedAgent.start(message="add please")
        drain()
    finally:
        llm.tool_support = "native"
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert len(tool_messages(session, loop.id)) == 2


def test_a_streamed_partial_never_shows_call_markup(app, session, llm, database_url):
    import psycopg

    from flask_solidloop.queue.broker import libpq_url
    from flask_solidloop.testing import drain as run

    other = create_app(SOLIDLOOP_STREAM_UPDATE_INTERVAL=0.01)
    llm.fault_next("slow_stream", seconds=0.02)
    llm.script(lambda body: not answered(body), {"content": "Let me see. " + TWO_CALLS})
    llm.script(answered, {"content": "42, done"})
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as pg:
            while not done.is_set():
                # The text so far, as the loop's stream has it (text deltas).
                seen.extend(row[0] for row in pg.execute(
                    "SELECT coalesce((SELECT string_agg(e.text, '' ORDER BY e.id) "
                    "FROM solidloop_stream_events e WHERE e.message_id = m.id "
                    "AND e.kind = 'text_delta'), '') FROM solidloop_messages m "
                    "WHERE m.role = 'assistant' AND m.status = 'processing'").fetchall())
                time.sleep(0.005)

    with other.app_context():
        loop_id = XmlToolsStreamingAgent.start(message="add please").id
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            run(other)
        finally:
            done.set()
            watcher.join()
    other.extensions["solidloop"].broker.close()
    partials = [p for p in seen if p]
    assert partials, "no partial was written while streaming"
    for partial in partials:
        assert "<tool" not in partial and "{" not in partial, partial
        assert not partial.rstrip().endswith("<"), partial
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
