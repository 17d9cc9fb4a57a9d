"""The streaming side of an LLM turn: read SSE, aggregate, retry while it is safe.

One request, read as server-sent events and fed to the dialect's aggregator.
``read_timeout`` is the silence allowed between two reads (httpx applies its
read timeout per socket read), not the length of the response, so a long
generation is fine as long as tokens keep coming.

Retries follow the non-streaming policy (client.py) with one more rule: once a
piece of content has been handed to the caller (``on_delta``), the attempt is
never repeated, because the caller already shows or stores it and a second
generation would be glued onto the first. Before that point a broken stream, a
mid-stream error event or a retryable status is retried like any transient
failure; an answer a retry would only repeat (ProviderAnswerError: an unknown
finish reason, a blocked prompt) is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from ..errors import (
    ProviderAnswerError,
    ProviderError,
    ProviderHTTPError,
    ProviderResponseError,
)
from .client import (
    AbortedError,
    RetryPolicy,
    WireRecord,
    _sleep,
    backoff_delay,
    retry_delay,
    shared_client,
)
from .dialect import StreamAggregator, StreamDelta
from .redact import redact_headers, redact_secrets
from .types import AssistantTurn

#: How often a stream checks whether its loop was paused or stopped meanwhile.
ABORT_CHECK_SECONDS = 1.0


def post_stream(
    url: str,
    payload: dict[str, Any],
    *,
    headers: dict[str, str],
    params: dict[str, str] | None = None,
    read_timeout: float,
    connect_timeout: float = 10.0,
    policy: RetryPolicy | None = None,
    secrets: list[str] | None = None,
    should_abort: Callable[[], bool] | None = None,
    make_aggregator: Callable[[], StreamAggregator],
    on_delta: Callable[[StreamDelta], None] | None = None,
    retry_after_from_body: Callable[[Any], float | None] | None = None,
    client: httpx.Client | None = None,
) -> tuple[AssistantTurn, WireRecord, dict[str, float]]:
    """Stream one response; return the assembled turn, the wire record and metrics
    (``ttft_ms``, ``duration_ms``, ``output_tokens_per_s`` of the attempt that answered)."""
    from .sse import SSEParser

    policy = policy or RetryPolicy()
    secrets = secrets or []
    record = WireRecord(url=url, request_headers=redact_headers(headers),
                        request_body=redact_secrets(payload, secrets))
    timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout,
                            pool=connect_timeout)
    http = client or shared_client()
    started = time.monotonic()
    attempt = 0
    try:
        while True:
            attempt += 1
            attempt_started = time.monotonic()
            entry: dict[str, Any] = {"attempt": attempt, "stream": True}
            record.attempts.append(entry)
            aggregator = make_aggregator()
            handed = False
            first_delta_at: float | None = None
            events = received = 0
            try:
                with http.stream("POST", url, json=payload, headers=headers, params=params,
                                 timeout=timeout) as response:
                    entry["status"] = response.status_code
                    if response.status_code >= 400:
                        body_text = response.read().decode(errors="replace")
                        delay = retry_delay(response, body_text, attempt, policy,
                                            retry_after_from_body)
                        entry.update(body=redact_secrets(body_text[:2000], secrets),
                                     duration_ms=_ms(attempt_started))
                        if delay is not None:
                            entry["retry_in_s"] = delay
                            _sleep(delay, should_abort)
                            continue
                        record.status = response.status_code
                        record.response_body = redact_secrets(body_text[:20000], secrets)
                        raise ProviderHTTPError(response.status_code,
                                                redact_secrets(body_text, secrets), url)
                    record.status = response.status_code
                    parser = SSEParser()
                    next_check = time.monotonic() + ABORT_CHECK_SECONDS
                    for raw in response.iter_bytes():
                        if should_abort is not None and time.monotonic() >= next_check:
                            next_check = time.monotonic() + ABORT_CHECK_SECONDS
                            if should_abort():
                                # Closing the response ends the generation (and its bill).
                                raise AbortedError(
                                    "the loop was paused or stopped while streaming")
                        received += len(raw)
                        for event in parser.feed(raw):
                            events += 1
                            delta = aggregator.feed(event)
                            if delta:
                                if first_delta_at is None:
                                    first_delta_at = time.monotonic()
                                handed = True  # the latch: from here on, never retried
                                if on_delta is not None:
                                    on_delta(delta)
                    for event in parser.close():
                        events += 1
                        aggregator.feed(event)
                    turn = aggregator.result()
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                entry.update(error=f"connect failed: {exc}", duration_ms=_ms(attempt_started))
                if attempt <= policy.retries:
                    delay = backoff_delay(policy, attempt)
                    entry["retry_in_s"] = delay
                    _sleep(delay, should_abort)
                    continue
                record.error = entry["error"]
                raise ProviderError(f"cannot connect to {url}: {exc}") from exc
            except httpx.TimeoutException as exc:
                entry.update(error=f"{type(exc).__name__}: no data for {read_timeout}s",
                             duration_ms=_ms(attempt_started), events=events)
                record.error = entry["error"]
                raise ProviderError(
                    f"{type(exc).__name__}: {url} sent nothing for {read_timeout}s "
                    "(read_timeout is the silence allowed between reads; not retried)"
                ) from exc
            except (httpx.TransportError, ProviderResponseError) as exc:
                # A broken stream, a mid-stream error event, a malformed chunk.
                message = f"{type(exc).__name__}: {exc}"
                entry.update(error=message, duration_ms=_ms(attempt_started), events=events,
                             handed_content=handed)
                repeatable = not isinstance(exc, ProviderAnswerError)
                if repeatable and not handed and attempt <= policy.retries:
                    delay = backoff_delay(policy, attempt)
                    entry["retry_in_s"] = delay
                    _sleep(delay, should_abort)
                    continue
                record.error = message
                if isinstance(exc, ProviderResponseError):
                    raise
                raise ProviderResponseError(
                    f"the stream from {url} broke after {events} events: {exc}"
                ) from exc
            duration = time.monotonic() - attempt_started
            ttft = (first_delta_at - attempt_started) if first_delta_at else duration
            output = turn.usage.output_tokens if turn.usage else 0
            generation = max(duration - ttft, 1e-6)
            metrics = {"ttft_ms": round(ttft * 1000, 1), "duration_ms": round(duration * 1000, 1),
                       "output_tokens_per_s": round(output / generation, 1) if output else 0.0}
            entry.update(duration_ms=round(duration * 1000, 1), events=events, bytes=received)
            record.response_body = {
                "stream_summary": {
                    "events": events, "bytes": received, "finish_reason": turn.finish_reason,
                    "content_chars": len(turn.content or ""),
                    "reasoning_chars": len(turn.reasoning or ""),
                    "tool_calls": [c.name for c in turn.tool_calls],
                    "usage": turn.usage.to_dict() if turn.usage else None,
                }
            }
            return turn, record, metrics
    except ProviderError as exc:
        exc.wire = record  # type: ignore[attr-defined]
        raise
    finally:
        record.duration_ms = (time.monotonic() - started) * 1000


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)
