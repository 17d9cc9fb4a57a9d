"""The LLM emulator's rate limits, over real HTTP: token buckets that burst and refill,
the charge settled to the real usage, the 429s and headers shaped per dialect.

Timing: every limit here refills slowly enough (or the test waits long enough) that
the outcome does not depend on how fast the machine is; no test asserts that
something happened within a time."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from flask_solidloop.errors import InvalidArgumentError
from flask_solidloop.llm.gemini import retry_after_from_body
from flask_solidloop.testing import LLMEmulator

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
PROMPT = "hello there friend"  # 18 characters: 4 prompt tokens
PROMPT_TOKENS = len(PROMPT) // 4
GO_DURATION = re.compile(r"^(?:\d+ms|(?:\d+h)?(?:\d+m)?\d+(?:\.\d{1,3})?s)$")
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@pytest.fixture
def llm() -> Iterator[LLMEmulator]:
    with LLMEmulator(strict=True) as emulator:
        emulator.script("", "ok")  # 1 completion token
        yield emulator


@pytest.fixture
def client(llm: LLMEmulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llm.base_url, timeout=30) as http:
        yield http


def openai(client: httpx.Client, *, model: str = "gpt-test", stream: bool = False,
           content: str = PROMPT, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    if stream:
        body["stream"] = True
    return client.post(CHAT, json=body)


def anthropic(client: httpx.Client, *, max_tokens: int = 100) -> httpx.Response:
    return client.post(MESSAGES, headers={"anthropic-version": "2023-06-01"}, json={
        "model": "claude-test", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}]})


def gemini(client: httpx.Client, model: str = "gemini-test") -> httpx.Response:
    return client.post(f"/v1beta/models/{model}:generateContent",
                       json={"contents": [{"role": "user", "parts": [{"text": PROMPT}]}]})


def seconds(duration: str) -> float:
    """An OpenAI reset duration (``6m0s``, ``1.5s``, ``20ms``) in seconds."""
    assert GO_DURATION.match(duration), duration
    if duration.endswith("ms"):
        return int(duration[:-2]) / 1000
    found = re.match(r"^(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s$", duration)
    assert found is not None
    hours, minutes, secs = found.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs)


# ---- OpenAI --------------------------------------------------------------------------


def test_openai_burst_then_429_with_headers_and_retry_after(llm, client):
    llm.rate_limit(rpm=3, tpm=1200)  # refills one request every 20 s
    first = openai(client)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-reset-requests"] == "20s"  # one request's refill
    assert first.headers["x-ratelimit-limit-tokens"] == "1200"
    # 5 tokens spent; the bucket refills 20 a second, so it may have some back.
    assert 1200 - PROMPT_TOKENS - 1 <= int(first.headers["x-ratelimit-remaining-tokens"]) <= 1200
    assert GO_DURATION.match(first.headers["x-ratelimit-reset-tokens"])
    assert [openai(client).status_code for _ in range(2)] == [200, 200]

    refused = openai(client)
    assert refused.status_code == 429
    assert refused.json() == {"error": {
        "message": refused.json()["error"]["message"], "type": "requests", "param": None,
        "code": "rate_limit_exceeded"}}
    assert refused.json()["error"]["message"].startswith(
        "Rate limit reached for requests per min (RPM) on gpt-test")
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 40 < seconds(refused.headers["x-ratelimit-reset-requests"]) <= 60
    retry_after = int(refused.headers["retry-after"])
    retry_after_ms = int(refused.headers["retry-after-ms"])
    assert 1 <= retry_after <= 20 and 0 < retry_after_ms <= 20_000
    assert retry_after == -(-retry_after_ms // 1000)  # whole seconds, rounded up
    # The refused request consumed nothing: it is still refused, with no fewer left.
    assert openai(client).headers["x-ratelimit-remaining-requests"] == "0"
    assert llm.rate_limit_stats().count_429 == 2


def test_refill_admits_again_after_the_retry_after(llm, client):
    llm.rate_limit(rpm=60)  # a burst of 60, then one a second
    admitted = 0
    while (response := openai(client)).status_code == 200:
        admitted += 1
    assert admitted >= 60
    assert response.headers["retry-after"] == "1"
    wait_ms = int(response.headers["retry-after-ms"])
    assert 0 < wait_ms <= 1000
    time.sleep(wait_ms / 1000)
    assert openai(client).status_code == 200


def test_tokens_charged_with_max_tokens_then_settled_to_real_usage(llm, client):
    llm.rate_limit(tpm=600)  # 10 tokens a second
    first = openai(client, max_tokens=500)
    assert first.status_code == 200
    usage = first.json()["usage"]
    spent = usage["prompt_tokens"] + usage["completion_tokens"]
    assert spent == PROMPT_TOKENS + 1
    # Charged prompt + 500 on admission; the 499 unused output tokens came back.
    assert int(first.headers["x-ratelimit-remaining-tokens"]) >= 600 - spent
    # Without the refund this one (4 + 500 tokens) would not fit in the 96 left.
    assert openai(client, max_completion_tokens=500).status_code == 200
    assert [tokens for _, tokens in llm.rate_limit_stats().tokens] == [spent, spent]

    # An answer that uses more than its cap is charged the difference: 3 + 400 here.
    llm.script("verbose", {"content": "ok", "usage": {"completion_tokens": 400}})
    assert openai(client, content="verbose please", max_tokens=100).status_code == 200
    assert llm.rate_limit_stats().tokens[-1][1] == 403
    # About 600 - 2 * 5 - 403 = 187 left (plus 10 a second): 4 + 300 does not fit.
    refused = openai(client, max_tokens=300)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "tokens"
    assert "for tokens per min (TPM)" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 12


def test_a_request_larger_than_the_bucket_is_refused_and_consumes_nothing(llm, client):
    llm.rate_limit(rpm=5, tpm=1000)
    refused = openai(client, max_tokens=2000)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert error["message"].startswith("Request too large for tokens per min (TPM)")
    assert "retry-after" not in refused.headers  # no wait would make it fit
    assert refused.headers["x-ratelimit-remaining-requests"] == "5"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "1000"
    assert openai(client, max_tokens=100).status_code == 200


def test_without_limits_no_headers_and_reset_clears_limits(llm, client):
    plain = openai(client)
    assert plain.status_code == 200
    assert not [name for name in plain.headers if "ratelimit" in name]
    llm.rate_limit(rpm=1)
    assert openai(client).status_code == 200
    assert openai(client).status_code == 429
    llm.rate_limit(None)
    assert openai(client).status_code == 200
    llm.rate_limit(rpm=1)
    llm.reset()
    llm.script("", "ok")
    assert [openai(client).status_code for _ in range(3)] == [200, 200, 200]
    assert llm.rate_limit_stats().count_429 == 0  # reset forgets the statistics too


def test_the_limits_are_checked(llm):
    with pytest.raises(InvalidArgumentError):
        llm.rate_limit(rpm=0)
    with pytest.raises(InvalidArgumentError):
        llm.rate_limit(tpm=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        LLMEmulator(rate_limits={"rpd": 10})


def test_rate_limits_given_to_the_constructor():
    with LLMEmulator(rate_limits={"rpm": 2, "tpm": 40_000}) as emulator:
        emulator.script("", "ok")
        with httpx.Client(base_url=emulator.base_url) as http:
            statuses = [openai(http).status_code for _ in range(3)]
            assert statuses == [200, 200, 429]


# ---- per-model limits ----------------------------------------------------------------


def test_a_model_limit_applies_to_that_model_in_addition(llm, client):
    llm.rate_limit(rpm=3)
    llm.rate_limit(rpm=1, model="small")
    assert openai(client, model="small").status_code == 200
    refused = openai(client, model="small")
    assert refused.status_code == 429
    assert "on small" in refused.json()["error"]["message"]
    # The headers report the binding limit: the model's, empty.
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    # The refused request did not consume the emulator's limit: two more fit.
    assert [openai(client, model="big").status_code for _ in range(3)] == [200, 200, 429]
    llm.rate_limit(None, model="small")
    assert llm.rate_limit_stats().count_429 == 2
    assert openai(client, model="small").status_code == 429  # the emulator's limit remains


def test_a_gemini_model_is_named_by_its_path(llm, client):
    llm.rate_limit(rpm=1, model="gemini-small")
    assert gemini(client, "gemini-small").status_code == 200
    assert gemini(client, "gemini-small").status_code == 429
    assert gemini(client, "gemini-other").status_code == 200


# ---- Anthropic and Gemini ------------------------------------------------------------


def test_anthropic_headers_and_429(llm, client):
    llm.rate_limit(rpm=2, tpm=10_000)
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    first = anthropic(client)
    assert first.status_code == 200
    headers = first.headers
    assert headers["anthropic-ratelimit-requests-limit"] == "2"
    assert headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert headers["anthropic-ratelimit-tokens-limit"] == "10000"
    assert int(headers["anthropic-ratelimit-tokens-remaining"]) >= 10_000 - PROMPT_TOKENS - 1
    for name in ("requests", "tokens"):
        reset = headers[f"anthropic-ratelimit-{name}-reset"]
        assert RFC3339.match(reset), reset
        assert dt.datetime.fromisoformat(reset) >= before
    # One request refills in 30 s: the requests bucket is full again about then.
    reset = dt.datetime.fromisoformat(headers["anthropic-ratelimit-requests-reset"])
    assert reset >= before + dt.timedelta(seconds=30)
    assert not [name for name in headers if name.startswith("x-ratelimit")]

    assert anthropic(client).status_code == 200
    refused = anthropic(client)
    assert refused.status_code == 429
    body = refused.json()
    assert body == {"type": "error", "error": {"type": "rate_limit_error",
                                               "message": body["error"]["message"]}}
    assert "rate limit of 2 requests per minute" in body["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert "retry-after-ms" not in refused.headers


def test_anthropic_input_and_output_token_limits(llm, client):
    llm.rate_limit(input_tpm=100, output_tpm=50)
    first = anthropic(client, max_tokens=40)
    assert first.status_code == 200
    headers = first.headers
    assert headers["anthropic-ratelimit-input-tokens-limit"] == "100"
    assert int(headers["anthropic-ratelimit-input-tokens-remaining"]) >= 100 - PROMPT_TOKENS
    assert headers["anthropic-ratelimit-output-tokens-limit"] == "50"
    # 40 output tokens reserved, 1 used: settled to 49 left (it refills from there).
    assert int(headers["anthropic-ratelimit-output-tokens-remaining"]) >= 49
    assert "anthropic-ratelimit-requests-limit" not in headers
    too_large = anthropic(client, max_tokens=60)
    assert too_large.status_code == 429
    assert "50 output tokens per minute" in too_large.json()["error"]["message"]
    assert "retry-after" not in too_large.headers


def test_gemini_429_carries_retry_info_and_no_headers(llm, client):
    llm.rate_limit(rpm=2)
    first = gemini(client)
    assert first.status_code == 200
    assert not [name for name in first.headers if "ratelimit" in name]
    assert gemini(client).status_code == 200
    refused = gemini(client)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == 429 and error["status"] == "RESOURCE_EXHAUSTED"
    (detail,) = error["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.RetryInfo"
    assert re.match(r"^\d+s$", detail["retryDelay"])
    assert 1 <= int(detail["retryDelay"][:-1]) <= 30
    assert retry_after_from_body(refused.json()) == int(detail["retryDelay"][:-1])
    assert not [name for name in refused.headers if "ratelimit" in name or "retry" in name]


# ---- streams, concurrency, statistics ------------------------------------------------


def test_a_stream_settles_when_it_ends(llm, client):
    llm.rate_limit(tpm=1200)  # 20 tokens a second
    llm.fault_next("slow_stream", seconds=0.3)  # 5 events: the end comes 1.2 s later
    body = {"model": "gpt-test", "stream": True, "max_tokens": 1000,
            "messages": [{"role": "user", "content": PROMPT}]}
    with client.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        # The headers went out with the reservation: prompt + 1000 taken.
        assert int(response.headers["x-ratelimit-remaining-tokens"]) < 1200 - 1000 + 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert llm.rate_limit_stats().tokens == []  # not settled mid-stream
        rest = list(lines)
    assert "data: [DONE]" in rest
    (settled,) = llm.rate_limit_stats().tokens
    assert settled[1] == PROMPT_TOKENS + 1
    after = openai(client, max_tokens=1000)  # fits only because the stream gave back 999
    assert after.status_code == 200


def test_an_abandoned_endless_stream_settles_when_the_client_hangs_up(llm, client):
    llm.rate_limit(tpm=1200)
    llm.fault_next("endless_stream", seconds=0.01)
    body = {"model": "gpt-test", "stream": True, "max_tokens": 1000,
            "messages": [{"role": "user", "content": PROMPT}]}
    with client.stream("POST", CHAT, json=body) as response:
        for _ in zip(range(5), response.iter_lines(), strict=False):
            pass
    for _ in range(3000):  # the server notices the hang-up on its next writes
        if llm.rate_limit_stats().tokens:
            break
        time.sleep(0.01)
    (settled,) = llm.rate_limit_stats().tokens
    assert settled[1] > 0


def test_concurrent_requests_never_exceed_the_bucket(llm):
    llm.rate_limit(rpm=10)  # one more every 6 s: none while 20 requests race
    barrier = threading.Barrier(20)
    statuses: list[int] = []
    lock = threading.Lock()

    def call() -> None:
        with httpx.Client(base_url=llm.base_url, timeout=30) as http:
            barrier.wait()
            status = openai(http).status_code
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=call) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [200] * 10 + [429] * 10
    stats = llm.rate_limit_stats()
    assert stats.count_429 == 10 and len(stats.tokens) == 10


def test_stats_for_benches(llm, client):
    start = time.monotonic()
    llm.rate_limit(rpm=2)
    statuses = [openai(client).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    stats = llm.rate_limit_stats()
    assert [status for _, status in stats.requests] == statuses
    times = [at for at, _ in stats.requests]
    assert times == sorted(times) and times[0] >= start
    assert stats.count_429 == 1
    assert stats.count_429_since(start) == 1
    assert stats.count_429_since(times[-1] + 1) == 0
    assert [tokens for _, tokens in stats.tokens] == [PROMPT_TOKENS + 1] * 2
    end = stats.tokens[-1][0] + 0.001
    assert stats.tokens_per_minute(start, end) == pytest.approx(
        2 * (PROMPT_TOKENS + 1) * 60 / (end - start))
    assert len(llm.requests) == 3  # the recorded requests are unchanged


def test_a_refused_request_does_not_draw_a_fault(llm, client):
    llm.rate_limit(rpm=1)
    assert openai(client).status_code == 200
    llm.fail_next(500)
    assert openai(client).status_code == 429
    llm.rate_limit(None)
    assert openai(client).status_code == 500  # the fault waited for an admitted request


def test_an_error_answer_costs_its_request_and_no_tokens(llm, client):
    llm.rate_limit(rpm=5, tpm=1200)
    llm.fail_next(503)
    failed = openai(client, max_tokens=1000)
    assert failed.status_code == 503
    assert failed.headers["x-ratelimit-remaining-requests"] == "4"
    assert int(failed.headers["x-ratelimit-remaining-tokens"]) >= 1199
    assert llm.rate_limit_stats().tokens == []
    assert json.loads(failed.text)["error"]["type"] == "server_error"
