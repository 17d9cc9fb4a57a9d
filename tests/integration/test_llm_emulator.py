"""Tests for flask_solidloop.testing.llm_emulator: real HTTP against a running LLMEmulator."""

from __future__ import annotations

import base64
import datetime as dt
import email.utils
import hashlib
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from flask_solidloop.testing import LLMEmulator

CHAT = "/v1/chat/completions"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {
                "timezone": {"type": "string"},
                "hours_ahead": {"type": "integer"},
                "precise": {"type": "boolean"},
                "factor": {"type": "number"},
                "verbose": {"type": "boolean"},
            },
            "required": ["timezone", "hours_ahead", "precise", "factor"],
        },
    },
}


@pytest.fixture(scope="module")
def emulator() -> Iterator[LLMEmulator]:
    with LLMEmulator() as llm:
        yield llm


@pytest.fixture
def llm(emulator: LLMEmulator) -> Iterator[LLMEmulator]:
    emulator.reset()
    yield emulator
    emulator.reset()


@pytest.fixture
def client(llm: LLMEmulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llm.base_url, timeout=10) as c:
        yield c


def chat(client: httpx.Client, text: str, **extra: Any) -> httpx.Response:
    body = {"model": "test-model", "messages": [{"role": "user", "content": text}], **extra}
    return client.post(CHAT, json=body)


def parse_sse(resp: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """Return (chunks, saw_done) from a text/event-stream response."""
    chunks: list[dict[str, Any]] = []
    done = False
    for event in resp.text.split("\n\n"):
        if not event.strip():
            continue
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        chunks.append(json.loads(data))
    return chunks, done


# --------------------------------------------------------------------------- lifecycle


def test_base_url_is_origin_only(llm: LLMEmulator) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", llm.base_url)


def test_start_stop_and_context_manager() -> None:
    llm = LLMEmulator(offline_model=True)
    assert llm.start() is llm
    url = llm.base_url
    assert chat(httpx.Client(base_url=url), "hi").status_code == 200
    llm.stop()
    llm.stop()  # idempotent
    with pytest.raises(httpx.TransportError):
        httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}, timeout=2)
    with LLMEmulator(offline_model=True) as other:
        assert httpx.post(other.base_url + CHAT, json={
            "messages": [{"role": "user", "content": "x"}]}).status_code == 200


# --------------------------------------------------------------------------- scripted replies


def test_scripted_text_reply(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hello", {"content": "Hi there!"})
    resp = chat(client, "Hello, emulator")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    data = resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert isinstance(data["created"], int)
    assert data["model"] == "test-model"
    choice = data["choices"][0]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hi there!"}
    usage = data["usage"]
    assert usage["prompt_tokens"] >= 1 and usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_reply_usage_reasoning_and_finish_reason_overrides(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script(
        "think",
        {
            "content": "cut off",
            "reasoning_content": "Let me think...",
            "finish_reason": "length",
            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        },
    )
    data = chat(client, "think hard").json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["choices"][0]["message"]["reasoning_content"] == "Let me think..."
    assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_tool_call_reply(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script(
        "weather",
        {
            "content": None,
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Paris"}},
                {"name": "get_time", "arguments": '{"tz": "CET"}', "id": "call_fixed"},
            ],
        },
    )
    data = chat(client, "weather please", tools=[WEATHER_TOOL]).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    first, second = message["tool_calls"]
    assert first["type"] == "function"
    assert first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert isinstance(first["function"]["arguments"], str)
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    assert second["id"] == "call_fixed"
    assert second["function"]["arguments"] == '{"tz": "CET"}'


def test_match_by_str_regex_and_callable(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("PaRiS", {"content": "str matched"})
    llm.script(re.compile(r"\bberlin\b", re.I), {"content": "regex matched"})
    llm.script(lambda req: req.get("temperature") == 0.5, {"content": "callable matched"})
    assert chat(client, "trip to paris").json()["choices"][0]["message"]["content"] == (
        "str matched"
    )
    assert chat(client, "Berlin trip").json()["choices"][0]["message"]["content"] == (
        "regex matched"
    )
    resp = chat(client, "anything", temperature=0.5)
    assert resp.json()["choices"][0]["message"]["content"] == "callable matched"


def test_match_uses_last_message_text_parts_and_tool_results(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("needle", {"content": "found"})
    body: dict[str, Any] = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "needle in an earlier message"},
            {"role": "user", "content": [{"type": "text", "text": "part one"},
                                         {"type": "text", "text": "a NEEDLE part"}]},
        ],
    }
    assert client.post(CHAT, json=body).json()["choices"][0]["message"]["content"] == "found"
    body["messages"].append({"role": "user", "content": "no match here"})
    assert client.post(CHAT, json=body).status_code == 500
    body["messages"].append({"role": "tool", "tool_call_id": "c1", "content": "needle result"})
    assert client.post(CHAT, json=body).status_code == 200


def test_newest_script_first_and_times(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "old"})
    llm.script("hi", {"content": "new"}, times=2)

    def content() -> str:
        return chat(client, "hi").json()["choices"][0]["message"]["content"]

    assert [content(), content(), content(), content()] == ["new", "new", "old", "old"]


def test_callable_reply(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("echo", lambda req: {"content": f"{len(req['messages'])} message(s)"})
    assert chat(client, "echo").json()["choices"][0]["message"]["content"] == "1 message(s)"


def test_script_rejects_unknown_reply_keys(llm: LLMEmulator) -> None:
    with pytest.raises(ValueError, match="contnet"):
        llm.script("x", {"contnet": "typo"})


# --------------------------------------------------------------------------- errors and faults


def test_auth_required_when_api_key_set() -> None:
    with LLMEmulator(api_key="sk-test") as llm, httpx.Client(base_url=llm.base_url) as client:
        llm.script("hi", {"content": "ok"})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = client.post(CHAT, json=body, headers=headers)
            assert resp.status_code == 401
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["code"] == "invalid_api_key"
            assert err["message"]
        resp = client.post(CHAT, json=body, headers={"Authorization": "Bearer sk-test"})
        assert resp.status_code == 200
        assert len(llm.requests) == 3


def test_fail_next_with_retry_after(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "finally"})
    llm.fail_next(429, headers={"Retry-After": "2"}, times=2)
    llm.fail_next(503, body="upstream down")
    for _ in range(2):
        resp = chat(client, "hi")
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    resp = chat(client, "hi")
    assert resp.status_code == 503
    assert resp.text == "upstream down"
    resp = chat(client, "hi")
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == "finally"


def test_fail_next_custom_json_body(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.fail_next(400, body={"error": {"message": "context too long", "type": "x"}})
    resp = chat(client, "hi")
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "context too long"


def test_malformed_json_is_400(llm: LLMEmulator, client: httpx.Client) -> None:
    resp = client.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert llm.last_request().json is None
    assert llm.last_request().body == "{not json"
    resp = client.post(CHAT, json={"model": "m"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages"


def test_unknown_path_is_404_and_wrong_method_405(client: httpx.Client) -> None:
    resp = client.post("/v1/completions", json={})
    assert resp.status_code == 404
    assert "error" in resp.json()
    assert client.get(CHAT).status_code == 405


def test_no_match_500_quotes_last_message(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("something else", {"content": "nope"})
    resp = chat(client, "Where is my order #42?")
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert "no script matched" in err["message"]
    assert '"Where is my order #42?"' in err["message"]
    long_text = "x" * 500
    message = chat(client, long_text).json()["error"]["message"]
    assert "x" * 200 in message and "x" * 201 not in message


def test_failing_callable_reply_gives_500_not_dropped_connection(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    def explode(req: dict[str, Any]) -> dict[str, Any]:
        return {"content": str(1 / 0)}

    llm.script("boom", explode)
    resp = chat(client, "boom")
    assert resp.status_code == 500
    assert "ZeroDivisionError" in resp.json()["error"]["message"]


# --------------------------------------------------------------------------- streaming


def test_streaming_text_and_tool_calls(llm: LLMEmulator, client: httpx.Client) -> None:
    content = "The weather in Paris is sunny and warm today."
    llm.script(
        "stream",
        {
            "content": content,
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}},
            ],
        },
    )
    with client.stream("POST", CHAT, json={
        "model": "test-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "stream it"}],
    }) as resp:
        resp.read()
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks, done = parse_sse(resp)
    assert done
    assert resp.text.endswith("data: [DONE]\n\n")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"

    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"]
    )
    final = chunks[-2]
    assert final["choices"][0]["finish_reason"] == "tool_calls"

    text_deltas = [
        c["choices"][0]["delta"]["content"]
        for c in chunks[:-1]
        if c["choices"][0]["delta"].get("content")
    ]
    assert len(text_deltas) >= 3
    assert "".join(text_deltas) == content

    calls: dict[int, dict[str, str]] = {}
    arg_pieces: dict[int, int] = {}
    for c in chunks[:-1]:
        for tc in c["choices"][0]["delta"].get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in tc:
                assert not slot["id"], "id only on the first delta of a call"
                slot["id"] = tc["id"]
                slot["name"] = tc["function"]["name"]
            fragment = tc["function"].get("arguments", "")
            if fragment:
                arg_pieces[tc["index"]] = arg_pieces.get(tc["index"], 0) + 1
            slot["arguments"] += fragment
    assert sorted(calls) == [0, 1]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["arguments"]) == {"timezone": "Europe/Paris"}
    assert arg_pieces[0] > 1 and arg_pieces[1] > 1


def test_streaming_without_usage_option(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "hello world"})
    resp = chat(client, "hi", stream=True)
    chunks, done = parse_sse(resp)
    assert done
    assert all(c["choices"] for c in chunks)
    assert "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "hello world"


# --------------------------------------------------------------------------- offline model


def test_offline_model_tool_call_then_summary() -> None:
    with LLMEmulator(offline_model=True) as llm, httpx.Client(base_url=llm.base_url) as client:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What's the weather in Paris?"},
        ]
        tools = [TIME_TOOL, WEATHER_TOOL]
        data = client.post(CHAT, json={"model": "m", "messages": messages,
                                       "tools": tools}).json()
        choice = data["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me call get_weather."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

        messages.append(choice["message"])
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21°C in Paris"}
        )
        data = client.post(CHAT, json={"model": "m", "messages": messages,
                                       "tools": tools}).json()
        choice = data["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "get_weather returned: Sunny, 21°C in Paris."


def test_offline_model_argument_types_and_plain_text() -> None:
    with LLMEmulator(offline_model=True) as llm, httpx.Client(base_url=llm.base_url) as client:
        data = client.post(CHAT, json={
            "model": "m",
            "messages": [{"role": "user", "content": "what time is it in tokyo"}],
            "tools": [WEATHER_TOOL, TIME_TOOL],
        }).json()
        (call,) = data["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        assert json.loads(call["function"]["arguments"]) == {
            "timezone": "tokyo", "hours_ahead": 1, "precise": True, "factor": 1.0,
        }
        data = client.post(CHAT, json={
            "model": "m", "messages": [{"role": "user", "content": "Good morning"}],
        }).json()
        assert data["choices"][0]["message"]["content"] == "(offline model) You said: Good morning"
        # scripts still take precedence over the offline model
        llm.script("morning", {"content": "scripted"})
        data = client.post(CHAT, json={
            "model": "m", "messages": [{"role": "user", "content": "Good morning"}],
        }).json()
        assert data["choices"][0]["message"]["content"] == "scripted"


def test_offline_model_streams_too() -> None:
    with LLMEmulator(offline_model=True) as llm, httpx.Client(base_url=llm.base_url) as client:
        resp = client.post(CHAT, json={
            "model": "m", "stream": True,
            "messages": [{"role": "user", "content": "Weather in New York, please"}],
            "tools": [WEATHER_TOOL],
        })
        chunks, done = parse_sse(resp)
        assert done
        args = "".join(
            tc["function"].get("arguments", "")
            for c in chunks
            for tc in c["choices"][0]["delta"].get("tool_calls", [])
        )
        assert json.loads(args) == {"city": "New York"}


# --------------------------------------------------------------------------- recording


def test_requests_are_recorded(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "ok"})
    with pytest.raises(IndexError):
        llm.last_request()
    chat(client, "hi")
    client.post("/nowhere", json={"a": 1}, headers={"X-Trace": "abc"})
    reqs = llm.requests
    assert [(r.method, r.path) for r in reqs] == [("POST", CHAT), ("POST", "/nowhere")]
    first = reqs[0]
    assert first.json["messages"][0]["content"] == "hi"
    assert json.loads(first.body) == first.json
    assert first.headers["content-type"] == "application/json"
    assert "host" in first.headers
    assert all(k == k.lower() for k in first.headers)
    assert llm.last_request().headers["x-trace"] == "abc"
    llm.requests.clear()  # a copy: does not affect the emulator
    assert len(llm.requests) == 2
    llm.reset()
    assert llm.requests == []
    assert chat(client, "hi").status_code == 500  # scripts were cleared too


def test_concurrent_requests_are_all_recorded(llm: LLMEmulator) -> None:
    llm.script("hi", {"content": "ok"}, times=20)
    statuses: list[int] = []

    def worker() -> None:
        with httpx.Client(base_url=llm.base_url) as c:
            for _ in range(5):
                statuses.append(chat(c, "hi").status_code)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(llm.requests) == 30
    assert sorted(statuses).count(200) == 20  # `times` is honoured under concurrency
    assert statuses.count(500) == 10


# =========================================================================== Anthropic

MESSAGES = "/v1/messages"
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
GEMINI_MODEL = "gemini-2.5-flash"
GENERATE = f"/v1beta/models/{GEMINI_MODEL}:generateContent"
STREAM_GENERATE = f"/v1beta/models/{GEMINI_MODEL}:streamGenerateContent"
RICH_REPLY: dict[str, Any] = {
    "content": "The weather in Paris is sunny and warm today.",
    "reasoning_content": "The user wants weather; call the tool.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}},
    ],
}


def anthropic(
    client: httpx.Client, messages: Any, *, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = {"model": "claude-test", "max_tokens": 256, "messages": messages, **extra}
    return client.post(MESSAGES, json=body, headers=ANTHROPIC_HEADERS | (headers or {}))


def gemini(
    client: httpx.Client, contents: Any, *, stream: bool = False, sse: bool = True,
    headers: dict[str, str] | None = None, **extra: Any,
) -> httpx.Response:
    if isinstance(contents, str):
        contents = [{"role": "user", "parts": [{"text": contents}]}]
    path = STREAM_GENERATE + ("?alt=sse" if sse else "") if stream else GENERATE
    return client.post(path, json={"contents": contents, **extra}, headers=headers or {})


def parse_anthropic_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """[(event name, data)] of an Anthropic stream; checks each event's two-line framing."""
    events = []
    for raw in text.split("\n\n"):
        if not raw.strip():
            continue
        name_line, data_line = raw.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), raw
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        events.append((data["type"], data))
    return events


def parse_gemini_sse(text: str) -> list[dict[str, Any]]:
    chunks = []
    for raw in text.split("\n\n"):
        if not raw.strip():
            continue
        assert raw.startswith("data: ") and "\n" not in raw, raw  # no event: lines
        chunks.append(json.loads(raw[len("data: ") :]))
    return chunks


def assemble_anthropic(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client would rebuild from the stream."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    for kind, data in events:
        if kind == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    return [blocks[i] for i in sorted(blocks)]


def test_anthropic_message_with_thinking_text_and_tool_use(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("weather", RICH_REPLY)
    resp = anthropic(client, "What's the weather?", tools=[])
    assert resp.status_code == 200
    data = resp.json()
    assert data["id"].startswith("msg_")
    assert (data["type"], data["role"], data["model"]) == ("message", "assistant", "claude-test")
    thinking, text, call1, call2 = data["content"]
    signature = "sig-" + hashlib.sha256(RICH_REPLY["reasoning_content"].encode()).hexdigest()
    assert thinking == {"type": "thinking", "thinking": RICH_REPLY["reasoning_content"],
                        "signature": signature}
    assert text == {"type": "text", "text": RICH_REPLY["content"]}
    assert call1["type"] == "tool_use" and call1["id"].startswith("toolu_")
    assert (call1["name"], call1["input"]) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert call2["input"] == {"timezone": "Europe/Paris"}
    assert data["stop_reason"] == "tool_use" and data["stop_sequence"] is None
    usage = data["usage"]
    assert usage["input_tokens"] >= 1 and usage["output_tokens"] >= 1
    assert usage["cache_read_input_tokens"] == usage["cache_creation_input_tokens"] == 0


def test_anthropic_end_turn_verbatim_blocks_and_mapped_overrides(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("plain", {"content": "Just text."})
    data = anthropic(client, "plain please").json()
    assert data["content"] == [{"type": "text", "text": "Just text."}]
    assert data["stop_reason"] == "end_turn"
    blocks = [{"type": "redacted_thinking", "data": "opaque=="},
              {"type": "text", "text": "exact", "citations": None}]
    llm.script("verbatim", {"anthropic_blocks": blocks, "finish_reason": "length",
                            "usage": {"prompt_tokens": 7, "output_tokens": 3}})
    data = anthropic(client, "verbatim").json()
    assert data["content"] == blocks
    assert data["stop_reason"] == "max_tokens"
    assert data["usage"]["input_tokens"] == 7 and data["usage"]["output_tokens"] == 3
    events = parse_anthropic_sse(anthropic(client, "verbatim", stream=True).text)
    assert assemble_anthropic(events) == blocks


def test_anthropic_streaming_event_sequence(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("weather", RICH_REPLY)
    resp = anthropic(client, "weather?", stream=True)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = parse_anthropic_sse(resp.text)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "ping" in kinds
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] >= 1
    # each block: start, deltas, stop, in index order
    starts = [d["index"] for k, d in events if k == "content_block_start"]
    stops = [d["index"] for k, d in events if k == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]
    deltas: dict[int, list[dict[str, Any]]] = {}
    for kind, data in events:
        if kind == "content_block_delta":
            deltas.setdefault(data["index"], []).append(data["delta"])
    assert [d["type"] for d in deltas[0]][-1] == "signature_delta"
    assert sum(d["type"] == "signature_delta" for d in deltas[0]) == 1
    assert len([d for d in deltas[0] if d["type"] == "thinking_delta"]) >= 3
    assert len(deltas[1]) >= 3 and {d["type"] for d in deltas[1]} == {"text_delta"}
    json_pieces = [d["partial_json"] for d in deltas[2] if d["partial_json"]]
    assert len(json_pieces) >= 2 and {d["type"] for d in deltas[2]} == {"input_json_delta"}
    blocks = assemble_anthropic(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert blocks[0]["signature"].startswith("sig-")
    assert blocks[1]["text"] == RICH_REPLY["content"]
    assert blocks[2]["input"] == {"city": "Paris", "unit": "celsius"}
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use"
    assert final["usage"]["output_tokens"] >= 1


def test_anthropic_auth_version_and_validation() -> None:
    with LLMEmulator(api_key="sk-ant") as llm, httpx.Client(base_url=llm.base_url) as client:
        llm.script("hi", {"content": "ok"})
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer sk-ant"}):
            resp = anthropic(client, "hi", headers=headers)
            assert resp.status_code == 401
            body = resp.json()
            assert body["type"] == "error"
            assert body["error"]["type"] == "authentication_error" and body["error"]["message"]
        resp = client.post(MESSAGES, headers={"x-api-key": "sk-ant"}, json={
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert "anthropic-version" in resp.json()["error"]["message"]
        resp = client.post(MESSAGES, headers={"x-api-key": "sk-ant", **ANTHROPIC_HEADERS},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"]
        resp = anthropic(client, [], headers={"x-api-key": "sk-ant"})
        assert resp.status_code == 400
        resp = anthropic(client, "hi", headers={"x-api-key": "sk-ant"})
        assert resp.status_code == 200
        recorded = llm.last_request()
        assert recorded.path == MESSAGES
        assert recorded.headers["x-api-key"] == "sk-ant"
        assert recorded.headers["anthropic-version"] == "2023-06-01"
        assert recorded.json["max_tokens"] == 256
        assert client.get(MESSAGES).status_code == 405


def test_anthropic_matches_last_message_blocks_and_tool_results(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("needle", {"content": "found"})
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "needle in an earlier message"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
            {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]},
    ]
    string_result = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a NEEDLE"}]
    list_result = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "nothing"},
        {"type": "tool_result", "tool_use_id": "toolu_2",
         "content": [{"type": "text", "text": "the needle is here"}]},
    ]
    text_blocks = [{"type": "text", "text": "part one"}, {"type": "text", "text": "needle"}]
    for content in (string_result, list_result, text_blocks):
        resp = anthropic(client, [*history, {"role": "user", "content": content}])
        assert resp.json()["content"][0]["text"] == "found", content
    miss = anthropic(client, [*history, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "haystack"}]}])
    assert miss.status_code == 500
    assert miss.json()["type"] == "error"
    assert '"haystack"' in miss.json()["error"]["message"]


# =========================================================================== Gemini


def test_gemini_generate_content(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("weather", RICH_REPLY)
    resp = gemini(client, "weather in Paris?")
    assert resp.status_code == 200
    data = resp.json()
    (candidate,) = data["candidates"]
    assert candidate["finishReason"] == "STOP" and candidate["index"] == 0
    content = candidate["content"]
    assert content["role"] == "model"
    thought, text, call1, call2 = content["parts"]
    assert thought == {"text": RICH_REPLY["reasoning_content"], "thought": True}
    assert text == {"text": RICH_REPLY["content"]}
    assert call1["functionCall"] == {"name": "get_weather",
                                     "args": {"city": "Paris", "unit": "celsius"}}
    assert call1["thoughtSignature"].startswith("c2ln")
    assert base64.b64decode(call1["thoughtSignature"]).startswith(b"sig-")
    assert "thoughtSignature" not in call2  # parallel calls: only the first is signed
    usage = data["usageMetadata"]
    assert usage["totalTokenCount"] == (
        usage["promptTokenCount"] + usage["candidatesTokenCount"] + usage["thoughtsTokenCount"]
    )
    again = gemini(client, "weather in Paris?").json()["candidates"][0]["content"]["parts"]
    assert again[2]["thoughtSignature"] == call1["thoughtSignature"]  # deterministic

    llm.script("plain", {"content": "Just text.", "finish_reason": "length"})
    data = gemini(client, "plain").json()
    (part,) = data["candidates"][0]["content"]["parts"]
    assert part["text"] == "Just text." and part["thoughtSignature"].startswith("c2ln")
    assert data["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_gemini_streaming_sse(llm: LLMEmulator, client: httpx.Client) -> None:
    text = "The weather in Paris is sunny and warm today."
    llm.script("text", {"content": text})
    resp = gemini(client, "text please", stream=True)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in resp.text
    chunks = parse_gemini_sse(resp.text)
    parts = [c["candidates"][0]["content"]["parts"] for c in chunks]
    texts = [p[0]["text"] for p in parts if p[0].get("text")]
    assert len(texts) >= 3 and "".join(texts) == text
    # the signature arrives later, on an empty-text part of the last chunk
    assert parts[-1] == [{"text": "", "thoughtSignature": parts[-1][0]["thoughtSignature"]}]
    assert all("thoughtSignature" not in p[0] for p in parts[:-1])
    reasons = [c["candidates"][0].get("finishReason") for c in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["STOP"]
    totals = [c["usageMetadata"]["candidatesTokenCount"] for c in chunks]
    assert totals == sorted(totals)  # a running total, last one wins
    final = gemini(client, "text please").json()["usageMetadata"]
    assert chunks[-1]["usageMetadata"] == final

    llm.script("calls", RICH_REPLY)
    chunks = parse_gemini_sse(gemini(client, "calls", stream=True).text)
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    calls = [p for p in parts if "functionCall" in p]
    assert [c["functionCall"]["args"] for c in calls] == [  # whole, not split
        {"city": "Paris", "unit": "celsius"}, {"timezone": "Europe/Paris"}]
    assert "thoughtSignature" in calls[0] and "thoughtSignature" not in calls[1]
    assert "".join(p["text"] for p in parts if p.get("thought")) == (
        RICH_REPLY["reasoning_content"])


def test_gemini_stream_without_alt_sse_is_a_json_array(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("hi", {"content": "hello there world"})
    resp = gemini(client, "hi", stream=True, sse=False)
    assert resp.headers["content-type"].startswith("application/json")
    chunks = resp.json()
    assert isinstance(chunks, list) and len(chunks) >= 3
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"


def test_gemini_verbatim_parts(llm: LLMEmulator, client: httpx.Client) -> None:
    parts = [{"text": "a", "thoughtSignature": "Zm9v"}, {"functionCall": {"name": "f",
                                                                         "args": {}}}]
    llm.script("v", {"gemini_parts": parts})
    assert gemini(client, "v").json()["candidates"][0]["content"]["parts"] == parts
    chunks = parse_gemini_sse(gemini(client, "v", stream=True).text)
    assert [p for c in chunks for p in c["candidates"][0]["content"]["parts"]] == parts


def test_gemini_auth() -> None:
    with LLMEmulator(api_key="g-key") as llm, httpx.Client(base_url=llm.base_url) as client:
        llm.script("hi", {"content": "ok"})
        resp = gemini(client, "hi")
        assert resp.status_code == 401
        assert resp.json()["error"]["status"] == "UNAUTHENTICATED"
        assert resp.json()["error"]["code"] == 401
        resp = gemini(client, "hi", headers={"x-goog-api-key": "nope"})
        assert resp.status_code == 403
        assert resp.json()["error"]["status"] == "PERMISSION_DENIED"
        assert gemini(client, "hi", headers={"x-goog-api-key": "g-key"}).status_code == 200
        assert llm.last_request().headers["x-goog-api-key"] == "g-key"
        resp = client.post(GENERATE + "?key=g-key", json={
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
        assert resp.status_code == 200
        assert llm.last_request().query == "key=g-key"
        resp = gemini(client, [], headers={"x-goog-api-key": "g-key"})
        assert resp.status_code == 400
        assert resp.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_gemini_matches_last_content_and_function_response(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("needle", {"content": "found"})
    llm.script(re.compile(r'"temp_c": 21'), {"content": "json matched"})
    history = [
        {"role": "user", "parts": [{"text": "needle earlier"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {}}}]},
    ]
    reply = gemini(client, [*history, {"role": "user", "parts": [
        {"functionResponse": {"name": "get_weather", "response": {"temp_c": 21}}}]}])
    assert reply.json()["candidates"][0]["content"]["parts"][0]["text"] == "json matched"
    reply = gemini(client, [*history, {"role": "user", "parts": [
        {"text": "part one"}, {"text": "the NEEDLE"}]}])
    assert reply.json()["candidates"][0]["content"]["parts"][0]["text"] == "found"
    miss = gemini(client, [*history, {"role": "user", "parts": [{"text": "haystack"}]}])
    assert miss.status_code == 500
    assert miss.json()["error"]["status"] == "INTERNAL"
    assert '"haystack"' in miss.json()["error"]["message"]
    assert llm.requests[0].path == GENERATE


def test_offline_model_speaks_anthropic_and_gemini() -> None:
    with LLMEmulator(offline_model=True) as llm, httpx.Client(base_url=llm.base_url) as client:
        tool = WEATHER_TOOL["function"]
        anthropic_tools = [{"name": tool["name"], "description": tool["description"],
                            "input_schema": tool["parameters"]}]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "What's the weather in Paris?"}]
        data = anthropic(client, messages, tools=anthropic_tools).json()
        assert data["stop_reason"] == "tool_use"
        call = data["content"][-1]
        assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})
        messages += [{"role": "assistant", "content": data["content"]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": call["id"],
                                                   "content": "Sunny, 21°C"}]}]
        data = anthropic(client, messages, tools=anthropic_tools).json()
        assert data["stop_reason"] == "end_turn"
        assert data["content"] == [{"type": "text", "text": "get_weather returned: Sunny, 21°C."}]

        gemini_tools = [{"functionDeclarations": [{
            "name": tool["name"], "description": tool["description"],
            "parameters": {"type": "OBJECT", "properties": {"city": {"type": "STRING"}},
                           "required": ["city"]}}]}]
        contents: list[dict[str, Any]] = [
            {"role": "user", "parts": [{"text": "Weather in New York, please"}]}]
        parts = gemini(client, contents, tools=gemini_tools).json()[
            "candidates"][0]["content"]["parts"]
        (call_part,) = [p for p in parts if "functionCall" in p]
        assert call_part["functionCall"] == {"name": "get_weather",
                                             "args": {"city": "New York"}}
        contents += [{"role": "model", "parts": parts},
                     {"role": "user", "parts": [{"functionResponse": {
                         "name": "get_weather", "response": {"sky": "clear"}}}]}]
        parts = gemini(client, contents, tools=gemini_tools).json()[
            "candidates"][0]["content"]["parts"]
        assert parts[0]["text"] == 'get_weather returned: {"sky": "clear"}.'


# =========================================================================== faults


def openai_stream(client: httpx.Client, text: str = "hi", **extra: Any) -> httpx.Response:
    return chat(client, text, stream=True, stream_options={"include_usage": True}, **extra)


def test_retry_after_delta_seconds(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.fault_next("status", status=429, retry_after=2)
    llm.fault_next("status", status=503, retry_after=1.5)
    llm.fail_next(429, headers={"Retry-After": "7"})
    assert chat(client, "hi").headers["retry-after"] == "2"
    resp = chat(client, "hi")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1.5"
    assert resp.json()["error"]["type"] == "server_error"
    assert chat(client, "hi").headers["retry-after"] == "7"


def test_retry_after_http_date(llm: LLMEmulator, client: httpx.Client) -> None:
    when = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    llm.fault_next("status", status=429, retry_after=when)
    llm.fail_next(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    header = chat(client, "hi").headers["retry-after"]
    assert header == "Wed, 02 Jan 2030 03:04:05 GMT"
    assert email.utils.parsedate_to_datetime(header) == when
    assert chat(client, "hi").headers["retry-after"] == "Wed, 21 Oct 2015 07:28:00 GMT"


def test_retry_after_ms(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.fault_next("status", status=429, retry_after_ms=1500)
    llm.fail_next(529, headers={"retry-after-ms": "250"})
    resp = anthropic(client, "hi")
    assert resp.status_code == 429
    assert resp.headers["retry-after-ms"] == "1500" and "retry-after" not in resp.headers
    assert resp.json()["error"]["type"] == "rate_limit_error"  # dialect-shaped default body
    resp = anthropic(client, "hi")
    assert resp.status_code == 529 and resp.headers["retry-after-ms"] == "250"
    assert resp.json()["error"]["type"] == "overloaded_error"


def test_gemini_retry_info_body(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.fault_next("retry_info", retry_delay="2s")
    llm.fault_next("retry_info", retry_delay=0.5, message="slow down")
    llm.fail_next(429)
    resp = gemini(client, "hi")
    assert resp.status_code == 429
    error = resp.json()["error"]
    assert error["code"] == 429 and error["status"] == "RESOURCE_EXHAUSTED" and error["message"]
    assert error["details"] == [
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2s"}]
    error = gemini(client, "hi").json()["error"]
    assert error["details"][0]["retryDelay"] == "0.5s" and error["message"] == "slow down"
    error = gemini(client, "hi").json()["error"]  # fail_next: Google-shaped default
    assert error["status"] == "RESOURCE_EXHAUSTED" and "details" not in error


def test_faults_apply_in_order_across_dialects(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "ok"})
    llm.fail_next(500, times=2)
    llm.fault_next("no_usage")
    llm.fail_next(401)
    assert chat(client, "hi").status_code == 500
    assert anthropic(client, "hi").status_code == 500
    assert "usageMetadata" not in gemini(client, "hi").json()
    assert chat(client, "hi").status_code == 401
    assert anthropic(client, "hi").status_code == 200
    assert "usage" in chat(client, "hi").json()


def test_fault_next_validates_eagerly(llm: LLMEmulator) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        llm.fault_next("explode")
    with pytest.raises(TypeError, match="secs"):
        llm.fault_next("slow_stream", secs=1)
    with pytest.raises(TypeError, match="status"):
        llm.fault_next("status")
    with pytest.raises(ValueError, match="times"):
        llm.fault_next("no_usage", times=0)
    with pytest.raises(ValueError, match="after"):
        llm.fault_next("disconnect_mid_stream", after=-1)
    assert "slow_prefill" in LLMEmulator.FAULT_KINDS


def test_slow_prefill(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "ok"})
    # A second of silence, twice; then none (well under a second, however loaded).
    llm.fault_next("slow_prefill", seconds=1.0, times=2)
    start = time.perf_counter()
    assert chat(client, "hi").status_code == 200
    assert time.perf_counter() - start >= 0.98
    start = time.perf_counter()
    with client.stream("POST", MESSAGES, headers=ANTHROPIC_HEADERS, json={
        "model": "m", "max_tokens": 5, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}) as resp:
        first_byte = time.perf_counter() - start
        resp.read()
    assert first_byte >= 0.98
    assert parse_anthropic_sse(resp.text)[-1][0] == "message_stop"
    start = time.perf_counter()
    assert chat(client, "hi").status_code == 200
    assert time.perf_counter() - start < 0.9  # consumed


def test_slow_stream_gaps_and_read_timeout(llm: LLMEmulator) -> None:
    llm.script("hi", {"content": "a fairly long answer, split into many chunks"})
    llm.fault_next("slow_stream", seconds=0.06)
    # read_timeout is silence between reads: a 0.25 s timeout survives a longer stream
    with httpx.Client(base_url=llm.base_url, timeout=httpx.Timeout(5, read=0.25)) as client:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        stamps: list[float] = []
        start = time.perf_counter()
        with client.stream("POST", CHAT, json=body) as resp:
            assert "content-length" not in resp.headers
            lines = []
            for line in resp.iter_lines():
                if line:
                    stamps.append(time.perf_counter())
                    lines.append(line)
        total = time.perf_counter() - start
    assert lines[-1] == "data: [DONE]" and len(lines) >= 8
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    assert gaps[len(gaps) // 2] >= 0.04  # the median gap (client-side jitter aside)
    # the server sleeps between events: the last one cannot come earlier than this
    assert stamps[-1] - start >= 0.06 * (len(stamps) - 1) * 0.95
    assert total > 0.25  # longer than read_timeout, yet no ReadTimeout
    llm.fault_next("slow_stream", seconds=0.5)
    with (
        httpx.Client(base_url=llm.base_url, timeout=httpx.Timeout(5, read=0.1)) as client,
        pytest.raises(httpx.ReadTimeout),
        client.stream("POST", CHAT, json=body) as resp,
    ):
        for _ in resp.iter_lines():
            pass


def test_slow_stream_non_streaming_body_trickles(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "ok"})
    llm.fault_next("slow_stream", seconds=0.05)
    start = time.perf_counter()
    data = gemini(client, "hi").json()
    assert time.perf_counter() - start >= 0.14  # 4 pieces, 3 gaps
    assert data["candidates"][0]["content"]["parts"][0]["text"] == "ok"


def read_until_error(resp: httpx.Response) -> tuple[bytes, Exception | None]:
    received = b""
    try:
        for piece in resp.iter_bytes():
            received += piece
    except httpx.TransportError as exc:
        return received, exc
    return received, None


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "gemini"])
def test_disconnect_mid_stream(llm: LLMEmulator, client: httpx.Client, dialect: str) -> None:
    llm.script("hi", RICH_REPLY)
    llm.fault_next("disconnect_mid_stream", after=3)
    if dialect == "openai":
        request = client.build_request("POST", CHAT, json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    elif dialect == "anthropic":
        request = client.build_request("POST", MESSAGES, headers=ANTHROPIC_HEADERS, json={
            "model": "m", "max_tokens": 9, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
    else:
        request = client.build_request("POST", STREAM_GENERATE + "?alt=sse", json={
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
    resp = client.send(request, stream=True)
    assert resp.status_code == 200
    received, error = read_until_error(resp)
    resp.close()
    assert isinstance(error, httpx.RemoteProtocolError)
    text = received.decode()
    assert text.count("data: ") == 3 and text.endswith("\n\n")
    assert "[DONE]" not in text and "message_stop" not in text and "finishReason" not in text
    # the emulator is fine afterwards
    assert chat(client, "hi").status_code == 200


def test_disconnect_torn_event_headers_only_and_non_streaming(
    llm: LLMEmulator, client: httpx.Client
) -> None:
    llm.script("hi", {"content": "hello world, this is a stream"})
    llm.fault_next("disconnect_mid_stream", after=2, torn=True)
    llm.fault_next("disconnect_mid_stream", after=0)
    llm.fault_next("disconnect_mid_stream")
    with client.stream("POST", CHAT, json={"model": "m", "stream": True, "messages": [
            {"role": "user", "content": "hi"}]}) as resp:
        received, error = read_until_error(resp)
    assert isinstance(error, httpx.RemoteProtocolError)
    assert received.decode().count("data: ") == 3 and not received.endswith(b"\n\n")
    with client.stream("POST", CHAT, json={"model": "m", "stream": True, "messages": [
            {"role": "user", "content": "hi"}]}) as resp:
        assert resp.status_code == 200  # headers arrive, then nothing
        received, error = read_until_error(resp)
    assert received == b"" and isinstance(error, httpx.RemoteProtocolError)
    with pytest.raises(httpx.RemoteProtocolError):  # Content-Length promised more
        chat(client, "hi")


def test_error_mid_stream_each_dialect(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", RICH_REPLY)
    llm.fault_next("error_mid_stream", after=2, times=3)
    llm.fault_next("error_mid_stream")
    chunks, done = parse_sse(openai_stream(client))
    assert not done and len(chunks) == 3
    assert chunks[-1]["error"]["type"] == "server_error" and chunks[-1]["error"]["message"]

    events = parse_anthropic_sse(anthropic(client, "hi", stream=True).text)
    assert [k for k, _ in events] == ["message_start", "content_block_start", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error"

    chunks = parse_gemini_sse(gemini(client, "hi", stream=True).text)
    assert len(chunks) == 3 and "candidates" in chunks[0]
    assert chunks[-1]["error"]["code"] == 503 and chunks[-1]["error"]["status"] == "UNAVAILABLE"

    resp = anthropic(client, "hi")  # not streaming: the overload as a status
    assert resp.status_code == 529 and resp.json()["error"]["type"] == "overloaded_error"


def test_malformed_chunk_each_dialect(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "hello world"})
    llm.fault_next("malformed_chunk", times=3)
    llm.fault_next("malformed_chunk", data="not json at all")
    responses = [openai_stream(client), anthropic(client, "hi", stream=True),
                 gemini(client, "hi", stream=True)]
    for resp in responses:
        data_lines = [line[len("data: ") :] for line in resp.text.split("\n")
                      if line.startswith("data: ") and line != "data: [DONE]"]
        bad = []
        for index, data in enumerate(data_lines):
            try:
                json.loads(data)
            except ValueError:
                bad.append(index)
        assert bad == [1], resp.text  # exactly one, after the first event
    assert responses[0].text.endswith("data: [DONE]\n\n")  # the stream then goes on
    assert "event: message_stop" in responses[1].text
    resp = chat(client, "hi")
    assert resp.status_code == 200 and resp.text == "not json at all"
    with pytest.raises(json.JSONDecodeError):
        resp.json()


def test_no_usage_anywhere(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", RICH_REPLY)
    llm.fault_next("no_usage", times=6)
    responses = [openai_stream(client), anthropic(client, "hi", stream=True),
                 gemini(client, "hi", stream=True), chat(client, "hi"),
                 anthropic(client, "hi"), gemini(client, "hi")]
    for resp in responses:
        assert resp.status_code == 200
        assert "usage" not in resp.text.lower().replace("usage_", ""), resp.text
    assert parse_sse(responses[0])[1]  # still a complete stream
    assert "usage" in openai_stream(client).text
