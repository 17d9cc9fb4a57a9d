"""OpenAI-compatible chat-completions emulator served over real HTTP on 127.0.0.1.

This module owns :class:`LLMEmulator` (a scriptable fake of ``POST /v1/chat/completions``,
streaming and non-streaming, with fault injection and request recording) and the
deterministic built-in "offline model" policy the demo uses when no API key is configured.
Nothing is monkeypatched: clients talk to it through a socket exactly as they would talk to
a real provider, so the whole HTTP client stack (timeouts, retries, SSE parsing) is exercised.

Typical use::

    with LLMEmulator() as llm:
        llm.script("weather", {"tool_calls": [{"name": "get_weather",
                                               "arguments": {"city": "Paris"}}]})
        llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "Sunny."})
        client = httpx.Client(base_url=llm.base_url + "/v1")
        ...
"""

# Latency, measured on the development machine (200 sequential non-streaming POSTs through
# one httpx.Client, after warm-up): ~1.8 ms per request on average (streaming: ~1.9 ms);
# raw http.client with a fresh connection per request: ~1.0 ms. werkzeug answers every request
# with "Connection: close", so each POST opens a new connection; Linux ACKs the first segments
# of a fresh connection immediately, so the ~44 ms Nagle + delayed-ACK stall seen with
# keep-alive BaseHTTPRequestHandler servers does not occur (measured: same ~1.8 ms with
# TCP_NODELAY off). We still set TCP_NODELAY on accepted sockets (`_NoDelayRequestHandler`)
# and produce every response body, including a whole SSE stream, as one bytes object written
# in a single write, so the stall cannot come back if the transport changes.

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

__all__ = ["LLMEmulator", "RecordedRequest"]

logger = logging.getLogger(__name__)

Match = str | re.Pattern[str] | Callable[[dict[str, Any]], bool]
Reply = dict[str, Any] | str | Callable[[dict[str, Any]], "dict[str, Any] | str"]

CHAT_PATH = "/v1/chat/completions"
_REPLY_KEYS = frozenset({"content", "tool_calls", "finish_reason", "usage", "reasoning_content"})
_NO_MATCH_SNIPPET = 200
_TOOL_RESULT_SNIPPET = 500

_STATUS_TEXT = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
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
}


# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request as the emulator received it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case keys
    json: Any  # parsed body, or None if empty/malformed
    body: str  # raw body, decoded as UTF-8 (invalid bytes replaced)


@dataclass
class _Script:
    match: Match
    reply: Reply
    remaining: int | None


@dataclass
class _Fault:
    status: int
    body: dict[str, Any] | str | None
    headers: dict[str, str]
    remaining: int


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- server plumbing


class _NoDelayRequestHandler(WSGIRequestHandler):
    """werkzeug handler with TCP_NODELAY and without per-request access logging."""

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # tests fire hundreds of requests; access logs are noise

    def log(self, type: str, message: str, *args: Any) -> None:
        if type == "error":
            logger.error("LLMEmulator: " + message, *args)
        else:
            logger.debug("LLMEmulator: " + message, *args)


def _error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Response:
    body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    return _Response(status, body, "application/json", dict(headers or {}))


def _default_fault_body(status: int) -> dict[str, Any]:
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


def _last_message_text(request_json: dict[str, Any]) -> str:
    messages = request_json.get("messages")
    if not isinstance(messages, list) or not messages:
        return ""
    last = messages[-1]
    if not isinstance(last, dict):
        return ""
    return _content_text(last.get("content"))


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _prompt_text(request_json: dict[str, Any]) -> str:
    chunks: list[str] = []
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
    return t if isinstance(t, str) else None


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


# --------------------------------------------------------------------------- emulator


class LLMEmulator:
    """A scriptable OpenAI-compatible ``/v1/chat/completions`` server on a real socket.

    Resolution order for each chat request: auth (if ``api_key``), JSON validation, queued
    faults (:meth:`fail_next`), scripts (:meth:`script`, newest first), then the offline
    model (if ``offline_model=True``) or a 500 error naming the unmatched last message.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        offline_model: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.offline_model = offline_model
        self._lock = threading.Lock()
        self._scripts: list[_Script] = []
        self._faults: list[_Fault] = []
        self._requests: list[RecordedRequest] = []
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> LLMEmulator:
        """Bind the socket and serve from a daemon thread. Returns ``self``."""
        if self._server is not None:
            raise RuntimeError("LLMEmulator is already running")
        server = make_server(
            self.host, self.port, self._wsgi_app, threaded=True,
            request_handler=_NoDelayRequestHandler,
        )
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.01},
            name=f"LLMEmulator:{server.server_port}",
            daemon=True,
        )
        self._server, self._thread = server, thread
        thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Safe to call more than once."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> LLMEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """Origin of the running server, e.g. ``http://127.0.0.1:54321`` (no ``/v1``)."""
        if self._server is None:
            raise RuntimeError("LLMEmulator is not running; call start() first")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self._server.server_port}"

    # ---- configuration ---------------------------------------------------------------

    def script(self, match: Match, reply: Reply, *, times: int | None = None) -> None:
        """Answer requests matching ``match`` with ``reply`` (at most ``times`` times).

        ``match``: a str (case-insensitive substring of the last message's text), a compiled
        regex (``search`` on that text) or ``callable(request_json) -> bool``.
        ``reply``: ``{"content", "tool_calls", "finish_reason", "usage",
        "reasoning_content"}`` (all optional; a bare str means ``{"content": str}``) or
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
        ``body=None`` sends an OpenAI-shaped error suited to ``status``.
        """
        if times < 1:
            raise ValueError("times must be >= 1")
        with self._lock:
            self._faults.append(_Fault(status, body, dict(headers or {}), times))

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in arrival order (a snapshot copy)."""
        with self._lock:
            return list(self._requests)

    def last_request(self) -> RecordedRequest:
        """The most recent request; raises ``IndexError`` if none was received."""
        with self._lock:
            if not self._requests:
                raise IndexError("LLMEmulator has not received any request")
            return self._requests[-1]

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
            response = _json_response(
                500, _error_body(f"LLMEmulator internal error: {exc!r}", "server_error")
            )
        headers = {"Content-Type": response.content_type, **response.headers}
        headers["Content-Length"] = str(len(response.body))
        reason = _STATUS_TEXT.get(response.status, "Status")
        start_response(f"{response.status} {reason}", list(headers.items()))
        return [response.body]  # a single write (see latency note at the top)

    def _handle(self, environ: dict[str, Any]) -> _Response:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO", "") or "/"
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
            self._requests.append(RecordedRequest(method, path, headers, parsed, body))

        if path.rstrip("/") != CHAT_PATH:
            return _json_response(
                404,
                _error_body(f"Unknown path {path!r}; the emulator serves POST {CHAT_PATH}.",
                            "invalid_request_error", "unknown_url"),
            )
        if method != "POST":
            return _json_response(
                405,
                _error_body(f"Method {method} not allowed on {CHAT_PATH}; use POST.",
                            "invalid_request_error", "method_not_allowed"),
                {"Allow": "POST"},
            )
        if self.api_key is not None:
            auth = headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                what = "No API key provided." if not auth else "Incorrect API key provided."
                return _json_response(
                    401, _error_body(what, "invalid_request_error", "invalid_api_key")
                )
        if json_error is not None or not body.strip():
            return _json_response(
                400,
                _error_body(
                    "We could not parse the JSON body of your request. "
                    f"({json_error or 'empty body'})",
                    "invalid_request_error",
                ),
            )
        if not isinstance(parsed, dict):
            return _json_response(
                400, _error_body("The request body must be a JSON object.", "invalid_request_error")
            )
        if not isinstance(parsed.get("messages"), list) or not parsed["messages"]:
            return _json_response(
                400,
                _error_body("'messages' must be a non-empty array.", "invalid_request_error",
                            None, "messages"),
            )

        fault = self._take_fault()
        if fault is not None:
            return _fault_response(fault)

        script = self._take_script(parsed)
        if script is not None:
            reply = script.reply(parsed) if callable(script.reply) else script.reply
        elif self.offline_model:
            reply = _offline_reply(parsed)
        else:
            text = _last_message_text(parsed)
            snippet = text[:_NO_MATCH_SNIPPET] + ("…" if len(text) > _NO_MATCH_SNIPPET else "")
            return _json_response(
                500,
                _error_body(
                    f'LLMEmulator: no script matched the request; last message: "{snippet}"',
                    "server_error",
                    "no_script_matched",
                ),
            )
        return _completion_response(parsed, _normalise_reply(reply))

    def _take_fault(self) -> _Fault | None:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._faults.pop(0)
            return fault

    def _take_script(self, request_json: dict[str, Any]) -> _Script | None:
        text = _last_message_text(request_json)
        with self._lock:
            for script in reversed(self._scripts):
                if script.remaining is not None and script.remaining <= 0:
                    continue
                if _matches(script.match, text, request_json):
                    if script.remaining is not None:
                        script.remaining -= 1
                    return script
        return None


def _matches(match: Match, text: str, request_json: dict[str, Any]) -> bool:
    if isinstance(match, str):
        return match.lower() in text.lower()
    if isinstance(match, re.Pattern):
        return match.search(text) is not None
    return bool(match(request_json))


def _fault_response(fault: _Fault) -> _Response:
    if fault.body is None:
        return _json_response(fault.status, _default_fault_body(fault.status), fault.headers)
    if isinstance(fault.body, dict):
        return _json_response(fault.status, fault.body, fault.headers)
    try:
        json.loads(fault.body)
        content_type = "application/json"
    except ValueError:
        content_type = "text/plain; charset=utf-8"
    return _Response(fault.status, fault.body.encode("utf-8"), content_type, fault.headers)


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
    for call in reply.get("tool_calls") or []:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"each tool call needs a 'name': {call!r}")
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
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
    return {
        "content": content,
        "tool_calls": calls,
        "finish_reason": reply.get("finish_reason") or ("tool_calls" if calls else "stop"),
        "usage": reply.get("usage"),
        "reasoning_content": reply.get("reasoning_content"),
    }


def _usage(request_json: dict[str, Any], reply: dict[str, Any]) -> dict[str, int]:
    completion_text = (reply["content"] or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in reply["tool_calls"]
    )
    usage = {
        "prompt_tokens": _estimate_tokens(_prompt_text(request_json)),
        "completion_tokens": _estimate_tokens(completion_text),
    }
    override = reply.get("usage") or {}
    usage.update({k: int(v) for k, v in override.items()})
    usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
    return usage


def _completion_response(request_json: dict[str, Any], reply: dict[str, Any]) -> _Response:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
    created = int(time.time())
    model = request_json.get("model") or "llm-emulator"
    usage = _usage(request_json, reply)

    if not request_json.get("stream"):
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply["reasoning_content"] is not None:
            message["reasoning_content"] = reply["reasoning_content"]
        if reply["tool_calls"]:
            message["tool_calls"] = reply["tool_calls"]
        return _json_response(
            200,
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": reply["finish_reason"]}
                ],
                "usage": usage,
            },
        )

    stream_options = request_json.get("stream_options") or {}
    include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
    events: list[str] = []

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
        events.append(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n")

    emit({"role": "assistant", "content": "" if reply["content"] is not None else None})
    for piece in _split(reply["reasoning_content"] or ""):
        emit({"reasoning_content": piece})
    for piece in _split(reply["content"] or ""):
        emit({"content": piece})
    for index, call in enumerate(reply["tool_calls"]):
        fn = call["function"]
        emit({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                              "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _split(fn["arguments"]):
            emit({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    emit({}, reply["finish_reason"])
    if include_usage:
        emit(None)
    events.append("data: [DONE]\n\n")
    return _Response(
        200,
        "".join(events).encode("utf-8"),
        "text/event-stream; charset=utf-8",
        {"Cache-Control": "no-cache"},
    )
