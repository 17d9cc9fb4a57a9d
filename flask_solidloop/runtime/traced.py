"""The turns' spans: what a ``chat`` or ``execute_tool`` span carries, read off
the turn (telemetry/tracing.py emits them; docs/decisions/0033-tracing.md).

Each function returns at once when tracing is off, so the turn bodies call
them unconditionally, one line each.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..leases import worker_identity
from ..llm import pricing
from ..llm.redact import is_secret_header, redact_secrets
from ..models import Loop, ToolCall
from ..telemetry import tracing
from ..urls import redact_urls_in

#: GenAI provider names (gen_ai.provider.name) of our dialects.
PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini"}


def run_traceparent(loop: Loop | None) -> str | None:
    """The loop run's ``traceparent`` (its invoke_agent span), if it has one."""
    run = loop.trace if loop is not None else None
    return run.get("traceparent") if isinstance(run, dict) else None


@contextlib.contextmanager
def turn(span: Any, loop: Loop) -> Iterator[None]:
    """The turn's span is current inside, and the jobs it enqueues carry the
    run's context (nothing when tracing is off: ``span`` is None)."""
    if span is None:
        yield
        return
    with tracing.use(span, turn=True), tracing.carrying(run_traceparent(loop)):
        yield


def chat_started(loop: Loop, agent: Any, token: Any, *, start_ns: int,
                 inline: bool) -> Any:
    """The ``chat {model}`` span of an LLM turn just claimed (started at
    ``start_ns``, before its claim), with a child span for the claim."""
    if not tracing.enabled():
        return None
    settings = agent.provider()
    span = tracing.start_span(
        f"{tracing.CHAT} {settings.model}", run_traceparent(loop),
        kind=tracing.SpanKind.CLIENT, start_ns=start_ns, attributes={
            "gen_ai.operation.name": tracing.CHAT,
            "gen_ai.provider.name": PROVIDERS.get(settings.dialect, settings.dialect),
            "gen_ai.request.model": settings.model,
            "gen_ai.conversation.id": str(loop.id),
            "gen_ai.agent.name": loop.agent_name,
            "solidloop.generation": str(token),
            "solidloop.lease_holder": worker_identity(),
            "solidloop.delivery": "inline" if inline else "delivered",
        })
    tracing.child(span, "solidloop.claim", start_ns=start_ns)
    return span


def chat_ended(span: Any, ctx: Any, error: BaseException | None = None) -> None:
    """End a turn's ``chat`` span with what the answer says (model, id, finish
    reason, usage, cost) and, when captured, the redacted messages."""
    if span is None:
        return
    response = ctx.response
    attributes: dict[str, Any] = {}
    if response is not None:
        raw = response.raw if isinstance(response.raw, dict) else {}
        model = ctx.agent.provider().model
        attributes.update({
            "gen_ai.response.model": raw.get("model") or raw.get("modelVersion") or model,
            "gen_ai.response.id": raw.get("id") or raw.get("responseId"),
            "gen_ai.response.finish_reasons": [response.finish_reason or "stop"],
        })
        usage = response.usage
        if usage is not None:
            cost = pricing.cost(usage, ctx.state.config.prices.get(model))
            attributes.update({
                "gen_ai.usage.input_tokens": usage.input_tokens,
                "gen_ai.usage.output_tokens": usage.output_tokens,
                "gen_ai.usage.reasoning.output_tokens": usage.reasoning_tokens,
                "solidloop.usage.reasoning_tokens": usage.reasoning_tokens,
                "solidloop.usage.cached_input_tokens": usage.cached_input_tokens,
                "solidloop.cost": float(cost) if cost is not None else None,
            })
        if tracing.capture_content():
            attributes["gen_ai.output.messages"] = tracing.content(_redacted(ctx, [{
                "role": "assistant", "finish_reason": response.finish_reason,
                "parts": [{"type": "text", "content": response.content}] + [
                    {"type": "tool_call", "id": call.call_id, "name": call.name,
                     "arguments": call.arguments_raw} for call in response.tool_calls]}]))
    if tracing.capture_content() and ctx.history:
        attributes["gen_ai.input.messages"] = tracing.content(_redacted(ctx, [
            {"role": message.role, "parts": [{"type": "text", "content": message.content}]}
            for message in ctx.history]))
    if error is None and response is None and ctx.wire is not None \
            and getattr(ctx.wire, "error", None):
        error = RuntimeError(str(ctx.wire.error))
    tracing.end_span(span, attributes=attributes, error=error)


def tool_started(loop: Loop, call: ToolCall, token: Any, *, start_ns: int,
                 inline: bool) -> Any:
    """The ``execute_tool {tool}`` span of a tool call, with its claim's span."""
    if not tracing.enabled():
        return None
    span = tracing.start_span(
        f"{tracing.EXECUTE_TOOL} {call.name}", run_traceparent(loop), start_ns=start_ns,
        attributes={
            "gen_ai.operation.name": tracing.EXECUTE_TOOL,
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.call_id or str(call.id),
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": str(loop.id),
            "gen_ai.agent.name": loop.agent_name,
            "solidloop.tool_call.id": call.id,
            "solidloop.generation": str(token),
            "solidloop.lease_holder": worker_identity(),
            "solidloop.delivery": "inline" if inline else "delivered",
        })
    tracing.child(span, "solidloop.claim", start_ns=start_ns)
    return span


def tool_ended(span: Any, ctx: Any, error: BaseException | None = None) -> None:
    """End a tool call's span: an error result marks it (``error.type`` the
    infrastructure's kind, or ``tool_error``); arguments and result only when
    captured, redacted."""
    if span is None:
        return
    result = ctx.result
    attributes: dict[str, Any] = {}
    if tracing.capture_content():
        call = ctx.tool_call
        if call is not None:
            attributes["gen_ai.tool.call.arguments"] = tracing.content(
                _redacted(ctx, call.arguments if call.arguments is not None
                          else call.arguments_raw))
        if result is not None:
            attributes["gen_ai.tool.call.result"] = tracing.content(
                _redacted(ctx, result.content))
    if error is None and result is not None and result.is_error:
        tracing.end_span(span, attributes=attributes, error=result.error_kind or "tool_error")
        return
    tracing.end_span(span, attributes=attributes, error=error)


def _redacted(ctx: Any, value: Any) -> Any:
    """``value`` through the wire log's redaction: the agent's key and secret
    header values, and the credentials of any URL."""
    secrets = list(getattr(ctx, "secrets", None) or ())
    if not secrets and ctx.agent is not None:
        settings = ctx.agent.provider()
        key = settings.resolve_api_key()
        secrets = [v for v in ([key] if key else []) + [
            v for k, v in settings.headers.items() if is_secret_header(k)] if v]
    value = redact_secrets(value, secrets)
    return _urls(value)


def _urls(value: Any) -> Any:
    if isinstance(value, str):
        return redact_urls_in(value)
    if isinstance(value, dict):
        return {k: _urls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_urls(v) for v in value]
    return value


def now_ns() -> int:
    """The wall clock a span's start is taken from, only when tracing is on."""
    return time.time_ns() if tracing.enabled() else 0
