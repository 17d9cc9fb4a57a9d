"""The default LLM turn stack, outermost first:

ErrorHandling → AgentInitialization → (host middlewares) → NetworkCalling → ResponseParsing

* ErrorHandling turns the failures a turn can expect into recorded outcomes
  under the generation fence: a limit pauses the loop, a provider error fails
  it with the status and a body excerpt.
* AgentInitialization checks limits, resolves the tools and loads the history
  the model will see. Anything inserted before it runs on an empty context.
* NetworkCalling creates the hidden ``processing`` assistant shell, renders
  the request, sends it (with retries) and keeps the wire record.
* ResponseParsing is the canonical write: under the row lock and fence it
  finalizes the message, records tool calls, usage and the wire event, and
  either completes the loop or enters the tool phase with the tool jobs
  enqueued in the same commit.

A middleware that *replaces* ResponseParsing must keep its fence, or it loses
the durability guarantees.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..errors import LimitExceededError, LostLeaseError, ProviderError
from ..llm import pricing, reasoning
from ..llm.client import AbortedError, RetryPolicy, post_json
from ..llm.dialect import StreamDelta
from ..llm.redact import is_secret_header, redact_secrets
from ..llm.registry import get_dialect
from ..llm.streaming import post_stream
from ..llm.types import ChatMessage, ToolCallRequest
from ..loops.fence import lock_loop, owns, transition
from ..mcp.registry import ToolRegistry
from ..models import Event, Loop, McpSession, Message, ToolCall
from .builder import Handler
from .context import LlmContext

logger = logging.getLogger("flask_solidloop.llm")


class ErrorHandling:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        try:
            return self.next_step(ctx)
        except LostLeaseError:
            raise
        except LimitExceededError as exc:
            ctx.session.rollback()
            _end_turn(ctx, to="paused", error_message=str(exc))
        except AbortedError:
            ctx.session.rollback()
            logger.info("loop %s: the turn stopped: the loop was paused or stopped", ctx.loop_id)
        except ProviderError as exc:
            ctx.session.rollback()
            # Exception text can quote a request (and so a key): scrub it first.
            message = redact_secrets(f"{type(exc).__name__}: {exc}",
                                     ctx.extras.get("secrets", []))
            logger.warning("loop %s: provider error: %s", ctx.loop_id, message)
            _end_turn(ctx, to="failed", error_message=message)
        return None


def _end_turn(ctx: LlmContext, *, to: str, error_message: str) -> None:
    if ctx.lease is not None and ctx.lease.lost():
        return  # not ours any more: the reaper or the new generation decides
    loop = transition(
        ctx.session, ctx.loop_id, from_="running", to=to,
        expected_token=ctx.execution_token, error_message=error_message,
    )
    if loop is None:
        ctx.session.rollback()
        return
    if ctx.shell_id is not None:
        shell = ctx.session.get(Message, ctx.shell_id)
        if shell is not None and shell.status == "processing":
            shell.status = "failed"
            shell.is_hidden = True
    if ctx.wire is not None:
        ctx.session.add(Event(
            loop_id=ctx.loop_id, message_id=ctx.shell_id, kind="llm_request",
            status_code=ctx.wire.status, duration_ms=ctx.wire.duration_ms,
            error=error_message, payload=ctx.wire.to_payload(),
        ))
    ctx.session.commit()


class AgentInitialization:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        loop = ctx.loop
        steps = loop.step_count - loop.run_step_base
        max_steps = ctx.agent.option("max_steps")
        if max_steps and steps >= max_steps:
            raise LimitExceededError(
                f"max_steps reached ({steps} of {max_steps} LLM turns in this run); "
                "resume() starts a new run"
            )
        max_duration = ctx.agent.effective_max_duration(ctx.state.config.default_max_duration)
        elapsed = ctx.session.scalar(
            select(func.extract("epoch", func.now() - Loop.run_started_at))
            .where(Loop.id == ctx.loop_id)
        )
        if elapsed is not None and float(elapsed) > max_duration:
            raise LimitExceededError(
                f"max_duration reached ({int(elapsed)}s of {max_duration}s in this run); "
                "resume() starts a new run"
            )
        ctx.tools = _tools_with_snapshots(ctx)
        ctx.history = load_history(ctx)
        ctx.session.commit()  # end the read transaction before the network call
        return self.next_step(ctx)


def _tools_with_snapshots(ctx: LlmContext) -> ToolRegistry:
    """The agent's tools, remote servers taken from the loop's snapshot when it has
    one. A server listed for the first time becomes part of the snapshot: later
    turns advertise the same tools without asking it again, and a server that is
    briefly down fails only the calls made to it, not the turn."""
    session = ctx.session
    snapshots = {row.server_name: row.tools for row in session.scalars(
        select(McpSession).where(McpSession.loop_id == ctx.loop_id))}
    registry = ToolRegistry.build(ctx.agent.tool_entries(), agent=str(ctx.agent.agent_name),
                                  snapshots=snapshots)
    for server_name, (tools, state) in registry.new_snapshots.items():
        session.execute(
            pg_insert(McpSession)
            .values(loop_id=ctx.loop_id, server_name=server_name, tools=tools,
                    session_state=state)
            .on_conflict_do_nothing(index_elements=["loop_id", "server_name"])
        )
    return registry


#: Keys of a message's metadata that its dialect gets back next turn.
PROVIDER_META_KEYS = ("anthropic_blocks", "gemini_parts")


def load_history(ctx: LlmContext) -> list[ChatMessage]:
    """The visible, completed history in the provider-neutral shape."""
    session = ctx.session
    messages = list(session.scalars(
        select(Message)
        .where(Message.loop_id == ctx.loop_id, Message.is_hidden.is_(False),
               Message.status == "completed")
        .order_by(Message.id)
    ))
    calls_by_message: dict[int, list[ToolCall]] = {}
    calls_by_id: dict[int, ToolCall] = {}
    call_ids: dict[int, str] = {}
    for call in session.scalars(
        select(ToolCall).where(ToolCall.loop_id == ctx.loop_id).order_by(ToolCall.position)
    ):
        calls_by_message.setdefault(call.message_id, []).append(call)
        calls_by_id[call.id] = call
        call_ids[call.id] = call.call_id or f"call_{call.id}"
    history = []
    for message in messages:
        if message.role == "assistant":
            meta = message.meta or {}
            history.append(ChatMessage(
                role="assistant",
                content=message.content,
                reasoning=message.reasoning,
                meta={k: meta[k] for k in PROVIDER_META_KEYS if k in meta},
                tool_calls=[
                    ToolCallRequest(call_ids[c.id], c.name, c.arguments_raw or "")
                    for c in calls_by_message.get(message.id, [])
                ],
            ))
        elif message.role == "tool":
            answered = calls_by_id.get(message.tool_call_id or -1)
            history.append(ChatMessage(
                role="tool", content=message.content,
                tool_call_id=call_ids.get(message.tool_call_id or -1),
                name=answered.name if answered else None,
                is_error=bool((message.meta or {}).get("is_error")),
            ))
        else:
            history.append(ChatMessage(role=message.role, content=message.content))
    return history


class NetworkCalling:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        settings = ctx.agent.provider()
        _check_lease(ctx)
        loop = lock_loop(ctx.session, ctx.loop_id)
        if not owns(loop, ctx.execution_token):
            ctx.session.rollback()
            raise LostLeaseError(f"loop {ctx.loop_id} changed hands before the request")
        shell = Message(loop_id=ctx.loop_id, role="assistant", status="processing",
                        is_hidden=True, content="")
        ctx.session.add(shell)
        ctx.session.flush()
        ctx.shell_id = shell.id  # read before the commit: afterwards it would reload
        ctx.session.commit()

        dialect = get_dialect(settings.dialect)
        strategies = ctx.agent.option("reasoning_strategies")
        streaming = bool(ctx.agent.option("streaming"))
        rendered = dialect.render(
            settings,
            ctx.history,
            ctx.tools.definitions() if ctx.tools else [],
            stream=streaming,
            llm_params=ctx.agent.option("llm_params"),
            reasoning_effort=ctx.agent.option("reasoning_effort"),
            max_tokens=ctx.agent.option("max_tokens"),
            reasoning_strategies=strategies,
        )
        ctx.reasoning_carried = reasoning.carried(ctx.history, {
            index: reasoning.plan(message, strategies, dialect.name)
            for index, message in enumerate(ctx.history) if message.role == "assistant"
        })
        api_key = settings.resolve_api_key()
        headers = {"Content-Type": "application/json", **rendered.headers, **settings.headers,
                   **dialect.auth_headers(settings, api_key)}
        config = ctx.state.config
        policy = RetryPolicy(
            retries=config.llm_retries, base_delay=config.llm_retry_base_delay,
            max_delay=config.llm_retry_max_delay, statuses=config.llm_retry_statuses,
        )
        common: dict[str, Any] = dict(
            headers=headers, params=rendered.params or None,
            read_timeout=settings.read_timeout or config.default_read_timeout,
            connect_timeout=settings.connect_timeout, policy=policy,
            # The key and every secret-looking configured header value are
            # scrubbed from anything stored, wherever they appear.
            secrets=[v for v in ([api_key] if api_key else [])
                     + [v for k, v in settings.headers.items() if is_secret_header(k)] if v],
            should_abort=lambda: _no_longer_ours(ctx),
            retry_after_from_body=dialect.retry_after_from_body,
        )
        ctx.extras["secrets"] = common["secrets"]
        url = settings.base_url + rendered.path
        # No transaction may stay open across the network call: it would pin a
        # connection, hold locks and trip idle_in_transaction_session_timeout.
        ctx.session.commit()
        started = time.monotonic()
        try:
            if streaming:
                partial = PartialWriter(ctx)
                ctx.response, ctx.wire, ctx.metrics = post_stream(
                    url, rendered.payload, make_aggregator=dialect.aggregator,
                    on_delta=partial, **common)
            else:
                body, ctx.wire = post_json(url, rendered.payload, **common)
                ctx.metrics = {"duration_ms": round((time.monotonic() - started) * 1000, 1)}
                ctx.response = dialect.parse(body)
        except ProviderError as exc:
            # Keep the record we have: a 2xx whose body would not parse is exactly
            # the response someone will want to look at.
            ctx.wire = getattr(exc, "wire", None) or ctx.wire
            raise
        if not streaming and ctx.response.usage and ctx.response.usage.output_tokens:
            seconds = max(time.monotonic() - started, 1e-6)
            ctx.metrics["output_tokens_per_s"] = round(
                ctx.response.usage.output_tokens / seconds, 1)
        return self.next_step(ctx)


class PartialWriter:
    """Writes a streaming turn's text so far onto its hidden shell, at most every
    SOLIDLOOP_STREAM_UPDATE_INTERVAL seconds, so a watcher (the admin, a host
    view) sees progress. The shell stays hidden and ``processing``: a turn that
    never commits never puts its partial into the history the model sees."""

    def __init__(self, ctx: LlmContext) -> None:
        self.ctx = ctx
        self.interval = ctx.state.config.stream_update_interval
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.last_write = time.monotonic()

    def __call__(self, delta: StreamDelta) -> None:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        now = time.monotonic()
        if now - self.last_write < self.interval:
            return
        self.last_write = now
        ctx = self.ctx
        if ctx.lease is not None and ctx.lease.lost():
            return
        ctx.session.execute(
            update(Message)
            .where(Message.id == ctx.shell_id, Message.status == "processing")
            .values(content="".join(self.content), reasoning="".join(self.reasoning) or None)
        )
        ctx.session.commit()


def _check_lease(ctx: LlmContext) -> None:
    """Before any canonical write: yield silently if the renewer lost our lease."""
    if ctx.lease is not None:
        ctx.lease.check()


def _no_longer_ours(ctx: LlmContext) -> bool:
    if ctx.lease is not None and ctx.lease.lost():
        return True
    row = ctx.session.execute(
        select(Loop.status, Loop.execution_token).where(Loop.id == ctx.loop_id)
    ).one_or_none()
    ctx.session.rollback()
    return row is None or row.status != "running" or row.execution_token != ctx.execution_token


class ResponseParsing:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        response = ctx.response
        assert response is not None and ctx.shell_id is not None
        session = ctx.session
        _check_lease(ctx)
        loop = lock_loop(session, ctx.loop_id)
        if not owns(loop, ctx.execution_token):
            session.rollback()
            raise LostLeaseError(f"loop {ctx.loop_id} changed hands during the request")
        assert loop is not None
        shell = session.get(Message, ctx.shell_id)
        assert shell is not None
        shell.content = response.content
        shell.reasoning = response.reasoning
        shell.finish_reason = response.finish_reason
        shell.status = "completed"
        shell.is_hidden = False
        shell.completed_at = func.now()
        model = ctx.agent.provider().model
        meta: dict[str, Any] = {**response.provider_meta, "model": model,
                                "metrics": ctx.metrics,
                                "reasoning_carried": ctx.reasoning_carried}
        if response.usage is not None:
            shell.usage = response.usage.to_dict()
            loop.input_tokens += response.usage.input_tokens
            loop.output_tokens += response.usage.output_tokens
            turn_cost = pricing.cost(response.usage, ctx.state.config.prices.get(model))
            if turn_cost is None:
                meta["unpriced"] = True
            else:
                shell.cost = turn_cost
                loop.cost = (loop.cost or 0) + turn_cost
        shell.meta = meta
        loop.step_count += 1
        calls = []
        for position, request in enumerate(response.tool_calls):
            arguments, route = _parse_arguments(request.arguments_raw), None
            if ctx.tools is not None:
                route = ctx.tools.resolve(request.name)
            call = ToolCall(
                loop_id=ctx.loop_id, message_id=shell.id, position=position,
                call_id=request.call_id or None, name=request.name,
                server_name=route.server_name if route else None,
                tool_name=route.tool_name if route else None,
                arguments_raw=request.arguments_raw, arguments=arguments,
            )
            session.add(call)
            calls.append(call)
        if ctx.wire is not None:
            session.add(Event(
                loop_id=ctx.loop_id, message_id=shell.id, kind="llm_request",
                status_code=ctx.wire.status, duration_ms=ctx.wire.duration_ms,
                payload=ctx.wire.to_payload(),
            ))
        session.flush()
        if not calls:
            loop.status = "completed"
            loop.execution_token = None
            loop.lease_expires_at = None
            loop.finished_at = func.now()
            loop.error_message = None
        else:
            # Tool phase: the loop stays running under this generation; no LLM lease.
            loop.lease_expires_at = None
            to_enqueue = calls[:1] if ctx.agent.option("sequential_tool_calls") else calls
            for call in to_enqueue:
                ctx.state.dispatch.tool_call(session, call.id, ctx.execution_token,
                                             loop_id=ctx.loop_id)
        session.commit()
        ctx.committed = True
        ctx.message = shell
        return self.next_step(ctx)


def _parse_arguments(raw: str | None) -> dict[str, Any] | None:
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


DEFAULT_LLM_STACK = (ErrorHandling, AgentInitialization, NetworkCalling, ResponseParsing)
