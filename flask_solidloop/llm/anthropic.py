"""The Anthropic Messages dialect (``POST /v1/messages``): render, parse, stream.

Pure: no I/O. The caller adds the ``x-api-key`` header (:meth:`auth_headers`)
and any configured extra headers at send time.

Reasoning round trip. Anthropic returns thinking as ``thinking`` blocks (with a
``signature``) and ``redacted_thinking`` blocks (opaque ``data``), interleaved
with ``text`` and ``tool_use`` blocks. With extended thinking and tools, the
next request must carry those blocks back unchanged and in order, or the API
rejects it. :meth:`AnthropicDialect.parse` and :class:`AnthropicAggregator`
therefore keep the content list exactly as received in
``provider_meta["anthropic_blocks"]``; :meth:`AnthropicDialect.render` sends it
back verbatim whenever the ``"anthropic_signed"`` strategy applies to a message
(see :mod:`.reasoning`), and otherwise rebuilds the blocks from the message's
content and tool calls (welding ``<think>`` text in front under ``"xml"`` /
``"xml!"``, sending no reasoning under ``[]``). ``"xml!"`` alongside the signed
blocks welds into their first text block; the thinking blocks stay untouched.

History shape. Anthropic has no ``tool`` role and wants user and assistant
turns to alternate: consecutive tool results become one user message of
``tool_result`` blocks, and a user message that directly follows (the
human's follow-up) is appended to that same message as a trailing ``text``
block. System messages are lifted into the top-level ``system`` string.

Usage. Anthropic's ``input_tokens`` excludes cached input, so the normalized
:class:`Usage.input_tokens` is ``input_tokens + cache_read_input_tokens +
cache_creation_input_tokens`` and ``cached_input_tokens`` is
``cache_read_input_tokens``, matching the OpenAI meaning (prompt incl. cache).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ..errors import InvalidArgumentError, ProviderAnswerError, ProviderResponseError
from . import output as _output
from . import reasoning
from .dialect import RenderedRequest, RenderOptions, SSEEvent, StreamDelta, input_schema
from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

PATH = "/v1/messages"
DEFAULT_VERSION = "2023-06-01"
#: Anthropic requires ``max_tokens`` on every request; used when the agent sets none.
DEFAULT_MAX_TOKENS = 4096
#: ``reasoning_effort`` -> extended-thinking ``budget_tokens``.
THINKING_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
#: Room kept for the visible answer when ``max_tokens`` must be raised above the budget.
THINKING_ANSWER_ROOM = 1024
#: Anthropic ``stop_reason`` -> provider-neutral ``finish_reason``.
STOP_REASONS: dict[str | None, str | None] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    # The response filled the context window: as truncated as max_tokens.
    "model_context_window_exceeded": "length",
    "pause_turn": "pause_turn",
    "refusal": "refusal",
    None: None,
}
THINKING_TYPES = ("thinking", "redacted_thinking")
#: Streamed text deltas -> the block field they extend.
_TEXT_DELTAS = {"text_delta": "text", "thinking_delta": "thinking"}


class AnthropicDialect:
    """The Anthropic Messages API. See the module docstring for the mapping rules."""

    name = "anthropic"

    def render(self, settings: ProviderSettings, messages: list[ChatMessage],
               tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
               ) -> RenderedRequest:
        """The request for this history. Of the :class:`RenderOptions`:

        ``max_tokens`` defaults to :data:`DEFAULT_MAX_TOKENS` (Anthropic requires
        it). ``reasoning_effort`` ``"low"``/``"medium"``/``"high"`` enables
        extended thinking with a budget of 1024/4096/16384 tokens; ``max_tokens``
        is raised to ``budget + 1024`` when it would not exceed the budget. Any
        other effort raises ValueError.

        ``llm_params`` is deep-merged into the payload last and verbatim, as in
        the OpenAI dialect: it can override anything above (``thinking``,
        ``max_tokens``, ...) and add any Messages API field (``temperature``,
        ``top_k``, ``metadata``, ``tool_choice``, ...). Nothing is filtered, and
        Anthropic rejects unknown top-level keys with HTTP 400.
        """
        system: list[str] = []
        wire: list[dict[str, Any]] = []
        for message in messages:
            if message.role == "system":
                if message.content:
                    system.append(message.content)
            elif message.role == "user":
                _append_user(wire, [{"type": "text", "text": message.content or ""}],
                             plain=message.content or "")
            elif message.role == "tool":
                _append_user(wire, [_tool_result(message)])
            elif message.role == "assistant":
                blocks = _assistant_blocks(message, options.reasoning_strategies)
                if blocks:  # Anthropic rejects an assistant turn with no content
                    wire.append({"role": "assistant", "content": blocks})
            else:
                raise InvalidArgumentError(
                    f"message role {message.role!r} is not one of system, user, assistant, tool"
                )

        budget = None
        effort = options.reasoning_effort
        if effort is not None:
            budget = THINKING_BUDGETS.get(effort)
            if budget is None:
                raise InvalidArgumentError(
                    f"reasoning_effort {effort!r} is not supported by the anthropic "
                    f"dialect; accepted: {', '.join(map(repr, THINKING_BUDGETS))} (or None)"
                )
        limit = options.max_tokens if options.max_tokens is not None else DEFAULT_MAX_TOKENS
        if budget is not None and limit <= budget:
            limit = budget + THINKING_ANSWER_ROOM

        payload: dict[str, Any] = {"model": settings.model, "max_tokens": limit}
        if system:
            payload["system"] = "\n\n".join(system)
        payload["messages"] = wire
        if tools:
            payload["tools"] = [
                {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "input_schema": input_schema(tool),
                }
                for tool in tools
            ]
        if budget is not None:
            payload["thinking"] = {"type": "enabled", "budget_tokens": budget}
        if options.output_schema is not None:
            _ask_for_output(payload, options.output_schema, thinking=budget is not None)
        if options.stream:
            payload["stream"] = True
        version = getattr(settings, "anthropic_version", None) or DEFAULT_VERSION
        return RenderedRequest(path=PATH, payload=options.merge_llm_params(payload),
                               headers={"anthropic-version": str(version)})

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        return {"x-api-key": api_key} if api_key else {}

    def parse(self, body: Any) -> AssistantTurn:
        """Interpret a non-streaming Messages response body."""
        return parse_message(body)

    def aggregator(self) -> AnthropicAggregator:
        return AnthropicAggregator()

    def retry_after_from_body(self, body: Any) -> float | None:
        """Anthropic signals waits only in headers (retry-after)."""
        return None


# -- rendering ---------------------------------------------------------------


def _ask_for_output(payload: dict[str, Any], schema: dict[str, Any], *, thinking: bool) -> None:
    """Structured output, Anthropic's way: the answer is the input of a tool
    (:data:`.output.OUTPUT_TOOL`, whose input schema is the output's) the model
    is made to call: by name when it is the only tool; any tool when the agent
    has others (it calls them, then answers through this one). Anthropic
    refuses a forced tool_choice with extended thinking: the choice is then
    left to the model, and an answer given as text is validated as text."""
    tools = payload.setdefault("tools", [])
    tools.append({"name": _output.OUTPUT_TOOL, "description": _output.OUTPUT_TOOL_DESCRIPTION,
                  "input_schema": schema})
    if thinking:
        payload["tool_choice"] = {"type": "auto"}
    elif len(tools) == 1:
        payload["tool_choice"] = {"type": "tool", "name": _output.OUTPUT_TOOL}
    else:
        payload["tool_choice"] = {"type": "any"}



def _append_user(wire: list[dict[str, Any]], blocks: list[dict[str, Any]],
                 plain: str | None = None) -> None:
    """Add user content, merging into the previous user message to keep alternation.

    A lone user message stays ``{"role": "user", "content": "<text>"}``; once
    it must share a turn (with tool results or another user message) its
    content becomes a list of blocks.
    """
    previous = wire[-1] if wire else None
    if previous is None or previous["role"] != "user":
        content: Any = plain if plain is not None else list(blocks)
        wire.append({"role": "user", "content": content})
        return
    if isinstance(previous["content"], str):
        previous["content"] = [{"type": "text", "text": previous["content"]}]
    previous["content"].extend(blocks)


def _tool_result(message: ChatMessage) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id}
    if message.content:
        block["content"] = message.content
    if message.is_error:
        block["is_error"] = True
    return block


def _assistant_blocks(message: ChatMessage,
                      strategies: list[str] | None) -> list[dict[str, Any]]:
    chosen = reasoning.plan(message, strategies, "anthropic")
    if chosen.signed == "anthropic_signed":
        # Verbatim and in order: the signatures cover the thinking blocks' content.
        verbatim: list[dict[str, Any]] = copy.deepcopy(list(message.meta["anthropic_blocks"]))
        if chosen.weld:  # "xml!": weld into the text as well, thinking blocks untouched
            _weld_into_blocks(verbatim, message.reasoning)
        return verbatim
    text = reasoning.weld(message.content, message.reasoning) if chosen.weld else message.content
    blocks: list[dict[str, Any]] = []
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.call_id, "name": call.name,
                       "input": _tool_input(call.arguments_raw)})
    return blocks


def _weld_into_blocks(blocks: list[dict[str, Any]], thought: str | None) -> None:
    """``<think>`` in front of the first text block (a new one before any tool_use)."""
    for block in blocks:
        if block.get("type") == "text":
            block["text"] = reasoning.weld(block.get("text"), thought)
            return
    at = next((i for i, b in enumerate(blocks) if b.get("type") not in THINKING_TYPES),
              len(blocks))
    blocks.insert(at, {"type": "text", "text": reasoning.weld(None, thought)})


def _tool_input(raw: str | None) -> dict[str, Any]:
    """The parsed arguments; Anthropic wants an object, so anything else is wrapped."""
    if not raw or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"_invalid_arguments": raw}
    return value if isinstance(value, dict) else {"_invalid_arguments": raw}


# -- parsing -----------------------------------------------------------------


def parse_message(body: Any) -> AssistantTurn:
    """An :class:`AssistantTurn` from a ``message`` object (also the assembled stream)."""
    if not isinstance(body, dict):
        raise ProviderResponseError(f"expected a JSON object, got {type(body).__name__}")
    if body.get("type") == "error":
        raise _error(body.get("error"))
    content = body.get("content")
    if not isinstance(content, list):
        raise ProviderResponseError(
            f"response has no content list (keys: {', '.join(sorted(body)) or 'none'})"
        )
    stop_reason = body.get("stop_reason")
    if stop_reason not in STOP_REASONS:
        raise ProviderAnswerError(
            f"unknown stop_reason {stop_reason!r}; known: "
            + ", ".join(k for k in STOP_REASONS if k)
        )
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCallRequest] = []
    for block in content:
        if not isinstance(block, dict):
            raise ProviderResponseError(f"content block is not an object: {block!r}")
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))
        elif kind == "tool_use":
            calls.append(ToolCallRequest(
                call_id=block.get("id"),
                name=str(block.get("name") or ""),
                arguments_raw=json.dumps(block.get("input") or {}, ensure_ascii=False),
            ))
        # redacted_thinking carries no readable text; other block types (server
        # tools, ...) only travel in provider_meta.
    refusal = None
    if stop_reason == "refusal":  # the streaming classifiers stopped the answer
        refusal = "".join(texts) or "the model declined to answer (stop_reason 'refusal')"
    return AssistantTurn(
        refusal=refusal,
        content="".join(texts) if texts else None,
        tool_calls=calls,
        finish_reason=STOP_REASONS[stop_reason],
        usage=parse_usage(body.get("usage")),
        reasoning="".join(thoughts) or None,
        raw=body,
        provider_meta={"anthropic_blocks": content},
    )


def parse_usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    fresh = int(data.get("input_tokens") or 0)
    read = int(data.get("cache_read_input_tokens") or 0)
    written = int(data.get("cache_creation_input_tokens") or 0)
    details = data.get("output_tokens_details")
    thinking = details.get("thinking_tokens") if isinstance(details, dict) else None
    return Usage(
        input_tokens=fresh + read + written,
        cached_input_tokens=read,
        output_tokens=int(data.get("output_tokens") or 0),
        # Part of output_tokens (which stays the billed total), reported apart.
        reasoning_tokens=int(thinking or 0),
    )


def _error(error: Any) -> ProviderResponseError:
    if isinstance(error, dict):
        kind = error.get("type") or "error"
        message = error.get("message") or json.dumps(error)
    else:
        kind, message = "error", str(error)
    exc = ProviderResponseError(f"anthropic {kind}: {message}")
    exc.error_type = kind  # type: ignore[attr-defined]  # e.g. overloaded_error
    return exc


# -- streaming ---------------------------------------------------------------


class AnthropicAggregator:
    """Assembles one streamed Messages response into the body the non-streaming
    API would have returned, then parses it with :func:`parse_message`.

    Unknown event and delta types are ignored (Anthropic may add new ones).
    Text, thinking and tool-input deltas are collected as pieces per block and
    joined once, when the block closes (or at :meth:`result`), never appended
    to a growing string.
    """

    def __init__(self) -> None:
        self._invalid_inputs: dict[Any, str] = {}
        self._message: dict[str, Any] | None = None
        self._usage: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}
        #: (block index, "text" | "thinking") -> pieces not yet joined into the block
        self._pieces: dict[tuple[int, str], list[str]] = {}
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def feed(self, event: SSEEvent) -> StreamDelta | None:
        if self._finished or not event.data.strip():
            return None
        try:
            data = json.loads(event.data)
        except ValueError as exc:
            raise ProviderResponseError(
                f"unparseable stream event {event.event or ''}: {event.data[:200]!r}"
            ) from exc
        if not isinstance(data, dict):
            raise ProviderResponseError(f"stream event is not an object: {event.data[:200]!r}")
        kind = data.get("type") or event.event
        if kind == "message_start":
            message = data.get("message")
            if not isinstance(message, dict):
                raise ProviderResponseError("message_start without a message object")
            self._message = copy.deepcopy(message)
            self._merge_usage(message.get("usage"))
        elif kind == "content_block_start":
            index = self._index(data)
            block = data.get("content_block")
            if not isinstance(block, dict):
                raise ProviderResponseError(f"content_block_start {index} without a block")
            self._blocks[index] = copy.deepcopy(block)
        elif kind == "content_block_delta":
            return self._delta(self._index(data), data.get("delta") or {})
        elif kind == "content_block_stop":
            self._close(self._index(data))
        elif kind == "message_delta":
            if self._message is None:
                raise ProviderResponseError("message_delta before message_start")
            self._message.update(data.get("delta") or {})
            self._merge_usage(data.get("usage"))
        elif kind == "message_stop":
            self._finished = True
        elif kind == "error":
            raise _error(data.get("error"))
        return None  # ping and event types added later

    def result(self) -> AssistantTurn:
        if not self._finished:
            raise ProviderResponseError("stream ended without message_stop")
        if self._message is None:
            raise ProviderResponseError("stream ended without message_start")
        for index in sorted({*self._json, *(index for index, _ in self._pieces)}):
            self._close(index)
        body = dict(self._message)
        body["content"] = [self._blocks[i] for i in sorted(self._blocks)]
        # No usage in any event: leave it out, so the turn says "usage unknown"
        # instead of counting zero tokens.
        body["usage"] = dict(self._usage) if self._usage else None
        turn = parse_message(body)
        for call in turn.tool_calls:
            if call.call_id in self._invalid_inputs:
                call.arguments_raw = self._invalid_inputs[call.call_id]
        return turn

    def _index(self, data: dict[str, Any]) -> int:
        index = data.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ProviderResponseError(f"{data.get('type')} without an integer index")
        return index

    def _delta(self, index: int, delta: dict[str, Any]) -> StreamDelta | None:
        block = self._blocks.get(index)
        if block is None:
            raise ProviderResponseError(f"content_block_delta for unstarted block {index}")
        kind = delta.get("type")
        if kind in _TEXT_DELTAS:
            field = _TEXT_DELTAS[kind]
            text = str(delta.get(field) or "")
            pieces = self._pieces.get((index, field))
            if pieces is None:
                pieces = self._pieces[(index, field)] = [block.get(field) or ""]
            pieces.append(text)
            if not text:
                return None
            return StreamDelta(content=text) if field == "text" else StreamDelta(reasoning=text)
        if kind == "signature_delta":  # sent whole, once per thinking block
            block["signature"] = delta.get("signature")
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(str(delta.get("partial_json") or ""))
        elif kind == "citations_delta":
            block.setdefault("citations", []).append(delta.get("citation"))
        return None

    def _close(self, index: int) -> None:
        block = self._blocks.get(index)
        if block is None:
            raise ProviderResponseError(f"content_block_stop for unstarted block {index}")
        for field in ("text", "thinking"):
            pieces = self._pieces.pop((index, field), None)
            if pieces is not None:
                block[field] = "".join(pieces)
        parts = self._json.pop(index, None)
        if parts is None:
            return
        text = "".join(parts)
        try:
            block["input"] = json.loads(text) if text.strip() else block.get("input") or {}
        except ValueError:
            # The model emitted broken tool JSON. Like on the other dialects this
            # becomes a tool error the model can correct, not a failed turn: the
            # raw text is kept for the tool call, the block gets an empty input.
            block["input"] = {}
            self._invalid_inputs[block.get("id")] = text

    def _merge_usage(self, usage: Any) -> None:
        """Counts are cumulative: any value present replaces the earlier one."""
        if isinstance(usage, dict):
            self._usage.update({k: v for k, v in usage.items() if v is not None})
