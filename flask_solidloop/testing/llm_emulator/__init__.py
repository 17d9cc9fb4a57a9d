"""A scriptable fake LLM provider served over real HTTP on 127.0.0.1, in four dialects.

This package owns :class:`LLMEmulator` and the deterministic built-in "offline model" policy
the demo uses when no API key is configured. Nothing is monkeypatched: clients talk to it
through a socket exactly as they would talk to a real provider, so the whole HTTP client
stack (timeouts, retries, SSE parsing) is exercised. It serves:

* OpenAI chat completions: ``POST /v1/chat/completions`` (``"stream": true`` gives
  ``data:`` chunks ending in ``data: [DONE]``; ``stream_options.include_usage`` adds the
  usage chunk). Auth: ``Authorization: Bearer <api_key>``.
* OpenAI Responses: ``POST /v1/responses`` (named events ending in
  ``response.completed``; module ``openai_responses``, which also holds its
  strict checks and the server's memory of issued reasoning and stored responses).
* Anthropic Messages: ``POST /v1/messages``. Auth: ``x-api-key``; ``anthropic-version`` and
  ``max_tokens`` are required, as by the real API. Streams use ``event:`` lines
  (message_start, content_block_start/_delta/_stop, ping, message_delta, message_stop).
* Gemini: ``POST /v1beta/models/{model}:generateContent`` and
  ``:streamGenerateContent?alt=sse`` (``data:`` chunks, no terminator; without ``alt=sse``
  the chunks come as one JSON array). Auth: ``x-goog-api-key`` (or ``?key=``).

Every request is recorded (:attr:`LLMEmulator.requests`). A chat request is resolved in
this order: auth (when ``api_key`` is set), validation, rate limits, the next queued
fault, scripts (newest first), then the offline model (``offline_model=True``) or a 500
naming the unmatched last message. Errors are shaped like each provider's.

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
    llm.fault_next("held_stream", after=3)                    # 3 events, then wait for
    llm.held()                                                # 1 while it waits
    llm.release_held()                                        # ... for this
    llm.fault_next("disconnect_mid_stream", after=3)          # 3 events, then a closed socket
    llm.fault_next("interrupted_stream", after=3)             # 3 events, then [DONE] (openai)
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

Rate limits (:meth:`LLMEmulator.rate_limit`, or ``LLMEmulator(rate_limits={"rpm": 120,
"tpm": 40000})``) are token buckets as providers run them: each holds its per-minute
amount and refills continuously at amount/60 per second (a full minute may burst at
start)::

    llm.rate_limit(rpm=60, tpm=40_000)                  # the emulator's (the API key's)
    llm.rate_limit(rpm=5, model="gpt-small")            # that model's, checked in addition
    llm.rate_limit(input_tpm=10_000, output_tpm=2_000)  # Anthropic's ITPM / OTPM
    llm.rate_limit(None)                                # no limits (reset() clears them too)

An admitted chat request is charged 1 request and its prompt's token estimate (the
usage it will report) + its output cap (OpenAI ``max_tokens`` / ``max_completion_tokens``,
Anthropic ``max_tokens``, Gemini ``generationConfig.maxOutputTokens``; 0 without one);
``input_tpm`` / ``output_tpm`` charge the halves apart. The answer settles the charge to
the real usage (a refund, or a further charge); a stream settles when it ends, so its
headers show the reservation. An error answer costs its request and no token. A request
that does not fit every limit that applies gets a 429 and consumes nothing; one larger
than a bucket's capacity gets a 429 "Request too large" with no ``Retry-After``. The
refusal and headers are each provider's: OpenAI ``{"error": {..., "type": "requests" |
"tokens", "code": "rate_limit_exceeded"}}``, ``x-ratelimit-limit-/remaining-/reset-
requests|tokens`` (resets like ``6m0s``, ``1.5s``, ``20ms``: until the bucket is full) on
every chat response, ``retry-after`` (whole seconds, rounded up) and ``retry-after-ms``
on a 429; Anthropic ``rate_limit_error``, ``anthropic-ratelimit-{requests,tokens,
input-tokens,output-tokens}-{limit,remaining,reset}`` (reset: an RFC 3339 UTC time) and
``retry-after``; Gemini ``RESOURCE_EXHAUSTED`` with a ``google.rpc.RetryInfo``
``retryDelay`` ("3s") and no headers. The headers report, per dimension, the most
restrictive limit that applies. :meth:`LLMEmulator.rate_limit_stats` gives a bench
every chat answer's ``(time.monotonic(), status)``, each settled answer's ``(time,
tokens)`` and the count of 429s (``count_429_since(t)``, ``tokens_per_minute(since,
until)``).

Structured answers: the reply key ``output`` (any JSON value, or a string sent as it is)
is given the way the request asks for it: the arguments of a ``final_answer`` tool call
when the request offers that tool, else the answer's text. Strict mode checks the fields
that ask for it as the real APIs do: OpenAI ``response_format`` (a strict schema's
objects need ``additionalProperties: false`` and every property required), Anthropic
``tool_choice`` (the tool named must be offered; no forced tool with thinking), Gemini
``responseSchema`` (a JSON ``responseMimeType``, the Schema subset) and ``toolConfig``.

Reply keys for the edge cases: ``refusal`` (OpenAI ``message.refusal`` / ``delta.refusal``;
Anthropic a text block and ``stop_reason: "refusal"``), ``continuation_token`` (Gemini:
the candidate's ``continuationToken``, with ``finish_reason: "CONTINUATION"``).

Stream faults on a non-streaming request: ``disconnect_mid_stream`` sends half the body
(``Content-Length`` promises all of it); ``slow_stream`` trickles the body in pieces;
``malformed_chunk`` sends a truncated JSON body; ``error_mid_stream`` answers the dialect's
overload error status (OpenAI 500, Anthropic 529, Gemini 503); ``no_usage`` drops usage.

Modules, mirroring ``flask_solidloop/llm/``: ``server`` (the emulator and each request's
path through it), ``types`` (recorded requests, scripts, faults, the reply format),
``dialect`` (what the dialects share), ``openai`` / ``anthropic`` / ``gemini`` (each
dialect's auth, validation, text and rendering), ``registry`` (dialects by name),
``offline`` (the offline model), ``faults`` (fault injection and delivery),
``ratelimit`` (rate limits) and ``strict`` (strict mode). The HTTP plumbing is
``flask_solidloop/testing/_local_server.py``, shared with the MCP emulator.
"""

from .ratelimit import RateLimitStats
from .server import LLMEmulator
from .types import RecordedRequest

__all__ = ["LLMEmulator", "RateLimitStats", "RecordedRequest"]
