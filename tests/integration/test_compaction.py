"""Compaction of long histories against the strict emulator
(docs/decisions/0038-compaction.md): a 60-turn tool loop with the trigger at
4,000 tokens stays under it, never separates a tool call from its result in
any request, and keeps every original message in the database; the summary
turn's end is one commit, all or nothing."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from sqlalchemy import select

from flask_solidloop import Compaction, InvalidArgumentError
from flask_solidloop.llm.estimate import estimate
from flask_solidloop.llm.types import ChatMessage, ToolCallRequest
from flask_solidloop.loops import queries
from flask_solidloop.models import Loop, Message, ToolCall
from flask_solidloop.pipeline.compaction import (
    DEFAULT_INSTRUCTIONS,
    SUMMARY_PREFIX,
    compaction_span,
)

from ..support.support_app import COMPACTION, CompactingAgent

TURNS = 60


def is_summary_request(body: dict) -> bool:
    return body["messages"][0]["content"] == DEFAULT_INSTRUCTIONS


def script_book(llm, turns: int = TURNS) -> list[int]:
    """The model reads pages 1..``turns`` one call a turn, then answers; the
    summarizer answers with the pages its transcript names. Returns the list
    the script appends each page it asked for to."""
    asked: list[int] = []

    def reply(body: dict) -> dict:
        if is_summary_request(body):
            text = body["messages"][-1]["content"]
            read = sorted({int(word) for word in text.replace('"', " ").replace("}", " ")
                           .split() if word.isdigit()})
            return {"content": f"Pages read so far include {read[:3]} ... {read[-3:]}."}
        if len(asked) == turns:
            return {"content": f"All {turns} pages read."}
        asked.append(len(asked) + 1)
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[-1]}}]}

    llm.script(lambda body: True, reply)
    return asked


def chat_requests(llm) -> list[dict]:
    return [r.json for r in llm.requests if r.path.endswith("/chat/completions")]


def check_calls_with_results(body: dict) -> None:
    """Every tool call of the request has its result after it, and every
    result follows its call."""
    open_calls: set[str] = set()
    seen: set[str] = set()
    for message in body["messages"]:
        for call in message.get("tool_calls") or ():
            open_calls.add(call["id"])
            seen.add(call["id"])
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, (
                f"a tool result without its call: {message['tool_call_id']}")
            open_calls.discard(message["tool_call_id"])
        elif message["role"] != "assistant" or not message.get("tool_calls"):
            assert not open_calls, f"calls without their results: {open_calls}"
    assert not open_calls, f"calls without their results: {open_calls}"


def test_a_60_turn_loop_stays_under_the_trigger_and_keeps_every_message(
        app, session, llm, drain):
    asked = script_book(llm)
    loop_id = CompactingAgent.start(message="Read the whole book.").id
    drain()
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.error_message) == ("completed", None)
    assert asked == list(range(1, TURNS + 1))

    requests = chat_requests(llm)
    summaries = [body for body in requests if is_summary_request(body)]
    turns = [body for body in requests if not is_summary_request(body)]
    assert len(turns) == TURNS + 1 and len(summaries) >= 2
    # The summarizer is the named model; the turns, the agent's.
    assert {body["model"] for body in summaries} == {"summary-model"}
    assert {body["model"] for body in turns} == {"test-model"}

    sizes = [estimate(body, default_output=0).prompt_tokens for body in turns]
    # One turn's growth: a call and its result (the largest step between two
    # requests that no summary came between).
    one_turn = max(b - a for a, b in itertools.pairwise(sizes))
    assert 0 < one_turn < 400
    trigger = COMPACTION.trigger_tokens
    for body in requests:
        assert estimate(body, default_output=0).prompt_tokens <= trigger + one_turn
    # Every turn's request is under the trigger itself: past it, the turn
    # summarises first.
    assert max(sizes) <= trigger
    for body in requests:
        check_calls_with_results(body)
    for body in turns:
        # The system prompt and the task are never summarised.
        assert body["messages"][0] == {"role": "system",
                                       "content": "You read a book page by page."}
        assert body["messages"][1] == {"role": "user", "content": "Read the whole book."}
    # After the first summary, each request carries exactly one summary,
    # right after the task.
    compacted_turns = [body for body in turns if any(
        (m.get("content") or "").startswith(SUMMARY_PREFIX) for m in body["messages"])]
    assert compacted_turns
    for body in compacted_turns:
        assert [n for n, m in enumerate(body["messages"])
                if (m.get("content") or "").startswith(SUMMARY_PREFIX)] == [2]

    # Every original message is still in the database: the system prompt, the
    # task, a call and its result per turn, the final answer; plus the summaries.
    rows = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                .order_by(Message.id)))
    originals = [m for m in rows if m.kind == "message"]
    summary_rows = [m for m in rows if m.kind == "summary"]
    assert [m.role for m in originals] == (["system", "user"] + ["assistant", "tool"] * TURNS
                                           + ["assistant"])
    assert all(not m.is_hidden and m.status == "completed" for m in originals)
    assert len(summary_rows) == len(summaries)
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
    assert len(calls) == TURNS and all(c.response_message_id is not None for c in calls)
    # Each summary but the newest was folded into the next one; the pinned
    # messages and the last turns never were.
    assert [s.compacted_by for s in summary_rows[:-1]] == [s.id for s in summary_rows[1:]]
    assert summary_rows[-1].compacted_by is None
    assert originals[0].compacted_by is None and originals[1].compacted_by is None
    assert all(m.compacted_by is None for m in originals[-5:])
    # A call and its result are always replaced by the same summary.
    by_id = {m.id: m for m in rows}
    for call in calls:
        assert by_id[call.message_id].compacted_by == by_id[call.response_message_id].compacted_by
    # The summaries' requests are on record, their usage counted on the loop.
    assert all(s.usage is not None and s.meta["model"] == "summary-model"
               for s in summary_rows)
    assert loop.step_count == TURNS + 1 + len(summary_rows)

    # The history a turn reads now: the pinned messages, the newest summary,
    # the last turns.
    history = queries.history(session, loop_id)
    assert [m.role for m in history[:3]] == ["system", "user", "user"]
    assert history[2].content == summary_rows[-1].content
    assert history[-1].content == f"All {TURNS} pages read."


def test_below_the_trigger_nothing_is_summarised(app, session, llm, drain):
    script_book(llm, turns=3)
    loop_id = CompactingAgent.start(message="Read three pages.").id
    drain()
    assert session.get(Loop, loop_id).status == "completed"
    assert not any(is_summary_request(body) for body in chat_requests(llm))
    assert session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                 Message.kind == "summary")).first() is None


def test_a_summary_turn_that_loses_its_loop_writes_nothing(app, state, session, llm, drain):
    """The summary turn's end is fenced: a generation that lost the loop (paused
    and resumed while the summarizer answered) inserts no summary and marks
    nothing."""
    from flask_solidloop.loops import store

    script_book(llm, turns=2)
    loop_id = CompactingAgent.start(message="Read two pages.").id
    drain()
    ids = [m.id for m in session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "tool"))]
    session.rollback()
    import uuid

    from flask_solidloop.errors import LostLeaseError
    with pytest.raises(LostLeaseError):
        store.finish_summary_turn(state, session, loop_id=loop_id, token=uuid.uuid4(),
                                  content="x", message_ids=ids, meta={}, usage=None,
                                  cost=None, wire=None, event_id=None)
    session.expire_all()
    assert session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                 Message.kind == "summary")).first() is None
    assert all(m.compacted_by is None for m in session.scalars(
        select(Message).where(Message.loop_id == loop_id)))


def test_the_span_never_takes_the_pinned_messages_or_splits_a_call():
    def call(n):
        return ChatMessage(role="assistant", tool_calls=[ToolCallRequest(f"c{n}", "f", "{}")],
                           message_id=10 * n)

    def result(n):
        return ChatMessage(role="tool", tool_call_id=f"c{n}", content="r",
                           message_id=10 * n + 1)

    history = [ChatMessage(role="system", content="s", message_id=1),
               ChatMessage(role="user", content="task", message_id=2),
               call(1), result(1), call(2), result(2), call(3), result(3)]
    span = compaction_span(history, keep_last_turns=1)
    assert [m.message_id for m in span] == [10, 11, 20, 21]
    assert compaction_span(history, keep_last_turns=3) == []
    # Two calls of one turn answered after a later message: no cut between.
    odd = [*history[:2], ChatMessage(role="assistant", message_id=5, tool_calls=[
        ToolCallRequest("a", "f", "{}"), ToolCallRequest("b", "f", "{}")]),
        ChatMessage(role="tool", tool_call_id="a", content="r", message_id=6),
        ChatMessage(role="assistant", content="meanwhile", message_id=7),
        ChatMessage(role="tool", tool_call_id="b", content="r", message_id=8),
        call(9), result(9)]
    assert [m.message_id for m in compaction_span(odd, keep_last_turns=1)] == [5, 6, 7, 8]
    assert compaction_span(odd[:6], keep_last_turns=1) == []
    # Right after a summary turn only the kept turns are newer than the
    # summary: nothing to replace.
    summary = ChatMessage(role="user", content=SUMMARY_PREFIX + "gist", message_id=3)
    assert compaction_span([*history[:2], summary, call(4), result(4)],
                           keep_last_turns=1) == []
    # A summary alone is never summarised again, even where the only cut that
    # keeps calls with their results would leave it alone.
    interleaved = [*history[:2], summary, call(4), call(5), result(4), call(6), result(5),
                   result(6)]
    assert compaction_span(interleaved, keep_last_turns=1) == []
    assert [m.message_id for m in compaction_span(
        [*interleaved[:3], call(7), result(7), *interleaved[3:]],
        keep_last_turns=1)] == [3, 70, 71]
    assert [m.message_id for m in compaction_span(
        [*history[:2], summary, call(4), result(4), call(5), result(5)],
        keep_last_turns=1)] == [3, 40, 41]
    # A message made in memory (no id) is never replaced.
    assert compaction_span([*history[:2], ChatMessage(role="user", content="x"),
                            *history[2:]], keep_last_turns=1) == []


@pytest.mark.parametrize("kwargs, error", [
    ({"trigger_tokens": 0}, "Compaction trigger_tokens must be a positive int, got 0"),
    ({"trigger_tokens": 10, "keep_last_turns": 0},
     "Compaction keep_last_turns must be an int of at least 1"),
    ({"trigger_tokens": 10, "summarizer": {"modle": "x"}},
     "Compaction summarizer has unknown llm setting(s) modle; known: dialect"),
    ({"trigger_tokens": 10, "summarizer": "cheap"},
     "Compaction summarizer must be None (the agent's model) or a dict"),
])
def test_bad_settings_are_refused_with_the_fix(kwargs, error):
    with pytest.raises(InvalidArgumentError) as raised:
        Compaction(**kwargs)
    assert str(raised.value).startswith(error)


def test_native_falls_back_to_the_summary_turn():
    assert Compaction(trigger_tokens=10, native=True).native is True
    assert json.dumps(repr(COMPACTION)) == '"Compaction(trigger_tokens=4000, keep_last_turns=2)"'


def test_the_admin_folds_compacted_messages_and_shows_them_on_expand(app, session, llm,
                                                                      drain):
    from ..support.support_app import solidloop

    script_book(llm, turns=25)
    loop_id = CompactingAgent.start(message="Read 25 pages.").id
    drain()
    (summary,) = session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                       Message.kind == "summary"))
    replaced = list(session.scalars(select(Message).where(
        Message.compacted_by == summary.id).order_by(Message.id)))
    session.rollback()
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    page = app.test_client().get(f"/admin/loops/{loop_id}").get_data(as_text=True)
    fold = page[page.index(f'<details class="compacted" data-summary="{summary.id}">'):]
    fold = fold[:fold.index("</details>")]
    assert f"{len(replaced)} message(s) compacted into summary #{summary.id}" in fold
    # Every replaced message is in the fold, once, and nowhere else on the page.
    for message in replaced:
        assert fold.count(f'data-message="{message.id}"') == 1
        assert page.count(f'data-message="{message.id}"') == 1
    assert f"summary of {len(replaced)} earlier message(s)" in page
    # The summary is one message of the page (its "Fork here" button names it too).
    assert len(re.findall(rf'<article [^>]*data-message="{summary.id}"', page)) == 1


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "gemini"])
def test_each_dialect_takes_the_summary_and_the_compacted_history(app, session, llm, drain,
                                                                  dialect):
    """The strict emulator accepts the summarizer's request and the compacted
    history (the summary is a user message right after the task) in each
    dialect."""
    from flask_solidloop import Agent
    from flask_solidloop.pipeline import AgentInitialization

    from ..support.support_app import pages, solidloop

    compaction = Compaction(trigger_tokens=700, keep_last_turns=1)
    base_url = llm.base_url

    class DialectCompactingAgent(Agent):
        system_prompt = "You read a book page by page."
        mcps = [{"name": "pages", "toolset": pages}]
        llm = {"dialect": dialect, "base_url": base_url, "model": "test-model",
               "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}
        streaming = True

        def configure_llm_middlewares(self, builder):
            builder.insert_after(AgentInitialization, compaction)

    agent = solidloop.agent(f"compacting_{dialect}")(DialectCompactingAgent)
    asked: list[int] = []

    def reply(body: dict) -> dict:
        if DEFAULT_INSTRUCTIONS in json.dumps(body):
            return {"content": "The pages so far were about a fox."}
        if len(asked) == 6:
            return {"content": "Done."}
        asked.append(len(asked) + 1)
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[-1]}}]}

    llm.script(lambda body: True, reply)
    loop_id = agent.start(message="Read six pages.").id
    drain()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.error_message) == ("completed", None)
    bodies = [json.dumps(r.json) for r in llm.requests]
    summary_at = [n for n, body in enumerate(bodies) if DEFAULT_INSTRUCTIONS in body]
    assert summary_at
    # The request after each summary carries it, and the task before it.
    after = bodies[summary_at[0] + 1]
    assert "The pages so far were about a fox." in after
    assert after.index("Read six pages.") < after.index(SUMMARY_PREFIX.strip().rstrip(":"))
    assert asked == [1, 2, 3, 4, 5, 6]


def test_kept_turns_over_the_trigger_go_out_as_they_are(app, session, llm, drain):
    """A trigger smaller than the kept turns themselves: the turn right after a
    summary turn is still past it, and is sent as it is (only the kept turn
    is newer than the summary); the loop summarises at most once before each
    turn, never twice in a row, and ends."""
    from flask_solidloop import Agent
    from flask_solidloop.pipeline import AgentInitialization

    from ..support.support_app import llm_settings, pages, solidloop

    tiny = Compaction(trigger_tokens=150, keep_last_turns=1)

    @solidloop.agent("tiny_compacting")
    class TinyCompactingAgent(Agent):
        system_prompt = "You read a book page by page."
        mcps = [{"name": "pages", "toolset": pages}]

        def llm(self) -> dict:
            return llm_settings()

        def configure_llm_middlewares(self, builder):
            builder.insert_after(AgentInitialization, tiny)

    asked = script_book(llm, turns=6)
    loop_id = TinyCompactingAgent.start(message="Read six pages.").id
    drain()
    assert session.get(Loop, loop_id).status == "completed"
    assert asked == [1, 2, 3, 4, 5, 6]
    kinds = ["S" if is_summary_request(body) else "T" for body in chat_requests(llm)]
    # Each turn from the third on follows one summary of the turn before it.
    assert "".join(kinds) == "TT" + "ST" * 5


def test_a_refused_summary_request_fails_the_turn_as_any_request_does(app, session, llm,
                                                                      drain):
    """The summarizer's error goes through ErrorHandling: the loop fails with
    the provider's status, nothing is summarised or marked, and the summary
    request's record holds its answer."""
    from flask_solidloop.models import Event

    from ..support.support_app import QUICK_COMPACTION, QuickCompactingAgent

    asked: list[int] = []

    def reply(body: dict) -> dict:
        asked.append(len(asked) + 1)
        if estimate(body, default_output=0).prompt_tokens > QUICK_COMPACTION.trigger_tokens \
                - 250:
            llm.fail_next(400)  # the next request: this turn's successor's summary
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[-1]}}]}

    llm.script(lambda body: not is_summary_request(body), reply)
    loop_id = QuickCompactingAgent.start(message="Read the book.").id
    drain()
    loop = session.get(Loop, loop_id)
    assert loop.status == "failed"
    assert "400" in loop.error_message
    (refused,) = [r.json for r in llm.requests if is_summary_request(r.json)]
    assert refused["model"] == "test-model"  # the agent's own model: no summarizer named
    assert session.scalars(select(Message).where(
        Message.loop_id == loop_id, (Message.kind == "summary")
        | Message.compacted_by.is_not(None))).first() is None
    events = list(session.scalars(select(Event).where(Event.loop_id == loop_id,
                                                      Event.kind == "llm_request")
                                  .order_by(Event.id)))
    assert len(events) == len(llm.requests)
    assert events[-1].message_id is None and events[-1].status_code == 400


def test_a_fork_of_a_compacted_loop_copies_the_history_the_model_reads(app, session, llm,
                                                                       drain):
    """A fork takes the summary in place of the messages it replaced (the
    original keeps those), so its first request is the one the original sent
    at the same point; a replaced message is no fork point."""
    from flask_solidloop.loops import control
    from flask_solidloop.state import get_state

    script_book(llm, turns=30)
    loop_id = CompactingAgent.start(message="Read thirty pages.").id
    drain()
    assert session.get(Loop, loop_id).status == "completed"
    turns = [body for body in chat_requests(llm) if not is_summary_request(body)]
    assert any(is_summary_request(body) for body in chat_requests(llm))
    rows = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                .order_by(Message.id)))
    last_result = [m for m in rows if m.role == "tool"][-1]
    replaced = next(m for m in rows if m.compacted_by is not None)
    session.rollback()

    fork = control.fork(get_state(), loop_id, last_result.id)
    drain()
    after = [body for body in chat_requests(llm) if not is_summary_request(body)]
    assert after[len(turns)] == turns[-1]
    copied = list(session.scalars(select(Message).where(Message.loop_id == fork.id)
                                  .order_by(Message.id)))
    summaries = [m for m in copied if m.kind == "summary"]
    assert len(summaries) == 1 and "sorts_at" not in summaries[0].meta
    assert [m.role for m in copied[:3]] == ["system", "user", "user"]
    assert copied[2].id == summaries[0].id
    assert all(m.compacted_by is None for m in copied)
    session.rollback()
    with pytest.raises(InvalidArgumentError, match=f"was compacted into summary "
                                                   f"{replaced.compacted_by}"):
        control.fork(get_state(), loop_id, replaced.id)


PIN = "The code word is PLUM. Read on."


def test_a_pinned_message_is_never_summarised(app, session, llm, drain):
    """A user message pinned by the host (``Agent(loop).pin``) stays in every
    request, in its place, while the summaries replace the messages on both
    sides of it; the summarizer never reads it."""
    from ..support.support_app import QuickCompactingAgent

    asked: list[int] = []
    limit = [2]

    def reply(body: dict) -> dict:
        if body["messages"][0]["content"] == DEFAULT_INSTRUCTIONS:
            return {"content": "Pages were read."}
        if len(asked) >= limit[0]:
            return {"content": f"Read {len(asked)} pages."}
        asked.append(len(asked) + 1)
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[-1]}}]}

    llm.script(lambda body: True, reply)
    loop_id = QuickCompactingAgent.start(message="Read two pages.").id
    drain()
    assert session.get(Loop, loop_id).status == "completed"
    assert not any(is_summary_request(body) for body in chat_requests(llm))
    limit[0] = 8
    agent = QuickCompactingAgent(loop_id)
    agent.send_message(PIN)
    pinned = session.scalars(select(Message).where(Message.loop_id == loop_id,
                                                   Message.content == PIN)).one()
    agent.pin(pinned.id)
    session.rollback()
    sent_before = len(chat_requests(llm))
    drain()
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    assert asked == list(range(1, 9))

    after = chat_requests(llm)[sent_before:]
    summaries = [body for body in after if is_summary_request(body)]
    assert summaries, "the second part passes the trigger"
    for body in summaries:
        assert "PLUM" not in body["messages"][-1]["content"]
    for body in after:
        if not is_summary_request(body):
            assert [m["content"] for m in body["messages"] if m["role"] == "user"
                    ].count(PIN) == 1
    rows = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                .order_by(Message.id)))
    pin_row = next(m for m in rows if m.id == pinned.id)
    assert pin_row.compacted_by is None and pin_row.meta.get("pinned") is True
    compacted = [m.id for m in rows if m.compacted_by is not None and m.kind == "message"]
    assert min(compacted) < pinned.id < max(compacted)

    # Only the loop's own, not yet summarised user messages can be pinned.
    with pytest.raises(InvalidArgumentError, match="was compacted into summary"):
        agent.pin(min(compacted))
    assistant = next(m for m in rows if m.role == "assistant" and m.compacted_by is None)
    with pytest.raises(InvalidArgumentError, match="only the loop's own user messages"):
        agent.pin(assistant.id)
    with pytest.raises(InvalidArgumentError, match="is not one of loop"):
        agent.pin(10**12)
    agent.pin(pinned.id, pinned=False)
    session.expire_all()
    assert "pinned" not in session.get(Message, pinned.id).meta
