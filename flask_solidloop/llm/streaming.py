"""The streaming side of an LLM turn: read SSE, aggregate, and hand text over as it comes.

One attempt of a streamed request: its response is read as server-sent events
and fed to the dialect's aggregator. Sending, the retry loop, the wire record
and the mapping of failures are the send path's (client.py), shared with the
non-streaming request. ``read_timeout`` is the silence allowed between two reads
(httpx applies its read timeout per socket read), not the length of the
response, so a long generation is fine as long as tokens keep coming.

Streams follow the non-streaming retry policy with one more rule: once a piece
of content has been handed to the caller (``on_delta``), the attempt is never
repeated, because the caller already shows or stores it and a second
generation would be glued onto the first. Before that point a broken stream, a
mid-stream error event or a retryable status is retried like any transient
failure; an answer a retry would only repeat (ProviderAnswerError: an unknown
finish reason, a blocked prompt) is not. This module keeps the latch
(``Attempt.handed``); :func:`.client.map_exceptions` applies the rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from ..errors import AbortedError, ProviderAnswerError, TurnLimitError
from .client import Attempt, RetryPolicy, Send, TurnLimits, WireRecord, rate_headers
from .dialect import StreamAggregator, StreamDelta
from .sse import SSEParser
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
    limits: TurnLimits | None = None,
    record: WireRecord | None = None,
    pool_timeout: float | None = None,
) -> tuple[AssistantTurn, WireRecord, dict[str, Any]]:
    """Stream one response; return the assembled turn, the wire record and metrics
    (``ttft_ms`` (absent when no text streamed), ``thinking_ms``, ``duration_ms``,
    ``output_tokens`` (labelled ``output_tokens_estimated`` when the server sent
    no usage), ``output_tokens_per_s`` (see :func:`output_rate`) of the attempt
    that answered; ``record``: as :func:`.client.post_json`'s)."""
    send = Send(url, payload, headers=headers, params=params, read_timeout=read_timeout,
                connect_timeout=connect_timeout, policy=policy, secrets=secrets,
                should_abort=should_abort, client=client,
                retry_after_from_body=retry_after_from_body, stream=True, limits=limits,
                record=record, pool_timeout=pool_timeout)
    turn, metrics = send.run(
        lambda attempt: _stream_attempt(send, attempt, make_aggregator(), on_delta))
    return turn, send.record, metrics


async def post_stream_async(
    url: str, payload: dict[str, Any], *, client: httpx.AsyncClient,
    make_aggregator: Callable[[], StreamAggregator],
    on_delta: Callable[[StreamDelta], None] | None = None, **options: Any,
) -> tuple[AssistantTurn, WireRecord, dict[str, Any]]:
    """:func:`post_stream` on an asyncio loop, through ``client`` (llm/aio.py):
    the same arguments, retry loop, reading and wire record. ``should_abort``
    and ``on_delta`` are called on the loop: neither may block."""
    send = Send(url, payload, params=options.pop("params", None),
                connect_timeout=options.pop("connect_timeout", 10.0), client=client,
                policy=options.pop("policy", None), secrets=options.pop("secrets", None),
                should_abort=options.pop("should_abort", None),
                retry_after_from_body=options.pop("retry_after_from_body", None),
                stream=True, **options)
    turn, metrics = await send.run_async(
        lambda attempt: stream_attempt_async(send, attempt, make_aggregator(), on_delta))
    return turn, send.record, metrics


#: The shortest stretch between the first streamed text and the end of the
#: stream that a token rate is measured over. A shorter one (the whole answer in
#: the last chunk or two) would divide by next to nothing: the rate is then
#: taken over the attempt's whole duration instead, and says so.
MIN_RATE_WINDOW_SECONDS = 0.05


def output_rate(output_tokens: int, duration: float,
                ttft: float | None) -> dict[str, Any]:
    """``ttft_ms`` and ``output_tokens_per_s`` of one streamed attempt.

    ``ttft`` is the time to the first streamed text or reasoning, None when none
    came (an answer that only called tools: its calls stream as no text). The
    rate is counted from the first text to the end; without text, or when that
    stretch is under :data:`MIN_RATE_WINDOW_SECONDS`, it is counted over the
    whole attempt (prompt processing included, so a lower bound) and
    ``output_tokens_per_s_whole_turn`` says so. ``ttft_ms`` is absent without text.
    """
    metrics: dict[str, Any] = {}
    window = None
    if ttft is not None:
        metrics["ttft_ms"] = round(ttft * 1000, 1)
        if duration - ttft >= MIN_RATE_WINDOW_SECONDS:
            window = duration - ttft
    if window is None:
        window = duration
        if output_tokens:
            metrics["output_tokens_per_s_whole_turn"] = True
    metrics["output_tokens_per_s"] = (
        round(output_tokens / window, 1) if output_tokens and window > 0 else 0.0)
    return metrics


def output_chars(turn: AssistantTurn) -> int:
    """Characters of everything the answer produced: text, reasoning, tool calls."""
    return len(turn.content or "") + len(turn.reasoning or "") + sum(
        len(call.name) + len(call.arguments_raw or "") for call in turn.tool_calls)


def estimate_output_tokens(turn: AssistantTurn) -> int:
    """Characters / 4 of everything the answer produced: text, reasoning, tool calls."""
    return (output_chars(turn) + 3) // 4


def _end_at_limit(send: Send, attempt: Attempt, received: int, chars: int,
                  limit: str) -> None:
    """A stream ends at one of its turn's limits: what arrived is summarised on
    the attempt and the record (leaving the response's context closes it, which
    ends the generation and its bill); the caller raises TurnLimitError."""
    attempt.log(error=f"{limit}: ended after {attempt.events} events, {chars} chars",
                events=attempt.events, bytes=received, handed_content=attempt.handed)
    send.record.response_body = {"stream_summary": {
        "events": attempt.events, "bytes": received, "ended_by": limit,
        "output_chars": chars}}
    send.fail(attempt)


def _empty_stream(send: Send, attempt: Attempt, status: int, received: int) -> None:
    """A 2xx stream that closed without a single event: not a broken connection
    but the server declining the request. llama.cpp-based servers answer a
    prompt over their context window this way (the cause is only in their log;
    the same request without streaming gets a 400 naming it). Sending the same
    payload again would get the same nothing, so it is never retried."""
    attempt.log(error=f"empty stream: HTTP {status}, {received} bytes, no events",
                events=0, handed_content=False)
    raise ProviderAnswerError(
        f"HTTP {status} from {send.shown_url} with an empty stream (no events, "
        f"{received} bytes): the server accepted the request and sent nothing. The "
        "prompt may exceed the server's context window; send the same request with "
        "streaming = False to see the server's own error. Not retried: the same "
        "payload gets the same answer"
    )


def _stream_attempt(
    send: Send, attempt: Attempt, aggregator: StreamAggregator,
    on_delta: Callable[[StreamDelta], None] | None,
) -> tuple[AssistantTurn, dict[str, Any]]:
    """One attempt: open the stream, feed every event to ``aggregator``, hand the
    visible text to ``on_delta``; the assembled turn and the attempt's metrics."""
    read = StreamRead(send, attempt, aggregator, on_delta)
    with send.http.stream("POST", send.url, **{"headers": send.headers, **send.body()},
                          params=send.params, timeout=send.attempt_timeout(attempt)
                          ) as response:
        if response.status_code >= 400:
            read.refused(response, response.read())
        read.opened(response)
        for raw in response.iter_bytes():
            read.chunk(raw)
        read.close(response.status_code)
    return read.result()


async def stream_attempt_async(
    send: Send, attempt: Attempt, aggregator: StreamAggregator,
    on_delta: Callable[[StreamDelta], None] | None,
) -> tuple[AssistantTurn, dict[str, Any]]:
    """:func:`_stream_attempt` on an asyncio loop (``send.http`` an
    ``httpx.AsyncClient``): the same reading, fed by ``aiter_bytes``."""
    read = StreamRead(send, attempt, aggregator, on_delta)
    async with send.http.stream("POST", send.url, **{"headers": send.headers, **send.body()},
                                params=send.params, timeout=send.attempt_timeout(attempt)
                                ) as response:
        if response.status_code >= 400:
            read.refused(response, await response.aread())
        read.opened(response)
        async for raw in response.aiter_bytes():
            read.chunk(raw)
        read.close(response.status_code)
    return read.result()


class StreamRead:
    """How one streamed attempt is read, whatever delivers its bytes: the
    events fed to the aggregator, the visible text handed to ``on_delta``
    (the latch), the abort checks, the turn's limits, the summary and the
    metrics. :func:`_stream_attempt` (threads) and
    :func:`stream_attempt_async` (the asyncio loop) feed it alike."""

    def __init__(self, send: Send, attempt: Attempt, aggregator: StreamAggregator,
                 on_delta: Callable[[StreamDelta], None] | None) -> None:
        self.send = send
        self.attempt = attempt
        self.aggregator = aggregator
        self.on_delta = on_delta
        self.first_delta_at: float | None = None
        # Thinking time: from the first reasoning piece to the first answer piece, for
        # every reasoning shape the dialects hand over as StreamDelta.reasoning
        # (reasoning_content / reasoning fields, a leading <think>, Anthropic thinking
        # blocks, Gemini thought parts).
        self.first_reasoning_at: float | None = None
        self.first_answer_at: float | None = None
        self.received = 0
        self.chars = 0
        self.parser = SSEParser()
        self.next_check = 0.0
        self.turn: AssistantTurn | None = None

    def refused(self, response: httpx.Response, body: bytes) -> None:
        """A 4xx/5xx answer: retried or failed (Send.reject always raises)."""
        body_text = body.decode(errors="replace")
        self.attempt.entry["status"] = response.status_code
        self.attempt.log(body=self.send.redact(body_text[:2000]))
        self.send.reject(response, body_text, self.attempt)

    def opened(self, response: httpx.Response) -> None:
        self.attempt.entry["status"] = response.status_code
        self.send.record.status = response.status_code
        self.send.record.rate_headers = rate_headers(response.headers)
        self.next_check = time.monotonic() + ABORT_CHECK_SECONDS

    def chunk(self, raw: bytes) -> None:
        send, attempt, limits = self.send, self.attempt, self.send.limits
        should_abort = send.should_abort
        if should_abort is not None and time.monotonic() >= self.next_check:
            self.next_check = time.monotonic() + ABORT_CHECK_SECONDS
            if should_abort():
                # Closing the response ends the generation (and its bill).
                raise AbortedError("the loop was paused or stopped while streaming")
        self.received += len(raw)
        for event in self.parser.feed(raw):
            attempt.events += 1
            delta = self.aggregator.feed(event)
            if delta:
                now = time.monotonic()
                if self.first_delta_at is None:
                    self.first_delta_at = now
                if delta.reasoning and self.first_reasoning_at is None:
                    self.first_reasoning_at = now
                if delta.content and self.first_answer_at is None:
                    self.first_answer_at = now
                attempt.handed = True  # the latch: from here on, never retried
                self.chars += len(delta.content) + len(delta.reasoning)
                if self.on_delta is not None:
                    self.on_delta(delta)
        if limits.max_output_chars is not None and self.chars > limits.max_output_chars:
            _end_at_limit(send, attempt, self.received, self.chars, "max_output_chars")
            raise TurnLimitError("max_output_chars", limits.length_message(self.chars))
        if send.past_deadline():
            _end_at_limit(send, attempt, self.received, self.chars, "turn_timeout")
            raise TurnLimitError("turn_timeout", limits.timeout_message())

    def close(self, status: int) -> None:
        """The stream ended: the last events, and the answer checked whole."""
        send, attempt, limits = self.send, self.attempt, self.send.limits
        for event in self.parser.close():
            attempt.events += 1
            self.aggregator.feed(event)
        if attempt.events == 0 and not self.aggregator.finished:
            _empty_stream(send, attempt, status, self.received)
        turn = self.turn = self.aggregator.result()
        total = output_chars(turn)  # tool-call arguments stream as no visible text
        if limits.max_output_chars is not None and total > limits.max_output_chars:
            _end_at_limit(send, attempt, self.received, total, "max_output_chars")
            raise TurnLimitError("max_output_chars", limits.length_message(total))

    def result(self) -> tuple[AssistantTurn, dict[str, Any]]:
        """The assembled turn and the attempt's metrics, its summary on record."""
        send, attempt, turn = self.send, self.attempt, self.turn
        assert turn is not None
        duration = time.monotonic() - attempt.started
        output = turn.usage.output_tokens if turn.usage else 0
        estimated = not output
        if estimated:
            # No usage from the server (llama-cpp-python ignores include_usage): the
            # same characters / 4 estimate the turn's usage_estimate uses, labelled.
            output = estimate_output_tokens(turn)
        metrics: dict[str, Any] = {"duration_ms": round(duration * 1000, 1),
                                   "output_tokens": output}
        metrics.update(output_rate(output, duration, self.first_delta_at - attempt.started
                                   if self.first_delta_at is not None else None))
        if estimated:
            metrics["output_tokens_estimated"] = True
        if self.first_reasoning_at is not None:
            # An answer that only called tools after thinking: its thinking ran to the end.
            end = self.first_answer_at if self.first_answer_at is not None \
                else attempt.started + duration
            metrics["thinking_ms"] = round(max(end - self.first_reasoning_at, 0.0) * 1000, 1)
        attempt.entry.update(duration_ms=round(duration * 1000, 1), events=attempt.events,
                             bytes=self.received)
        send.record.response_body = {
            "stream_summary": {
                "events": attempt.events, "bytes": self.received,
                "finish_reason": turn.finish_reason,
                "content_chars": len(turn.content or ""),
                "reasoning_chars": len(turn.reasoning or ""),
                "tool_calls": [c.name for c in turn.tool_calls],
                "usage": turn.usage.to_dict() if turn.usage else None,
            }
        }
        return turn, metrics
