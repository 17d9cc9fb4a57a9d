"""The HTTP server: :class:`LLMEmulator`, its configuration (scripts, faults, rate
limits) and the path of each request through it: record, route, auth, validation,
strict mode, tool support, rate limits, the next fault, scripts, then the offline
model."""

# Latency, measured on the development machine (200 sequential non-streaming POSTs through
# one httpx.Client, after warm-up): ~1.8 ms per request on average (streaming: ~1.9 ms);
# raw http.client with a fresh connection per request: ~1.0 ms. werkzeug answers every request
# with "Connection: close", so each POST opens a new connection; Linux ACKs the first segments
# of a fresh connection immediately, so the ~44 ms Nagle + delayed-ACK stall seen with
# keep-alive BaseHTTPRequestHandler servers does not occur (measured: same ~1.8 ms with
# TCP_NODELAY off). We still set TCP_NODELAY on accepted sockets (`NoDelayRequestHandler`)
# and produce every response body, including a whole SSE stream, as one bytes object written
# in a single write, so the stall cannot come back if the transport changes. Only responses
# shaped by a timing fault (slow_stream, disconnect_mid_stream) are written piece by piece
# (chunked transfer encoding for streams), which is their point.

from __future__ import annotations

import re
import threading
import time
from typing import Any
from urllib.parse import parse_qs

from ...errors import InvalidArgumentError
from .._local_server import LocalServer, Response, parse_json, read_request
from . import anthropic, gemini, openai, openai_responses, registry
from .dialect import estimate_tokens, json_response
from .faults import (
    FAULT_OPTIONS,
    STATUS_KINDS,
    context_overflow,
    deliver,
    make_fault,
    status_fault_response,
    stream_error_data,
)
from .offline import offline_reply, openai_view
from .ratelimit import RateLimiter, RateLimitStats, check_limits
from .strict import strict_check
from .types import (
    ANTHROPIC,
    ANTHROPIC_PATH,
    CHAT_PATH,
    GEMINI,
    OPENAI,
    OPENAI_RESPONSES,
    RESPONSES_PATH,
    Fault,
    Match,
    RecordedRequest,
    Reply,
    Script,
    normalise_reply,
    with_output,
)

_NO_MATCH_SNIPPET = 200
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
_TOOL_SUPPORT = ("native", "reject", "drop")
#: The request fields that carry tool definitions or tool choice, in every dialect.
_TOOL_FIELDS = ("tools", "tool_choice", "toolConfig", "parallel_tool_calls")


class LLMEmulator(LocalServer[RecordedRequest]):
    """A scriptable fake of the OpenAI, Anthropic and Gemini chat APIs on a real socket.

    Resolution order for each chat request: auth (if ``api_key``), validation, rate
    limits (:meth:`rate_limit`), queued faults (:meth:`fault_next`, :meth:`fail_next`),
    scripts (:meth:`script`, newest first), then the offline model (if
    ``offline_model=True``) or a 500 error naming the unmatched last message. See the
    package docstring for the served paths, the reply mapping and the rate limits.
    """

    FAULT_KINDS = tuple(FAULT_OPTIONS)

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        offline_model: bool = False,
        strict: bool = False,
        tool_support: str = "native",
        rate_limits: dict[str, int] | None = None,
    ) -> None:
        super().__init__(host, port)
        self.api_key = api_key
        self.offline_model = offline_model
        #: Refuse what real servers refuse (see :mod:`.strict`).
        self.strict = strict
        if tool_support not in _TOOL_SUPPORT:
            raise InvalidArgumentError(f"tool_support must be one of "
                                       f"{', '.join(_TOOL_SUPPORT)}, got {tool_support!r}")
        #: "native"; "reject": a request with tools gets a 400, like Ollama for a model
        #: without tool support; "drop": the tool fields are silently discarded before
        #: scripts see the request, like llama-cpp-python's chat formats without tools.
        self.tool_support = tool_support
        self._scripts: list[Script] = []
        self._faults: list[Fault] = []
        #: Releases of held streams (``held_stream``): one per stop; ``_ahead``
        #: counts the stops not yet passed, so no release outlives them.
        self._held = threading.Semaphore(0)
        self._ahead = 0
        self._released = 0
        self._waiting = 0
        self._rate = RateLimiter()
        #: The Responses API's memory: issued encrypted reasoning, stored responses.
        self.responses = openai_responses.ResponsesState()
        if rate_limits is not None:
            self._rate.set(check_limits(dict(rate_limits)), None)

    # ---- configuration ---------------------------------------------------------------

    def script(self, match: Match, reply: Reply, *, times: int | None = None) -> None:
        """Answer requests matching ``match`` with ``reply`` (at most ``times`` times).

        ``match``: a str (case-insensitive substring of the last message's text), a compiled
        regex (``search`` on that text) or ``callable(request_json) -> bool`` (the request
        body as sent, in its dialect). ``reply``: ``{"content", "tool_calls",
        "finish_reason", "usage", "reasoning_content", "anthropic_blocks",
        "gemini_parts", "output"}`` (all optional; a bare str means ``{"content": str}``) or
        ``callable(request_json) -> reply``. Scripts are tried newest first.
        """
        if not (isinstance(match, str | re.Pattern) or callable(match)):
            raise InvalidArgumentError(
                f"match must be str, re.Pattern or callable, not {type(match)!r}")
        if not callable(reply):
            normalise_reply(reply)  # validate eagerly so typos fail in the test, not the server
        if times is not None and times < 1:
            raise InvalidArgumentError("times must be >= 1 or None")
        with self._lock:
            self._scripts.append(Script(match, reply, times))

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
        * ``"endless_stream"``: the answer's first text chunk, repeated every
          ``seconds`` [0.05] until the client hangs up (openai dialect).
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
        * ``"held_stream"``: send ``after`` events [1], then hold the stream until
          :meth:`release_held` (or ``seconds`` [30.0] pass); with ``again``, hold
          once more before that event: a test acts while the answer is mid-way.
        """
        fault = make_fault(kind, times, options)
        with self._lock:
            self._faults.append(fault)

    def release_held(self) -> None:
        """Let a held stream (``held_stream``) go on past its next stop: the one
        it waits at, or the next it reaches. A release with no stop ahead is
        dropped (it cannot leak into a later test's stream)."""
        with self._lock:
            if self._released >= self._ahead:
                return
            self._released += 1
        self._held.release()

    def held(self) -> int:
        """How many streams wait at a stop now (``held_stream``)."""
        with self._lock:
            return self._waiting

    def _hold(self, seconds: float) -> None:
        with self._lock:
            self._waiting += 1
        try:
            self._held.acquire(timeout=seconds)
        finally:
            with self._lock:
                self._waiting -= 1
                self._ahead -= 1
                self._released = max(0, self._released - 1)

    def rate_limit(
        self,
        rpm: int | None = None,
        tpm: int | None = None,
        *,
        input_tpm: int | None = None,
        output_tpm: int | None = None,
        model: str | None = None,
    ) -> None:
        """Limit chat requests per minute as providers do (see :mod:`.ratelimit`).

        ``model=None`` sets the emulator's own limits (the API key's), replacing them;
        a model name sets that model's, checked in addition. Each limit is a token
        bucket that starts full and refills continuously (``rpm=60``: a burst of 60,
        then one a second). ``tpm`` charges prompt + output cap on admission and
        settles to the real usage; ``input_tpm`` / ``output_tpm`` (Anthropic's ITPM /
        OTPM) charge each half. A request that does not fit gets the dialect's 429.
        No limit at all clears: ``rate_limit(None)`` every limit, ``rate_limit(None,
        model="m")`` that model's. :meth:`reset` clears them too.
        """
        limits = check_limits(
            {"rpm": rpm, "tpm": tpm, "input_tpm": input_tpm, "output_tpm": output_tpm})
        self._rate.set(limits, model)

    def rate_limit_stats(self) -> RateLimitStats:
        """Every chat request's answer status and every answer's real token usage, with
        their ``time.monotonic()`` times, and the count of 429s (a snapshot)."""
        return self._rate.stats()

    def reset(self) -> None:
        """Forget all scripts, queued faults, recorded requests, rate limits and their
        statistics."""
        with self._lock:
            self._scripts.clear()
            self._faults.clear()
            self._requests.clear()
            self._held = threading.Semaphore(0)
            self._ahead = self._released = 0
        self._rate.reset()
        self.responses.reset()

    # ---- request handling ------------------------------------------------------------

    def _reason(self, status: int) -> str:
        return _STATUS_TEXT.get(status, "Status")

    def _internal_error(self, environ: dict[str, Any], exc: Exception) -> Response:
        route = registry.route(environ.get("PATH_INFO", "") or "/")
        return registry.dialect_error(
            route[0] if route else OPENAI, 500,
            f"LLMEmulator internal error: {exc!r}", type_="server_error",
        )

    def _handle(self, environ: dict[str, Any]) -> Response:
        incoming = read_request(environ)
        method, path, query, headers, body = (
            incoming.method, incoming.path, incoming.query, incoming.headers, incoming.body)
        parsed, json_error = parse_json(body)
        with self._lock:
            self._requests.append(RecordedRequest(method, path, headers, parsed, body, query))

        route = registry.route(path)
        if route is None:
            return json_response(
                404,
                openai.error_body(
                    f"Unknown path {path!r}; the emulator serves POST {CHAT_PATH}, POST "
                    f"{RESPONSES_PATH}, POST {ANTHROPIC_PATH} and POST "
                    "/v1beta/models/{model}:generateContent (or :streamGenerateContent).",
                    "invalid_request_error", "unknown_url",
                ),
            )
        response = self._chat(route, method, path, query, headers, parsed, body, json_error)
        self._rate.record(response.status)
        return response

    def _chat(self, route: tuple[str, str | None, str | None], method: str, path: str,
              query: str, headers: dict[str, str], parsed: Any, body: str,
              json_error: str | None) -> Response:
        dialect, model, gemini_method = route
        if method != "POST":
            return registry.dialect_error(
                dialect, 405, f"Method {method} not allowed on {path}; use POST.",
                code="method_not_allowed", headers={"Allow": "POST"},
            )
        params = parse_qs(query)
        if self.api_key is not None:
            denied = registry.check_auth(dialect, self.api_key, headers, params)
            if denied is not None:
                return denied
        invalid = registry.validate(dialect, headers, parsed, body, json_error)
        if invalid is not None:
            return invalid
        assert isinstance(parsed, dict)
        if self.strict:
            refused = self.responses.check(parsed) if dialect == OPENAI_RESPONSES \
                else strict_check(dialect, parsed)
            if refused is not None:
                return refused
        sent_tools = [key for key in _TOOL_FIELDS if parsed.get(key)]
        if sent_tools and self.tool_support == "reject":
            name = model or parsed.get("model") or "model"
            return registry.dialect_error(
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

        admitted = self._rate.admit(
            dialect, model or _model_name(parsed),
            estimate_tokens(registry.prompt_text(parsed, dialect)),
            registry.output_cap(parsed, dialect))
        if isinstance(admitted, Response):
            return admitted
        response, usage = self._answer(dialect, model, parsed, stream, sse)
        return self._rate.finish(admitted, response, usage, stream=stream)

    def _answer(self, dialect: str, model: str | None, parsed: dict[str, Any], stream: bool,
                sse: bool) -> tuple[Response, tuple[int, int] | None]:
        """The answer of an admitted request, and the (prompt, output) tokens it cost."""
        fault = self._take_fault()
        kind = fault.kind if fault is not None else None
        if fault is not None and fault.kind in STATUS_KINDS:
            return status_fault_response(fault, dialect), None
        if fault is not None and fault.kind == "slow_prefill":
            time.sleep(float(fault.options["seconds"]))
        if fault is not None and fault.kind == "context_overflow":
            return context_overflow(dialect, stream, parsed), None
        if fault is not None and fault.kind == "error_mid_stream" and not stream:
            status = {ANTHROPIC: 529, GEMINI: 503}.get(dialect, 500)
            return json_response(status, stream_error_data(dialect, fault.options)), None

        text = registry.last_message_text(parsed, dialect)
        script = self._take_script(parsed, text)
        if script is not None:
            reply = script.reply(parsed) if callable(script.reply) else script.reply
        elif self.offline_model:
            reply = offline_reply(openai_view(parsed, dialect))
        else:
            snippet = text[:_NO_MATCH_SNIPPET] + ("…" if len(text) > _NO_MATCH_SNIPPET else "")
            return registry.dialect_error(
                dialect, 500,
                f'LLMEmulator: no script matched the request; last message: "{snippet}"',
                type_="server_error", code="no_script_matched",
            ), None
        normalised = with_output(dialect, parsed, normalise_reply(reply))
        with_usage = kind != "no_usage"
        if dialect == ANTHROPIC:
            rendered = anthropic.render(parsed, normalised, stream=stream, with_usage=with_usage)
        elif dialect == OPENAI_RESPONSES:
            rendered = openai_responses.render(parsed, normalised, self.responses,
                                               stream=stream, with_usage=with_usage)
        elif dialect == GEMINI:
            rendered = gemini.render(
                parsed, normalised, model=model or "gemini", stream=stream, sse=sse,
                with_usage=with_usage,
            )
        else:
            rendered = openai.render(parsed, normalised, stream=stream, with_usage=with_usage)
        if kind == "held_stream" and fault is not None and rendered.events is not None:
            with self._lock:
                self._ahead += 1 + (fault.options["again"] is not None)
        return deliver(rendered, fault, dialect, hold=self._hold), rendered.usage

    def _take_fault(self) -> Fault | None:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._faults.pop(0)
            return fault

    def _take_script(self, request_json: dict[str, Any], text: str) -> Script | None:
        with self._lock:
            for script in reversed(self._scripts):
                if script.remaining is not None and script.remaining <= 0:
                    continue
                if _matches(script.match, text, request_json):
                    if script.remaining is not None:
                        script.remaining -= 1
                    return script
        return None


def _model_name(parsed: dict[str, Any]) -> str | None:
    model = parsed.get("model")
    return model if isinstance(model, str) and model else None


def _matches(match: Match, text: str, request_json: dict[str, Any]) -> bool:
    if isinstance(match, str):
        return match.lower() in text.lower()
    if isinstance(match, re.Pattern):
        return match.search(text) is not None
    return bool(match(request_json))
