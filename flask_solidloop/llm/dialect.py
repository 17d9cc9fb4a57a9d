"""The contract every wire dialect fulfils. Dialects do no I/O.

A dialect turns the provider-neutral history (:class:`ChatMessage`) and MCP tool
definitions into one HTTP request (:meth:`Dialect.render`), turns a
non-streaming body into an :class:`AssistantTurn` (:meth:`Dialect.parse`), and
hands out a fresh :class:`StreamAggregator` per streamed response, which is fed
parsed SSE events one by one.

Provider-specific data that must survive a round trip (Anthropic thinking
blocks with their signatures, Gemini thought signatures) travels in
``AssistantTurn.provider_meta`` on the way in; the loop stores it in the
message's ``metadata`` and gives it back in ``ChatMessage.meta`` on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .types import AssistantTurn, ChatMessage, ProviderSettings


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

    def render(
        self,
        settings: ProviderSettings,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]],
        *,
        stream: bool = False,
        llm_params: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        max_tokens: int | None = None,
        reasoning_strategies: list[str] | None = None,
    ) -> RenderedRequest:
        """The request for this history. ``tools`` are MCP tool dicts
        (name, description, inputSchema). ``llm_params`` is deep-merged last."""

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        """The secret headers for ``api_key`` (never stored)."""

    def parse(self, body: Any) -> AssistantTurn:
        """Interpret a non-streaming response body."""

    def aggregator(self) -> StreamAggregator:
        """A fresh aggregator for one streamed response."""

    def retry_after_from_body(self, body: Any) -> float | None:
        """A server-requested wait found in an error body (Gemini's RetryInfo)."""
