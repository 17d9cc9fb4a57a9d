"""The one send path (llm/client.py): one retry loop for both entry points, httpx's
exceptions mapped in one place, the wire record on every ProviderError. No DB,
no network: httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from flask_solidloop.errors import (
    ProviderConnectionLostError,
    ProviderError,
    ProviderHTTPError,
    ProviderResponseError,
    ProviderUnavailableError,
    TurnLimitError,
)
from flask_solidloop.llm.client import (
    AbortedError,
    RetryPolicy,
    TurnLimits,
    WireRecord,
    post_json,
    post_json_async,
)
from flask_solidloop.llm.openai import OpenAIAggregator
from flask_solidloop.llm.streaming import post_stream, post_stream_async

URL = "http://llm.test/v1/chat/completions"
SECRET = "sk-test-secret"
POLICY = RetryPolicy(retries=2, base_delay=0.001, max_delay=0.01)
BODY = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
STREAM = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
          b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')


def client(*steps):
    """A client whose n-th request gets ``steps[n]`` (the last one repeats): a
    response, or an exception class to raise."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        step = steps[min(len(calls), len(steps) - 1)]
        calls.append(request)
        if isinstance(step, type):
            raise step("injected", request=request)
        return step

    http = httpx.Client(transport=httpx.MockTransport(handler))
    http.calls = calls  # type: ignore[attr-defined]
    return http


def ok_json() -> httpx.Response:
    return httpx.Response(200, json=BODY)


def ok_stream() -> httpx.Response:
    return httpx.Response(200, content=STREAM, headers={"content-type": "text/event-stream"})


def send_json(http, policy=POLICY, **extra):
    return post_json(URL, {"key": SECRET}, headers={"Authorization": f"Bearer {SECRET}"},
                     read_timeout=5, policy=policy, secrets=[SECRET], client=http, **extra)


def send_stream(http, policy=POLICY, **extra):
    turn, record, _ = post_stream(URL, {"key": SECRET},
                                  headers={"Authorization": f"Bearer {SECRET}"},
                                  read_timeout=5, policy=policy, secrets=[SECRET], client=http,
                                  make_aggregator=OpenAIAggregator, **extra)
    return turn, record


def _on_a_loop(http):
    """The same mock transport, through an httpx.AsyncClient."""
    return httpx.AsyncClient(transport=http._transport)


def send_json_async(http, policy=POLICY, **extra):
    async def go():
        async with _on_a_loop(http) as aclient:
            return await post_json_async(
                URL, {"key": SECRET}, headers={"Authorization": f"Bearer {SECRET}"},
                read_timeout=5, policy=policy, secrets=[SECRET], client=aclient, **extra)
    return asyncio.run(go())


def send_stream_async(http, policy=POLICY, **extra):
    async def go():
        async with _on_a_loop(http) as aclient:
            turn, record, _ = await post_stream_async(
                URL, {"key": SECRET}, headers={"Authorization": f"Bearer {SECRET}"},
                read_timeout=5, policy=policy, secrets=[SECRET], client=aclient,
                make_aggregator=OpenAIAggregator, **extra)
            return turn, record
    return asyncio.run(go())


#: Every entry point: the threads' and the asyncio loop's (async LLM I/O), one
#: retry loop and one failure mapping for all four.
SENDERS = {"json": (send_json, ok_json), "stream": (send_stream, ok_stream),
           "json_async": (send_json_async, ok_json),
           "stream_async": (send_stream_async, ok_stream)}


def test_a_fresh_provider_error_has_no_wire_record():
    assert ProviderError("x").wire is None
    assert ProviderHTTPError(500, "body", URL).wire is None
    record = WireRecord(url=URL, request_headers={}, request_body=None)
    assert ProviderResponseError("x", wire=record).wire is record


@pytest.mark.parametrize("mode", SENDERS)
def test_both_entry_points_share_the_retry_loop(mode):
    send, ok = SENDERS[mode]
    http = client(httpx.ConnectError, httpx.Response(503, text="busy"), ok())
    _, record = send(http)
    assert len(http.calls) == 3
    assert [a.get("status") for a in record.attempts] == [None, 503, 200]
    assert record.attempts[0]["error"].startswith("connect failed")
    assert all("retry_in_s" in a for a in record.attempts[:2])
    assert record.error is None and record.duration_ms is not None
    assert SECRET not in json.dumps(record.to_payload())


@pytest.mark.parametrize("mode", SENDERS)
@pytest.mark.parametrize(("raised", "expected", "requests"), [
    (httpx.ConnectError, ProviderUnavailableError, 3),
    (httpx.ConnectTimeout, ProviderUnavailableError, 3),
    (httpx.ReadTimeout, ProviderError, 1),
    (httpx.WriteTimeout, ProviderError, 1),
    # Nothing was sent: retried, then the provider counts as unavailable.
    (httpx.PoolTimeout, ProviderUnavailableError, 3),
])
def test_httpx_exceptions_are_mapped_once(mode, raised, expected, requests):
    send, _ = SENDERS[mode]
    http = client(raised)
    with pytest.raises(expected) as info:
        send(http)
    assert type(info.value) is expected
    assert isinstance(info.value.__cause__, raised)
    assert len(http.calls) == requests
    assert info.value.wire is not None and info.value.wire.error


@pytest.mark.parametrize("mode", SENDERS)
def test_a_broken_connection_is_repeated_only_on_a_stream_before_content(mode):
    send, ok = SENDERS[mode]
    http = client(httpx.ReadError, ok())
    if mode.startswith("stream"):
        turn, record = send(http)
        assert turn.content == "hi" and len(record.attempts) == 2
        assert record.attempts[0]["handed_content"] is False
    else:
        with pytest.raises(ProviderConnectionLostError,
                           match="not retried at once, as it may have been served"):
            send(http)
        assert len(http.calls) == 1


@pytest.mark.parametrize("mode", SENDERS)
def test_every_provider_error_carries_the_wire_record(mode):
    send, _ = SENDERS[mode]
    with pytest.raises(ProviderHTTPError) as info:
        send(client(httpx.Response(400, text=f"bad key {SECRET}")))
    wire = info.value.wire
    assert isinstance(wire, WireRecord)
    assert wire.status == 400 and SECRET not in json.dumps(wire.to_payload())
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("mode", SENDERS)
def test_an_abort_during_a_retry_wait_carries_the_wire_record(mode):
    send, _ = SENDERS[mode]
    slow = RetryPolicy(retries=2, base_delay=5.0, max_delay=5.0)
    with pytest.raises(AbortedError) as info:
        send(client(httpx.Response(503, text="busy")), policy=slow, should_abort=lambda: True)
    assert info.value.wire is not None
    assert 0.0 <= info.value.wire.attempts[0]["retry_in_s"] <= 5.0  # full jitter
    assert info.value.wire.error is None


@pytest.mark.parametrize("mode", SENDERS)
def test_a_rate_limited_keys_short_wait_is_slept_no_longer_than_the_inline_wait(mode):
    # A 429 whose Retry-After is within defer_after is retried in the thread;
    # the backoff jitter above the server's wait must not keep the thread past
    # defer_after (decision 0022: no thread sleeps longer than the inline wait).
    send, ok = SENDERS[mode]
    http = client(httpx.Response(429, headers={"retry-after-ms": "10"}),
                  httpx.Response(429, headers={"retry-after-ms": "10"}), ok())
    policy = RetryPolicy(retries=2, base_delay=5.0, max_delay=60.0, defer_after=0.05)
    _, record = send(http, policy=policy)
    waits = [a["retry_in_s"] for a in record.attempts[:2]]
    assert all(0.01 <= wait <= 0.05 for wait in waits), waits


@pytest.mark.parametrize("mode", ["stream", "stream_async"])
def test_a_stream_ends_at_the_turns_output_limit(mode):
    send, ok = SENDERS[mode]
    with pytest.raises(TurnLimitError, match="max_output_chars") as info:
        send(client(ok()), limits=TurnLimits(max_output_chars=1))
    assert info.value.wire is not None and "max_output_chars" in info.value.wire.error
    summary = info.value.wire.response_body["stream_summary"]
    assert summary["ended_by"] == "max_output_chars"


@pytest.mark.parametrize("mode", SENDERS)
def test_no_attempt_starts_past_the_turns_deadline(mode):
    send, ok = SENDERS[mode]
    http = client(ok())
    spent = TurnLimits(timeout=1.0, deadline=time.monotonic() - 1)
    with pytest.raises(TurnLimitError, match="turn_timeout") as info:
        send(http, limits=spent)
    assert http.calls == [] and info.value.wire.error == "turn_timeout before the attempt"
