"""Tests for flask_solidloop.testing.llm_emulator: real HTTP against a running LLMEmulator."""

from __future__ import annotations

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

WEATHER_TOOL = {
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
    body = {
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
    llm.script("boom", lambda req: 1 / 0)
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


def test_sequential_latency_is_low(llm: LLMEmulator, client: httpx.Client) -> None:
    llm.script("hi", {"content": "ok"})
    for _ in range(5):
        chat(client, "hi")
    n = 100
    start = time.perf_counter()
    for _ in range(n):
        assert chat(client, "hi").status_code == 200
    average = (time.perf_counter() - start) / n
    assert average < 0.02, f"{average * 1000:.1f} ms per request"
