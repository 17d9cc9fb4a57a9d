"""Fault injection: the kinds :meth:`LLMEmulator.fault_next` queues and their options
(:func:`make_fault` checks them), the answers a status fault and a context overflow
give, and :func:`deliver`, which turns every rendered answer into the response
written, shaped by the fault drawn for it, if any: cut short, slowed down, broken
mid-stream or malformed."""

from __future__ import annotations

import datetime as dt
import email.utils
import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import InvalidArgumentError
from .._local_server import Response
from . import anthropic, gemini, openai, openai_responses, registry
from .dialect import dumps, estimate_tokens, json_response
from .types import ANTHROPIC, GEMINI, OPENAI, OPENAI_RESPONSES, Event, Fault, Raw, Rendered

_REQUIRED = object()
#: fault kind -> {option: default}; ``_REQUIRED`` marks options without a default.
FAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "status": {
        "status": _REQUIRED, "body": None, "headers": None,
        "retry_after": None, "retry_after_ms": None,
    },
    "retry_info": {"status": 429, "retry_delay": "2s", "message": None, "headers": None},
    "slow_prefill": {"seconds": 1.0},
    "slow_stream": {"seconds": 0.2},
    "endless_stream": {"seconds": 0.05},
    "held_stream": {"after": 1, "again": None, "seconds": 30.0},
    "disconnect_mid_stream": {"after": None, "torn": False},
    "interrupted_stream": {"after": None},
    "error_mid_stream": {"after": None, "message": None, "body": None},
    "malformed_chunk": {"after": 1, "data": None},
    "no_usage": {},
    "context_overflow": {},
}
STATUS_KINDS = frozenset({"status", "retry_info"})
_MALFORMED_DEFAULT = '{"choices": [{"delta": {"content": "unterminated'


def make_fault(kind: str, times: int, options: dict[str, Any]) -> Fault:
    """The fault ``fault_next(kind, times=times, **options)`` queues: its options
    checked, and completed with their defaults."""
    if kind not in FAULT_OPTIONS:
        raise InvalidArgumentError(
            f"unknown fault kind {kind!r}; known: {', '.join(FAULT_OPTIONS)}")
    if times < 1:
        raise InvalidArgumentError("times must be >= 1")
    allowed = FAULT_OPTIONS[kind]
    unknown = set(options) - set(allowed)
    if unknown:
        raise InvalidArgumentError(
            f"fault {kind!r} got unexpected option(s) {sorted(unknown)}; "
            f"allowed: {sorted(allowed)}"
        )
    merged = {**allowed, **options}
    missing = [name for name, value in merged.items() if value is _REQUIRED]
    if missing:
        raise InvalidArgumentError(f"fault {kind!r} requires option(s) {missing}")
    for name in ("seconds",):
        if name in merged and (not isinstance(merged[name], int | float)
                               or merged[name] < 0):
            raise InvalidArgumentError(f"{name} must be a number >= 0")
    after = merged.get("after")
    if after is not None and (not isinstance(after, int) or after < 0):
        raise InvalidArgumentError("after must be an int >= 0 or None")
    if kind == "status" and not isinstance(merged["status"], int):
        raise InvalidArgumentError("status must be an int")
    return Fault(kind, merged, times)


def _default_fault_body(status: int, dialect: str = OPENAI) -> dict[str, Any]:
    if dialect == ANTHROPIC:
        return anthropic.error_body(
            status, f"Request failed with status {status} (injected by LLMEmulator)."
        )
    if dialect == GEMINI:
        return gemini.error_body(
            status, f"Request failed with status {status} (injected by LLMEmulator)."
        )
    if status == 429:
        return openai.error_body(
            "Rate limit reached (injected by LLMEmulator.fail_next).",
            "requests",
            "rate_limit_exceeded",
        )
    if status == 401:
        return openai.error_body(
            "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
        )
    if status >= 500:
        return openai.error_body(
            "The server had an error while processing your request "
            "(injected by LLMEmulator.fail_next).",
            "server_error",
        )
    return openai.error_body(
        f"Request failed with status {status} (injected by LLMEmulator.fail_next).",
        "invalid_request_error",
    )


def _retry_after_value(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return email.utils.format_datetime(value.astimezone(dt.UTC), usegmt=True)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def status_fault_response(fault: Fault, dialect: str) -> Response:
    opts = fault.options
    headers = dict(opts.get("headers") or {})
    status = int(opts["status"])
    if fault.kind == "retry_info":
        delay = opts["retry_delay"]
        if not isinstance(delay, str):
            delay = f"{_retry_after_value(float(delay))}s"
        return json_response(status, gemini.retry_info_body(status, delay, opts["message"]),
                             headers)
    if opts["retry_after"] is not None:
        headers["Retry-After"] = _retry_after_value(opts["retry_after"])
    if opts["retry_after_ms"] is not None:
        headers["retry-after-ms"] = _retry_after_value(opts["retry_after_ms"])
    body: Any = opts["body"]
    if body is None:
        return json_response(status, _default_fault_body(status, dialect), headers)
    if isinstance(body, dict):
        return json_response(status, body, headers)
    try:
        json.loads(body)
        content_type = "application/json"
    except ValueError:
        content_type = "text/plain; charset=utf-8"
    return Response(status, body.encode("utf-8"), content_type, headers)


def context_overflow(dialect: str, stream: bool, request: dict[str, Any]) -> Response:
    """llama-cpp-python's answer to a prompt over its context window: a streamed
    request gets 200 and an empty stream (the cause is only in the server's log),
    the same request without streaming a 400 naming it."""
    if stream:
        return Response(200, b"", "text/event-stream; charset=utf-8",
                        {"Cache-Control": "no-cache"})
    tokens = estimate_tokens(registry.prompt_text(request, dialect)) + 4096
    return registry.dialect_error(
        dialect, 400, f"Requested tokens ({tokens}) exceed context window of 4096",
        code="context_length_exceeded")


def stream_error_data(dialect: str, opts: dict[str, Any]) -> Any:
    if opts.get("body") is not None:
        return opts["body"]
    message = opts.get("message")
    if dialect == ANTHROPIC:
        return anthropic.error_body(529, message or "Overloaded", "overloaded_error")
    if dialect == GEMINI:
        return gemini.error_body(
            503, message or "The model is overloaded. Please try again later."
        )
    if dialect == OPENAI_RESPONSES:
        return openai_responses.stream_error_data(opts)
    return openai.error_body(
        message or "The server had an error while processing your request "
        "(injected by LLMEmulator).",
        "server_error",
    )


def _frame(events: list[Event], framing: str) -> list[bytes]:
    """Each event's bytes on the wire (plus the closing ``]`` of a JSON-array stream)."""
    pieces: list[str] = []
    for index, event in enumerate(events):
        data = event.data if isinstance(event.data, Raw) else dumps(event.data)
        if framing == "json_array":
            pieces.append(("[" if index == 0 else ",\r\n") + data)
        else:
            pieces.append((f"event: {event.name}\n" if event.name else "") + f"data: {data}\n\n")
    if framing == "json_array":
        pieces.append("]" if events else "[]")
    return [piece.encode("utf-8") for piece in pieces]


def _position(after: int | None, total: int, default: int) -> int:
    return min(total, default if after is None else after)


def deliver(rendered: Rendered, fault: Fault | None, dialect: str,
            hold: Callable[[float], None] | None = None) -> Response:
    """The response for ``rendered``, shaped by a stream fault if one was drawn.
    ``hold(seconds)`` blocks a ``held_stream`` until the test releases it."""
    kind = fault.kind if fault is not None else None
    opts = fault.options if fault is not None else {}
    if rendered.events is None:  # a JSON answer
        body = dumps(rendered.payload).encode("utf-8")
        response = Response(200, body, rendered.content_type, dict(rendered.headers))
        if kind == "disconnect_mid_stream":
            response.pieces, response.abort = [body[: len(body) // 2]], True
        elif kind == "slow_stream":
            size = max(1, -(-len(body) // 4))
            response.pieces = [body[i : i + size] for i in range(0, len(body), size)]
            response.delay = float(opts["seconds"])
        elif kind == "malformed_chunk":
            broken = opts["data"] if opts["data"] is not None else body[: len(body) // 2].decode(
                "utf-8", errors="ignore")
            response.body = broken.encode("utf-8")
        return response

    events = list(rendered.events)
    total = len(events)
    if kind == "error_mid_stream":
        at = _position(opts["after"], total, max(1, min(total - 1, total // 2)))
        name = "error" if dialect in (ANTHROPIC, OPENAI_RESPONSES) else None
        events = [*events[:at], Event(stream_error_data(dialect, opts), name)]
    elif kind == "interrupted_stream":
        # llama-cpp-python with interrupt_requests=True when another request
        # waits: [DONE] straight after the last chunk sent, no finish_reason.
        if dialect != OPENAI:
            raise InvalidArgumentError(
                "fault 'interrupted_stream' is written for the openai dialect")
        at = _position(opts["after"], total, max(1, total // 2))
        kept = [e for e in events[:at]
                if not (isinstance(e.data, dict) and _finishes(e.data))]
        events = [*kept, Event(Raw("[DONE]"))]
    elif kind == "malformed_chunk":
        at = _position(opts["after"], total, 1)
        data = opts["data"] if opts["data"] is not None else _MALFORMED_DEFAULT
        name = "content_block_delta" if dialect == ANTHROPIC else None
        events.insert(at, Event(Raw(data), name))
    pieces = _frame(events, rendered.framing)
    response = Response(200, b"".join(pieces), rendered.content_type, dict(rendered.headers))
    if kind == "disconnect_mid_stream":
        # never the last piece: the terminator ([DONE], message_stop, the final chunk) is lost
        at = min(len(pieces) - 1, _position(opts["after"], total, total // 2))
        sent = pieces[:at]
        if opts["torn"]:
            sent.append(pieces[at][: max(1, len(pieces[at]) // 2)])
        response.pieces, response.abort, response.chunked = sent, True, True
    elif kind == "slow_stream":
        response.pieces, response.delay, response.chunked = pieces, float(opts["seconds"]), True
    elif kind == "endless_stream":
        response.pieces = _endless(events, pieces, rendered.framing, dialect)
        response.delay, response.chunked = float(opts["seconds"]), True
    elif kind == "held_stream":
        stops = sorted({_position(opts["after"], len(pieces) - 1, 1),
                        *([] if opts["again"] is None
                          else [_position(opts["again"], len(pieces) - 1, 1)])})
        response.pieces = _held(pieces, stops, float(opts["seconds"]), hold)
        response.chunked = True
    return response


def _held(pieces: list[bytes], stops: list[int], seconds: float,
          hold: Callable[[float], None] | None) -> Iterator[bytes]:
    """The pieces, stopping before each index of ``stops`` until released (or
    ``seconds`` pass: a test that forgets to release does not hang)."""
    for index, piece in enumerate(pieces):
        if index in stops:
            if hold is not None:
                hold(seconds)
            else:
                time.sleep(seconds)
        yield piece


def _finishes(chunk: dict[str, Any]) -> bool:
    """Whether an OpenAI stream chunk carries a finish_reason (or is the usage chunk
    that follows it)."""
    choices = chunk.get("choices")
    if not choices:
        return "usage" in chunk
    return any(c.get("finish_reason") for c in choices if isinstance(c, dict))


def _endless(events: list[Event], pieces: list[bytes], framing: str,
             dialect: str) -> Iterator[bytes]:
    """A stream that never ends: the answer up to its first text chunk, then that
    chunk again and again until the client hangs up (a runaway generation)."""
    if dialect != OPENAI:
        raise InvalidArgumentError("fault 'endless_stream' is written for the openai dialect")
    for index, event in enumerate(events):
        data = event.data if isinstance(event.data, dict) else {}
        choices = data.get("choices") or [{}]
        if (choices[0].get("delta") or {}).get("content"):
            (again,) = _frame([event], framing)
            return itertools.chain(pieces[:index + 1], itertools.repeat(again))
    raise InvalidArgumentError("fault 'endless_stream' needs an answer with text to repeat")
