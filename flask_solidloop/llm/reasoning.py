"""Reasoning: how a model's past thoughts are sent back, and what that costs.

Providers return reasoning in several shapes (a ``reasoning_content`` or
``reasoning`` field, ``<think>`` tags inside the content, Anthropic thinking
blocks with signatures, Gemini thought parts with ``thoughtSignature``). The
next request must decide what to do with it. An agent's
``reasoning_strategies`` picks, per message, in order of preference:

* a field name (``"reasoning_content"``, ``"reasoning"``): the text goes back in
  that field of the assistant message (OpenAI-compatible dialect only);
* ``"anthropic_signed"`` / ``"gemini_signed"`` / ``"openai_encrypted"``: the
  signed native shape (OpenAI Responses: the reasoning items with their
  ``encrypted_content``), sent back unchanged; needs the signature captured
  with it, else it does not apply;
* ``"xml"``: weld ``<think>...</think>`` in front of the content, but only when no
  native strategy applied to that message (so it is the fallback of a signed
  strategy that could not apply);
* ``"xml!"``: weld even alongside a native strategy;
* ``[]``: send no reasoning back at all.

``None`` (the default) means the dialect's default, :data:`DEFAULT_STRATEGIES`.
Whatever the choice, :func:`carried` measures what a request spends on earlier
reasoning; the loop stores it on each assistant message as ``reasoning_carried``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .types import ChatMessage

SIGNED = ("anthropic_signed", "gemini_signed", "openai_encrypted")
XML = ("xml", "xml!")
FIELDS = ("reasoning_content", "reasoning")
DEFAULT_STRATEGIES: dict[str, list[str]] = {
    # No field by default: api.openai.com and the official SDK's
    # ChatCompletionAssistantMessageParam know no reasoning field, and strict
    # servers (llama-cpp-python validates with pydantic) refuse what they do not
    # know. Servers that want it back are listed in SERVER_STRATEGIES.
    "openai": [],
    "anthropic": ["anthropic_signed"],
    "gemini": ["gemini_signed"],
    "openai_responses": ["openai_encrypted"],
}
#: Servers whose documentation asks for a reasoning field on assistant history
#: messages, by host: their default replaces the dialect's. DeepSeek rejects a
#: tool-call turn that lost its ``reasoning_content`` (thinking mode with tools).
SERVER_STRATEGIES: dict[str, list[str]] = {
    "api.deepseek.com": ["reasoning_content"],
}
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def default_strategies(dialect: str, base_url: str | None = None) -> list[str]:
    """The strategies used when an agent's ``reasoning_strategies`` is None: the
    server's own (:data:`SERVER_STRATEGIES`, matched on the host of ``base_url``),
    else the dialect's (:data:`DEFAULT_STRATEGIES`)."""
    if dialect == "openai" and base_url:
        host = urlsplit(base_url).hostname or ""
        if host in SERVER_STRATEGIES:
            return list(SERVER_STRATEGIES[host])
    return list(DEFAULT_STRATEGIES.get(dialect, []))


def resolve_strategies(strategies: list[str] | None, dialect: str,
                       base_url: str | None = None) -> list[str]:
    """The strategies a request uses: the agent's, or the default for its server."""
    return list(strategies) if strategies is not None else default_strategies(dialect, base_url)


def validate_strategies(value: Any, *, agent: str) -> list[str] | None:
    """Check an agent's reasoning_strategies option; raise AgentDefinitionError."""
    from ..errors import AgentDefinitionError

    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise AgentDefinitionError(
            f"agent {agent!r}: reasoning_strategies must be a list (e.g. ['xml']) or None, "
            f"got {value!r}"
        )
    known = (*FIELDS, *SIGNED, *XML)
    for item in value:
        if item not in known:
            raise AgentDefinitionError(
                f"agent {agent!r}: unknown reasoning strategy {item!r}; known: "
                f"{', '.join(known)} (or [] to send no reasoning back)"
            )
    return list(value)


@dataclass(frozen=True)
class ReasoningPlan:
    """What to send back for one assistant message's reasoning."""

    field: str | None = None
    signed: str | None = None
    weld: bool = False


def plan(message: ChatMessage, strategies: list[str] | None, dialect: str) -> ReasoningPlan:
    """Decide how ``message``'s reasoning goes back under ``dialect``."""
    chosen = DEFAULT_STRATEGIES.get(dialect, []) if strategies is None else strategies
    if not message.reasoning and not _has_signed(message, dialect):
        return ReasoningPlan()
    field_name = None
    signed = None
    for strategy in chosen:
        if strategy in XML:
            continue
        if strategy in SIGNED:
            if signed is None and _signed_applies(message, strategy, dialect):
                signed = strategy
        elif dialect == "openai" and field_name is None and message.reasoning:
            field_name = strategy
    native = field_name is not None or signed is not None
    weld = bool(message.reasoning) and (
        "xml!" in chosen or ("xml" in chosen and not native)
    )
    return ReasoningPlan(field=field_name, signed=signed, weld=weld)


def _has_signed(message: ChatMessage, dialect: str) -> bool:
    meta = message.meta or {}
    if dialect == "anthropic":
        return bool(meta.get("anthropic_blocks"))
    if dialect == "gemini":
        return bool(meta.get("gemini_parts"))
    if dialect == "openai_responses":
        return bool(meta.get("responses_items"))
    return False


def _signed_applies(message: ChatMessage, strategy: str, dialect: str) -> bool:
    meta = message.meta or {}
    if strategy == "anthropic_signed" and dialect == "anthropic":
        blocks = meta.get("anthropic_blocks") or []
        return any(b.get("type") in ("thinking", "redacted_thinking") for b in blocks)
    if strategy == "gemini_signed" and dialect == "gemini":
        parts = meta.get("gemini_parts") or []
        return any(p.get("thoughtSignature") for p in parts)
    if strategy == "openai_encrypted" and dialect == "openai_responses":
        items = meta.get("responses_items") or []
        return any(i.get("type") == "reasoning" for i in items)
    return False


def weld(content: str | None, reasoning: str | None) -> str | None:
    """``<think>reasoning</think>`` in front of the content."""
    if not reasoning:
        return content
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}" + (content or "")


def split_think(text: str | None) -> tuple[str | None, str | None]:
    """Split a leading ``<think>...</think>`` out of a whole content: (content, reasoning).

    Only a tag that opens the content (after optional whitespace) is reasoning, the
    way reasoning models emit it; a ``<think>`` anywhere later is ordinary text (a
    model explaining the tag, code, ...) and stays untouched. The whitespace
    before the tag and the newlines right after ``</think>`` are dropped. An
    unterminated leading tag makes everything after it reasoning.
    """
    if not text:
        return text, None
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return text, None
    thought, closed, after = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
    if not closed:
        return None, thought
    return after.lstrip("\n") or None, thought


class ThinkTagSplitter:
    """The streaming :func:`split_think`: separates a leading ``<think>`` block from
    the content of a stream, where a tag can be split across chunks (``"<thi"`` +
    ``"nk>"``). Feed the content chunks in order.

    Only the start of the content is examined: leading whitespace and a possible
    beginning of ``<think>`` are held back until it is known whether the tag
    opens the content. Without it, everything is content from then on; with it,
    text up to ``</think>`` is reasoning (a possible beginning of the closing tag
    held back), and everything after is content, later tags included.
    (:func:`split_think` also drops the newlines right after ``</think>``; a
    stream consumer does that on the joined content when :attr:`matched`.)
    """

    _START, _INSIDE, _CONTENT = range(3)

    def __init__(self) -> None:
        self._buffer = ""
        self._state = self._START
        #: Whether the content opened with ``<think>``.
        self.matched = False

    @property
    def passthrough(self) -> bool:
        """Nothing held back and every further chunk is plain content."""
        return self._state == self._CONTENT

    def feed(self, chunk: str) -> tuple[str, str]:
        """Return (content, reasoning) made certain by this chunk."""
        if self._state == self._CONTENT:
            return chunk, ""
        self._buffer += chunk
        if self._state == self._START:
            head = self._buffer.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return "", ""  # whitespace, maybe the beginning of the tag: wait
            if not head.startswith(THINK_OPEN):
                content, self._buffer = self._buffer, ""
                self._state = self._CONTENT
                return content, ""
            self._buffer = head[len(THINK_OPEN):]
            self._state = self._INSIDE
            self.matched = True
        index = self._buffer.find(THINK_CLOSE)
        if index >= 0:
            thought, content = self._buffer[:index], self._buffer[index + len(THINK_CLOSE):]
            self._buffer = ""
            self._state = self._CONTENT
            return content, thought
        # Keep back a tail that could be the start of the closing tag.
        keep = _partial_suffix(self._buffer, THINK_CLOSE)
        thought = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return "", thought

    def flush(self) -> tuple[str, str]:
        """The held-back tail at end of stream."""
        tail, self._buffer = self._buffer, ""
        return ("", tail) if self._state == self._INSIDE else (tail, "")


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def carried(messages: list[ChatMessage], plans: dict[int, ReasoningPlan]) -> dict[str, int]:
    """What a request spends on earlier reasoning (the ``reasoning_carried`` metadata).

    ``plans`` maps the index of each assistant message in ``messages`` to the
    plan that was applied to it.
    """
    count = chars = inline = 0
    for index, chosen in plans.items():
        message = messages[index]
        size = len(message.reasoning or "")
        if chosen.signed and not size:
            size = sum(len(b.get("thinking", "") or "") for b in
                       (message.meta or {}).get("anthropic_blocks", []))
        if chosen.field or chosen.signed or chosen.weld:
            count += 1
            chars += size
        if chosen.weld:
            inline += size
    return {"messages": count, "chars": chars, "inline_chars": inline,
            "tokens_est": (chars + 3) // 4}
