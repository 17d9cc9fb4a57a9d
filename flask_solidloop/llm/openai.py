"""The OpenAI-compatible chat-completions dialect: render a request, parse a response,
aggregate a stream.

No I/O. Works with OpenAI, vLLM, llama.cpp, Ollama, LiteLLM, DeepSeek and anything
else that speaks ``POST /v1/chat/completions``. :class:`OpenAIDialect` is the
:class:`~flask_solidloop.llm.dialect.Dialect`; the module-level functions
(:func:`render_request`, :func:`parse_response`, ...) are the same code for callers
that predate it.

Reasoning comes back as a ``reasoning_content`` field (DeepSeek, older vLLM,
llama.cpp), a ``reasoning`` field (newer vLLM, Ollama) or a ``<think>...</think>``
block that opens the content; all three end up in ``AssistantTurn.reasoning``.
Only a leading ``<think>`` (after optional whitespace) is reasoning: a tag later
in the content is ordinary text and stays (see :func:`.reasoning.split_think`).
How reasoning goes back on later requests is the agent's ``reasoning_strategies``
(see :mod:`.reasoning`).
"""

from __future__ import annotations

import copy
import json
import json.scanner
from typing import Any

from ..errors import ProviderAnswerError, ProviderResponseError
from . import output as _output
from . import reasoning as _reasoning
from .dialect import (
    CUT_STREAM_HINT,
    RenderedRequest,
    RenderOptions,
    SSEEvent,
    StreamDelta,
    input_schema,
)
from .dialect import deep_merge as deep_merge  # moved to .dialect; still importable here
from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

PATH = "/v1/chat/completions"
KNOWN_FINISH_REASONS = {"stop", "tool_calls", "length", "content_filter", "function_call", None}
#: finish_reason values OpenAI-compatible servers send beyond OpenAI's own, mapped
#: to the neutral value; ``None`` means the server gave up on the response, which
#: fails the turn (ProviderAnswerError). Any other unknown value fails it too.
EXTRA_FINISH_REASONS: dict[str, str | None] = {
    "model_length": "length",  # Mistral: the context window is full
    "insufficient_system_resource": None,  # DeepSeek: inference interrupted
    "error": None,  # Mistral: generation failed
}
DONE = "[DONE]"
_EXCERPT = 200
#: The stdlib's C JSON scanner, called directly: ``json.loads`` adds three Python
#: frames and a whitespace regex per call, a fifth of the cost of a small chunk.
_scan: Any = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "...")


def _finish_reason(finish_reason: Any) -> str | None:
    """The neutral finish_reason for a wire value; ProviderAnswerError when unusable."""
    if finish_reason is None or (isinstance(finish_reason, str)
                                 and finish_reason in KNOWN_FINISH_REASONS):
        return finish_reason
    if isinstance(finish_reason, str) and finish_reason in EXTRA_FINISH_REASONS:
        mapped = EXTRA_FINISH_REASONS[finish_reason]
        if mapped is None:
            raise ProviderAnswerError(
                f"the server reported it could not finish the response "
                f"(finish_reason {finish_reason!r})"
            )
        return mapped
    raise ProviderAnswerError(
        f"unknown finish_reason {finish_reason!r}; known: "
        + ", ".join(sorted([*(r for r in KNOWN_FINISH_REASONS if r), *EXTRA_FINISH_REASONS]))
    )


def _plans(
    messages: list[ChatMessage], strategies: list[str] | None
) -> dict[int, _reasoning.ReasoningPlan]:
    return {
        index: _reasoning.plan(message, strategies, "openai")
        for index, message in enumerate(messages)
        if message.role == "assistant"
    }


def reasoning_carried(
    messages: list[ChatMessage], strategies: list[str] | None = None
) -> dict[str, int]:
    """What :meth:`OpenAIDialect.render` spends on earlier reasoning for this history
    and these strategies (same plans as the render): the ``reasoning_carried`` metadata."""
    return _reasoning.carried(messages, _plans(messages, strategies))


def render_message(
    message: ChatMessage, plan: _reasoning.ReasoningPlan | None = None
) -> dict[str, Any]:
    """One history entry on the wire; ``plan`` says where its reasoning goes (if anywhere).

    Content is never ``null``: an assistant message that only called tools goes
    out with ``"content": ""``. OpenAI, vLLM, Ollama and LiteLLM accept both, but
    llama-cpp-python's server validates ``content`` as a string and answers HTTP
    500 to ``null`` (and to a missing key); ``""`` is the form all of them take.
    """
    content = message.content
    if plan is not None and plan.weld:
        content = _reasoning.weld(content, message.reasoning)
    if content is None:
        content = ""
    out: dict[str, Any] = {"role": message.role, "content": content}
    if plan is not None and plan.field and message.reasoning:
        out[plan.field] = message.reasoning
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_raw or "{}"},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def render_request(settings: ProviderSettings, messages: list[ChatMessage],
                   tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
                   ) -> tuple[str, dict[str, Any]]:
    """Return (path, payload). ``tools`` are MCP tool dicts (name, description, inputSchema)."""
    rendered = OpenAIDialect().render(settings, messages, tools, options)
    return rendered.path, rendered.payload


def parse_response(body: Any) -> AssistantTurn:
    """Interpret a non-streaming chat.completion body."""
    if not isinstance(body, dict):
        raise ProviderResponseError(f"expected a JSON object, got {type(body).__name__}")
    if "error" in body and not body.get("choices"):
        raise ProviderResponseError(f"provider returned an error object: {body['error']}")
    choices = body.get("choices")
    if not choices or not isinstance(choices, list):
        raise ProviderResponseError(
            f"response has no choices (keys: {', '.join(sorted(body)) or 'none'})"
        )
    choice = choices[0]
    message = choice.get("message") or {}
    finish_reason = _finish_reason(choice.get("finish_reason"))
    content = message.get("content")
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for raw in message.get("tool_calls") or []:
        function = raw.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, dict | list):
            arguments = json.dumps(arguments)
        calls.append(
            ToolCallRequest(
                call_id=raw.get("id"),
                name=str(function.get("name") or ""),
                arguments_raw=arguments if arguments is not None else "",
            )
        )
    field = message.get("reasoning_content") or message.get("reasoning")
    reasoning = field if isinstance(field, str) and field else None
    thought = None
    if isinstance(content, str):
        content, thought = _reasoning.split_think(content)
    if thought:
        reasoning = f"{reasoning}\n\n{thought}" if reasoning else thought
    refusal = message.get("refusal")
    refusal = refusal if isinstance(refusal, str) and refusal else None
    return AssistantTurn(
        content=content,
        tool_calls=calls,
        finish_reason=_refusal_finish(finish_reason, refusal, calls),
        usage=parse_usage(body.get("usage")),
        reasoning=reasoning,
        raw=body,
        refusal=refusal,
    )


def _refusal_finish(finish_reason: str | None, refusal: str | None,
                    calls: list[ToolCallRequest]) -> str | None:
    """A refusal is the turn's outcome: OpenAI reports it with finish_reason
    ``stop`` and the text in ``refusal``, which an empty answer would hide."""
    return "refusal" if refusal and not calls else finish_reason


def parse_usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    prompt_details = data.get("prompt_tokens_details") or {}
    completion_details = data.get("completion_tokens_details") or {}
    return Usage(
        input_tokens=int(data.get("prompt_tokens") or 0),
        cached_input_tokens=int(prompt_details.get("cached_tokens") or 0),
        output_tokens=int(data.get("completion_tokens") or 0),
        reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0),
    )


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``response_format`` asking for an answer of ``schema``: strict (the
    server then only samples what matches) when the schema can be made strict
    (:func:`strict_schema`), else the schema as it is, not strict."""
    strict = strict_schema(schema)
    return {"type": "json_schema", "json_schema": {
        "name": _output.OUTPUT_TOOL, "schema": strict if strict is not None else schema,
        "strict": strict is not None}}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """``schema`` in the form OpenAI's strict mode takes, or None when it cannot
    be: every object lists all its properties in ``required`` and forbids
    others (``additionalProperties: false``), as the official SDK makes a
    pydantic model's schema strict; ``default`` goes (an optional field stays
    nullable through its ``anyOf``, and the model is validated on our side
    anyway). An object that allows other properties, or a root that is not an
    object, cannot be strict."""
    if schema.get("type") != "object":
        return None
    result = copy.deepcopy(schema)
    return result if _make_strict(result) else None


def _make_strict(node: Any) -> bool:
    if isinstance(node, list):
        return all(_make_strict(item) for item in node)
    if not isinstance(node, dict):
        return True
    node.pop("default", None)
    if node.get("type") == "object" or "properties" in node:
        if node.get("additionalProperties", False) is not False:
            return False
        node["additionalProperties"] = False
        node["required"] = list(node.get("properties") or {})
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict) and not all(
                _make_strict(sub) for sub in node[key].values()):
            return False
    return all(_make_strict(node[key]) for key in ("items", "anyOf", "allOf", "oneOf",
                                                   "prefixItems") if key in node)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class OpenAIDialect:
    """``POST /v1/chat/completions``, streamed or not."""

    name = "openai"

    def render(self, settings: ProviderSettings, messages: list[ChatMessage],
               tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
               ) -> RenderedRequest:
        strategies = _reasoning.resolve_strategies(options.reasoning_strategies, self.name,
                                                   settings.base_url)
        plans = _plans(messages, strategies)
        payload: dict[str, Any] = {
            "model": settings.model,
            "messages": [render_message(m, plans.get(i)) for i, m in enumerate(messages)],
            "stream": options.stream,
        }
        if options.stream:
            payload["stream_options"] = {"include_usage": True}
        if tools:
            payload["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "description": tool.get("description") or "",
                        "parameters": input_schema(tool),
                    },
                }
                for tool in tools
            ]
        if options.output_schema is not None:
            payload["response_format"] = response_format(options.output_schema)
        if options.reasoning_effort is not None:
            payload["reasoning_effort"] = options.reasoning_effort
        if options.max_tokens is not None:
            payload[settings.max_tokens_param] = options.max_tokens
        return RenderedRequest(path=PATH, payload=options.merge_llm_params(payload), headers={})

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        return auth_headers(api_key)

    def parse(self, body: Any) -> AssistantTurn:
        return parse_response(body)

    def aggregator(self) -> OpenAIAggregator:
        return OpenAIAggregator()

    def retry_after_from_body(self, body: Any) -> float | None:
        return None  # OpenAI-compatible servers use the Retry-After headers


class OpenAIAggregator:
    """Assembles one streamed chat completion from its ``data: {chunk}`` events.

    * ``data: [DONE]`` is the terminator; events after it are ignored.
    * Tool-call deltas are merged by ``index``: ``id`` and ``name`` are SET when
      present (llama.cpp repeats them in every delta; appending would double
      them), ``arguments`` are APPENDED.
    * Reasoning deltas come from ``reasoning_content`` or ``reasoning``; a
      ``<think>`` block opening the content is split out, even when a tag is cut
      across chunks. Content that does not open with the tag, and all content
      after ``</think>``, is passed through as is.
    * Usage: any non-null ``usage`` (top level; or, on a final chunk, inside the
      choice or Groq's ``x_groq``), last wins: with ``include_usage`` OpenAI sends
      it on a last chunk whose ``choices`` is empty; vLLM can send a running total
      on every chunk.
    * Only choice 0 is assembled (the loop never asks for ``n`` > 1).
    """

    __slots__ = ("_calls", "_content", "_done", "_finish_reason", "_first", "_reasoning",
                 "_refusal", "_splitter", "_think_seen", "_turn", "_usage",
                 "_wire_finish_reason")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        #: ``delta.refusal`` pieces: the model declined (never handed over as text).
        self._refusal: list[str] = []
        #: index -> [id, name, argument pieces]
        self._calls: dict[int, list[Any]] = {}
        self._usage: dict[str, Any] | None = None
        self._finish_reason: str | None = None
        self._wire_finish_reason: str | None = None
        self._done = False
        #: Watches the start of the content for a leading <think>; dropped (None)
        #: once the rest of the content is known to be plain.
        self._splitter: _reasoning.ThinkTagSplitter | None = _reasoning.ThinkTagSplitter()
        #: The content opened with <think>: newlines after </think> are trimmed.
        self._think_seen = False
        self._first: dict[str, Any] | None = None
        self._turn: AssistantTurn | None = None

    @property
    def finished(self) -> bool:
        return self._done

    def feed(self, event: SSEEvent) -> StreamDelta | None:
        if self._done:
            return None
        data = event.data
        if event.event == "error":
            raise ProviderResponseError(f"provider sent an error event mid-stream: {data}")
        if not data.startswith("{"):
            data = data.strip()
            if not data.startswith("{"):
                self._not_an_object(data)
                return None
        try:
            chunk, end = _scan(data, 0)
        except (StopIteration, ValueError):
            chunk, end = _loads_chunk(data), len(data)  # raises, naming the text
        if end != len(data) and not data[end:].isspace():
            _loads_chunk(data)  # trailing garbage: raises, naming the text
        try:
            if self._first is None:
                self._first = chunk
            if chunk.get("error"):
                raise ProviderResponseError(
                    f"provider sent an error mid-stream: {_error_text(chunk['error'])}"
                )
            usage = chunk.get("usage")
            if usage:
                self._usage = usage
            choices = chunk.get("choices")
            if not choices:  # the include_usage chunk, or a keep-alive chunk
                self._extra_usage(chunk, None)
                return None
            choice = choices[0]
            if choice.get("index"):  # n > 1 (never asked for): keep choice 0 only
                choice = next((c for c in choices if not c.get("index")), None)
                if choice is None:
                    return None
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None:
                self._finish_reason = _finish_reason(finish_reason)
                self._wire_finish_reason = finish_reason
                self._extra_usage(chunk, choice)
            delta = choice.get("delta")
            if not delta:
                return None
            content = delta.get("content")
            # The hot path: a delta that is one piece of plain text.
            if (content and len(delta) == 1 and content.__class__ is str
                    and self._splitter is None):
                self._content.append(content)
                return StreamDelta(content)
            return self._delta(delta, content)
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            raise ProviderResponseError(
                f"stream chunk has an unexpected shape ({type(exc).__name__}: {exc}): "
                f"{_excerpt(data)}"
            ) from None

    def _not_an_object(self, data: str) -> None:
        """[DONE], an empty keep-alive, or something this dialect cannot use."""
        if data == DONE:
            self._done = True
            return
        if not data:  # an empty data line: a keep-alive of sorts
            return
        _loads_chunk(data)  # not JSON: raises, naming the text
        raise ProviderResponseError(f"stream chunk is not a JSON object: {_excerpt(data)}")

    def _extra_usage(self, chunk: dict[str, Any], choice: dict[str, Any] | None) -> None:
        """Usage where some servers put it on their last chunks: inside the choice,
        or in Groq's ``x_groq``."""
        if choice is not None and choice.get("usage"):
            self._usage = choice["usage"]
        extra = chunk.get("x_groq")
        if isinstance(extra, dict) and extra.get("usage"):
            self._usage = extra["usage"]

    def _delta(self, delta: dict[str, Any], content: Any) -> StreamDelta | None:
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        refusal = delta.get("refusal")
        if refusal:
            self._refusal.append(str(refusal))
        tool_calls = delta.get("tool_calls")
        if tool_calls:
            self._merge_calls(tool_calls)
        if thought:
            if type(thought) is not str:
                thought = str(thought)
            self._reasoning.append(thought)
        if content:
            if type(content) is not str:  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            splitter = self._splitter
            if splitter is not None:
                content, tagged = splitter.feed(content)
                if tagged:
                    self._reasoning.append(tagged)
                    thought = f"{thought}{tagged}" if thought else tagged
                if splitter.passthrough:
                    self._think_seen = splitter.matched
                    self._splitter = None
            if content:
                self._content.append(content)
        if content or thought:
            return StreamDelta(content or "", thought or "")
        return None

    def _merge_calls(self, tool_calls: Any) -> None:
        calls = self._calls
        for tc in tool_calls:
            index = tc.get("index")
            if type(index) is not int:
                index = self._guess_index(tc)
            slot = calls.get(index)
            if slot is None:
                slot = calls[index] = [None, "", []]
            call_id = tc.get("id")
            if call_id:
                slot[0] = call_id
            function = tc.get("function")
            if function:
                name = function.get("name")
                if name:
                    slot[1] = name
                arguments = function.get("arguments")
                if arguments:
                    if type(arguments) is str:
                        slot[2].append(arguments)
                    else:  # a whole JSON value (some servers): it replaces the text
                        slot[2] = [json.dumps(arguments)]

    def _guess_index(self, tc: dict[str, Any]) -> int:
        """A delta without ``index``: match it by id, else a new id opens a new call,
        else it continues the last call."""
        call_id = tc.get("id")
        if call_id:
            for index, slot in self._calls.items():
                if slot[0] == call_id:
                    return index
            return max(self._calls, default=-1) + 1
        return max(self._calls, default=0)

    def result(self) -> AssistantTurn:
        if self._turn is not None:
            return self._turn
        # The chunk carrying finish_reason says the generation ended. Some
        # compatible servers close the connection right after it, without [DONE],
        # so that chunk alone completes a stream. (With include_usage a stream cut
        # between finish_reason and the usage chunk passes, without usage.) A
        # [DONE] without it is a stream cut short: llama-cpp-python ends an
        # interrupted stream so.
        if self._finish_reason is None:
            received = (f"{len(self._content)} content pieces and {len(self._calls)} "
                        "tool call(s) received")
            if self._done:
                raise ProviderResponseError(
                    "the stream ended with [DONE] before its final chunk (no "
                    f"finish_reason): the response was cut short ({received}); "
                    f"likely cause: {CUT_STREAM_HINT}"
                )
            raise ProviderResponseError(
                "stream ended without [DONE] and without a finish_reason: the response "
                f"was cut short ({received}); if the server is llama-cpp-python: "
                f"{CUT_STREAM_HINT}"
            )
        if self._splitter is not None:
            tail_content, tail_thought = self._splitter.flush()
            if tail_content:
                self._content.append(tail_content)
            if tail_thought:
                self._reasoning.append(tail_thought)
            self._think_seen = self._splitter.matched
            self._splitter = None
        content = "".join(self._content)
        if self._think_seen:
            content = content.lstrip("\n")
        calls = [
            ToolCallRequest(call_id=slot[0], name=slot[1], arguments_raw="".join(slot[2]))
            for _, slot in sorted(self._calls.items())
        ]
        reasoning = "".join(self._reasoning) or None
        refusal = "".join(self._refusal) or None
        first = self._first or {}
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if refusal:
            message["refusal"] = refusal
        if calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_raw}}
                for c in calls
            ]
        raw = {
            "id": first.get("id"), "object": "chat.completion", "model": first.get("model"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": self._wire_finish_reason}],
            "usage": self._usage, "streamed": True,
        }
        self._turn = AssistantTurn(
            content=content or None,
            tool_calls=calls,
            finish_reason=_refusal_finish(self._finish_reason, refusal, calls),
            usage=parse_usage(self._usage),
            reasoning=reasoning,
            raw=raw,
            refusal=refusal,
        )
        return self._turn


def _loads_chunk(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise ProviderResponseError(f"stream chunk is not JSON: {_excerpt(data)}") from None


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message") or json.dumps(error)
        kind = error.get("type") or error.get("code")
        return f"{message} ({kind})" if kind and str(kind) not in str(message) else str(message)
    return str(error)
