"""A scriptable fake LLM provider served over real HTTP on 127.0.0.1, in three dialects.

This module owns :class:`LLMEmulator` and the deterministic built-in "offline model" policy
the demo uses when no API key is configured. Nothing is monkeypatched: clients talk to it
through a socket exactly as they would talk to a real provider, so the whole HTTP client
stack (timeouts, retries, SSE parsing) is exercised. It serves:

* OpenAI chat completions: ``POST /v1/chat/completions`` (``"stream": true`` gives
  ``data:`` chunks ending in ``data: [DONE]``; ``stream_options.include_usage`` adds the
  usage chunk). Auth: ``Authorization: Bearer <api_key>``.
* Anthropic Messages: ``POST /v1/messages``. Auth: ``x-api-key``; ``anthropic-version`` and
  ``max_tokens`` are required, as by the real API. Streams use ``event:`` lines
  (message_start, content_block_start/_delta/_stop, ping, message_delta, message_stop).
* Gemini: ``POST /v1beta/models/{model}:generateContent`` and
  ``:streamGenerateContent?alt=sse`` (``data:`` chunks, no terminator; without ``alt=sse``
  the chunks come as one JSON array). Auth: ``x-goog-api-key`` (or ``?key=``).

Every request is recorded (:attr:`LLMEmulator.requests`). A chat request is resolved in
this order: auth (when ``api_key`` is set), validation, the next queued fault, scripts
(newest first), then the offline model (``offline_model=True``) or a 500 naming the
unmatched last message. Errors are shaped like each provider's.

Scripts match the text of the LAST message: OpenAI ``content`` (string or text parts);
Anthropic text blocks, or a ``tool_result``'s content text; Gemini text parts, or a
``functionResponse``'s ``response`` dumped as JSON. One reply dict drives all dialects::

    with LLMEmulator() as llm:
        llm.script("weather", {"tool_calls": [{"name": "get_weather",
                                               "arguments": {"city": "Paris"}}]})
        llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "Sunny."})
        client = httpx.Client(base_url=llm.base_url + "/v1")
        ...

Reply keys: ``content`` (a text block / text part), ``tool_calls`` (tool_use blocks /
functionCall parts), ``reasoning_content`` (``reasoning_content`` / a thinking block placed
first, signed ``"sig-" + sha256(thinking)`` / a ``"thought": true`` part), ``finish_reason``
(mapped: ``"length"`` is Anthropic ``max_tokens`` and Gemini ``MAX_TOKENS``; native values
pass through), ``usage`` (native keys used verbatim, ``prompt_tokens``/``completion_tokens``
mapped), and, for byte-exact tests, ``anthropic_blocks`` / ``gemini_parts``: a content
list sent verbatim by that dialect (and ignored by the others). Gemini answers carry a
deterministic base64 ``thoughtSignature`` on the first ``functionCall`` part, else on the
first text part; when streaming a text answer it arrives on a later empty-text part
(``{"text": "", "thoughtSignature": ...}``) in the last chunk, as real Gemini sends it.

Faults (:meth:`LLMEmulator.fault_next`, or :meth:`LLMEmulator.fail_next` for a plain
status) are consumed one per chat request, in the order queued, whatever the dialect::

    llm.fault_next("status", status=429, retry_after=2)       # Retry-After: 2
    llm.fault_next("status", status=503, retry_after=datetime_obj, retry_after_ms=1500)
    llm.fault_next("retry_info", retry_delay="2s")            # Gemini RetryInfo 429 body
    llm.fault_next("slow_prefill", seconds=0.5)               # silence before the first byte
    llm.fault_next("slow_stream", seconds=0.2)                # silence between chunks
    llm.fault_next("disconnect_mid_stream", after=3)          # 3 events, then a closed socket
    llm.fault_next("error_mid_stream", after=3)               # the dialect's in-stream error
    llm.fault_next("malformed_chunk", after=1)                # a data line that is not JSON
    llm.fault_next("no_usage", times=2)                       # no usage anywhere
    llm.fault_next("context_overflow")                        # llama.cpp: 200 + empty stream

Strict mode (``LLMEmulator(strict=True)``, on in this project's own tests) refuses what
the real servers refuse, before faults and scripts: OpenAI chat requests outside the keys
of the official SDK's request types, or with a ``content`` that is not a string (``null``
beside ``tool_calls`` is llama-cpp-python's HTTP 500 "Input should be a valid string");
Anthropic Messages outside Anthropic's request schema (unknown keys, block types, a
``tool_use`` input that is not an object, a thinking block without its signature); Gemini
requests outside the REST ``GenerateContentRequest``, with no unknown key in any
``Schema`` (``$defs``, ``$ref``). Each refusal is shaped like the server's own error.

Tool support (``LLMEmulator(tool_support=...)``), for servers whose chat format has no
tools: ``"native"`` (the default); ``"reject"`` answers any request carrying ``tools`` (or
``tool_choice`` / ``toolConfig``) with HTTP 400 "... does not support tools", as Ollama does
for such a model; ``"drop"`` discards those fields before scripts and the offline model see
the request, as llama-cpp-python's chat formats without tool support do (the recorded
request keeps them).

Reply keys for the edge cases: ``refusal`` (OpenAI ``message.refusal`` / ``delta.refusal``;
Anthropic a text block and ``stop_reason: "refusal"``), ``continuation_token`` (Gemini:
the candidate's ``continuationToken``, with ``finish_reason: "CONTINUATION"``).

Stream faults on a non-streaming request: ``disconnect_mid_stream`` sends half the body
(``Content-Length`` promises all of it); ``slow_stream`` trickles the body in pieces;
``malformed_chunk`` sends a truncated JSON body; ``error_mid_stream`` answers the dialect's
overload error status (OpenAI 500, Anthropic 529, Gemini 503); ``no_usage`` drops usage.
"""

# Latency, measured on the development machine (200 sequential non-streaming POSTs through
# one httpx.Client, after warm-up): ~1.8 ms per request on average (streaming: ~1.9 ms);
# raw http.client with a fresh connection per request: ~1.0 ms. werkzeug answers every request
# with "Connection: close", so each POST opens a new connection; Linux ACKs the first segments
# of a fresh connection immediately, so the ~44 ms Nagle + delayed-ACK stall seen with
# keep-alive BaseHTTPRequestHandler servers does not occur (measured: same ~1.8 ms with
# TCP_NODELAY off). We still set TCP_NODELAY on accepted sockets (`_NoDelayRequestHandler`)
# and produce every response body, including a whole SSE stream, as one bytes object written
# in a single write, so the stall cannot come back if the transport changes. Only responses
# shaped by a timing fault (slow_stream, disconnect_mid_stream) are written piece by piece
# (chunked transfer encoding for streams), which is their point.

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as dt
import email.utils
import hashlib
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from werkzeug.serving import BaseWSGIServer

from ._local_server import LocalServer

__all__ = ["LLMEmulator", "RecordedRequest"]

logger = logging.getLogger(__name__)

Match = str | re.Pattern[str] | Callable[[dict[str, Any]], bool]
Reply = dict[str, Any] | str | Callable[[dict[str, Any]], "dict[str, Any] | str"]

CHAT_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"
_GEMINI_PATH = re.compile(
    r"^/(?:v1beta|v1|v1alpha)/models/(?P<model>[^/:]+):(?P<method>generateContent|"
    r"streamGenerateContent)$"
)
OPENAI, ANTHROPIC, GEMINI = "openai", "anthropic", "gemini"

_REPLY_KEYS = frozenset(
    {
        "content",
        "tool_calls",
        "finish_reason",
        "usage",
        "reasoning_content",
        "anthropic_blocks",
        "gemini_parts",
        "refusal",
        "continuation_token",
    }
)
_NO_MATCH_SNIPPET = 200
_TOOL_RESULT_SNIPPET = 500

_STATUS_TEXT = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    402: "Payment Required",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Overloaded",
}

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}

_REQUIRED = object()
#: fault kind -> {option: default}; ``_REQUIRED`` marks options without a default.
_FAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "status": {
        "status": _REQUIRED, "body": None, "headers": None,
        "retry_after": None, "retry_after_ms": None,
    },
    "retry_info": {"status": 429, "retry_delay": "2s", "message": None, "headers": None},
    "slow_prefill": {"seconds": 1.0},
    "slow_stream": {"seconds": 0.2},
    "disconnect_mid_stream": {"after": None, "torn": False},
    "error_mid_stream": {"after": None, "message": None, "body": None},
    "malformed_chunk": {"after": 1, "data": None},
    "no_usage": {},
    "context_overflow": {},
}
_STATUS_KINDS = frozenset({"status", "retry_info"})
_TOOL_SUPPORT = ("native", "reject", "drop")
#: The request fields that carry tool definitions or tool choice, in all three dialects.
_TOOL_FIELDS = ("tools", "tool_choice", "toolConfig", "parallel_tool_calls")
_MALFORMED_DEFAULT = '{"choices": [{"delta": {"content": "unterminated'


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request as the emulator received it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case keys
    json: Any  # parsed body, or None if empty/malformed
    body: str  # raw body, decoded as UTF-8 (invalid bytes replaced)
    query: str = ""  # raw query string, e.g. "alt=sse"


@dataclass
class _Script:
    match: Match
    reply: Reply
    remaining: int | None


@dataclass
class _Fault:
    kind: str
    options: dict[str, Any]
    remaining: int


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # Set only by timing faults: written one piece at a time instead of ``body`` at once.
    pieces: list[bytes] | None = None
    delay: float = 0.0  # seconds of silence between pieces
    abort: bool = False  # close the socket after the last piece
    chunked: bool = False  # no Content-Length (streams); else Content-Length = len(body)


class _Raw(str):
    """Event data written verbatim (``[DONE]``, a malformed chunk) instead of JSON-dumped."""


@dataclass
class _Event:
    data: Any  # JSON-serialisable, or _Raw
    name: str | None = None  # the SSE ``event:`` line (Anthropic)


@dataclass
class _Rendered:
    """A dialect's answer before faults shape its delivery: a JSON payload or events."""

    payload: Any = None
    events: list[_Event] | None = None
    framing: str = "sse"  # "sse" | "json_array" (Gemini stream without alt=sse)
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- server plumbing


def _trickle(response: _Response, sock: socket.socket | None) -> Iterator[bytes]:
    """Write ``response.pieces`` one by one (werkzeug flushes each), then maybe hang up."""
    yield b""  # werkzeug sends the status line and headers on the first write
    for index, piece in enumerate(response.pieces or []):
        if index and response.delay:
            time.sleep(response.delay)
        yield piece
    if response.abort:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # FIN now: no chunked terminator follows
        # werkzeug treats ConnectionError as "client went away" and stays quiet
        raise ConnectionAbortedError("LLMEmulator: injected disconnect_mid_stream")


def _error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _anthropic_error_body(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    error_type = type_ or _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _google_error_body(status: int, message: str, status_name: str | None = None) -> dict[str, Any]:
    name = status_name or _GOOGLE_STATUS.get(status, "UNKNOWN")
    return {"error": {"code": status, "message": message, "status": name}}


def _json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Response:
    body = _dumps(payload).encode("utf-8")
    return _Response(status, body, "application/json", dict(headers or {}))


def _dialect_error(
    dialect: str,
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> _Response:
    """An error response shaped like ``dialect``'s (``type_``: OpenAI/Anthropic type)."""
    if dialect == ANTHROPIC:
        return _json_response(status, _anthropic_error_body(status, message, type_), headers)
    if dialect == GEMINI:
        return _json_response(status, _google_error_body(status, message), headers)
    return _json_response(
        status, _error_body(message, type_ or "invalid_request_error", code, param), headers
    )


def _default_fault_body(status: int, dialect: str = OPENAI) -> dict[str, Any]:
    if dialect == ANTHROPIC:
        return _anthropic_error_body(
            status, f"Request failed with status {status} (injected by LLMEmulator)."
        )
    if dialect == GEMINI:
        return _google_error_body(
            status, f"Request failed with status {status} (injected by LLMEmulator)."
        )
    if status == 429:
        return _error_body(
            "Rate limit reached (injected by LLMEmulator.fail_next).",
            "requests",
            "rate_limit_exceeded",
        )
    if status == 401:
        return _error_body(
            "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
        )
    if status >= 500:
        return _error_body(
            "The server had an error while processing your request "
            "(injected by LLMEmulator.fail_next).",
            "server_error",
        )
    return _error_body(
        f"Request failed with status {status} (injected by LLMEmulator.fail_next).",
        "invalid_request_error",
    )


def _route(path: str) -> tuple[str, str | None, str | None] | None:
    """``(dialect, model from the path, Gemini method)`` for a served path, else None."""
    clean = path.rstrip("/") or "/"
    if clean == CHAT_PATH:
        return OPENAI, None, None
    if clean == ANTHROPIC_PATH:
        return ANTHROPIC, None, None
    found = _GEMINI_PATH.match(clean)
    if found:
        return GEMINI, found["model"], found["method"]
    return None


# --------------------------------------------------------------------------- text helpers


def _content_text(content: Any) -> str:
    """Text of a message ``content``: a string, a list of parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
        return "\n".join(parts)
    return str(content)


def _anthropic_content_text(content: Any) -> str:
    """Text of an Anthropic ``content``: text blocks, and tool_result blocks' content text."""
    if not isinstance(content, list):
        return _content_text(content)
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            if block.get("type") == "tool_result":
                parts.append(_content_text(block.get("content")))
            elif block.get("type", "text") == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
    return "\n".join(parts)


def _gemini_parts_text(parts: Any) -> str:
    """Text of Gemini ``parts``: text parts, and functionResponse ``response`` as JSON."""
    if not isinstance(parts, list):
        return ""
    texts: list[str] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        response = part.get("functionResponse")
        if isinstance(response, dict):
            texts.append(json.dumps(response.get("response"), ensure_ascii=False))
    return "\n".join(texts)


def _last_message_text(request_json: dict[str, Any], dialect: str = OPENAI) -> str:
    key = "contents" if dialect == GEMINI else "messages"
    messages = request_json.get(key)
    if not isinstance(messages, list) or not messages:
        return ""
    last = messages[-1]
    if not isinstance(last, dict):
        return ""
    if dialect == ANTHROPIC:
        return _anthropic_content_text(last.get("content"))
    if dialect == GEMINI:
        return _gemini_parts_text(last.get("parts"))
    return _content_text(last.get("content"))


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _dumps(value: Any) -> str:
    """JSON as servers send it: UTF-8 text, with a lone surrogate (which UTF-8
    cannot hold) written as its ``\\uXXXX`` escape, as JSON.stringify does."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _prompt_text(request_json: dict[str, Any], dialect: str = OPENAI) -> str:
    chunks: list[str] = []
    if dialect == ANTHROPIC:
        chunks.append(_anthropic_content_text(request_json.get("system")))
        for msg in request_json.get("messages") or []:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            chunks.append(_anthropic_content_text(content))
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    chunks.append(str(block.get("name", "")) + _dumps(block.get("input")))
        return "".join(chunks)
    if dialect == GEMINI:
        system = request_json.get("systemInstruction")
        if isinstance(system, dict):
            chunks.append(_gemini_parts_text(system.get("parts")))
        for content in request_json.get("contents") or []:
            if not isinstance(content, dict):
                continue
            chunks.append(_gemini_parts_text(content.get("parts")))
            for part in content.get("parts") or []:
                if isinstance(part, dict) and isinstance(part.get("functionCall"), dict):
                    chunks.append(_dumps(part["functionCall"]))
        return "".join(chunks)
    for msg in request_json.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        chunks.append(_content_text(msg.get("content")))
        for call in msg.get("tool_calls") or []:
            if isinstance(call, dict):
                fn = call.get("function") or {}
                chunks.append(str(fn.get("name", "")))
                chunks.append(str(fn.get("arguments", "")))
    return "".join(chunks)


def _split(text: str, max_piece: int = 8) -> list[str]:
    """Split ``text`` into several small pieces (at least 3 when it has >= 3 chars)."""
    if not text:
        return []
    size = max(1, min(max_piece, -(-len(text) // 3)))
    return [text[i : i + size] for i in range(0, len(text), size)]


# --------------------------------------------------------------------------- offline model

_STOPWORDS = frozenset(
    {
        "a", "an", "the", "and", "or", "but", "if", "of", "to", "in", "on", "at", "for", "from",
        "by", "with", "about", "into", "over", "under", "as", "is", "are", "was", "were", "be",
        "been", "am", "do", "does", "did", "what", "whats", "which", "who", "whom", "whose", "when",
        "where", "why", "how", "s", "t", "it", "its", "this", "that", "these", "those", "there",
        "here", "i", "im", "me", "my", "mine", "we", "us", "our", "you", "your", "yours", "he",
        "she", "they", "them", "their", "his", "her", "please", "can", "could", "would", "should",
        "will", "shall", "may", "might", "must", "tell", "give", "show", "let", "lets", "some",
        "any", "much", "many", "very", "just", "also", "than", "then", "so", "not", "no", "yes",
        "hi", "hello", "hey", "thanks", "thank", "today", "now", "currently", "current",
    }
)
_SENTENCE_END = (".", "!", "?", ":", ";")
_PUNCT = "\"'`\u201c\u201d\u2018()[]{}<>,.!?:;*_"


def _words(text: str) -> set[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", text)  # camelCase -> camel Case
    out: set[str] = set()
    for w in re.findall(r"[a-z0-9]+", spaced.lower()):
        if w in _STOPWORDS:
            continue
        if len(w) > 3 and w.endswith("s"):
            w = w[:-1]
        out.add(w)
    return out


def _tool_function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        return {}
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


def _clean_word(raw: str) -> str:
    word = raw.replace("\u2019", "'").strip(_PUNCT + "-")
    if word.endswith("'s"):
        word = word[:-2]
    return word


def _capitalised_phrases(text: str) -> list[str]:
    """Capitalised words/phrases ("Paris", "New York") that do not start a sentence."""
    phrases: list[str] = []
    current: list[str] = []
    sentence_start = True
    for raw in text.split():
        word = _clean_word(raw)
        is_candidate = (
            bool(word)
            and word[0].isupper()
            and not sentence_start
            and word.lower().replace("'", "") not in _STOPWORDS
        )
        if is_candidate:
            current.append(word)
        elif current:
            phrases.append(" ".join(current))
            current = []
        ends = raw.rstrip("\"')]}\u201d\u2019").endswith(_SENTENCE_END)
        if is_candidate and (ends or raw.rstrip().endswith(",")) and current:
            phrases.append(" ".join(current))
            current = []
        sentence_start = ends
    if current:
        phrases.append(" ".join(current))
    return phrases


def _last_word(text: str) -> str:
    for raw in reversed(text.split()):
        word = _clean_word(raw)
        if word:
            return word
    return text.strip()


def _schema_type(schema: dict[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t.lower() if isinstance(t, str) else None  # Gemini writes "STRING"


def _offline_arguments(parameters: Any, user_text: str) -> dict[str, Any]:
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties") or {}
    required = parameters.get("required") or []
    candidates = _capitalised_phrases(user_text)
    lowered = user_text.lower()
    args: dict[str, Any] = {}
    for name in required:
        schema = props.get(name) if isinstance(props, dict) else None
        schema = schema if isinstance(schema, dict) else {}
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            args[name] = next((v for v in enum if str(v).lower() in lowered), enum[0])
            continue
        type_ = _schema_type(schema)
        if type_ == "integer":
            args[name] = 1
        elif type_ == "number":
            args[name] = 1.0
        elif type_ == "boolean":
            args[name] = True
        elif type_ == "array":
            args[name] = []
        elif type_ == "object":
            args[name] = {}
        else:  # string, or untyped
            args[name] = candidates.pop(0) if candidates else _last_word(user_text)
    return args


def _offline_reply(request_json: dict[str, Any]) -> dict[str, Any]:
    """The deterministic built-in "offline model" policy (see module docstring)."""
    messages = [m for m in request_json.get("messages") or [] if isinstance(m, dict)]
    last = messages[-1] if messages else {}
    role = last.get("role")
    text = _content_text(last.get("content"))
    tools = [t for t in request_json.get("tools") or [] if _tool_function(t).get("name")]

    if role == "user" and tools:
        user_words = _words(text)
        best_fn: dict[str, Any] = _tool_function(tools[0])
        best_score = -1
        for tool in tools:
            fn = _tool_function(tool)
            score = len(user_words & _words(f"{fn['name']} {fn.get('description') or ''}"))
            if score > best_score:
                best_fn, best_score = fn, score
        name = best_fn["name"]
        return {
            "content": f"Let me call {name}.",
            "tool_calls": [
                {"name": name, "arguments": _offline_arguments(best_fn.get("parameters"), text)}
            ],
        }

    if role == "tool":
        # the current turn's tool results are the trailing run of tool messages
        start = len(messages)
        while start > 0 and messages[start - 1].get("role") == "tool":
            start -= 1
        names: dict[str, str] = {}
        for msg in reversed(messages[:start]):
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                for call in msg["tool_calls"]:
                    if isinstance(call, dict):
                        fn = call.get("function") or {}
                        names[str(call.get("id"))] = str(fn.get("name") or "tool")
                break
        sentences: list[str] = []
        for msg in messages[start:]:
            name = names.get(str(msg.get("tool_call_id"))) or msg.get("name") or "tool"
            result = _content_text(msg.get("content")).strip()
            if len(result) > _TOOL_RESULT_SNIPPET:
                result = result[:_TOOL_RESULT_SNIPPET] + "…"
            if not result.endswith((".", "!", "?", "…")):
                result += "."
            sentences.append(f"{name} returned: {result}")
        return {"content": " ".join(sentences), "finish_reason": "stop"}

    return {"content": f"(offline model) You said: {text}"}


def _openai_view(request_json: dict[str, Any], dialect: str) -> dict[str, Any]:
    """An Anthropic or Gemini request as OpenAI ``messages``/``tools`` (for the offline model).

    Tool results become ``tool`` messages placed after any text of the same turn, so the
    offline model summarises them rather than calling a tool again.
    """
    if dialect == OPENAI:
        return request_json
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if dialect == ANTHROPIC:
        for tool in request_json.get("tools") or []:
            if isinstance(tool, dict) and tool.get("name"):
                tools.append({"type": "function", "function": {
                    "name": tool["name"], "description": tool.get("description") or "",
                    "parameters": tool.get("input_schema") or {}}})
        for msg in request_json.get("messages") or []:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            blocks = content if isinstance(content, list) else []
            text = "\n".join(
                b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"
            ) if blocks else _content_text(content)
            if msg.get("role") == "assistant":
                calls = [
                    {"id": b.get("id"), "type": "function", "function": {
                        "name": b.get("name"), "arguments": _dumps(b.get("input") or {})}}
                    for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"
                ]
                messages.append({"role": "assistant", "content": text, "tool_calls": calls})
                continue
            results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            if text or not results:
                messages.append({"role": "user", "content": text})
            for block in results:
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": _content_text(block.get("content"))})
        return {"messages": messages, "tools": tools}
    for entry in request_json.get("tools") or []:
        for decl in (entry.get("functionDeclarations") or []) if isinstance(entry, dict) else []:
            if isinstance(decl, dict) and decl.get("name"):
                params = decl.get("parameters") or decl.get("parametersJsonSchema") or {}
                tools.append({"type": "function", "function": {
                    "name": decl["name"], "description": decl.get("description") or "",
                    "parameters": params}})
    for content in request_json.get("contents") or []:
        if not isinstance(content, dict):
            continue
        parts = [p for p in content.get("parts") or [] if isinstance(p, dict)]
        text = "\n".join(
            p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought")
        )
        if content.get("role") == "model":
            calls = [
                {"id": p["functionCall"].get("id") or f"_call_{i}", "type": "function",
                 "function": {"name": p["functionCall"].get("name"),
                              "arguments": _dumps(p["functionCall"].get("args") or {})}}
                for i, p in enumerate(parts) if isinstance(p.get("functionCall"), dict)
            ]
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
            continue
        results = [p["functionResponse"] for p in parts
                   if isinstance(p.get("functionResponse"), dict)]
        if text or not results:
            messages.append({"role": "user", "content": text})
        for i, result in enumerate(results):
            messages.append({"role": "tool", "name": result.get("name"),
                             "tool_call_id": result.get("id") or f"_result_{i}",
                             "content": _dumps(result.get("response"))})
    return {"messages": messages, "tools": tools}


# --------------------------------------------------------------------------- emulator


class LLMEmulator(LocalServer[RecordedRequest]):
    """A scriptable fake of the OpenAI, Anthropic and Gemini chat APIs on a real socket.

    Resolution order for each chat request: auth (if ``api_key``), validation, queued
    faults (:meth:`fault_next`, :meth:`fail_next`), scripts (:meth:`script`, newest first),
    then the offline model (if ``offline_model=True``) or a 500 error naming the unmatched
    last message. See the module docstring for the served paths and the reply mapping.
    """

    FAULT_KINDS = tuple(_FAULT_OPTIONS)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        offline_model: bool = False,
        strict: bool = False,
        tool_support: str = "native",
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.offline_model = offline_model
        #: Refuse what real servers refuse (see the module docstring, "Strict mode").
        self.strict = strict
        if tool_support not in _TOOL_SUPPORT:
            raise ValueError(f"tool_support must be one of {', '.join(_TOOL_SUPPORT)}, "
                             f"got {tool_support!r}")
        #: "native"; "reject": a request with tools gets a 400, like Ollama for a model
        #: without tool support; "drop": the tool fields are silently discarded before
        #: scripts see the request, like llama-cpp-python's chat formats without tools.
        self.tool_support = tool_support
        self._lock = threading.Lock()
        self._scripts: list[_Script] = []
        self._faults: list[_Fault] = []
        self._requests: list[RecordedRequest] = []
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    # ---- configuration ---------------------------------------------------------------

    def script(self, match: Match, reply: Reply, *, times: int | None = None) -> None:
        """Answer requests matching ``match`` with ``reply`` (at most ``times`` times).

        ``match``: a str (case-insensitive substring of the last message's text), a compiled
        regex (``search`` on that text) or ``callable(request_json) -> bool`` (the request
        body as sent, in its dialect). ``reply``: ``{"content", "tool_calls",
        "finish_reason", "usage", "reasoning_content", "anthropic_blocks",
        "gemini_parts"}`` (all optional; a bare str means ``{"content": str}``) or
        ``callable(request_json) -> reply``. Scripts are tried newest first.
        """
        if not (isinstance(match, str | re.Pattern) or callable(match)):
            raise TypeError(f"match must be str, re.Pattern or callable, not {type(match)!r}")
        if not callable(reply):
            _normalise_reply(reply)  # validate eagerly so typos fail in the test, not the server
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        with self._lock:
            self._scripts.append(_Script(match, reply, times))

    def fail_next(
        self,
        status: int,
        *,
        body: dict[str, Any] | str | None = None,
        headers: dict[str, str] | None = None,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` chat requests with ``status``/``body``/``headers``.

        Faults are consumed in the order they were queued, before scripts are consulted.
        ``body=None`` sends an error shaped like the request's dialect (OpenAI: as before).
        Same as ``fault_next("status", status=..., body=..., headers=..., times=...)``.
        """
        self.fault_next("status", times=times, status=status, body=body, headers=headers)

    def fault_next(self, kind: str, *, times: int = 1, **options: Any) -> None:
        """Inject fault ``kind`` into the next ``times`` chat requests (any dialect).

        Faults are consumed one per request, in the order queued, after auth and
        validation and before scripts. Kinds and options (defaults in brackets):

        * ``"status"``: ``status`` (required), ``body`` [dialect-shaped error],
          ``headers``, ``retry_after`` (seconds as int/float/str -> ``Retry-After: 2``; a
          ``datetime`` -> an HTTP-date), ``retry_after_ms`` (-> ``retry-after-ms``).
        * ``"retry_info"``: a Google-style error with a ``google.rpc.RetryInfo`` detail;
          ``status`` [429], ``retry_delay`` ["2s"; a number means seconds], ``message``,
          ``headers``.
        * ``"slow_prefill"``: ``seconds`` [1.0] of silence before the first byte.
        * ``"slow_stream"``: ``seconds`` [0.2] of silence between chunks.
        * ``"disconnect_mid_stream"``: send ``after`` events [half] then close the socket
          (no terminator, no end of the chunked body); ``torn`` [False] also sends half of
          the next event.
        * ``"error_mid_stream"``: after ``after`` events [half], the dialect's in-stream
          error (OpenAI ``data: {"error":...}``, Anthropic ``event: error`` with
          ``overloaded_error``, Gemini a ``{"error":...}`` chunk), then the stream ends;
          ``message``, or ``body`` for the error event's data verbatim.
        * ``"malformed_chunk"``: after ``after`` events [1], a data line that is not JSON
          (``data`` [a truncated object]); the stream then continues normally.
        * ``"no_usage"``: no usage anywhere in the answer (stream or not).
        """
        if kind not in _FAULT_OPTIONS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(_FAULT_OPTIONS)}")
        if times < 1:
            raise ValueError("times must be >= 1")
        allowed = _FAULT_OPTIONS[kind]
        unknown = set(options) - set(allowed)
        if unknown:
            raise TypeError(
                f"fault {kind!r} got unexpected option(s) {sorted(unknown)}; "
                f"allowed: {sorted(allowed)}"
            )
        merged = {**allowed, **options}
        missing = [name for name, value in merged.items() if value is _REQUIRED]
        if missing:
            raise TypeError(f"fault {kind!r} requires option(s) {missing}")
        for name in ("seconds",):
            if name in merged and (not isinstance(merged[name], int | float)
                                   or merged[name] < 0):
                raise ValueError(f"{name} must be a number >= 0")
        after = merged.get("after")
        if after is not None and (not isinstance(after, int) or after < 0):
            raise ValueError("after must be an int >= 0 or None")
        if kind == "status" and not isinstance(merged["status"], int):
            raise TypeError("status must be an int")
        with self._lock:
            self._faults.append(_Fault(kind, merged, times))

    def reset(self) -> None:
        """Forget all scripts, queued faults and recorded requests."""
        with self._lock:
            self._scripts.clear()
            self._faults.clear()
            self._requests.clear()

    # ---- request handling ------------------------------------------------------------

    def _wsgi_app(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        try:
            response = self._handle(environ)
        except Exception as exc:  # never let a bug here turn into a dropped connection
            logger.exception("LLMEmulator: error while handling request")
            route = _route(environ.get("PATH_INFO", "") or "/")
            response = _dialect_error(
                route[0] if route else OPENAI, 500,
                f"LLMEmulator internal error: {exc!r}", type_="server_error",
            )
        headers = {"Content-Type": response.content_type, **response.headers}
        if response.pieces is None or not response.chunked:
            headers["Content-Length"] = str(len(response.body))
        reason = _STATUS_TEXT.get(response.status, "Status")
        start_response(f"{response.status} {reason}", list(headers.items()))
        if response.pieces is None:
            return [response.body]  # a single write (see latency note at the top)
        return _trickle(response, environ.get("werkzeug.socket"))

    def _handle(self, environ: dict[str, Any]) -> _Response:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO", "") or "/"
        query = environ.get("QUERY_STRING", "") or ""
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        raw = environ["wsgi.input"].read(length) if length > 0 else b""
        body = raw.decode("utf-8", errors="replace")
        headers = {
            key[5:].replace("_", "-").lower(): value
            for key, value in environ.items()
            if key.startswith("HTTP_")
        }
        for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(key):
                headers[key.replace("_", "-").lower()] = environ[key]
        parsed: Any = None
        json_error: str | None = None
        if body.strip():
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                json_error = str(exc)
        with self._lock:
            self._requests.append(RecordedRequest(method, path, headers, parsed, body, query))

        route = _route(path)
        if route is None:
            return _json_response(
                404,
                _error_body(
                    f"Unknown path {path!r}; the emulator serves POST {CHAT_PATH}, POST "
                    f"{ANTHROPIC_PATH} and POST /v1beta/models/{{model}}:generateContent "
                    "(or :streamGenerateContent).",
                    "invalid_request_error", "unknown_url",
                ),
            )
        dialect, model, gemini_method = route
        if method != "POST":
            return _dialect_error(
                dialect, 405, f"Method {method} not allowed on {path}; use POST.",
                code="method_not_allowed", headers={"Allow": "POST"},
            )
        params = parse_qs(query)
        denied = self._check_auth(dialect, headers, params)
        if denied is not None:
            return denied
        invalid = _validate(dialect, headers, parsed, body, json_error)
        if invalid is not None:
            return invalid
        assert isinstance(parsed, dict)
        if self.strict:
            refused = _strict_check(dialect, parsed)
            if refused is not None:
                return refused
        sent_tools = [key for key in _TOOL_FIELDS if parsed.get(key)]
        if sent_tools and self.tool_support == "reject":
            name = model or parsed.get("model") or "model"
            return _dialect_error(
                dialect, 400, f"registry.ollama.ai/library/{name} does not support tools",
                code="tools_not_supported", param=sent_tools[0])
        if sent_tools and self.tool_support == "drop":
            # The recorded request keeps what was sent; the "model" never sees the tools.
            parsed = {key: value for key, value in parsed.items() if key not in _TOOL_FIELDS}
        if dialect == GEMINI:
            stream = gemini_method == "streamGenerateContent"
            sse = "sse" in params.get("alt", [])
        else:
            stream, sse = bool(parsed.get("stream")), True

        fault = self._take_fault()
        kind = fault.kind if fault is not None else None
        if fault is not None and fault.kind in _STATUS_KINDS:
            return _status_fault_response(fault, dialect)
        if fault is not None and fault.kind == "slow_prefill":
            time.sleep(float(fault.options["seconds"]))
        if fault is not None and fault.kind == "context_overflow":
            return _context_overflow(dialect, stream, parsed)
        if fault is not None and fault.kind == "error_mid_stream" and not stream:
            status = {ANTHROPIC: 529, GEMINI: 503}.get(dialect, 500)
            return _json_response(status, _stream_error_data(dialect, fault.options))

        text = _last_message_text(parsed, dialect)
        script = self._take_script(parsed, text)
        if script is not None:
            reply = script.reply(parsed) if callable(script.reply) else script.reply
        elif self.offline_model:
            reply = _offline_reply(_openai_view(parsed, dialect))
        else:
            snippet = text[:_NO_MATCH_SNIPPET] + ("…" if len(text) > _NO_MATCH_SNIPPET else "")
            return _dialect_error(
                dialect, 500,
                f'LLMEmulator: no script matched the request; last message: "{snippet}"',
                type_="server_error", code="no_script_matched",
            )
        normalised = _normalise_reply(reply)
        with_usage = kind != "no_usage"
        if dialect == ANTHROPIC:
            rendered = _anthropic_render(parsed, normalised, stream=stream, with_usage=with_usage)
        elif dialect == GEMINI:
            rendered = _gemini_render(
                parsed, normalised, model=model or "gemini", stream=stream, sse=sse,
                with_usage=with_usage,
            )
        else:
            rendered = _openai_render(parsed, normalised, stream=stream, with_usage=with_usage)
        return _deliver(rendered, fault, dialect)

    def _check_auth(
        self, dialect: str, headers: dict[str, str], params: dict[str, list[str]]
    ) -> _Response | None:
        if self.api_key is None:
            return None
        if dialect == ANTHROPIC:
            key = headers.get("x-api-key", "")
            if key == self.api_key:
                return None
            what = "x-api-key header is required" if not key else "invalid x-api-key"
            return _json_response(401, _anthropic_error_body(401, what))
        if dialect == GEMINI:
            key = headers.get("x-goog-api-key") or (params.get("key") or [""])[0]
            if key == self.api_key:
                return None
            if not key:
                return _json_response(401, _google_error_body(
                    401, "Method doesn't allow unregistered callers (callers without "
                    "established identity). Please use API Key or other form of API "
                    "consumer identity to call this API."))
            return _json_response(403, _google_error_body(
                403, "API key not valid. Please pass a valid API key."))
        auth = headers.get("authorization", "")
        if auth == f"Bearer {self.api_key}":
            return None
        what = "No API key provided." if not auth else "Incorrect API key provided."
        return _json_response(401, _error_body(what, "invalid_request_error", "invalid_api_key"))

    def _take_fault(self) -> _Fault | None:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._faults.pop(0)
            return fault

    def _take_script(self, request_json: dict[str, Any], text: str) -> _Script | None:
        with self._lock:
            for script in reversed(self._scripts):
                if script.remaining is not None and script.remaining <= 0:
                    continue
                if _matches(script.match, text, request_json):
                    if script.remaining is not None:
                        script.remaining -= 1
                    return script
        return None


def _validate(
    dialect: str, headers: dict[str, str], parsed: Any, body: str, json_error: str | None
) -> _Response | None:
    """A 400 in the dialect's shape when the request is not a usable chat request."""
    if dialect == ANTHROPIC and not headers.get("anthropic-version"):
        return _dialect_error(dialect, 400, "anthropic-version: header is required")
    if json_error is not None or not body.strip():
        return _dialect_error(
            dialect, 400,
            "We could not parse the JSON body of your request. "
            f"({json_error or 'empty body'})",
        )
    if not isinstance(parsed, dict):
        return _dialect_error(dialect, 400, "The request body must be a JSON object.")
    key = "contents" if dialect == GEMINI else "messages"
    if not isinstance(parsed.get(key), list) or not parsed[key]:
        if dialect == GEMINI:
            return _dialect_error(
                dialect, 400, "* GenerateContentRequest.contents: contents is not specified"
            )
        return _dialect_error(
            dialect, 400, f"'{key}' must be a non-empty array.", param=key
        )
    if dialect == ANTHROPIC:
        max_tokens = parsed.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            return _dialect_error(dialect, 400, "max_tokens: Field required")
    return None


def _matches(match: Match, text: str, request_json: dict[str, Any]) -> bool:
    if isinstance(match, str):
        return match.lower() in text.lower()
    if isinstance(match, re.Pattern):
        return match.search(text) is not None
    return bool(match(request_json))


# --------------------------------------------------------------------------- faults


def _retry_after_value(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return email.utils.format_datetime(value.astimezone(dt.UTC), usegmt=True)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _status_fault_response(fault: _Fault, dialect: str) -> _Response:
    opts = fault.options
    headers = dict(opts.get("headers") or {})
    status = int(opts["status"])
    if fault.kind == "retry_info":
        delay = opts["retry_delay"]
        if not isinstance(delay, str):
            delay = f"{_retry_after_value(float(delay))}s"
        message = opts["message"] or (
            "Resource has been exhausted (e.g. check quota). "
            f"Please retry in {delay} (injected by LLMEmulator)."
        )
        body: Any = _google_error_body(status, message)
        body["error"]["details"] = [
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
        ]
        return _json_response(status, body, headers)
    if opts["retry_after"] is not None:
        headers["Retry-After"] = _retry_after_value(opts["retry_after"])
    if opts["retry_after_ms"] is not None:
        headers["retry-after-ms"] = _retry_after_value(opts["retry_after_ms"])
    body = opts["body"]
    if body is None:
        return _json_response(status, _default_fault_body(status, dialect), headers)
    if isinstance(body, dict):
        return _json_response(status, body, headers)
    try:
        json.loads(body)
        content_type = "application/json"
    except ValueError:
        content_type = "text/plain; charset=utf-8"
    return _Response(status, body.encode("utf-8"), content_type, headers)


def _context_overflow(dialect: str, stream: bool, request: dict[str, Any]) -> _Response:
    """llama-cpp-python's answer to a prompt over its context window: a streamed
    request gets 200 and an empty stream (the cause is only in the server's log),
    the same request without streaming a 400 naming it."""
    if stream:
        return _Response(200, b"", "text/event-stream; charset=utf-8",
                         {"Cache-Control": "no-cache"})
    tokens = _estimate_tokens(_prompt_text(request, dialect)) + 4096
    return _dialect_error(
        dialect, 400, f"Requested tokens ({tokens}) exceed context window of 4096",
        code="context_length_exceeded")


def _stream_error_data(dialect: str, opts: dict[str, Any]) -> Any:
    if opts.get("body") is not None:
        return opts["body"]
    message = opts.get("message")
    if dialect == ANTHROPIC:
        return _anthropic_error_body(529, message or "Overloaded", "overloaded_error")
    if dialect == GEMINI:
        return _google_error_body(
            503, message or "The model is overloaded. Please try again later."
        )
    return _error_body(
        message or "The server had an error while processing your request "
        "(injected by LLMEmulator).",
        "server_error",
    )


def _frame(events: list[_Event], framing: str) -> list[bytes]:
    """Each event's bytes on the wire (plus the closing ``]`` of a JSON-array stream)."""
    pieces: list[str] = []
    for index, event in enumerate(events):
        data = event.data if isinstance(event.data, _Raw) else _dumps(event.data)
        if framing == "json_array":
            pieces.append(("[" if index == 0 else ",\r\n") + data)
        else:
            pieces.append((f"event: {event.name}\n" if event.name else "") + f"data: {data}\n\n")
    if framing == "json_array":
        pieces.append("]" if events else "[]")
    return [piece.encode("utf-8") for piece in pieces]


def _position(after: int | None, total: int, default: int) -> int:
    return min(total, default if after is None else after)


def _deliver(rendered: _Rendered, fault: _Fault | None, dialect: str) -> _Response:
    """The response for ``rendered``, shaped by a stream fault if one was drawn."""
    kind = fault.kind if fault is not None else None
    opts = fault.options if fault is not None else {}
    if rendered.events is None:  # a JSON answer
        body = _dumps(rendered.payload).encode("utf-8")
        response = _Response(200, body, rendered.content_type, dict(rendered.headers))
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
        name = "error" if dialect == ANTHROPIC else None
        events = [*events[:at], _Event(_stream_error_data(dialect, opts), name)]
    elif kind == "malformed_chunk":
        at = _position(opts["after"], total, 1)
        data = opts["data"] if opts["data"] is not None else _MALFORMED_DEFAULT
        name = "content_block_delta" if dialect == ANTHROPIC else None
        events.insert(at, _Event(_Raw(data), name))
    pieces = _frame(events, rendered.framing)
    response = _Response(200, b"".join(pieces), rendered.content_type, dict(rendered.headers))
    if kind == "disconnect_mid_stream":
        # never the last piece: the terminator ([DONE], message_stop, the final chunk) is lost
        at = min(len(pieces) - 1, _position(opts["after"], total, total // 2))
        sent = pieces[:at]
        if opts["torn"]:
            sent.append(pieces[at][: max(1, len(pieces[at]) // 2)])
        response.pieces, response.abort, response.chunked = sent, True, True
    elif kind == "slow_stream":
        response.pieces, response.delay, response.chunked = pieces, float(opts["seconds"]), True
    return response


# --------------------------------------------------------------------------- replies


def _normalise_reply(reply: Any) -> dict[str, Any]:
    """Validate a scripted reply and return it as a dict with JSON-string tool arguments."""
    if isinstance(reply, str):
        reply = {"content": reply}
    if not isinstance(reply, dict):
        raise TypeError(f"reply must be a dict, str or callable, not {type(reply)!r}")
    unknown = set(reply) - _REPLY_KEYS
    if unknown:
        raise ValueError(f"unknown reply keys {sorted(unknown)}; allowed: {sorted(_REPLY_KEYS)}")
    calls: list[dict[str, Any]] = []
    call_ids: list[str | None] = []
    for call in reply.get("tool_calls") or []:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"each tool call needs a 'name': {call!r}")
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_ids.append(call.get("id"))
        calls.append(
            {
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": args},
            }
        )
    content = reply.get("content", None if calls else "")
    if content is not None and not isinstance(content, str):
        raise TypeError("reply 'content' must be a str or None")
    for key in ("anthropic_blocks", "gemini_parts"):
        value = reply.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            raise TypeError(f"reply {key!r} must be a list of dicts")
    return {
        "content": content,
        "tool_calls": calls,
        "finish_reason": reply.get("finish_reason") or ("tool_calls" if calls else "stop"),
        "usage": reply.get("usage"),
        "reasoning_content": reply.get("reasoning_content"),
        "explicit_finish_reason": reply.get("finish_reason"),
        "call_ids": call_ids,
        "anthropic_blocks": reply.get("anthropic_blocks"),
        "gemini_parts": reply.get("gemini_parts"),
        "refusal": reply.get("refusal"),
        "continuation_token": reply.get("continuation_token"),
    }


def _completion_text(reply: dict[str, Any]) -> str:
    return (reply["content"] or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in reply["tool_calls"]
    )


def _loads_or_raw(arguments: str) -> Any:
    """Parsed tool arguments; a string that is not JSON passes through (to test clients)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments


def _usage(request_json: dict[str, Any], reply: dict[str, Any]) -> dict[str, int]:
    usage = {
        "prompt_tokens": _estimate_tokens(_prompt_text(request_json)),
        "completion_tokens": _estimate_tokens(_completion_text(reply)),
    }
    override = reply.get("usage") or {}
    usage.update({k: int(v) for k, v in override.items()})
    usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
    return usage


# --------------------------------------------------------------------------- OpenAI


def _openai_render(
    request_json: dict[str, Any], reply: dict[str, Any], *, stream: bool, with_usage: bool
) -> _Rendered:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
    created = int(time.time())
    model = request_json.get("model") or "llm-emulator"
    usage = _usage(request_json, reply)

    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply["refusal"] is not None:
            message["refusal"] = reply["refusal"]
        if reply["reasoning_content"] is not None:
            message["reasoning_content"] = reply["reasoning_content"]
        if reply["tool_calls"]:
            message["tool_calls"] = reply["tool_calls"]
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply["finish_reason"]}],
        }
        if with_usage:
            payload["usage"] = usage
        return _Rendered(payload=payload)

    stream_options = request_json.get("stream_options") or {}
    include_usage = with_usage and bool(
        isinstance(stream_options, dict) and stream_options.get("include_usage")
    )
    events: list[_Event] = []

    def emit(delta: dict[str, Any] | None, finish_reason: str | None = None) -> None:
        chunk: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": (
                []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
            ),
        }
        if include_usage:
            chunk["usage"] = usage if delta is None else None
        events.append(_Event(chunk))

    emit({"role": "assistant", "content": "" if reply["content"] is not None else None})
    for piece in _split(reply["reasoning_content"] or ""):
        emit({"reasoning_content": piece})
    for piece in _split(reply["content"] or ""):
        emit({"content": piece})
    for piece in _split(reply["refusal"] or ""):
        emit({"refusal": piece})
    for index, call in enumerate(reply["tool_calls"]):
        fn = call["function"]
        emit({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                              "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _split(fn["arguments"]):
            emit({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    emit({}, reply["finish_reason"])
    if include_usage:
        emit(None)
    events.append(_Event(_Raw("[DONE]")))
    return _Rendered(
        events=events,
        content_type="text/event-stream; charset=utf-8",
        headers={"Cache-Control": "no-cache"},
    )


# --------------------------------------------------------------------------- Anthropic

_ANTHROPIC_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                   "content_filter": "refusal"}


def _anthropic_signature(thinking: str) -> str:
    return "sig-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _anthropic_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    if reply["anthropic_blocks"] is not None:
        return copy.deepcopy(reply["anthropic_blocks"])
    blocks: list[dict[str, Any]] = []
    thinking = reply["reasoning_content"]
    if thinking:
        blocks.append(
            {"type": "thinking", "thinking": thinking, "signature": _anthropic_signature(thinking)}
        )
    if reply["content"]:
        blocks.append({"type": "text", "text": reply["content"]})
    for call_id, call in zip(reply["call_ids"], reply["tool_calls"], strict=True):
        fn = call["function"]
        blocks.append({
            "type": "tool_use",
            "id": call_id or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": fn["name"],
            "input": _loads_or_raw(fn["arguments"]),
        })
    return blocks


def _anthropic_usage(
    request_json: dict[str, Any], reply: dict[str, Any], blocks: list[dict[str, Any]]
) -> dict[str, int]:
    if reply["anthropic_blocks"] is not None:
        output = _dumps(blocks)
    else:
        output = (reply["reasoning_content"] or "") + _completion_text(reply)
    usage = {
        "input_tokens": _estimate_tokens(_prompt_text(request_json, ANTHROPIC)),
        "output_tokens": _estimate_tokens(output),
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    override = dict(reply.get("usage") or {})
    for openai_key, key in (("prompt_tokens", "input_tokens"),
                            ("completion_tokens", "output_tokens")):
        if openai_key in override:
            override.setdefault(key, override[openai_key])
    usage.update({k: int(v) for k, v in override.items() if k in usage})
    return usage


def _anthropic_render(
    request_json: dict[str, Any], reply: dict[str, Any], *, stream: bool, with_usage: bool
) -> _Rendered:
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    model = request_json.get("model") or "llm-emulator"
    blocks = _anthropic_blocks(reply)
    explicit = reply["explicit_finish_reason"]
    if reply["refusal"]:
        blocks.append({"type": "text", "text": reply["refusal"]})
        stop_reason = "refusal"
    elif explicit:
        stop_reason = _ANTHROPIC_STOP.get(explicit, explicit)
    else:
        has_tool = any(b.get("type") == "tool_use" for b in blocks)
        stop_reason = "tool_use" if has_tool else "end_turn"
    usage = _anthropic_usage(request_json, reply, blocks)
    headers = {"request-id": f"req_{uuid.uuid4().hex[:24]}"}

    if not stream:
        payload: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": None,
        }
        if with_usage:
            payload["usage"] = usage
        return _Rendered(payload=payload, headers=headers)

    events: list[_Event] = []

    def emit(data: dict[str, Any]) -> None:
        events.append(_Event(data, data["type"]))

    start: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
    }
    if with_usage:
        start["usage"] = {**usage, "output_tokens": 1}
    emit({"type": "message_start", "message": start})
    for index, block in enumerate(blocks):
        kind = block.get("type")
        deltas: list[dict[str, Any]] = []
        # the start block keeps every key but the streamed one, which starts empty
        if kind == "text":
            first: dict[str, Any] = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _split(block.get("text") or "")]
        elif kind == "thinking":
            first = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p}
                      for p in _split(block.get("thinking") or "")]
            if block.get("signature"):
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            first = {**block, "input": {}}
            raw = block.get("input")
            partial = raw if isinstance(raw, str) else _dumps(raw if raw is not None else {})
            # the real API opens with an empty partial_json
            deltas = [{"type": "input_json_delta", "partial_json": p}
                      for p in ["", *_split(partial)]]
        else:  # redacted_thinking, server tool blocks, ...: whole in the start event
            first = block
        emit({"type": "content_block_start", "index": index, "content_block": first})
        if index == 0:
            emit({"type": "ping"})
        for delta in deltas:
            emit({"type": "content_block_delta", "index": index, "delta": delta})
        emit({"type": "content_block_stop", "index": index})
    if not blocks:
        emit({"type": "ping"})
    message_delta: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
    }
    if with_usage:
        message_delta["usage"] = {"output_tokens": usage["output_tokens"]}
    emit(message_delta)
    emit({"type": "message_stop"})
    return _Rendered(
        events=events,
        content_type="text/event-stream; charset=utf-8",
        headers={**headers, "Cache-Control": "no-cache"},
    )


# --------------------------------------------------------------------------- Gemini

_GEMINI_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS",
                  "content_filter": "SAFETY"}


def _gemini_signature(reply: dict[str, Any]) -> str:
    basis = _dumps([reply["reasoning_content"], reply["content"],
                    [c["function"] for c in reply["tool_calls"]]])
    digest = hashlib.sha256(basis.encode("utf-8")).hexdigest()[:32]
    return base64.b64encode(f"sig-{digest}".encode()).decode("ascii")


def _gemini_calls(reply: dict[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for call_id, call in zip(reply["call_ids"], reply["tool_calls"], strict=True):
        fn = call["function"]
        function_call: dict[str, Any] = {"name": fn["name"], "args": _loads_or_raw(fn["arguments"])}
        if call_id:
            function_call["id"] = call_id
        calls.append({"functionCall": function_call})
    return calls


def _gemini_parts(reply: dict[str, Any]) -> list[dict[str, Any]]:
    if reply["gemini_parts"] is not None:
        return copy.deepcopy(reply["gemini_parts"])
    parts: list[dict[str, Any]] = []
    if reply["reasoning_content"]:
        parts.append({"text": reply["reasoning_content"], "thought": True})
    if reply["content"]:
        parts.append({"text": reply["content"]})
    calls = _gemini_calls(reply)
    parts.extend(calls)
    signature = _gemini_signature(reply)
    carrier = calls[0] if calls else next(
        (p for p in parts if "text" in p and not p.get("thought")), None
    )
    if carrier is None:
        parts.append({"text": "", "thoughtSignature": signature})
    else:
        carrier["thoughtSignature"] = signature
    return parts


def _gemini_usage(
    request_json: dict[str, Any], reply: dict[str, Any], parts: list[dict[str, Any]]
) -> dict[str, int]:
    thoughts = 0
    if reply["gemini_parts"] is not None:
        candidates = _estimate_tokens(_dumps(parts))
    else:
        candidates = _estimate_tokens(_completion_text(reply))
        if reply["reasoning_content"]:
            thoughts = _estimate_tokens(reply["reasoning_content"])
    usage = {
        "promptTokenCount": _estimate_tokens(_prompt_text(request_json, GEMINI)),
        "candidatesTokenCount": candidates,
    }
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    override = dict(reply.get("usage") or {})
    for openai_key, key in (("prompt_tokens", "promptTokenCount"),
                            ("completion_tokens", "candidatesTokenCount")):
        if openai_key in override:
            override.setdefault(key, override[openai_key])
    usage.update({k: int(v) for k, v in override.items()
                  if k in ("promptTokenCount", "candidatesTokenCount", "thoughtsTokenCount",
                           "cachedContentTokenCount", "totalTokenCount")})
    usage.setdefault(
        "totalTokenCount",
        usage["promptTokenCount"] + usage["candidatesTokenCount"]
        + usage.get("thoughtsTokenCount", 0),
    )
    return usage


def _gemini_render(
    request_json: dict[str, Any],
    reply: dict[str, Any],
    *,
    model: str,
    stream: bool,
    sse: bool,
    with_usage: bool,
) -> _Rendered:
    response_id = uuid.uuid4().hex[:22]
    explicit = reply["explicit_finish_reason"]
    finish = _GEMINI_FINISH.get(explicit, explicit) if explicit else "STOP"
    parts = _gemini_parts(reply)
    usage = _gemini_usage(request_json, reply, parts)

    def chunk(
        chunk_parts: list[dict[str, Any]], usage_now: dict[str, int] | None, last: bool
    ) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": chunk_parts}}
        if last:
            candidate["finishReason"] = finish
            if reply["continuation_token"]:
                candidate["continuationToken"] = reply["continuation_token"]
        candidate["index"] = 0
        data: dict[str, Any] = {"candidates": [candidate]}
        if with_usage and usage_now is not None:
            data["usageMetadata"] = usage_now
        data["modelVersion"] = model
        data["responseId"] = response_id
        return data

    if not stream:
        return _Rendered(payload=chunk(parts, usage, last=True))

    per_chunk: list[list[dict[str, Any]]]
    if reply["gemini_parts"] is not None:
        per_chunk = [[part] for part in parts]
    else:
        per_chunk = [[{"text": p, "thought": True}]
                     for p in _split(reply["reasoning_content"] or "")]
        per_chunk += [[{"text": p}] for p in _split(reply["content"] or "")]
        calls = _gemini_calls(reply)
        signature = _gemini_signature(reply)
        if calls:
            calls[0]["thoughtSignature"] = signature
            per_chunk += [[call] for call in calls]
        else:  # the real-world shape: the signature arrives later, on an empty text part
            per_chunk.append([{"text": "", "thoughtSignature": signature}])
    if not per_chunk:
        per_chunk = [[{"text": ""}]]
    total = len(per_chunk)
    events: list[_Event] = []
    for index, chunk_parts in enumerate(per_chunk):
        share = (index + 1) / total  # usageMetadata is a running total; the last one is exact
        running = dict(usage)
        for key in ("candidatesTokenCount", "thoughtsTokenCount"):
            if key in running:
                running[key] = round(usage[key] * share)
        running["totalTokenCount"] = usage["totalTokenCount"] - sum(
            usage[k] - running[k] for k in ("candidatesTokenCount", "thoughtsTokenCount")
            if k in usage
        )
        events.append(_Event(chunk(chunk_parts, running, last=index == total - 1)))
    if sse:
        return _Rendered(events=events, content_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
    return _Rendered(events=events, framing="json_array",
                     content_type="application/json; charset=UTF-8")


# --------------------------------------------------------------------------- strict mode
#
# What real servers refuse, checked before anything else answers (strict=True). The key
# sets are those of the official SDKs' request types (openai 3.57, anthropic 2.14,
# google-genai 3.6) and the REST references; the content rules add what
# llama-cpp-python's pydantic-validated server refuses on top of OpenAI's own.

_OPENAI_TOP = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model",
    "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
})
_OPENAI_MESSAGE_KEYS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "refusal", "audio",
                            "function_call"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
_ANTHROPIC_TOP = frozenset({
    "cache_control", "container", "diagnostics", "inference_geo", "max_tokens", "messages",
    "metadata", "model", "output_config", "service_tier", "speed", "stop_sequences", "stream",
    "system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
    "user_profile_id", "workspace_id", "mcp_servers", "context_management",
})
_ANTHROPIC_BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "image": frozenset({"type", "source", "cache_control"}),
    "document": frozenset({"type", "source", "cache_control", "citations", "context", "title"}),
}
_ANTHROPIC_TOOL_KEYS = frozenset({"name", "description", "input_schema", "cache_control",
                                  "type", "strict", "input_examples"})
_TOOL_USE_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
_GEMINI_TOP = frozenset({"contents", "systemInstruction", "tools", "toolConfig",
                         "safetySettings", "generationConfig", "cachedContent", "labels",
                         "continuationToken", "serviceTier"})
_GEMINI_PART_KEYS = frozenset({"text", "thought", "thoughtSignature", "functionCall",
                               "functionResponse", "inlineData", "fileData", "executableCode",
                               "codeExecutionResult", "videoMetadata", "mediaResolution",
                               "partMetadata"})
_GEMINI_DECLARATION_KEYS = frozenset({"name", "description", "parameters",
                                      "parametersJsonSchema", "response",
                                      "responseJsonSchema", "behavior"})
#: google-genai's Schema fields, camelCase, less "defs" and "ref": the Gemini API
#: takes no references (the SDK inlines them before sending).
_GEMINI_SCHEMA_KEYS = frozenset({
    "additionalProperties", "anyOf", "default", "description", "enum", "example", "format",
    "items", "maxItems", "maxLength", "maxProperties", "maximum", "minItems", "minLength",
    "minProperties", "minimum", "nullable", "pattern", "properties", "propertyOrdering",
    "required", "title", "type",
})
_GEMINI_TYPES = frozenset({"TYPE_UNSPECIFIED", "STRING", "NUMBER", "INTEGER", "BOOLEAN",
                           "ARRAY", "OBJECT", "NULL"})
_GEMINI_GENERATION_KEYS = frozenset({
    "audioTimestamp", "audioTranscriptionConfig", "candidateCount", "enableAffectiveDialog",
    "enableEnhancedCivicAnswers", "frequencyPenalty", "logprobs", "maxOutputTokens",
    "mediaResolution", "modelSelectionConfig", "presencePenalty", "responseFormat",
    "responseJsonSchema", "responseLogprobs", "responseMimeType", "responseModalities",
    "responseSchema", "routingConfig", "seed", "speechConfig", "stopSequences", "temperature",
    "thinkingConfig", "topK", "topP", "translationConfig",
})


class _Refused(Exception):
    """A request a real server refuses: its status and message."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _strict_check(dialect: str, request: dict[str, Any]) -> _Response | None:
    """The error a real server answers ``request`` with, or None when it is accepted."""
    try:
        if dialect == ANTHROPIC:
            _strict_anthropic(request)
        elif dialect == GEMINI:
            _strict_gemini(request)
        else:
            _strict_openai(request)
    except _Refused as refused:
        if dialect == GEMINI:
            return _json_response(refused.status, _google_error_body(
                refused.status, refused.message))
        return _dialect_error(dialect, refused.status, refused.message, code=refused.code)
    return None


def _unknown(keys: Iterable[str], known: frozenset[str]) -> list[str]:
    return sorted(k for k in keys if k not in known)


def _strict_openai(request: dict[str, Any]) -> None:
    extra = _unknown(request, _OPENAI_TOP)
    if extra:
        raise _Refused(400, f"Unrecognized request argument supplied: {', '.join(extra)}",
                       "unknown_parameter")
    for index, message in enumerate(request.get("messages") or []):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _Refused(400, f"Invalid type for '{where}': expected an object.")
        role = message.get("role")
        if role not in _OPENAI_MESSAGE_KEYS:
            raise _Refused(400, f"Invalid value: '{role}'. Supported values are: "
                           f"{', '.join(map(repr, _OPENAI_MESSAGE_KEYS))}.", "invalid_value")
        extra = _unknown(message, _OPENAI_MESSAGE_KEYS[role])
        if extra:
            raise _Refused(400, f"Unknown parameter: '{where}.{extra[0]}'.",
                           "unknown_parameter")
        content = message.get("content")
        # llama-cpp-python validates content as a string (or parts) on every role:
        # a null or missing content is a pydantic error, answered with HTTP 500.
        if not isinstance(content, str | list):
            raise _Refused(500, f"1 validation error for ChatCompletionRequest: {where}."
                           f"content: Input should be a valid string [type=string_type, "
                           f"input_value={content!r}]", "validation_error")
        for number, call in enumerate(message.get("tool_calls") or []):
            spot = f"{where}.tool_calls[{number}]"
            if not isinstance(call, dict) or call.get("type") != "function" \
                    or not isinstance(call.get("id"), str):
                raise _Refused(400, f"Invalid value for '{spot}': needs an id and "
                               "type 'function'.")
            extra = _unknown(call, frozenset({"id", "type", "function"}))
            function = call.get("function") or {}
            extra += _unknown(function, frozenset({"name", "arguments"}))
            if extra:
                raise _Refused(400, f"Unknown parameter: '{spot}.{extra[0]}'.",
                               "unknown_parameter")
            if not isinstance(function.get("arguments"), str):
                raise _Refused(400, f"Invalid type for '{spot}.function.arguments': "
                               "expected a string.")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _Refused(400, f"Missing required parameter: '{where}.tool_call_id'.")
    for index, tool in enumerate(request.get("tools") or []):
        spot = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _Refused(400, f"Invalid value for '{spot}.type': expected 'function'.")
        extra = _unknown(tool, frozenset({"type", "function"})) + _unknown(
            tool.get("function") or {},
            frozenset({"name", "description", "parameters", "strict"}))
        if extra:
            raise _Refused(400, f"Unknown parameter: '{spot}.{extra[0]}'.", "unknown_parameter")


def _strict_anthropic(request: dict[str, Any]) -> None:
    extra = _unknown(request, _ANTHROPIC_TOP)
    if extra:
        raise _Refused(400, f"{extra[0]}: Extra inputs are not permitted")
    system = request.get("system")
    if system is not None and not isinstance(system, str | list):
        raise _Refused(400, "system: Input should be a valid string or list of text blocks")
    for index, message in enumerate(request.get("messages") or []):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _Refused(400, f"{where}.role: Input should be 'user' or 'assistant'")
        extra = _unknown(message, frozenset({"role", "content"}))
        if extra:
            raise _Refused(400, f"{where}.{extra[0]}: Extra inputs are not permitted")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise _Refused(400, f"{where}: all messages must have non-empty content")
        for number, block in enumerate(content):
            spot = f"{where}.content.{number}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _ANTHROPIC_BLOCK_KEYS:
                raise _Refused(400, f"{spot}.type: Input tag {kind!r} does not match any of "
                               f"the expected tags: {', '.join(_ANTHROPIC_BLOCK_KEYS)}")
            extra = _unknown(block, _ANTHROPIC_BLOCK_KEYS[kind])
            if extra:
                raise _Refused(400, f"{spot}.{kind}.{extra[0]}: Extra inputs are not permitted")
            if kind == "tool_use":
                if not isinstance(block.get("input"), dict):
                    raise _Refused(400, f"{spot}.tool_use.input: Input should be a valid "
                                   "dictionary")
                if not _TOOL_USE_ID.match(str(block.get("id") or "")):
                    raise _Refused(400, f"{spot}.tool_use.id: String should match pattern "
                                   "'^[a-zA-Z0-9_-]+$'")
            if kind == "text" and not isinstance(block.get("text"), str):
                raise _Refused(400, f"{spot}.text.text: Field required")
            if kind == "thinking" and not block.get("signature"):
                raise _Refused(400, f"{spot}.thinking.signature: Field required")
    for index, tool in enumerate(request.get("tools") or []):
        extra = _unknown(tool, _ANTHROPIC_TOOL_KEYS) if isinstance(tool, dict) else ["tool"]
        if extra:
            raise _Refused(400, f"tools.{index}.custom.{extra[0]}: Extra inputs are not "
                           "permitted")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _Refused(400, f"tools.{index}.custom.input_schema.type: Input should be "
                           "'object'")


def _gemini_unknown(name: str, where: str) -> _Refused:
    return _Refused(400, f'Invalid JSON payload received. Unknown name "{name}" at '
                    f"'{where}': Cannot find field.")


def _strict_gemini(request: dict[str, Any]) -> None:
    for key in _unknown(request, _GEMINI_TOP):
        raise _gemini_unknown(key, "")
    blocks = [("contents", c) for c in request.get("contents") or []]
    if request.get("systemInstruction") is not None:
        blocks.append(("system_instruction", request["systemInstruction"]))
    for index, (where, content) in enumerate(blocks):
        if not isinstance(content, dict):
            raise _Refused(400, f"* GenerateContentRequest.{where}: must be an object")
        for key in _unknown(content, frozenset({"role", "parts"})):
            raise _gemini_unknown(key, f"{where}[{index}]")
        if where == "contents" and content.get("role") not in ("user", "model"):
            raise _Refused(400, "Please use a valid role: user, model.")
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            raise _Refused(400, f"* GenerateContentRequest.{where}[{index}].parts: contents.parts "
                           "must not be empty.")
        for number, part in enumerate(parts):
            for key in _unknown(part, _GEMINI_PART_KEYS):
                raise _gemini_unknown(key, f"{where}[{index}].parts[{number}]")
    for index, tool in enumerate(request.get("tools") or []):
        for number, declaration in enumerate(tool.get("functionDeclarations") or []):
            where = f"tools[{index}].function_declarations[{number}]"
            for key in _unknown(declaration, _GEMINI_DECLARATION_KEYS):
                raise _gemini_unknown(key, where)
            if "parameters" in declaration and "parametersJsonSchema" in declaration:
                raise _Refused(400, f"{where}: parameters and parametersJsonSchema are "
                               "mutually exclusive")
            if "parameters" in declaration:
                _strict_gemini_schema(declaration["parameters"], f"{where}.parameters")
    for key in _unknown(request.get("generationConfig") or {}, _GEMINI_GENERATION_KEYS):
        raise _gemini_unknown(key, "generation_config")


def _strict_gemini_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise _Refused(400, f"Invalid value at '{where}': expected a Schema object")
    for key in _unknown(schema, _GEMINI_SCHEMA_KEYS):
        raise _gemini_unknown(key, where)
    kind = schema.get("type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in _GEMINI_TYPES):
        raise _Refused(400, f"Invalid value at '{where}.type' ({kind!r}): expected one of "
                       + ", ".join(sorted(_GEMINI_TYPES)))
    if kind is not None and kind.upper() == "OBJECT" and "properties" in schema \
            and not schema["properties"]:
        raise _Refused(400, f"* {where}.properties: should be non-empty for OBJECT type")
    for name, sub in (schema.get("properties") or {}).items():
        _strict_gemini_schema(sub, f"{where}.properties[{name}].value")
    if "items" in schema:
        _strict_gemini_schema(schema["items"], f"{where}.items")
    for number, sub in enumerate(schema.get("anyOf") or []):
        _strict_gemini_schema(sub, f"{where}.any_of[{number}]")
