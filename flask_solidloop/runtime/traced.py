"""The turns' spans: what a ``chat`` or ``execute_tool`` span carries, read off
the turn (telemetry/tracing.py emits them; docs/decisions/0033-tracing.md).

Each function returns at once when tracing is off, so the turn bodies call
them unconditionally, one line each.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..leases import worker_identity
from ..llm import pricing
from ..llm.redact import is_secret_header, redact_secrets
from ..models import Loop, ToolCall
from ..telemetry import tracing
from ..urls import redact_urls_in

#: GenAI provider names (gen_ai.provider.name) of our dialects.
PROVIDERS = {"openai": "openai", "openai_responses": "openai", "anthropic": "anthropic",
             "gemini": "gcp.gemini"}


class TurnRun(NamedTuple):
    """What a turn's spans need of its loop (and tool call), read before its
    claim: the claim's commit expires the objects, and reading them after
    would cost a SELECT (and a transaction) per turn."""

    traceparent: str | None
    loop_id: int
    agent_name: str
    start_ns: int
    call_id: int | None = None
    call_name: str | None = None
    provider_call_id: str | None = None


def run_of(loop: Loop, call: ToolCall | None = None) -> TurnRun | None:
    """The turn's :class:`TurnRun`, started now; None when tracing is off."""
    if not tracing.enabled():
        return None
    run = loop.trace
    return TurnRun(run.get("traceparent") if isinstance(run, dict) else None, loop.id,
                   loop.agent_name, time.time_ns(),
                   *((call.id, call.name, call.call_id) if call is not None else ()))


@contextlib.contextmanager
def turn(span: Any, run: TurnRun | None) -> Iterator[None]:
    """The turn's span is current inside, and the jobs it enqueues carry the
    run's context (nothing when tracing is off: ``span`` is None)."""
    if span is None or run is None:
        yield
        return
    with tracing.use(span, turn=True), tracing.carrying(run.traceparent):
        yield


def chat_started(run: TurnRun | None, agent: Any, token: Any, *, inline: bool) -> Any:
    """The ``chat {model}`` span of an LLM turn just claimed (started when
    :func:`run_of` was read, before its claim), with a child span for the claim."""
    if run is None:
        return None
    settings = agent.provider()
    span = tracing.start_span(
        f"{tracing.CHAT} {settings.model}", run.traceparent,
        kind=tracing.SpanKind.CLIENT, start_ns=run.start_ns, attributes={
            "gen_ai.operation.name": tracing.CHAT,
            "gen_ai.provider.name": PROVIDERS.get(settings.dialect, settings.dialect),
            "gen_ai.request.model": settings.model,
            "gen_ai.conversation.id": str(run.loop_id),
            "gen_ai.agent.name": run.agent_name,
            "solidloop.generation": str(token),
            "solidloop.lease_holder": worker_identity(),
            "solidloop.delivery": "inline" if inline else "delivered",
        })
    tracing.child(span, "solidloop.claim", start_ns=run.start_ns)
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
            "gen_ai.response.finish_reasons":
                [response.finish_reason] if response.finish_reason else None,
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


def tool_started(run: TurnRun | None, token: Any, *, inline: bool) -> Any:
    """The ``execute_tool {tool}`` span of a tool call, with its claim's span."""
    if run is None:
        return None
    span = tracing.start_span(
        f"{tracing.EXECUTE_TOOL} {run.call_name}", run.traceparent, start_ns=run.start_ns,
        attributes={
            "gen_ai.operation.name": tracing.EXECUTE_TOOL,
            "gen_ai.tool.name": run.call_name,
            "gen_ai.tool.call.id": run.provider_call_id or str(run.call_id),
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": str(run.loop_id),
            "gen_ai.agent.name": run.agent_name,
            "solidloop.tool_call.id": run.call_id,
            "solidloop.generation": str(token),
            "solidloop.lease_holder": worker_identity(),
            "solidloop.delivery": "inline" if inline else "delivered",
        })
    tracing.child(span, "solidloop.claim", start_ns=run.start_ns)
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
        # The facts read before the tool ran: the call object is expired by
        # then, and reading it would cost a query.
        call = ctx.facts if ctx.facts is not None else ctx.tool_call
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


