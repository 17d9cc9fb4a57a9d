"""The OpenAI Responses API dialect (``POST /v1/responses``): render a request, parse a
response, aggregate a stream. No I/O.

History shape. Every history entry becomes ``input`` items: system and user
messages are message items in place (``role`` kept), an assistant turn is its
reasoning items, a message item for its text and one ``function_call`` item per
tool call, and a tool result is a ``function_call_output`` item. Tools are the
flat function tools (``type``, ``name``, ``description``, ``parameters``,
``strict``).

Our history is the truth: by default every request sends it whole with
``store: false`` and ``include: ["reasoning.encrypted_content"]``. With the llm
setting ``previous_response_id`` on, ``store: true`` is sent and a request carries
only the items after the last assistant message with a response id, and that id.

Reasoning round trip. The response's output order is kept in
``provider_meta["responses_items"]``: each ``reasoning`` item verbatim (its
``encrypted_content`` included), the message and function calls as placeholders
(``{"type": "message"}``, ``{"type": "function_call", "call_id": ...}``). Under the
``"openai_encrypted"`` strategy (the default, see :mod:`.reasoning`) the next
request rebuilds the turn in that order: reasoning items verbatim, the text and
the calls from the stored history. Output item ids are never sent: with
``store: false`` the server does not know them.

Usage: ``input_tokens`` (cached included), ``input_tokens_details.cached_tokens``,
``output_tokens`` (reasoning included) and ``output_tokens_details.reasoning_tokens``,
the Chat dialect's meanings. A ``refusal`` content part is the turn's refusal.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ..errors import ProviderAnswerError, ProviderResponseError
from . import output as _output
from . import reasoning as _reasoning
from .dialect import RenderedRequest, RenderOptions, SSEEvent, StreamDelta, input_schema
from .openai import auth_headers, strict_schema
from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

PATH = "/v1/responses"
META_ITEMS = "responses_items"
META_ID = "responses_id"
INCLUDE_ENCRYPTED = "reasoning.encrypted_content"
#: ``incomplete_details.reason`` -> neutral finish_reason.
INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter",
                      "max_messages": "length"}
_EXCERPT = 200


# -- rendering ---------------------------------------------------------------


def _chain_start(messages: list[ChatMessage]) -> tuple[int, str | None]:
    """Where the items to send begin, and the response id they continue (chaining)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        response_id = (message.meta or {}).get(META_ID) if message.role == "assistant" else None
        if response_id:
            return index + 1, str(response_id)
    return 0, None


def _message_items(message: ChatMessage, strategies: list[str] | None) -> list[dict[str, Any]]:
    if message.role in ("system", "user"):
        return [{"type": "message", "role": message.role, "content": message.content or ""}]
    if message.role == "tool":
        return [{"type": "function_call_output", "call_id": message.tool_call_id,
                 "output": message.content or ""}]
    chosen = _reasoning.plan(message, strategies, OpenAIResponsesDialect.name)
    text = _reasoning.weld(message.content, message.reasoning) if chosen.weld \
        else message.content
    calls = {call.call_id: _call_item(call) for call in message.tool_calls}
    items: list[dict[str, Any]] = []
    text_sent = False
    if chosen.signed:
        for stored in (message.meta or {}).get(META_ITEMS) or []:
            kind = stored.get("type")
            if kind == "reasoning":
                # As received, less null fields: the input item's types are not
                # nullable where the output's are (``content``, ``status``).
                items.append({k: copy.deepcopy(v) for k, v in stored.items() if v is not None})
            elif kind == "message" and not text_sent:
                text_sent = True
                if text:
                    items.append(_assistant_text(text))
            elif kind == "function_call" and stored.get("call_id") in calls:
                items.append(calls.pop(stored["call_id"]))
    if text and not text_sent:
        items.append(_assistant_text(text))
    items.extend(calls.values())
    # A reasoning item must be followed by the output it led to: the API refuses
    # one that ends a turn (a response cut off while reasoning, an empty answer).
    while items and items[-1].get("type") == "reasoning":
        items.pop()
    return items


def _assistant_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": text}


def _call_item(call: ToolCallRequest) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call.call_id or "", "name": call.name,
            "arguments": call.arguments_raw or "{}"}


def text_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``text.format`` asking for an answer of ``schema`` (strict when it can be)."""
    strict = strict_schema(schema)
    return {"type": "json_schema", "name": _output.OUTPUT_TOOL,
            "schema": strict if strict is not None else schema, "strict": strict is not None}


class OpenAIResponsesDialect:
    """``POST /v1/responses``, streamed or not. See the module docstring."""

    name = "openai_responses"

    def render(self, settings: ProviderSettings, messages: list[ChatMessage],
               tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
               ) -> RenderedRequest:
        strategies = _reasoning.resolve_strategies(options.reasoning_strategies, self.name,
                                                   settings.base_url)
        chain = settings.previous_response_id
        start, previous = _chain_start(messages) if chain else (0, None)
        items: list[dict[str, Any]] = []
        for message in messages[start:]:
            items.extend(_message_items(message, strategies))
        payload: dict[str, Any] = {"model": settings.model, "input": items,
                                   "stream": options.stream, "store": chain}
        if previous is not None:
            payload["previous_response_id"] = previous
        if not chain:
            payload["include"] = [INCLUDE_ENCRYPTED]
        if tools:
            payload["tools"] = [
                {"type": "function", "name": tool["name"],
                 "description": tool.get("description") or "",
                 "parameters": input_schema(tool), "strict": False}
                for tool in tools
            ]
        if options.output_schema is not None:
            payload["text"] = {"format": text_format(options.output_schema)}
        if options.reasoning_effort is not None:
            payload["reasoning"] = {"effort": options.reasoning_effort}
        if options.max_tokens is not None:
            payload["max_output_tokens"] = options.max_tokens
        return RenderedRequest(path=PATH, payload=options.merge_llm_params(payload), headers={})

    def first_sent(self, settings: ProviderSettings, messages: list[ChatMessage]) -> int:
        """The index of the first message a request for ``messages`` carries: 0, or
        the one after the last response when chaining with previous_response_id."""
        return _chain_start(messages)[0] if settings.previous_response_id else 0

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        return auth_headers(api_key)

    def parse(self, body: Any) -> AssistantTurn:
        return parse_response(body)

    def aggregator(self) -> ResponsesAggregator:
        return ResponsesAggregator()

    def retry_after_from_body(self, body: Any) -> float | None:
        return None  # OpenAI sends its waits in the Retry-After headers


# -- parsing -----------------------------------------------------------------


def parse_response(body: Any) -> AssistantTurn:
    """An :class:`AssistantTurn` from a ``response`` object (also a stream's final one)."""
    if not isinstance(body, dict):
        raise ProviderResponseError(f"expected a JSON object, got {type(body).__name__}")
    status = body.get("status")
    if body.get("error") or status == "failed":
        raise ProviderResponseError(
            f"provider returned an error object: {_error_text(body.get('error'))}")
    output = body.get("output")
    if not isinstance(output, list):
        raise ProviderResponseError(
            f"response has no output list (keys: {', '.join(sorted(body)) or 'none'})")
    texts: list[str] = []
    refusals: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCallRequest] = []
    kept: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, dict):
            raise ProviderResponseError(f"output item is not an object: {item!r}")
        kind = item.get("type")
        if kind == "message":
            kept.append({"type": "message"})
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    texts.append(str(part.get("text") or ""))
                elif part.get("type") == "refusal":
                    refusals.append(str(part.get("refusal") or ""))
        elif kind == "function_call":
            kept.append({"type": "function_call", "call_id": item.get("call_id")})
            arguments = item.get("arguments")
            if isinstance(arguments, dict | list):
                arguments = json.dumps(arguments)
            calls.append(ToolCallRequest(call_id=item.get("call_id"),
                                         name=str(item.get("name") or ""),
                                         arguments_raw=arguments if arguments is not None else ""))
        elif kind == "reasoning":
            kept.append(item)
            pieces = [str(p.get("text") or "") for p in (item.get("summary") or [])
                      + (item.get("content") or []) if isinstance(p, dict)]
            thoughts.append("\n\n".join(p for p in pieces if p))
        # other items (server-side tools) carry nothing this loop acts on
    refusal = "".join(refusals) or None
    finish_reason = _finish_reason(body, calls, refusal)
    meta: dict[str, Any] = {}
    if any(item.get("type") == "reasoning" for item in kept):
        meta[META_ITEMS] = kept
    if body.get("id"):
        meta[META_ID] = body["id"]
    return AssistantTurn(
        content="".join(texts) if texts else None,
        tool_calls=calls,
        finish_reason=finish_reason,
        usage=parse_usage(body.get("usage")),
        reasoning="\n\n".join(t for t in thoughts if t) or None,
        raw=body,
        provider_meta=meta,
        refusal=refusal,
    )


def _finish_reason(body: dict[str, Any], calls: list[ToolCallRequest],
                   refusal: str | None) -> str:
    status = body.get("status")
    if status == "incomplete":
        reason = (body.get("incomplete_details") or {}).get("reason")
        mapped = INCOMPLETE_REASONS.get(str(reason))
        if mapped is None:
            raise ProviderAnswerError(
                f"the response is incomplete (reason {reason!r}); known reasons: "
                + ", ".join(INCOMPLETE_REASONS))
        return mapped
    if status not in (None, "completed"):
        raise ProviderAnswerError(
            f"the response ended with status {status!r}, not 'completed' or 'incomplete'")
    if calls:
        return "tool_calls"
    return "refusal" if refusal else "stop"


def parse_usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    input_details = data.get("input_tokens_details") or {}
    output_details = data.get("output_tokens_details") or {}
    return Usage(
        input_tokens=int(data.get("input_tokens") or 0),
        cached_input_tokens=int(input_details.get("cached_tokens") or 0),
        output_tokens=int(data.get("output_tokens") or 0),
        reasoning_tokens=int(output_details.get("reasoning_tokens") or 0),
    )


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message") or json.dumps(error)
        code = error.get("code") or error.get("type")
        return f"{message} ({code})" if code and str(code) not in str(message) else str(message)
    return str(error)


# -- streaming ---------------------------------------------------------------


class ResponsesAggregator:
    """Assembles one streamed response from its named events.

    Every event's JSON carries its ``type``. Text, refusal, argument and
    reasoning deltas are appended to the item at their ``output_index``;
    ``response.output_item.done`` replaces that item with the whole one. The
    terminal event (``response.completed`` / ``response.incomplete``) carries the
    response object: its ``output`` wins when present, else the assembled items
    are used. ``response.failed`` and ``error`` raise.
    """

    def __init__(self) -> None:
        self._items: dict[int, dict[str, Any]] = {}
        self._pieces: dict[tuple[int, str], list[str]] = {}
        self._final: dict[str, Any] | None = None
        self._started: dict[str, Any] = {}

    @property
    def finished(self) -> bool:
        return self._final is not None

    def feed(self, event: SSEEvent) -> StreamDelta | None:
        if self._final is not None:
            return None
        data = event.data.strip()
        if not data or data == "[DONE]":
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ProviderResponseError(f"stream event is not JSON: {_excerpt(data)}") from None
        if not isinstance(chunk, dict):
            raise ProviderResponseError(f"stream event is not a JSON object: {_excerpt(data)}")
        kind = chunk.get("type") or event.event
        try:
            return self._event(str(kind), chunk)
        except (AttributeError, TypeError, KeyError) as exc:
            raise ProviderResponseError(
                f"stream event has an unexpected shape ({type(exc).__name__}: {exc}): "
                f"{_excerpt(data)}") from None

    def _event(self, kind: str, chunk: dict[str, Any]) -> StreamDelta | None:
        if kind == "error":
            raise ProviderResponseError(
                f"provider sent an error event mid-stream: {_error_text(chunk)}")
        if kind == "response.failed":
            error = (chunk.get("response") or {}).get("error")
            raise ProviderResponseError(f"the response failed: {_error_text(error)}")
        if kind in ("response.created", "response.in_progress"):
            self._started = chunk.get("response") or self._started
        elif kind in ("response.completed", "response.incomplete"):
            self._final = chunk.get("response") or {}
        elif kind == "response.output_item.added":
            self._items[int(chunk["output_index"])] = dict(chunk.get("item") or {})
        elif kind == "response.output_item.done":
            index = int(chunk["output_index"])
            self._items[index] = dict(chunk.get("item") or {})
            for key in [k for k in self._pieces if k[0] == index]:
                del self._pieces[key]
        elif kind == "response.output_text.delta":
            return self._piece(chunk, "text", content=True)
        elif kind == "response.refusal.delta":
            self._piece(chunk, "refusal")
        elif kind == "response.function_call_arguments.delta":
            self._piece(chunk, "arguments")
        elif kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self._piece(chunk, kind, reasoning=True)
        return None  # content_part / *.done / keep-alives: the done item has them whole

    def _piece(self, chunk: dict[str, Any], field: str, *, content: bool = False,
               reasoning: bool = False) -> StreamDelta | None:
        delta = str(chunk.get("delta") or "")
        self._pieces.setdefault((int(chunk["output_index"]), field), []).append(delta)
        if not delta:
            return None
        if content:
            return StreamDelta(content=delta)
        return StreamDelta(reasoning=delta) if reasoning else None

    def _assembled(self) -> list[dict[str, Any]]:
        """The items from the events, for a final response without its output."""
        for (index, field), pieces in self._pieces.items():
            item = self._items.setdefault(index, {})
            text = "".join(pieces)
            if field == "arguments":
                item["arguments"] = text
            elif field in ("text", "refusal"):
                part = {"type": "output_text", "text": text} if field == "text" \
                    else {"type": "refusal", "refusal": text}
                item.setdefault("content", []).append(part)
            else:
                item.setdefault("summary", []).append({"type": "summary_text", "text": text})
        return [self._items[i] for i in sorted(self._items)]

    def result(self) -> AssistantTurn:
        if self._final is None:
            raise ProviderResponseError(
                "the stream ended without response.completed: the response was cut short "
                f"({len(self._items)} output item(s) received)")
        body = dict(self._started)
        body.update(self._final)
        if not body.get("output"):
            body["output"] = self._assembled()
        body["streamed"] = True
        return parse_response(body)


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "...")
