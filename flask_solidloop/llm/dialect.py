"""The contract every wire dialect fulfils, and the code the dialects share. No I/O.

A dialect turns the provider-neutral history (:class:`ChatMessage`) and MCP tool
definitions into one HTTP request (:meth:`Dialect.render`, shaped by one
:class:`RenderOptions`), turns a non-streaming body into an
:class:`AssistantTurn` (:meth:`Dialect.parse`), and hands out a fresh
:class:`StreamAggregator` per streamed response, which is fed parsed SSE events
one by one.

This module owns what is the same in every dialect: the protocol, the request
and event shapes, the render options, and the rendering steps they share
(:meth:`RenderOptions.merge_llm_params`, :func:`input_schema`).

Provider-specific data that must survive a round trip (Anthropic thinking
blocks with their signatures, Gemini thought signatures) travels in
``AssistantTurn.provider_meta`` on the way in; the loop stores it in the
message's ``metadata`` and gives it back in ``ChatMessage.meta`` on the way out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

from .types import AssistantTurn, ChatMessage, ProviderSettings

#: The likely cause of a stream that ends before its final chunk, for the
#: errors that report one. llama-cpp-python's server (default
#: ``interrupt_requests=True``) ends a stream with ``[DONE]`` and no
#: ``finish_reason`` whenever another request waits for the model: measured,
#: 19 of 20 concurrent streams cut, none with ``--interrupt_requests False``.
CUT_STREAM_HINT = (
    "a llama-cpp-python server started without --interrupt_requests False cuts a "
    "stream whenever another request arrives; start it with that flag, or send one "
    "request at a time"
)

@dataclass(frozen=True)
class RenderOptions:
    """How to shape one request, beside the history and the tools.

    The agent's options, as one value: every dialect's :meth:`Dialect.render`
    takes it, so an option added here reaches every dialect without a new keyword in
    each. Frozen, so the shared default ``RenderOptions()`` cannot be changed by
    one caller for the next.
    """

    #: Ask for server-sent events (the dialect adds what its API needs for that).
    stream: bool = False
    #: Deep-merged into the payload last and verbatim (:func:`deep_merge`).
    llm_params: dict[str, Any] | None = None
    #: The agent's ``reasoning_effort``; each dialect maps it (or rejects it).
    reasoning_effort: str | None = None
    #: The answer's token limit; ``None`` leaves it to the dialect's default.
    max_tokens: int | None = None
    #: How earlier reasoning goes back to the model (see :mod:`.reasoning`).
    reasoning_strategies: list[str] | None = None
    #: The loop's structured-output JSON Schema (llm/output.py), or None: each
    #: dialect asks for an answer of that shape its own way.
    output_schema: dict[str, Any] | None = None

    def merge_llm_params(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload with the agent's ``llm_params`` deep-merged over it.

        Always the last rendering step, in every dialect: what the agent wrote goes
        on the wire verbatim, even over what the dialect set itself.
        """
        return deep_merge(payload, self.llm_params) if self.llm_params else payload


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` merged into a copy of ``base``, dicts key by key at every depth;
    neither argument is changed."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def input_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool's ``inputSchema``, or an empty object schema for a tool that
    declares none (OpenAI and Anthropic require an object schema on every tool)."""
    return tool.get("inputSchema") or {"type": "object", "properties": {}}


@dataclass
class RenderedRequest:
    """One request, minus authentication (added by the caller at send time)."""

    path: str
    payload: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    #: Extra query parameters (Gemini's ``alt=sse``).
    params: dict[str, str] = field(default_factory=dict)


@dataclass
class SSEEvent:
    """One server-sent event: its ``event:`` name (if any) and joined ``data:`` lines."""

    data: str
    event: str | None = None
    id: str | None = None


@dataclass
class StreamDelta:
    """What one event added that a watching human could see."""

    content: str = ""
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning)


class StreamAggregator(Protocol):
    """Assembles one streamed response. One instance per response."""

    def feed(self, event: SSEEvent) -> StreamDelta | None:
        """Consume one event; return the visible text it added, if any.

        Raises ProviderResponseError for an error event or an unparseable chunk.
        """

    @property
    def finished(self) -> bool:
        """True once the dialect's end-of-stream marker was seen."""

    def result(self) -> AssistantTurn:
        """The assembled turn. Raises ProviderResponseError when the stream ended
        without its terminator (a truncated response must not pass as complete)."""


class Dialect(Protocol):
    name: str

    def render(self, settings: ProviderSettings, messages: list[ChatMessage],
               tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
               ) -> RenderedRequest:
        """The request for this history. ``tools`` are MCP tool dicts
        (name, description, inputSchema). ``options.llm_params`` is deep-merged
        last."""

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        """The secret headers for ``api_key`` (never stored)."""

    def parse(self, body: Any) -> AssistantTurn:
        """Interpret a non-streaming response body."""

    def aggregator(self) -> StreamAggregator:
        """A fresh aggregator for one streamed response."""

    def retry_after_from_body(self, body: Any) -> float | None:
        """A server-requested wait found in an error body (Gemini's RetryInfo)."""
