"""Compaction of long histories: the ``Compaction`` LLM middleware and its
summary turn (docs/decisions/0038-compaction.md, docs/guides/conversations.md).

Placed after AgentInitialization, it estimates the request the turn is about
to send (llm/estimate.py, over the payload as the agent's dialect renders it).
Past ``trigger_tokens`` the turn becomes a summary turn: one request to the
summarizer (the agent's model, or its ``llm`` settings with ``summarizer``
merged over them) over the older part of the history, and one commit
(loops/store/compaction.py) that inserts the summary, marks the messages it
replaces ``compacted_by`` it, and queues the loop for its real turn with that
turn's job. The summary turn sends no request of the agent's own.

What is never summarised: the system prompt, the loop's first user message
(its task: the pinned message) and the last ``keep_last_turns`` assistant
turns with what follows them. The cut sits before an assistant message and
only where every tool call before it has its result before it, so a call and
its result stay together. A previous summary is an ordinary message of the
older part: a second summary folds the first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, ProviderAnswerError, ProviderError
from ..limits import admission
from ..llm import pricing, reasoning, tool_text
from ..llm.client import RetryPolicy, TurnLimits, post_json, request_record
from ..llm.dialect import RenderOptions
from ..llm.estimate import estimate
from ..llm.redact import is_secret_header
from ..llm.registry import get_dialect
from ..llm.types import PROVIDER_KEYS, ChatMessage, ProviderSettings
from ..loops import store
from .builder import Handler
from .context import LlmContext
from .llm_stack import _failed, _no_longer_ours, _settle, reserve_slot, wait_for_slot

logger = logging.getLogger("flask_solidloop.compaction")

#: What the summarizer is asked, unless ``Compaction(instructions=...)`` says otherwise.
DEFAULT_INSTRUCTIONS = (
    "You summarise the earlier part of an agent's conversation so the agent can go on "
    "without it. Keep every fact, decision, open question, identifier, number and tool "
    "result the agent may still need; drop pleasantries and repetition. Answer with the "
    "summary alone, as plain text.")
#: The summary as the model reads it: a user message starting with this.
SUMMARY_PREFIX = "Summary of the earlier conversation:\n\n"
#: Characters of one tool call's arguments or one message kept in the transcript
#: the summarizer reads (a huge tool result is cut, with a note).
TRANSCRIPT_ITEM_CHARS = 20_000


class Compaction:
    """An LLM middleware (a factory the Builder builds per turn) that replaces
    the older part of a long history with a summary, durably.

    ``trigger_tokens``: the request's estimated prompt tokens past which the
    turn summarises first. ``keep_last_turns``: assistant turns (with their
    tool results) kept as they are, at least 1. ``summarizer``: ``None`` for
    the agent's own model, or ``llm`` settings merged over the agent's (say
    ``{"model": "gpt-4o-mini"}``). ``native``: use the provider's own
    compaction where the agent's dialect has it; none of the shipped dialects
    does, so it falls back to the summary turn. ``instructions``: the
    summarizer's system prompt. ``max_tokens``: the summary's output cap
    (None: the dialect's default).

    Insert it after AgentInitialization::

        compaction = Compaction(trigger_tokens=100_000, keep_last_turns=4)

        def configure_llm_middlewares(self, builder):
            builder.insert_after(AgentInitialization, compaction)
    """

    def __init__(self, *, trigger_tokens: int, keep_last_turns: int = 4,
                 summarizer: dict[str, Any] | None = None, native: bool = False,
                 instructions: str | None = None, max_tokens: int | None = None) -> None:
        if isinstance(trigger_tokens, bool) or not isinstance(trigger_tokens, int) \
                or trigger_tokens < 1:
            raise InvalidArgumentError(
                f"Compaction trigger_tokens must be a positive int, got {trigger_tokens!r}")
        if isinstance(keep_last_turns, bool) or not isinstance(keep_last_turns, int) \
                or keep_last_turns < 1:
            raise InvalidArgumentError(
                "Compaction keep_last_turns must be an int of at least 1 (the model always "
                f"sees its last turn as it was), got {keep_last_turns!r}")
        if summarizer is not None:
            if not isinstance(summarizer, dict):
                raise InvalidArgumentError(
                    "Compaction summarizer must be None (the agent's model) or a dict of llm "
                    f"settings merged over the agent's, got {type(summarizer).__name__}")
            unknown = sorted(set(summarizer) - set(PROVIDER_KEYS))
            if unknown:
                raise InvalidArgumentError(
                    f"Compaction summarizer has unknown llm setting(s) {', '.join(unknown)}; "
                    f"known: {', '.join(PROVIDER_KEYS)}")
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 1):
            raise InvalidArgumentError(
                f"Compaction max_tokens must be a positive int or None, got {max_tokens!r}")
        self.trigger_tokens = trigger_tokens
        self.keep_last_turns = keep_last_turns
        self.summarizer = dict(summarizer) if summarizer is not None else None
        self.native = bool(native)
        self.instructions = instructions or DEFAULT_INSTRUCTIONS
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return (f"Compaction(trigger_tokens={self.trigger_tokens}, "
                f"keep_last_turns={self.keep_last_turns})")

    def __call__(self, next_step: Handler) -> Handler:
        return CompactionStep(self, next_step)


class CompactionStep:
    """One turn's compaction layer (made per turn by :class:`Compaction`)."""

    def __init__(self, config: Compaction, next_step: Handler) -> None:
        self.config = config
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        if not ctx.history:
            return self.next_step(ctx)
        tokens = request_tokens(ctx)
        if tokens <= self.config.trigger_tokens:
            return self.next_step(ctx)
        span = compaction_span(ctx.history, self.config.keep_last_turns)
        if not span:
            logger.info("loop %s: the request's estimate (%d tokens) passes the compaction "
                        "trigger (%d), but nothing is old enough to summarise; sent as it is",
                        ctx.loop_id, tokens, self.config.trigger_tokens)
            return self.next_step(ctx)
        return summary_turn(ctx, self.config, span, tokens)


def request_tokens(ctx: LlmContext) -> int:
    """The prompt tokens of the request this turn would send now, estimated
    as budgets estimate it (llm/estimate.py) over the payload the agent's
    dialect renders from ``ctx.history`` and its tools."""
    settings = ctx.agent.provider()
    dialect = get_dialect(settings.dialect)
    prompting = ctx.agent.option("tool_prompting")
    history, tools = tool_text.prepare_request(
        ctx.history, ctx.tools.definitions() if ctx.tools else [], prompting=prompting,
        result_format=tool_text.result_format(ctx.agent.option("tool_result_format"),
                                              prompting))
    options = RenderOptions(
        stream=bool(ctx.agent.option("streaming")), llm_params=ctx.agent.option("llm_params"),
        reasoning_effort=ctx.agent.option("reasoning_effort"),
        max_tokens=ctx.agent.option("max_tokens"),
        reasoning_strategies=reasoning.resolve_strategies(
            ctx.agent.option("reasoning_strategies"), settings.dialect, settings.base_url))
    payload = dialect.render(settings, history, tools, options).payload
    return estimate(payload, default_output=0).prompt_tokens


def compaction_span(history: list[ChatMessage], keep_last_turns: int) -> list[ChatMessage]:
    """The messages of ``history`` a summary may replace, oldest first: all
    before the cut but the system prompt, the first user message and the user
    messages the host pinned (``Agent(loop).pin``; only user messages can be
    pinned, so a pin never holds a call apart from its result). The cut
    is before the ``keep_last_turns``-th assistant message from the end, moved
    back to an earlier assistant message while a tool call before it has its
    result after it. Empty when nothing may be replaced, or when a message
    was not read from the database (it has no id to mark), or when it is
    a summary alone."""
    assistants = [i for i, m in enumerate(history) if m.role == "assistant"]
    if len(assistants) <= keep_last_turns:
        return []
    candidates = assistants[:len(assistants) - keep_last_turns + 1]
    first_user = next((i for i, m in enumerate(history) if m.role == "user"), None)
    for cut in reversed(candidates):
        if _splits_a_call(history, cut):
            continue
        span = [m for i, m in enumerate(history[:cut])
                if m.role != "system" and i != first_user and not m.meta.get("pinned")]
        if not span or any(m.message_id is None for m in span) \
                or all(is_summary(m) for m in span):
            # A summary alone is not summarised again: the turn right after a
            # summary turn would otherwise summarise its own summary forever.
            return []
        return span
    return []


def is_summary(message: ChatMessage) -> bool:
    """Whether a history entry is a summary (a user message this layer wrote)."""
    return message.role == "user" and (message.content or "").startswith(SUMMARY_PREFIX)


def _splits_a_call(history: list[ChatMessage], cut: int) -> bool:
    """Whether a tool call made before ``cut`` has no result before it (the
    cut would separate them)."""
    open_calls: set[str | None] = set()
    for message in history[:cut]:
        if message.role == "assistant":
            open_calls.update(call.call_id for call in message.tool_calls)
        elif message.role == "tool":
            open_calls.discard(message.tool_call_id)
    return bool(open_calls)


def transcript(span: list[ChatMessage]) -> str:
    """The messages to summarise as plain text: any dialect's model reads it,
    with or without tools, and it carries no call a provider would match to
    a result."""
    lines = []
    for message in span:
        if message.role == "assistant":
            if message.content:
                lines.append(f"[assistant] {_cut(message.content)}")
            for call in message.tool_calls:
                lines.append(f"[assistant called {call.name}] {_cut(call.arguments_raw)}")
        elif message.role == "tool":
            label = "tool error" if message.is_error else "tool result"
            lines.append(f"[{label} of {message.name}] {_cut(message.content or '')}")
        else:
            lines.append(f"[{message.role}] {_cut(message.content or '')}")
    return "\n\n".join(lines)


def _cut(text: str) -> str:
    if len(text) <= TRANSCRIPT_ITEM_CHARS:
        return text
    return f"{text[:TRANSCRIPT_ITEM_CHARS]} [... {len(text) - TRANSCRIPT_ITEM_CHARS:,} more " \
        "characters not shown]"


@dataclass(frozen=True)
class SummaryRequest:
    """The summarizer's request, rendered."""

    settings: ProviderSettings
    dialect: Any
    url: str
    payload: dict[str, Any]
    headers: dict[str, str]
    params: dict[str, str] | None
    secrets: list[str]


def summarizer_settings(ctx: LlmContext, config: Compaction) -> ProviderSettings:
    """The agent's ``llm`` settings, with the summarizer's merged over them."""
    if config.summarizer is None:
        return ctx.agent.provider()
    return ProviderSettings.from_dict({**(ctx.agent.option("llm") or {}), **config.summarizer},
                                      agent=str(ctx.agent.agent_name))


def summary_request(ctx: LlmContext, config: Compaction,
                    span: list[ChatMessage]) -> SummaryRequest:
    settings = summarizer_settings(ctx, config)
    dialect = get_dialect(settings.dialect)
    messages = [ChatMessage(role="system", content=config.instructions),
                ChatMessage(role="user", content=(
                    "Summarise this conversation between a user, an assistant and its "
                    f"tools:\n\n{transcript(span)}"))]
    rendered = dialect.render(settings, messages, [],
                              RenderOptions(stream=False, max_tokens=config.max_tokens))
    api_key = settings.resolve_api_key()
    headers = {"Content-Type": "application/json", **rendered.headers, **settings.headers,
               **dialect.auth_headers(settings, api_key)}
    secrets = [v for v in ([api_key] if api_key else [])
               + [v for k, v in settings.headers.items() if is_secret_header(k)] if v]
    return SummaryRequest(settings, dialect, settings.base_url + rendered.path,
                          rendered.payload, headers, rendered.params or None, secrets)


def summary_turn(ctx: LlmContext, config: Compaction, span: list[ChatMessage],
                 tokens: int) -> None:
    """The turn as a summary turn: the summarizer's request (on record before
    it is sent, as any turn's: decision 0025), then the one commit that
    writes the summary, marks what it replaces and queues the real turn. A
    provider error propagates to ErrorHandling, which defers or fails the
    turn as for any request (the request's event and wire record are the
    turn's: ``ctx.request_event_id``, ``ctx.wire``)."""
    request = summary_request(ctx, config, span)
    state = ctx.state
    cfg = state.config
    # The summarizer's request is a request of the loop's like any other: its
    # budget (a spent one pauses the loop here), its subject's ledger and the
    # rate buckets of the summarizer's model admit it, or defer it to its slot.
    limits = admission.limits_for(state, ctx.agent, ctx.loop, request.settings)
    slot_at: float | None = None
    if limits is not None:
        admission.check_loop(ctx.session, limits, ctx.loop, state)
        slot_at = reserve_slot(ctx, limits, request.payload, request.settings.model,
                               request.url, inline=True)
        if slot_at is None:
            return None
    ctx.secrets = request.secrets
    record = request_record(request.url, request.payload, headers=request.headers,
                            secrets=request.secrets)
    if ctx.lease is not None:
        ctx.lease.check()
    recorded = store.record_request(
        ctx.session, ctx.loop_id, ctx.execution_token, shell_id=None, wire=record,
        body_limit=cfg.wire_body_limit, repeat_history=cfg.event_repeat_history)
    ctx.request_event_id, ctx.wire = recorded.event_id, record
    # No transaction across the network call.
    store.end_transaction(ctx.session)
    if slot_at is not None and wait_for_slot(ctx, slot_at, inline=True) is None:
        return None
    ctx.requested = True
    started = time.monotonic()
    try:
        body, ctx.wire = _post(ctx, request, record)
    except ProviderError as exc:
        _failed(ctx, exc)
    answer = request.dialect.parse(body)
    summary = (answer.content or "").strip()
    if not summary:
        error = ProviderAnswerError(
            f"the summarizer ({request.settings.model}) answered no text "
            f"(finish_reason {answer.finish_reason!r}); nothing was compacted")
        error.wire = ctx.wire
        raise error
    usage = answer.usage
    if ctx.admitted is not None:
        _settle(ctx, request.settings.model, usage, 0)
    cost = pricing.cost(usage, cfg.prices.get(request.settings.model)) \
        if usage is not None else None
    meta: dict[str, Any] = {
        "model": request.settings.model,
        "compaction": {"trigger_tokens": config.trigger_tokens, "estimate_tokens": tokens,
                       "keep_last_turns": config.keep_last_turns,
                       "first_id": span[0].message_id, "last_id": span[-1].message_id},
        "metrics": {"duration_ms": round((time.monotonic() - started) * 1000, 1)}}
    if config.native:
        # No shipped dialect has provider-side compaction: the summary turn is
        # the fallback, and the message says so.
        meta["compaction"]["native"] = "unsupported by the " \
            f"{request.settings.dialect} dialect: summary turn"
    if usage is not None and cost is None:
        meta["unpriced"] = True
    ids = [m.message_id for m in span if m.message_id is not None]
    compacted = store.with_database_retry(
        lambda: store.finish_summary_turn(
            state, ctx.session, loop_id=ctx.loop_id, token=ctx.execution_token,
            content=SUMMARY_PREFIX + summary, message_ids=ids, meta=meta, usage=usage,
            cost=cost, wire=ctx.wire, event_id=ctx.request_event_id),
        session=ctx.session, seconds=cfg.database_retry_seconds, still_ours=ctx.still_ours,
        what=f"loop {ctx.loop_id}: the summary turn's end")
    ctx.committed = True
    logger.info("loop %s: compacted %d messages (estimate %d tokens, trigger %d) into "
                "summary %s", ctx.loop_id, compacted.replaced, tokens, config.trigger_tokens,
                compacted.summary_id)
    return None


def _post(ctx: LlmContext, request: SummaryRequest, record: Any) -> tuple[Any, Any]:
    """The summarizer's request, with the turn's retry policy and deadline."""
    cfg = ctx.state.config
    return post_json(  # type: ignore[no-any-return]
        request.url, request.payload, headers=request.headers, params=request.params,
        read_timeout=request.settings.read_timeout or cfg.default_read_timeout,
        connect_timeout=request.settings.connect_timeout,
        policy=RetryPolicy(
            retries=cfg.llm_retries, base_delay=cfg.llm_retry_base_delay,
            max_delay=cfg.llm_retry_max_delay, statuses=cfg.llm_retry_statuses,
            # A rate-limited key's refusal with a long wait defers the turn.
            defer_after=cfg.rate_limit_inline_wait
            if ctx.admitted is not None and ctx.admitted.reservation is not None else None),
        pool_timeout=cfg.llm_pool_timeout, secrets=request.secrets,
        should_abort=lambda: _no_longer_ours(ctx),
        retry_after_from_body=request.dialect.retry_after_from_body,
        limits=TurnLimits.starting_now(ctx.agent.option("turn_timeout"),
                                       ctx.agent.option("max_output_chars")),
        record=record)
