"""Forks and replays (``Agent(loop).fork``, ``flask solidloop fork / replay``,
the admin's "Fork here"; docs/decisions/0039-forks.md), driven in-process
(drain) against the strict LLM emulator and PostgreSQL. A fork's first
request is compared with the request the original sent at the same point,
as the emulator received both."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select

from flask_solidloop import InvalidArgumentError
from flask_solidloop.loops import control, store
from flask_solidloop.loops.store.forks import plan_fork
from flask_solidloop.models import Job, Loop, McpSession, Message, ToolCall

from ..support.rows import loop_of
from ..support.support_app import SIDE_EFFECTS, Assistant, ChatAgent, solidloop

TWO_ADDS = {"content": "Adding.", "tool_calls": [
    {"name": "add", "arguments": {"a": 2, "b": 3}},
    {"name": "add", "arguments": {"a": 4, "b": 5}}]}


def after_tools(request) -> bool:
    return request["messages"][-1]["role"] == "tool"


def visible(session, loop_id) -> list[Message]:
    session.expire_all()
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.is_hidden.is_(False)).order_by(Message.id)))


def chat_requests(llm) -> list:
    return [r for r in llm.requests if r.json and "messages" in r.json]


@pytest.fixture
def added(app, session, llm, drain):
    """A completed loop: two parallel adds, their results, the final answer;
    and the two requests it sent."""
    llm.script("add 2 and 3, and 4 and 5", TWO_ADDS)
    llm.script(after_tools, {"content": "5 and 9."})
    loop = Assistant.start(message="add 2 and 3, and 4 and 5")
    drain()
    assert loop_of(session, loop.id).status == "completed"
    requests = chat_requests(llm)
    assert len(requests) == 2
    return loop, requests


def test_a_fork_at_a_tool_result_sends_the_request_the_loop_sent_next(session, llm, drain,
                                                                      added):
    loop, (_, next_) = added
    messages = visible(session, loop.id)
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool",
                                          "assistant"]
    runs = len(SIDE_EFFECTS)
    # At either result, or at the assistant message that asked for both: the
    # whole tool phase, calls with their results.
    for point in (messages[4], messages[3], messages[2]):
        fork = Assistant(loop).fork(point.id)
        assert (fork.forked_from_loop_id, fork.forked_at_message_id) == (loop.id, point.id)
        assert loop_of(session, fork.id).status == "queued"
        drain()
        assert loop_of(session, fork.id).status == "completed"
        sent = chat_requests(llm)[-1]
        assert sent.json == next_.json
        assert sent.json["messages"][-2]["role"] == "tool"  # the request compared has both
        assert sent.json["messages"][-1]["role"] == "tool"
        copied = visible(session, fork.id)
        assert [(m.role, m.content) for m in copied[:5]] == [
            (m.role, m.content) for m in messages[:5]]
        calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == fork.id)
                                     .order_by(ToolCall.position)))
        originals = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop.id)
                                         .order_by(ToolCall.position)))
        assert [(c.call_id, c.name, c.arguments, c.result, c.is_success) for c in calls] == [
            (c.call_id, c.name, c.arguments, c.result, c.is_success) for c in originals]
        assert all(c.response_message.loop_id == fork.id for c in calls)
        assert all(c.lease_token is None for c in calls)
    # No tool ran again: the forks read the recorded results.
    assert len(SIDE_EFFECTS) == runs
    # Nothing hidden and no wire-log event was copied: each fork's record is its own.
    assert len(chat_requests(llm)) == 2 + 3


DIALECTS = [(d, s) for d in ("openai", "openai_responses", "anthropic", "gemini")
            for s in (False, True)]


@pytest.mark.parametrize(("dialect", "streaming"), DIALECTS)
def test_each_dialect_sends_the_same_next_request_from_a_fork(app, session, llm, drain,
                                                              dialect, streaming):
    """The provider's own blocks (reasoning, its signature, Gemini's thought
    signatures on the calls) travel with the copied messages."""
    from flask_solidloop import Agent

    from ..support.support_app import calc

    settings = {"dialect": dialect, "base_url": llm.base_url, "model": "test-model",
                "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}

    class DialectAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]
        llm = settings

    DialectAgent.streaming = streaming
    agent = solidloop.agent(f"fork_{dialect}_{'stream' if streaming else 'plain'}")(
        DialectAgent)
    llm.script(lambda request: True, {"content": "5 and 9."})  # the newest script wins
    llm.script("add 2 and 3, and 4 and 5", {**TWO_ADDS, "reasoning_content": "Two sums."})
    loop = agent.start(message="add 2 and 3, and 4 and 5")
    drain()
    assert loop_of(session, loop.id).status == "completed"
    requests = chat_requests_any(llm)
    assert len(requests) == 2
    messages = visible(session, loop.id)
    assert [m.role for m in messages][2:5] == ["assistant", "tool", "tool"]
    fork = agent(loop).fork(messages[3].id)
    drain()
    assert loop_of(session, fork.id).status == "completed"
    sent = chat_requests_any(llm)[2:]
    assert len(sent) == 1
    assert (sent[0].path, sent[0].json) == (requests[1].path, requests[1].json)


def chat_requests_any(llm) -> list:
    """Every chat request, whatever the dialect."""
    return [r for r in llm.requests if r.json is not None and r.method == "POST"]


def test_a_fork_at_the_first_user_message_asks_the_first_question_again(session, llm, drain,
                                                                        added):
    loop, (first, _) = added
    user = visible(session, loop.id)[1]
    fork = Assistant(loop).fork(user.id)
    drain()
    assert chat_requests(llm)[2].json == first.json
    # It went on as the original did, with its own tool calls this time.
    assert [m.role for m in visible(session, fork.id)] == [
        "system", "user", "assistant", "tool", "tool", "assistant"]
    assert loop_of(session, fork.id).status == "completed"


def test_a_fork_with_a_message_replaces_the_last_user_message(app, session, llm, drain):
    llm.script("hello", {"content": "Hi!"})
    llm.script("the weather", {"content": "It is sunny."})
    llm.script("the time", {"content": "It is noon."})
    loop = ChatAgent.start(message="hello")
    drain()
    ChatAgent(loop).send_message("what is the weather")
    drain()
    messages = visible(session, loop.id)
    assert [m.content for m in messages] == ["You chat.", "hello", "Hi!",
                                             "what is the weather", "It is sunny."]
    # At the question, or at its answer: the question is replaced, and the
    # answer to the old one is not copied.
    for point in (messages[3], messages[4]):
        fork = ChatAgent(loop).fork(point.id, message="what is the time")
        drain()
        assert [(m.role, m.content) for m in visible(session, fork.id)] == [
            ("system", "You chat."), ("user", "hello"), ("assistant", "Hi!"),
            ("user", "what is the time"), ("assistant", "It is noon.")]
        sent = chat_requests(llm)[-1].json["messages"]
        assert [(m["role"], m["content"]) for m in sent] == [
            ("system", "You chat."), ("user", "hello"), ("assistant", "Hi!"),
            ("user", "what is the time")]
    # The original is untouched.
    assert [m.content for m in visible(session, loop.id)] == [m.content for m in messages]


def test_a_fork_inside_an_unfinished_tool_phase_moves_back_before_it(app, session, llm,
                                                                     drain):
    llm.script("tell the ceo", {"content": "Drafting.", "tool_calls": [
        {"name": "send_email", "arguments": {"to": "ceo", "body": "hello"}}]})
    loop = ChatAgent.start(message="tell the ceo")
    drain()
    assert loop_of(session, loop.id).status == "waiting"
    first = chat_requests(llm)[0]
    asked = visible(session, loop.id)[-1]
    assert asked.role == "assistant"
    fork = ChatAgent(loop).fork(asked.id)
    assert [m.role for m in visible(session, fork.id)] == ["system", "user"]
    assert session.scalar(select(func.count()).select_from(ToolCall)
                          .where(ToolCall.loop_id == fork.id)) == 0
    drain()
    assert chat_requests(llm)[1].json == first.json
    assert loop_of(session, fork.id).status == "waiting"  # it asked again, and waits too
    assert loop_of(session, loop.id).status == "waiting"


def test_the_fork_is_one_transaction_with_its_first_job(session, llm, added):
    loop, _ = added
    user = visible(session, loop.id)[1]
    before = session.scalar(select(func.count()).select_from(Loop))
    fork = Assistant(loop).fork(user.id, commit=False)
    fork_id = fork.id
    assert session.scalar(select(func.count()).select_from(Job)
                          .where(Job.loop_id == fork_id)) == 1
    session.rollback()
    assert session.scalar(select(func.count()).select_from(Loop)) == before
    assert session.scalar(select(func.count()).select_from(Message)
                          .where(Message.loop_id == fork_id)) == 0
    assert session.scalar(select(func.count()).select_from(Job)
                          .where(Job.loop_id == fork_id)) == 0
    # A refused fork joined to the caller's transaction leaves the caller's writes
    # for the caller to commit.
    mine = Assistant.start(message="mine", session=session, commit=False)
    with pytest.raises(InvalidArgumentError, match="message 999999 is no message"):
        Assistant(loop).fork(999999, session=session, commit=False)
    session.commit()
    assert loop_of(session, mine.id).status == "queued"


def test_tool_snapshots_are_copied_without_the_mcp_session(session, llm, drain, added):
    loop, _ = added
    session.add(McpSession(loop_id=loop.id, server_name="remote",
                           tools=[{"name": "t", "inputSchema": {"type": "object"}}],
                           session_state={"session_id": "theirs"}))
    session.commit()
    fork = Assistant(loop).fork(visible(session, loop.id)[1].id)
    copied = session.scalars(select(McpSession).where(McpSession.loop_id == fork.id)).one()
    assert copied.tools == [{"name": "t", "inputSchema": {"type": "object"}}]
    assert copied.session_state == {}


# -- bad inputs -------------------------------------------------------------------------


def test_bad_fork_points_are_refused_with_the_fix(session, llm, drain, added):
    loop, _ = added
    messages = visible(session, loop.id)
    other = Assistant.start(message="another")
    other_message = visible(session, other.id)[-1]
    loops = session.scalar(select(func.count()).select_from(Loop))

    def refused(match, *args, **kwargs):
        with pytest.raises(InvalidArgumentError, match=match):
            control.fork(solidloop_state(), *args, **kwargs)
        session.rollback()

    refused(r"there is no loop 999999: fork an existing loop", 999999, messages[1].id)
    refused(rf"message {other_message.id} is loop {other.id}'s message, not one of "
            rf"loop {loop.id}'s: fork at a message id", loop.id, other_message.id)
    refused(r"message 999999 is no message, not one of", loop.id, 999999)
    refused(rf"message {messages[5].id} is the assistant's answer: .* fork at user message "
            rf"{messages[1].id} to ask again, or pass message=", loop.id, messages[5].id)
    refused(r"has no user message: fork at the first user message or later", loop.id,
            messages[0].id)
    refused(r"at_message_id must be a message id", loop.id, "7")
    refused(r"message must be a non-empty string", loop.id, messages[1].id, message=" ")
    refused(r"llm api_key cannot be set for one loop", loop.id, messages[1].id,
            llm={"api_key": "sk-secret"})
    refused(r"cannot fork loop .*unknown llm setting\(s\) modle", loop.id, messages[1].id,
            llm={"modle": "x"})
    hidden = Message(loop_id=loop.id, role="assistant", content="", status="failed",
                     is_hidden=True)
    session.add(hidden)
    session.commit()
    refused(rf"message {hidden.id} is a hidden failed shell, not part of loop {loop.id}'s "
            "history: fork at a visible message", loop.id, hidden.id)
    assert session.scalar(select(func.count()).select_from(Loop)) == loops
    # The system message with a message to ask: a fork of the prompt alone.
    fork = control.fork(solidloop_state(), loop.id, messages[0].id, message="add 1 and 1")
    assert [(m.role, m.content) for m in visible(session, fork.id)] == [
        ("system", "You are a test assistant."), ("user", "add 1 and 1")]


def solidloop_state():
    from flask_solidloop.state import get_state

    return get_state()


# -- replay, and a loop's own model -----------------------------------------------------


def test_replay_runs_the_first_question_against_another_model(session, llm, drain, added):
    loop, (first, _) = added
    replayed = control.replay(solidloop_state(), loop.id, model="other-model")
    assert replayed.llm_override == {"model": "other-model"}
    assert replayed.forked_at_message_id == visible(session, loop.id)[1].id
    drain()
    sent = chat_requests(llm)[2:]
    assert [r.json["model"] for r in sent] == ["other-model", "other-model"]
    assert sent[0].json == {**first.json, "model": "other-model"}
    assert loop_of(session, replayed.id).status == "completed"
    # A fork of the replay keeps its model; Agent.fork(model=...) sets another.
    again = Assistant(replayed).fork(visible(session, replayed.id)[1].id)
    third = Assistant(replayed).fork(visible(session, replayed.id)[1].id, model="third")
    assert loop_of(session, again.id).llm_override == {"model": "other-model"}
    assert loop_of(session, third.id).llm_override == {"model": "third"}
    drain()
    assert {r.json["model"] for r in chat_requests(llm)[4:]} == {"other-model", "third"}


def test_replay_of_a_missing_loop_is_refused(session):
    with pytest.raises(InvalidArgumentError, match="there is no loop 424242"):
        control.replay(solidloop_state(), 424242, model="m")
    with pytest.raises(InvalidArgumentError, match="model must be a non-empty model name"):
        control.replay(solidloop_state(), 1, model="")


def test_the_fork_plan_keeps_each_call_with_its_result():
    # (is_call, id, role, ref, answer): calls first, then the visible messages;
    # each row ends with its place (loops/sql.FORK_ROWS' sort_key).
    rows = [(*row, row[1]) for row in [
        (True, 10, None, 3, 4), (True, 11, None, 3, 5), (True, 12, None, 7, None),
        (False, 1, "system", None, None), (False, 2, "user", None, None),
        (False, 3, "assistant", None, None), (False, 4, "tool", 10, None),
        (False, 5, "tool", 11, None), (False, 6, "assistant", None, None),
        (False, 7, "assistant", None, None)]]
    plan = plan_fork
    assert plan(rows, 4, loop_id=1, replace=False).messages == [1, 2, 3, 4, 5]
    assert plan(rows, 3, loop_id=1, replace=False).calls == [10, 11]
    assert plan(rows, 2, loop_id=1, replace=False) == store.ForkPlan([1, 2], [])
    # Message 7 asked for a call with no answer yet: the point moves back before it,
    # to message 6, an answer: refused, naming the user message.
    with pytest.raises(InvalidArgumentError, match="fork at user message 2"):
        plan(rows, 7, loop_id=1, replace=False)
    assert plan(rows, 7, loop_id=1, replace=True) == store.ForkPlan([1], [], replaced=2)


# -- the CLI ----------------------------------------------------------------------------


def test_cli_fork_and_replay_print_the_new_loop(app, session, llm, drain, added):
    loop, (_, next_) = added
    runner = app.test_cli_runner()
    tool_result = visible(session, loop.id)[4]
    result = runner.invoke(args=["solidloop", "fork", str(loop.id), "--at", str(tool_result.id)])
    assert result.exit_code == 0, result.output
    fork_id = int(re.match(r"loop (\d+) queued: a fork of loop", result.output).group(1))
    assert loop_of(session, fork_id).forked_from_loop_id == loop.id
    drain()
    assert chat_requests(llm)[-1].json == next_.json
    status = runner.invoke(args=["solidloop", "status", str(fork_id)])
    assert f"forked from loop {loop.id} at message {tool_result.id}" in status.output

    llm.script("add 7 and 8", {"content": "15."})
    result = runner.invoke(args=["solidloop", "fork", str(loop.id), "--at", str(tool_result.id),
                                 "--message", "add 7 and 8"])
    assert result.exit_code == 0, result.output
    fork_id = int(re.match(r"loop (\d+) queued", result.output).group(1))
    drain()
    assert [m.content for m in visible(session, fork_id)][1:] == ["add 7 and 8", "15."]

    result = runner.invoke(args=["solidloop", "replay", str(loop.id), "--against-model", "m2"])
    assert result.exit_code == 0, result.output
    replay_id = int(re.match(r"loop (\d+) queued: a replay of loop", result.output).group(1))
    assert loop_of(session, replay_id).llm_override == {"model": "m2"}
    status = runner.invoke(args=["solidloop", "status", str(replay_id)])
    assert "llm override: model=m2" in status.output


def test_cli_fork_errors_are_one_line(app, session, added):
    loop, _ = added
    runner = app.test_cli_runner()
    for args, expected in (
            (["fork", "999999", "--at", "1"], "there is no loop 999999"),
            (["fork", str(loop.id), "--at", "999999"], "message 999999 is no message"),
            (["replay", "999999", "--against-model", "m"], "there is no loop 999999")):
        result = runner.invoke(args=["solidloop", *args])
        assert result.exit_code == 1, result.output
        assert result.output.count("\n") == 1 and expected in result.output, result.output
    missing = runner.invoke(args=["solidloop", "fork", str(loop.id)])
    assert missing.exit_code == 2 and "--at" in missing.output


# -- the admin --------------------------------------------------------------------------

SAME = {"Sec-Fetch-Site": "same-origin"}


def mount_admin(app, **kwargs):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True, **kwargs),
                           url_prefix="/admin")
    return app.test_client()


def fork_buttons(page: str) -> list[int]:
    return [int(m) for m in re.findall(r'data-action="fork" data-message="(\d+)"', page)]


def test_the_admin_forks_at_a_message_and_shows_the_origin(app, session, llm, drain, added):
    loop, (_, next_) = added
    messages = visible(session, loop.id)
    client = mount_admin(app)
    page = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    # On each message a fork can start from: the question, the tool phase (the
    # assistant message that asked and each result); not the prompt, not the answer.
    assert fork_buttons(page) == [m.id for m in messages[1:5]]
    assert 'id="forked-from"' not in page
    tool_result = messages[3]
    response = client.post(f"/admin/loops/{loop.id}/messages/{tool_result.id}/fork",
                           headers=SAME)
    assert response.status_code == 303
    fork_id = int(re.search(r"/admin/loops/(\d+)", response.headers["Location"]).group(1))
    fork = loop_of(session, fork_id)
    assert (fork.forked_from_loop_id, fork.forked_at_message_id) == (loop.id, tool_result.id)
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert re.search(rf'forked from <a href="/admin/loops/{loop.id}">#{loop.id}</a> at '
                     rf"message {tool_result.id}", page)
    drain()
    assert chat_requests(llm)[-1].json == next_.json

    # Refused fork points say why; nothing is written.
    loops = session.scalar(select(func.count()).select_from(Loop))
    answer = client.post(f"/admin/loops/{loop.id}/messages/{messages[5].id}/fork",
                         headers=SAME)
    assert answer.status_code == 400
    assert b"is the assistant's answer" in answer.data
    assert client.post(f"/admin/loops/{loop.id}/messages/999999/fork",
                       headers=SAME).status_code == 400
    assert session.scalar(select(func.count()).select_from(Loop)) == loops


def test_the_fork_button_is_csrf_protected_as_the_other_actions(app, session, added):
    loop, _ = added
    app.secret_key = "test-secret"
    client = mount_admin(app, require_token=True)
    user = visible(session, loop.id)[1]
    url = f"/admin/loops/{loop.id}/messages/{user.id}/fork"
    loops = session.scalar(select(func.count()).select_from(Loop))
    assert client.post(url).status_code == 403  # a cross-site post, no fetch metadata
    assert client.post(url, headers=SAME).status_code == 403  # no token
    assert client.post(url, headers=SAME, data={"_csrf": "0" * 64}).status_code == 403
    assert session.scalar(select(func.count()).select_from(Loop)) == loops
    page = client.get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    token = re.search(r'name="_csrf" value="([0-9a-f]+)"', page).group(1)
    assert client.post(url, headers=SAME, data={"_csrf": token}).status_code == 303
    assert session.scalar(select(func.count()).select_from(Loop)) == loops + 1
