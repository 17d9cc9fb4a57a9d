"""Structured output, each dialect streaming and not, against the strict emulator
(docs/decisions/0036-structured-output.md): a nested pydantic model validated
and kept as the loop's output; an invalid answer sent back with its error and
answered again; retries spent, the loop failed as ``output_invalid``."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import select

from flask_solidloop import Agent, LoopFailedError, Toolset
from flask_solidloop.loops import queries
from flask_solidloop.models import Loop

from ..support.rows import visible
from ..support.support_app import calc, solidloop

CASES = [(d, s) for d in ("openai", "anthropic", "gemini") for s in (False, True)]
IDS = [f"{d}-{'stream' if s else 'plain'}" for d, s in CASES]


class Address(BaseModel):
    city: str
    zip: str | None = None


class Person(BaseModel):
    name: str
    age: int
    addresses: list[Address]


GOOD = {"name": "Ada", "age": 36, "addresses": [{"city": "London", "zip": "N1"},
                                                {"city": "Paris", "zip": None}]}
#: Two faults: a nested field missing, a wrong type.
BAD = {"name": "Ada", "age": "thirty-six", "addresses": [{"zip": "N1"}]}
ERROR_MARK = "does not match the required output schema"


def make_agent(name: str, dialect: str, streaming: bool, base_url: str, *,
               tools: bool = False, retries: int = 2) -> type[Agent]:
    class PersonAgent(Agent):
        system_prompt = "You describe people."
        llm = {"dialect": dialect, "base_url": base_url, "model": "test-model",
               "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}
        output_type = Person

    PersonAgent.streaming = streaming
    PersonAgent.output_retries = retries
    if tools:
        PersonAgent.mcps = [{"name": "calc", "toolset": calc}]
    return solidloop.agent(name)(PersonAgent)


def chats(llm):
    return [r for r in llm.requests if r.method == "POST" and r.json is not None]


def assert_asks_for_output(dialect, body, *, tools=False):
    """The request asks for the schema the dialect's own way."""
    if dialect == "openai":
        spec = body["response_format"]
        assert spec["type"] == "json_schema" and spec["json_schema"]["strict"] is True
        schema = spec["json_schema"]["schema"]
        assert schema["additionalProperties"] is False
        assert schema["$defs"]["Address"]["required"] == ["city", "zip"]
    elif dialect == "anthropic":
        final = next(t for t in body["tools"] if t["name"] == "final_answer")
        assert final["input_schema"]["properties"]["addresses"]["type"] == "array"
        assert body["tool_choice"] == ({"type": "any"} if tools
                                       else {"type": "tool", "name": "final_answer"})
    elif tools:
        names = [d["name"] for d in body["tools"][0]["functionDeclarations"]]
        assert names[0] == "add" and names[-1] == "final_answer"
        assert body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
        assert "responseSchema" not in body.get("generationConfig", {})
    else:
        config = body["generationConfig"]
        assert config["responseMimeType"] == "application/json"
        # Gemini's subset: the nested model inlined, no $defs, no titles.
        assert "$defs" not in json.dumps(config["responseSchema"])
        assert config["responseSchema"]["properties"]["addresses"]["items"]["required"] \
            == ["city"]


def last_user_text(dialect, body):
    if dialect == "openai":
        return body["messages"][-1]["content"]
    if dialect == "anthropic":
        content = body["messages"][-1]["content"]
        return content if isinstance(content, str) else content[-1]["text"]
    return body["contents"][-1]["parts"][-1]["text"]


def test_a_tool_named_like_the_output_tool_fails_the_loop_naming_the_fix(app, session, llm,
                                                                       drain):
    clashing = Toolset("clashing")

    @clashing.tool
    def final_answer(text: str) -> str:
        """Say something final."""
        return text

    agent = make_agent("so_clash", "anthropic", False, llm.base_url)
    agent.mcps = [{"name": "clashing", "toolset": clashing}]
    llm.script("describe ada", {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    failed = session.get(Loop, loop.id)
    assert failed.status == "failed"
    assert "has output_type and a tool named 'final_answer'" in failed.error_message
    assert "rename that tool" in failed.error_message
    assert chats(llm) == []  # nothing was sent
    # Prefixed, the same tool no longer clashes.
    agent.mcps = [{"name": "clashing", "toolset": clashing, "prefix": "mine"}]
    ok = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    assert session.get(Loop, ok.id).status == "completed"


@pytest.mark.parametrize(("dialect", "streaming"), CASES, ids=IDS)
def test_a_nested_model_is_validated_and_kept(app, session, llm, drain, dialect, streaming):
    agent = make_agent(f"so_ok_{dialect}_{streaming}", dialect, streaming, llm.base_url)
    llm.script("describe ada", {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "completed", row.error_message
    assert row.output == GOOD
    assert row.output_schema == Person.model_json_schema()
    person = agent(loop.id).output()
    assert isinstance(person, Person) and isinstance(person.addresses[0], Address)
    assert (person.name, person.addresses[1].city, person.addresses[1].zip) \
        == ("Ada", "Paris", None)
    # The answer is an ordinary assistant message: its text is the JSON.
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant"]
    assert json.loads(history[-1].content) == GOOD
    assert json.loads(agent(loop.id).result()) == GOOD
    if dialect == "anthropic":  # the forced tool's call, lifted into the text
        assert history[-1].meta["output_call"]["call_id"]
    requests = chats(llm)
    assert len(requests) == 1
    assert_asks_for_output(dialect, requests[0].json)


@pytest.mark.parametrize(("dialect", "streaming"), CASES, ids=IDS)
def test_an_invalid_answer_is_sent_back_with_its_error(app, session, llm, drain, dialect,
                                                       streaming):
    agent = make_agent(f"so_retry_{dialect}_{streaming}", dialect, streaming, llm.base_url)
    llm.script("describe ada", {"output": BAD})
    llm.script(ERROR_MARK, {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "completed", row.error_message
    assert row.output == GOOD and row.step_count == 2
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant", "user", "assistant"]
    first, error, second = history[2:]
    # Each attempt is recorded: the invalid answer, its error, the valid one.
    assert json.loads(first.content) == BAD and first.meta["output_error"]
    assert error.meta == {"output_retry": 1}
    assert json.loads(second.content) == GOOD and "output_error" not in second.meta
    # What the model was told, on the wire: where and what.
    requests = chats(llm)
    assert len(requests) == 2
    told = last_user_text(dialect, requests[1].json)
    assert told == error.content
    assert ERROR_MARK in told and "'addresses.0'" in told and "'city'" in told
    assert "'age'" in told and "attempt 2 of 3" in told
    assert_asks_for_output(dialect, requests[1].json)
    # The invalid answer went back as the model's own turn, before the error.
    body = requests[1].json
    if dialect == "openai":
        assert body["messages"][-2] == {"role": "assistant", "content": first.content}
    elif dialect == "anthropic":
        assert body["messages"][-2] == {"role": "assistant",
                                        "content": [{"type": "text", "text": first.content}]}
    else:
        assert body["contents"][-2]["role"] == "model"
        assert body["contents"][-2]["parts"][0]["text"] == first.content


@pytest.mark.parametrize(("dialect", "streaming"), CASES, ids=IDS)
def test_spent_retries_fail_the_loop_as_output_invalid(app, session, llm, drain, dialect,
                                                       streaming):
    agent = make_agent(f"so_fail_{dialect}_{streaming}", dialect, streaming, llm.base_url)
    # Not JSON at all, where the answer is text; through Anthropic's forced tool
    # (whose input is always an object) an object that lacks fields.
    first = {"name": "Ada"} if dialect == "anthropic" else "Ada is 36 and lives in London."
    llm.script("describe ada", {"output": first})
    llm.script(ERROR_MARK, {"output": BAD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed"
    assert queries.classify_failure(row.error_message) == "output_invalid"
    assert "after 3 attempt(s)" in row.error_message and row.output is None
    assert len(chats(llm)) == 3  # the first answer and output_retries (2) more
    history = visible(session, loop.id)
    assert [m.role for m in history] == ["system", "user", "assistant", "user", "assistant",
                                         "user", "assistant"]
    assert ("'age' is a required property" if dialect == "anthropic" else "is not JSON") \
        in history[3].content
    assert [m.meta.get("output_retry") for m in history if m.role == "user"] == [None, 1, 2]
    assert all(m.meta.get("output_error") for m in history if m.role == "assistant")
    with pytest.raises(LoopFailedError, match="OutputInvalidError"):
        agent(loop.id).output()
    # The admin's filter finds it by its class.
    failed = session.scalars(select(Loop).where(
        queries.failure_class_sql() == "output_invalid")).all()
    assert [f.id for f in failed] == [loop.id]


def test_no_retries_fails_at_the_first_invalid_answer(app, session, llm, drain):
    agent = make_agent("so_no_retry", "openai", False, llm.base_url, retries=0)
    llm.script("describe ada", {"output": BAD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed" and "after 1 attempt(s)" in row.error_message
    assert len(chats(llm)) == 1


@pytest.mark.parametrize("streaming", [False, True])
def test_a_refusal_fails_the_loop_at_once_in_its_words(app, session, llm, drain, streaming):
    # Sending the validation error back would ask the same question again.
    agent = make_agent(f"so_refused_{streaming}", "openai", streaming, llm.base_url)
    llm.script("describe ada", {"refusal": "I can't describe real people."})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed" and len(chats(llm)) == 1
    assert queries.classify_failure(row.error_message) == "output_invalid"
    assert row.error_message == ("OutputInvalidError: the model refused to answer in the "
                                 "output schema: I can't describe real people.")


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_an_answer_cut_at_the_token_limit_fails_at_once_naming_max_tokens(
        app, session, llm, drain, dialect):
    agent = make_agent(f"so_cut_{dialect}", dialect, False, llm.base_url)
    cut = {"name": "Ada"} if dialect == "anthropic" else '{"name": "Ada", "ag'
    llm.script("describe ada", {"output": cut, "finish_reason": "length"})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed" and len(chats(llm)) == 1
    assert queries.classify_failure(row.error_message) == "output_invalid"
    assert "cut at the output token limit" in row.error_message
    assert row.error_message.endswith("raise the agent's max_tokens")


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "gemini"])
def test_an_agent_with_tools_calls_them_then_answers(app, session, llm, drain, dialect):
    agent = make_agent(f"so_tools_{dialect}", dialect, False, llm.base_url, tools=True)
    llm.script("describe ada", {"tool_calls": [{"name": "add",
                                                "arguments": {"a": 30, "b": 6}}]})
    llm.script("36", {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "completed", row.error_message
    assert row.output == GOOD
    assert [m.role for m in visible(session, loop.id)] == [
        "system", "user", "assistant", "tool", "assistant"]
    for request in chats(llm):
        assert_asks_for_output(dialect, request.json, tools=True)


def test_a_json_schema_dict_gives_a_dict(app, session, llm, drain):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}

    class Plain(Agent):
        output_type = schema

    Plain.llm = {"dialect": "gemini", "base_url": llm.base_url, "model": "test-model",
                 "api_key_env": "SOLIDLOOP_TEST_API_KEY"}
    agent = solidloop.agent("so_dict")(Plain)
    llm.script("what", {"output": {"answer": 42}})
    loop = agent.start(message="What is the answer?")
    drain()
    assert agent(loop.id).output() == {"answer": 42}
    assert chats(llm)[0].json["generationConfig"]["responseSchema"] == schema


# -- the strict emulator refuses what the real APIs refuse ---------------------------


def post(llm, path, body, headers):
    return httpx.post(llm.base_url + path, json=body, headers=headers, timeout=10)


OPENAI = ("/v1/chat/completions", {"Authorization": "Bearer sk"})
ANTHROPIC = ("/v1/messages", {"x-api-key": "sk", "anthropic-version": "2023-06-01"})
GEMINI = ("/v1beta/models/m:generateContent", {"x-goog-api-key": "sk"})


def test_the_emulator_refuses_a_strict_schema_openai_would(app, llm):
    llm.script("hi", {"output": {"a": 1}})
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = post(llm, *OPENAI[:1], {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": loose, "strict": True}}},
        OPENAI[1])
    assert answer.status_code == 400
    assert "'additionalProperties' is required to be supplied and to be false" \
        in answer.json()["error"]["message"]
    partial = {**loose, "additionalProperties": False,
               "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    answer = post(llm, *OPENAI[:1], {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": partial,
                                               "strict": True}}}, OPENAI[1])
    assert answer.status_code == 400 and "Missing 'b'" in answer.json()["error"]["message"]
    answer = post(llm, *OPENAI[:1], {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad name", "schema": loose}}},
        OPENAI[1])
    assert answer.status_code == 400
    # Not strict, the same schema goes; the scripted output comes back as the text.
    answer = post(llm, *OPENAI[:1], {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": loose}}}, OPENAI[1])
    assert answer.status_code == 200
    assert json.loads(answer.json()["choices"][0]["message"]["content"]) == {"a": 1}


def test_the_emulator_refuses_a_tool_choice_anthropic_would(app, llm):
    llm.script("hi", {"output": {"a": 1}})
    tool = {"name": "final_answer", "input_schema": {"type": "object"}}
    base = {"model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool]}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    answer = post(llm, ANTHROPIC[0], {**base, "thinking": thinking,
                                      "tool_choice": {"type": "tool", "name": "final_answer"}},
                  ANTHROPIC[1])
    assert answer.status_code == 400
    assert "Thinking may not be enabled when tool_choice forces tool use" in answer.text
    answer = post(llm, ANTHROPIC[0], {**base, "tool_choice": {"type": "tool", "name": "nope"}},
                  ANTHROPIC[1])
    assert answer.status_code == 400 and "not found" in answer.text
    answer = post(llm, ANTHROPIC[0], {**base, "tool_choice": {"type": "tool",
                                                              "name": "final_answer"}},
                  ANTHROPIC[1])
    assert answer.status_code == 200
    block = answer.json()["content"][0]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "final_answer",
                                                              {"a": 1})


def test_the_emulator_refuses_a_response_schema_gemini_would(app, llm):
    llm.script("hi", {"output": {"a": 1}})
    base = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    answer = post(llm, GEMINI[0], {**base, "generationConfig": {"responseSchema": schema}},
                  GEMINI[1])
    assert answer.status_code == 400 and "response_mime_type" in answer.text
    answer = post(llm, GEMINI[0], {**base, "generationConfig": {
        "responseMimeType": "application/json",
        "responseSchema": {**schema, "$defs": {}}}}, GEMINI[1])
    assert answer.status_code == 400
    assert 'Unknown name "$defs"' in answer.json()["error"]["message"]
    answer = post(llm, GEMINI[0], {**base, "toolConfig": {
        "functionCallingConfig": {"mode": "ANY"}}}, GEMINI[1])
    assert answer.status_code == 400
    answer = post(llm, GEMINI[0], {**base, "generationConfig": {
        "responseMimeType": "application/json", "responseSchema": schema}}, GEMINI[1])
    assert answer.status_code == 200
    text = answer.json()["candidates"][0]["content"]["parts"][0]["text"]
    assert json.loads(text) == {"a": 1}


# -- status and the admin show the output ----------------------------------------------


def test_status_and_the_admin_show_the_output(app, session, llm, drain):
    agent = make_agent("so_shown", "openai", False, llm.base_url)
    llm.script("describe ada", {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    # Another that never gives a valid answer: failed, with no output.
    llm.script("describe nobody", {"output": BAD})
    llm.script(ERROR_MARK, {"output": BAD})
    waiting = agent.start(message="Describe nobody")
    drain()
    runner = app.test_cli_runner()
    shown = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert shown.exit_code == 0, shown.output
    assert '  output:\n    {\n' in shown.output  # indented JSON under its label
    assert '      "name": "Ada",\n' in shown.output and '"city": "Paris"' in shown.output
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    page = app.test_client().get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    row = re.search(r'<tr id="loop-output">.*?</tr>', page, re.S)
    assert row is not None and "&#34;London&#34;" in row.group(0)
    session.expire_all()
    assert session.get(Loop, waiting.id).status == "failed"
    shown = runner.invoke(args=["solidloop", "status", str(waiting.id)])
    assert "output: none (structured output; no valid answer yet)" in shown.output
    assert "OutputInvalidError" in shown.output


# -- a tool that returns a model declares its outputSchema (the MCP server blueprint) ------

MODERN = "2026-07-28"


class Forecast(BaseModel):
    city: str
    highs: list[int]


forecasts = Toolset("forecasts")


@forecasts.tool
def forecast(city: str) -> Forecast:
    """The week's highs for a city."""
    return Forecast(city=city, highs=[21, 23])


@forecasts.tool
def summary(city: str) -> str:
    """A sentence about a city's week."""
    return f"{city}: warm"


def mcp(client, method, params=None):
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {}}, **(params or {})}}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": "Bearer t",
               "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if params and "name" in params:
        headers["Mcp-Name"] = params["name"]
    answer = client.post("/mcp/forecasts", json=body, headers=headers)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return answer.get_json()["result"]


def test_a_tool_returning_a_model_declares_its_output_schema(app):
    blueprint = solidloop.mcp_blueprint(forecasts, auth=lambda token, request: "a",
                                        allowed_hosts=["localhost"])
    app.register_blueprint(blueprint, url_prefix="/mcp/forecasts")
    client = app.test_client()
    tools = {t["name"]: t for t in mcp(client, "tools/list")["tools"]}
    assert tools["forecast"]["outputSchema"] == Forecast.model_json_schema()
    assert "outputSchema" not in tools["summary"]
    result = mcp(client, "tools/call", {"name": "forecast", "arguments": {"city": "Oslo"}})
    assert result["structuredContent"] == {"city": "Oslo", "highs": [21, 23]}
    assert json.loads(result["content"][0]["text"]) == result["structuredContent"]
    assert result["isError"] is False


def test_start_many_and_create_store_the_schema_too(app, session, llm):
    agent = make_agent("so_many", "openai", False, llm.base_url)
    ids = agent.start_many(["Describe Ada", "Describe Grace"])
    created = agent.create(message="Describe Alan")
    session.expire_all()
    for loop_id in [*ids, created.id]:
        row = session.get(Loop, loop_id)
        assert row.output_schema == Person.model_json_schema() and row.output is None
        # The property order survives storage (json, not jsonb).
        assert list(row.output_schema["properties"]) == ["name", "age", "addresses"]


def test_an_exposed_agents_status_tool_gives_the_output(app, llm, drain):
    agent = make_agent("so_mcp", "openai", False, llm.base_url)
    llm.script("describe ada", {"output": GOOD})
    blueprint = solidloop.mcp_blueprint(forecasts, auth=lambda token, request: "a",
                                        allowed_hosts=["localhost"], agents=[agent])
    app.register_blueprint(blueprint, url_prefix="/mcp/forecasts")
    client = app.test_client()
    started = mcp(client, "tools/call", {"name": "start_so_mcp",
                                         "arguments": {"message": "Describe Ada"}})
    loop_id = started["structuredContent"]["loop_id"]
    drain()
    status = mcp(client, "tools/call", {"name": "status_so_mcp",
                                        "arguments": {"loop_id": loop_id}})
    assert status["structuredContent"]["status"] == "completed"
    assert status["structuredContent"]["output"] == GOOD


def test_a_fork_keeps_the_schema_and_answers_with_its_own_output(app, session, llm, drain):
    """A fork (decision 0039) copies the loop's stored schema, not its output:
    the fork's answer is validated against the schema the original started
    with, and is its own."""
    from flask_solidloop.loops import control
    from flask_solidloop.state import get_state

    agent = make_agent("so_fork", "openai", False, llm.base_url)
    llm.script("describe ada", {"output": GOOD})
    loop = agent.start(message="Describe Ada")
    drain()
    (question,) = [m for m in visible(session, loop.id) if m.role == "user"]
    session.rollback()
    grace = {"name": "Grace", "age": 85, "addresses": [{"city": "New York", "zip": None}]}
    llm.script("describe grace", {"output": grace})
    fork = control.fork(get_state(), loop.id, question.id, message="Describe Grace")
    drain()
    session.expire_all()
    row = session.get(Loop, fork.id)
    assert row.status == "completed", row.error_message
    assert row.output_schema == session.get(Loop, loop.id).output_schema \
        == Person.model_json_schema()
    assert row.output == grace and session.get(Loop, loop.id).output == GOOD
    assert_asks_for_output("openai", chats(llm)[-1].json)
