"""The default LLM turn stack, outermost first:

ErrorHandling → AgentInitialization → (host middlewares) → NetworkCalling → ResponseParsing

* ErrorHandling turns the failures a turn can expect into recorded outcomes
  under the generation fence: a limit pauses the loop, a provider error fails
  it with the status and a body excerpt.
* AgentInitialization checks limits, resolves the tools and loads the history
  the model will see (unless the turn's claim read it). It only reads: the
  claim committed before the stack ran. Anything inserted before it runs on
  an empty context.
* NetworkCalling creates the hidden ``processing`` assistant shell (unless the
  turn's claim wrote it), renders the request, puts it on record (the
  ``llm_request`` event, pending until the turn's end completes it: decision
  0025), sends it (with retries) and keeps the wire record.
* ResponseParsing is the canonical write: under the row lock and fence it
  finalizes the message, records tool calls, usage and the wire event, and
  either completes the loop or enters the tool phase with the tool jobs
  enqueued in the same commit (the first call leased to this thread instead,
  when it continues inline: ``ctx.adopt_next``, returned in ``ctx.adopted``).

A middleware that *replaces* ResponseParsing must keep its fence, or it loses
the durability guarantees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, NoReturn

from ..dbapi import is_transient
from ..errors import (
    AbortedError,
    AgentDefinitionError,
    BudgetExceededError,
    HistoryTooLargeError,
    LimitExceededError,
    LostLeaseError,
    ProviderAnswerError,
    ProviderConnectionLostError,
    ProviderError,
    SolidLoopError,
    TurnLimitError,
    is_provider_outage,
)
from ..limits import admission, rates
from ..llm import output, pricing, reasoning, tool_text
from ..llm.client import (
    RetryPolicy,
    TurnLimits,
    post_json,
    post_json_async,
    request_record,
    shared_client,
)
from ..llm.dialect import RenderOptions, StreamDelta
from ..llm.redact import is_secret_header, redact_secrets
from ..llm.registry import get_dialect
from ..llm.streaming import output_chars, post_stream, post_stream_async
from ..llm.types import ChatMessage
from ..loops import queries, store
from ..mcp.registry import ToolRegistry
from ..telemetry import metrics, tracing
from ..urls import redact_urls_in
from . import watch_arrivals
from .builder import Handler
from .context import LlmContext
from .waits import call_wait

logger = logging.getLogger("flask_solidloop.llm")


class ErrorHandling:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        return handle_errors(ctx, lambda: self.next_step(ctx))


def handle_errors(ctx: LlmContext, step: Callable[[], Any]) -> Any:
    """ErrorHandling's work: run ``step`` (the rest of the stack), and turn the
    failures a turn can expect into recorded outcomes under the fence. The
    end of a handed-off turn (:class:`HandedOff`) runs inside it too."""
    try:
        return step()
    except LostLeaseError:
        raise
    except LimitExceededError as exc:
        ctx.session.rollback()
        message = f"BudgetExceededError: {exc}" \
            if isinstance(exc, BudgetExceededError) else str(exc)
        if isinstance(exc, BudgetExceededError):
            logger.info("loop %s: %s", ctx.loop_id, message)
        _end_turn(ctx, to="paused", error_message=message)
    except HistoryTooLargeError as exc:
        ctx.session.rollback()
        logger.warning("loop %s: %s", ctx.loop_id, exc)
        _end_turn(ctx, to="failed", error_message=f"{type(exc).__name__}: {exc}")
    except AbortedError:
        ctx.session.rollback()
        _count(ctx, "aborted")
        logger.info("loop %s: the turn stopped: the loop was paused or stopped", ctx.loop_id)
    except ProviderError as exc:
        store.recover(ctx.session)
        tracing.note_error(exc)
        # Exception text can quote a request (and so a key): scrub it first.
        message = redact_urls_in(redact_secrets(f"{type(exc).__name__}: {exc}",
                                                ctx.secrets))
        if ctx.admitted is not None and ctx.admitted.wait > 0 \
                and getattr(exc, "retry_after", None) is not None:
            # A rate-limited key refused with a wait: every worker is off
            # the key until then, and this turn goes at the block's end.
            _defer_to(ctx, ctx.admitted, ctx.admitted.wait, error_message=message)
            return None
        if is_provider_outage(exc) and _defer(
                ctx, message, max_attempts=BROKEN_RESPONSE_DEFERRALS
                if isinstance(exc, ProviderConnectionLostError) else None):
            return None
        if isinstance(exc, TurnLimitError) and ctx.partial is not None:
            ctx.partial.keep()  # what arrived stays on the failed shell
        logger.warning("loop %s: provider error: %s", ctx.loop_id, message)
        _end_turn(ctx, to="failed", error_message=message)
    return None


#: Deferrals a turn gets, in one outage, for a connection that broke after its
#: request was sent (ProviderConnectionLostError): each one sends (and may bill)
#: the request again, so a proxy that always cuts long answers costs a few
#: requests, not a quarter of an hour of them.
BROKEN_RESPONSE_DEFERRALS = 3


def _defer(ctx: LlmContext, message: str, *, max_attempts: int | None = None) -> bool:
    """The provider is away or overloaded past the request's own retries: the turn
    goes back to the queue, due later, holding nothing (store.defer_llm_turn).
    False when the outage has lasted SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT (or, for
    a broken connection, ``max_attempts`` deferrals): the turn then fails, the
    outage's length in its message."""
    if ctx.lease is not None and ctx.lease.lost():
        return True  # not ours any more: nothing to defer
    max_wait = ctx.state.config.provider_outage_max_wait
    deferred = store.defer_llm_turn(ctx.state, ctx.session, ctx.loop_id, ctx.execution_token,
                                    error_message=message, max_wait=max_wait,
                                    max_attempts=max_attempts, wire=ctx.wire,
                                    shell_id=ctx.shell_id, event_id=ctx.request_event_id)
    if deferred is not None:
        _count(ctx, "deferred", message)
        logger.warning("loop %s: the provider is out (%s); deferred %d time(s) since %s, next "
                       "try in %.0fs", ctx.loop_id, message, deferred.attempts,
                       deferred.since.isoformat(timespec="seconds"), deferred.delay_seconds)
        return True
    loop = queries.get_loop(ctx.session, ctx.loop_id)
    ctx.session.rollback()
    if loop is None or not queries.owns(loop, ctx.execution_token):
        return True
    since = loop.provider_wait_since
    waited = f" for {_minutes(loop)} ({loop.provider_wait_attempts} deferred turns)" \
        if since is not None else ""
    if max_attempts is not None and since is not None \
            and loop.provider_wait_attempts >= max_attempts:
        _end_turn(ctx, to="failed", error_message=(
            f"the connection to the provider broke mid-response again after "
            f"{loop.provider_wait_attempts} deferred turns (over {_minutes(loop)}); each sent "
            f"the request again, so it is not sent any more; last error: {message}"))
        return True
    _end_turn(ctx, to="failed", error_message=(
        f"the provider stayed out{waited}, past SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT "
        f"({max_wait:g}s); last error: {message}"))
    return True


def _minutes(loop: Any) -> str:
    """How long the loop's provider outage has lasted, as a person reads it."""
    seconds = (datetime.now(UTC) - loop.provider_wait_since).total_seconds()
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f}s"


def _end_turn(ctx: LlmContext, *, to: str, error_message: str) -> None:
    if ctx.lease is not None and ctx.lease.lost():
        return  # not ours any more: the reaper or the new generation decides
    _count(ctx, to, error_message)
    try:
        store.with_database_retry(
            lambda: store.end_turn(ctx.session, ctx.loop_id, ctx.execution_token, to=to,
                                   error_message=error_message, shell_id=ctx.shell_id,
                                   wire=ctx.wire, body_limit=ctx.state.config.wire_body_limit,
                                   repeat_history=ctx.state.config.event_repeat_history,
                                   ends=store.loop_ends(ctx.state, ctx.loop),
                                   event_id=ctx.request_event_id),
            session=ctx.session, seconds=ctx.state.config.database_retry_seconds,
            still_ours=ctx.still_ours, what=f"loop {ctx.loop_id}: the turn's end")
    except Exception as exc:
        if not is_transient(exc):
            raise
        store.recover(ctx.session)
        logger.warning("loop %s: the database failed as the turn ended (%s): it is left "
                       "to its lease, and the reaper queues it again", ctx.loop_id,
                       type(exc).__name__)


def _count(ctx: LlmContext, outcome: str, error_message: str | None = None) -> None:
    """An LLM turn that ended without an answer, for the metrics (nothing while
    they are off): its outcome, and its error's failure class (the admin's)."""
    if metrics.enabled():
        try:
            model = ctx.agent.provider().model
        except Exception:  # a broken definition is what failed the turn
            model = None
        metrics.llm_turn(ctx.agent.agent_name, model, outcome, error=None if error_message
                         is None else queries.classify_failure(error_message))


class AgentInitialization:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        # Reads only (and the tool snapshots a first listing writes): the turn's
        # claim committed before the stack ran. No transaction stays open across
        # the network call; the rows read stay loaded for the turn's end.
        self._initialize(ctx)
        store.end_transaction(ctx.session, keep_objects=True)
        return self.next_step(ctx)

    def _initialize(self, ctx: LlmContext) -> None:
        loop = ctx.loop
        steps = loop.step_count - loop.run_step_base
        max_steps = ctx.agent.option("max_steps")
        if max_steps and steps >= max_steps:
            raise LimitExceededError(
                f"max_steps reached ({steps} of {max_steps} LLM turns in this run); "
                "resume() starts a new run"
            )
        max_duration = ctx.agent.effective_max_duration(ctx.state.config.default_max_duration)
        elapsed = (ctx.claim.run_elapsed_seconds if ctx.claim is not None
                   else queries.run_elapsed_seconds(ctx.session, ctx.loop_id))
        if elapsed is not None and elapsed > max_duration:
            raise LimitExceededError(
                f"max_duration reached ({int(elapsed)}s of {max_duration}s in this run); "
                "resume() starts a new run"
            )
        ctx.tools = _tools_with_snapshots(ctx)
        if loop.output_schema is not None and output.OUTPUT_TOOL in ctx.tools.names:
            # Anthropic and Gemini are asked for the answer through a tool of
            # that name; two tools with one name is a request they refuse.
            raise AgentDefinitionError(
                f"agent {ctx.agent.agent_name!r} has output_type and a tool named "
                f"{output.OUTPUT_TOOL!r}, the name structured output's own tool takes; "
                "rename that tool (or its mcps entry's prefix)")
        carried = ctx.claim.history if ctx.claim is not None else None
        ctx.history = carried if carried is not None else queries.history(ctx.session,
                                                                          ctx.loop_id)
        cap = ctx.state.config.max_history_bytes
        size = ctx.history_chars = history_size(ctx.history)
        if cap is not None and size > cap:
            ctx.history = []  # not kept while the turn ends
            raise HistoryTooLargeError(
                f"the loop's history is {_amount(size)} of text, past "
                f"SOLIDLOOP_MAX_HISTORY_BYTES ({_amount(cap)}); no model takes a prompt "
                "that large: start a new loop from a summary (or raise the cap)")


def _amount(chars: int) -> str:
    return f"{chars / 1e6:.1f} MB" if chars >= 1_000_000 else f"{chars:,} characters"


def history_size(history: list[Any]) -> int:
    """The history's text, in characters (a byte each for ASCII): contents,
    reasoning and tool-call arguments."""
    return sum(len(m.content or "") + len(m.reasoning or "") + sum(
        len(c.arguments_raw or "") for c in (m.tool_calls or ())) for m in history)


def _tools_with_snapshots(ctx: LlmContext) -> ToolRegistry:
    """The agent's tools, remote servers taken from the loop's snapshot when it has
    one. A server listed for the first time becomes part of the snapshot: later
    turns advertise the same tools without asking it again, and a server that is
    briefly down fails only the calls made to it, not the turn."""
    entries = ctx.agent.tool_entries()
    # Only remote servers have snapshots: an in-process-only agent reads none.
    remote = [str(entry["name"]) for entry in entries if entry.get("toolset") is None]
    snapshots = queries.tool_snapshots(ctx.session, ctx.loop_id) if remote else {}
    if any(name not in snapshots for name in remote):
        # Listing a server is a network call: never inside a transaction.
        store.end_transaction(ctx.session)
    registry = ToolRegistry.build(entries, agent=str(ctx.agent.agent_name), snapshots=snapshots)
    if registry.new_snapshots:
        store.record_tool_snapshots(ctx.session, ctx.loop_id, registry.new_snapshots)
    return registry


class NetworkCalling:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        settings = ctx.agent.provider()
        _check_lease(ctx)
        # Read now, from the loop the claim loaded: the writes below (a shell, a
        # stream's flushes) expire it, and ResponseParsing must not load it again.
        ctx.output_schema = ctx.loop.output_schema
        if ctx.shell_id is None:  # the claim wrote it, unless a step runs in between
            ctx.shell_id = store.open_shell(ctx.session, ctx.loop_id, ctx.execution_token)

        # The loop's budget, before anything is rendered: a reached limit pauses
        # the loop here; near one, the model reads a note in this request.
        limits = admission.limits_for(ctx.state, ctx.agent, ctx.loop, settings)
        note = admission.check_loop(ctx.session, limits, ctx.loop, ctx.state) \
            if limits is not None else None
        store.end_transaction(ctx.session, keep_objects=True)

        dialect = get_dialect(settings.dialect)
        # None means the default for this server (no reasoning field on OpenAI-
        # compatible servers but DeepSeek's); the resolved list is stored on the
        # message, so what was sent back is visible.
        strategies = reasoning.resolve_strategies(ctx.agent.option("reasoning_strategies"),
                                                  settings.dialect, settings.base_url)
        ctx.reasoning_strategies = strategies
        streaming = bool(ctx.agent.option("streaming"))
        # Tools as text for servers without tool calling (see llm/tool_text.py):
        # in the system prompt instead of ``tools``, past calls and results as text.
        prompting = ctx.agent.option("tool_prompting")
        history, tools = tool_text.prepare_request(
            ctx.history, ctx.tools.definitions() if ctx.tools else [], prompting=prompting,
            result_format=tool_text.result_format(ctx.agent.option("tool_result_format"),
                                                  prompting))
        options = RenderOptions(
            stream=streaming,
            llm_params=ctx.agent.option("llm_params"),
            reasoning_effort=ctx.agent.option("reasoning_effort"),
            max_tokens=ctx.agent.option("max_tokens"),
            reasoning_strategies=strategies,
            output_schema=ctx.output_schema,
        )
        rendered = dialect.render(settings, with_note(history, note), tools, options)
        url = settings.base_url + rendered.path
        slot_at: float | None = None
        if limits is not None:
            slot_at = reserve_slot(ctx, limits, rendered.payload, settings.model, url)
            if slot_at is None:
                return None
            admitted_note = ctx.admitted.note if ctx.admitted is not None else None
            if admitted_note is not None and note is None:
                rendered = dialect.render(settings, with_note(history, admitted_note), tools,
                                          options)
        # A dialect that sends only the newest part of the history (Responses
        # chained with previous_response_id) names where it starts.
        first_sent = getattr(dialect, "first_sent", None)
        start = first_sent(settings, history) if first_sent is not None else 0
        ctx.reasoning_carried = reasoning.carried(history, {
            index: reasoning.plan(message, strategies, dialect.name)
            for index, message in enumerate(history)
            if message.role == "assistant" and index >= start
        })
        api_key = settings.resolve_api_key()
        headers = {"Content-Type": "application/json", **rendered.headers, **settings.headers,
                   **dialect.auth_headers(settings, api_key)}
        config = ctx.state.config
        policy = RetryPolicy(
            retries=config.llm_retries, base_delay=config.llm_retry_base_delay,
            max_delay=config.llm_retry_max_delay, statuses=config.llm_retry_statuses,
            # A rate-limited key's refusal with a long wait defers the turn.
            defer_after=config.rate_limit_inline_wait
            if ctx.admitted is not None and ctx.admitted.reservation is not None else None,
        )
        common: dict[str, Any] = dict(
            headers=headers, params=rendered.params or None,
            read_timeout=settings.read_timeout or config.default_read_timeout,
            connect_timeout=settings.connect_timeout, policy=policy,
            pool_timeout=config.llm_pool_timeout,
            # The key and every secret-looking configured header value are
            # scrubbed from anything stored, wherever they appear.
            secrets=[v for v in ([api_key] if api_key else [])
                     + [v for k, v in settings.headers.items() if is_secret_header(k)] if v],
            should_abort=lambda: _no_longer_ours(ctx),
            retry_after_from_body=dialect.retry_after_from_body,
            # One deadline for the whole turn: its retries, its stream and any
            # continuation share it.
            limits=TurnLimits.starting_now(ctx.agent.option("turn_timeout"),
                                           ctx.agent.option("max_output_chars")),
        )
        ctx.secrets = common["secrets"]
        record = request_record(url, rendered.payload, headers=headers, secrets=ctx.secrets)
        _record_request(ctx, record)
        # No transaction may stay open across the network call: it would pin a
        # connection, hold locks and trip idle_in_transaction_session_timeout.
        store.end_transaction(ctx.session)
        if slot_at is not None:
            slot_at = wait_for_slot(ctx, slot_at)
            if slot_at is None:
                return None
        request = OutgoingRequest(url=url, payload=rendered.payload, streaming=streaming,
                                  dialect=dialect, model=settings.model, common=common,
                                  record=record, slot_at=slot_at)
        if ctx.hand_off:
            # Async mode (runtime/llm_io.py): the process's I/O loop sends it and
            # a commit thread runs the rest (resume); this thread goes back for
            # other jobs, the turn's lease still renewed by the process.
            ctx.requested = True
            ctx.adopt_next = False  # no thread waits here to continue the loop
            if streaming:
                ctx.partial = PartialWriter(ctx)
            raise HandedOff(ctx, request, partial(self.resume, ctx, request))
        ctx.requested = True
        request.started = time.monotonic()
        answer: tuple[Any, ...]
        try:
            if streaming:
                partial_writer = ctx.partial = PartialWriter(ctx)
                answer = post_stream(url, rendered.payload, make_aggregator=dialect.aggregator,
                                     on_delta=partial_writer, record=record, **common)
            else:
                answer = post_json(url, rendered.payload, record=record, **common)
            request.took(ctx, answer)
            _follow_continuations(ctx, dialect, url, rendered.payload, streaming, common)
        except ProviderError as exc:
            _failed(ctx, exc)
        finally:
            if ctx.partial is not None:
                ctx.partial.close()
        return self.answered(ctx, request)

    def resume(self, ctx: LlmContext, request: OutgoingRequest,
               error: BaseException | None) -> Any:
        """A handed-off turn, its exchange over (``error``: how it failed): the
        rest of this step and of the stack, as :meth:`__call__` would have run
        it (on a commit thread, inside :func:`handle_errors`)."""
        try:
            if error is not None:
                raise error
            _follow_continuations(ctx, request.dialect, request.url, request.payload,
                                  request.streaming, request.common)
        except ProviderError as exc:
            _failed(ctx, exc)
        finally:
            if ctx.partial is not None:
                ctx.partial.close()
        return self.answered(ctx, request)

    def answered(self, ctx: LlmContext, request: OutgoingRequest) -> Any:
        """The answer is in ``ctx.response``: settle its reservations, then the
        rest of the stack."""
        assert ctx.response is not None
        if ctx.admitted is not None:
            _settle(ctx, request.model, ctx.response.usage, len(ctx.response.tool_calls))
        if not request.streaming and ctx.response.usage and ctx.response.usage.output_tokens:
            seconds = max(time.monotonic() - request.started, 1e-6)
            ctx.metrics["output_tokens_per_s"] = round(
                ctx.response.usage.output_tokens / seconds, 1)
        return self.next_step(ctx)


def _failed(ctx: LlmContext, exc: ProviderError) -> NoReturn:
    # Keep the record we have: a 2xx whose body would not parse is exactly
    # the response someone will want to look at.
    ctx.wire = exc.wire or ctx.wire
    if ctx.admitted is not None:
        _settle_failed(ctx, exc)
    raise exc


@dataclass
class OutgoingRequest:
    """A turn's request, rendered and on record, not sent yet: what
    NetworkCalling sends itself (thread mode) or hands to the process's I/O
    loop (:class:`HandedOff`)."""

    url: str
    payload: dict[str, Any]
    streaming: bool
    dialect: Any
    model: str | None
    #: The send path's keyword arguments (headers, policy, limits, ...).
    common: dict[str, Any]
    record: Any
    #: When a rate-limit slot lets it go (``time.monotonic()``); None: now.
    slot_at: float | None = None
    #: ``time.monotonic()`` when it was sent.
    started: float = 0.0

    def took(self, ctx: LlmContext, answer: tuple[Any, ...]) -> None:
        """Put what the send path returned on the turn."""
        if self.streaming:
            ctx.response, ctx.wire, ctx.metrics = answer
            return
        body, ctx.wire = answer
        ctx.metrics = {"duration_ms": round((time.monotonic() - self.started) * 1000, 1)}
        ctx.response = self.dialect.parse(body)
        _check_length(ctx.response, self.common["limits"], ctx.wire)

    async def send_async(self, ctx: LlmContext, client: Any,
                         should_abort: Callable[[], bool]) -> None:
        """Send it on an asyncio loop through ``client`` (an
        ``httpx.AsyncClient``), through the same retry loop as the threads';
        ``should_abort`` must not block. The answer goes onto the turn as
        :meth:`took` puts it; a failure raises."""
        if self.slot_at is not None:
            await asyncio.sleep(max(0.0, self.slot_at - time.monotonic()))
        common = {**self.common, "should_abort": should_abort}
        self.started = time.monotonic()
        answer: tuple[Any, ...]
        if self.streaming:
            answer = await post_stream_async(self.url, self.payload, client=client,
                                             make_aggregator=self.dialect.aggregator,
                                             on_delta=ctx.partial, record=self.record,
                                             **common)
        else:
            answer = await post_json_async(self.url, self.payload, client=client,
                                           record=self.record, **common)
        self.took(ctx, answer)


class HandedOff(SolidLoopError):
    """Raised by NetworkCalling in async mode once the request is on record: it
    unwinds the turn thread's stack to the runtime (runtime/llm_io.py), which
    sends ``request`` on the process's I/O loop and, when it is over, runs
    ``resume(error)`` on a commit thread. Only stacks whose steps before
    NetworkCalling are the built-in ones hand off (``StackPlan.hands_off``):
    none of them catches it, and ``runtime/turns._guarded`` lets it through."""

    def __init__(self, ctx: LlmContext, request: OutgoingRequest,
                 resume: Callable[[BaseException | None], Any]) -> None:
        super().__init__("handed off to the I/O loop")
        self.ctx = ctx
        self.request = request
        self.resume = resume


def _record_request(ctx: LlmContext, record: Any) -> None:
    """Put the request on record before it is sent: its ``llm_request`` event,
    redacted as the send path keeps it, pending until the turn's end completes
    it (``ctx.request_event_id``). Fenced: a turn that lost its loop gets
    LostLeaseError here and sends nothing. One statement in autocommit (it
    joins the session's transaction when one is open, and commits it). The
    record is the turn's from now on, so
    every exit (an error, a limit, a hand-back) answers it with what the
    attempts so far left on it (a row of ``solidloop_llm_answers``: the
    request's row is not written again)."""
    _check_lease(ctx)
    config = ctx.state.config
    recorded = store.record_request(
        ctx.session, ctx.loop_id, ctx.execution_token, shell_id=ctx.shell_id, wire=record,
        body_limit=config.wire_body_limit, repeat_history=config.event_repeat_history)
    ctx.request_event_id, ctx.watched = recorded.event_id, recorded.watched
    ctx.wire = record


def with_note(history: list[Any], note: str | None) -> list[Any]:
    """The history as sent: ``note`` (a budget's soft warning) at the end of the
    system prompt, in this request only; the stored history is untouched."""
    if note is None:
        return history
    for index, message in enumerate(history):
        if message.role == "system":
            content = f"{message.content}\n\n{note}" if message.content else note
            return [*history[:index], dataclasses.replace(message, content=content),
                    *history[index + 1:]]
    return [ChatMessage(role="system", content=note), *history]


def reserve_slot(ctx: LlmContext, limits: Any, payload: dict[str, Any], model: str | None,
                 url: str, *, inline: bool | None = None) -> float | None:
    """Admission of one request of the turn (the turn's own, or a compaction's
    summary request): the subject's ledger and the rate buckets reserve its
    estimate (``ctx.admitted``); the instant it may go, or None when the turn
    was deferred to its slot. The one implementation both requests share.
    ``inline``: this thread sends the request (default: unless the turn is
    handed to the async I/O loop; a summary request is always sent inline)."""
    if (not ctx.hand_off) if inline is None else inline:
        # The process's client for the origin, built before the slot is
        # reserved: a fresh process's first build (TLS setup) takes tens of
        # milliseconds, far longer on a loaded machine, and would push the
        # request past its slot.
        shared_client(url)
    admitted = ctx.admitted = admission.admit(ctx.state, ctx.session, limits, ctx.loop,
                                              payload, model, ctx.execution_token)
    return _capacity_at(ctx, admitted)


def wait_for_slot(ctx: LlmContext, slot_at: float, *,
                  inline: bool | None = None) -> float | None:
    """The rest of a short wait for the reserved slot, slept after the
    request's record (its write then does not push the request past it; in
    async mode the I/O loop sleeps instead), then the slot checked again
    (:func:`_on_time`): the instant to send, or None when deferred."""
    inline = (not ctx.hand_off) if inline is None else inline
    if inline:
        time.sleep(max(0.0, slot_at - time.monotonic()))
    return _on_time(ctx, slot_at, inline=inline)


#: Reservations a request may make again in one turn when each slot passes
#: before it can be sent; then the turn goes back to the queue.
LATE_RESERVATIONS = 3


def _on_time(ctx: LlmContext, slot_at: float, *, inline: bool = True) -> float | None:
    """When the request, on record, may go: ``slot_at`` unless its slot passed
    more than admission.SLOT_LATE ago (the request's record, a thread the
    machine ran late come between the reservation and the send; a held
    slot's job checked its own lateness when it took it, and counts from
    then). A request
    whose slot passed reserves again (admission.reserve_again) and waits for
    the new slot, inline within SOLIDLOOP_RATE_LIMIT_INLINE_WAIT (threads
    sleep here; async mode's I/O loop sleeps until the slot returned); a
    longer wait defers the turn to it, and None."""
    admitted = ctx.admitted
    if admitted is None:
        return slot_at
    for attempt in range(LATE_RESERVATIONS + 1):
        if admitted.reservation is None or time.monotonic() <= slot_at + admission.SLOT_LATE:
            return slot_at
        if attempt == LATE_RESERVATIONS:
            # Late at every slot: back to the queue holding no slot, due at
            # once; its job reserves when it runs.
            admitted.reservation, admitted.wait = None, 0.0
            break
        try:
            admission.reserve_again(ctx.state, ctx.session, admitted)
        finally:
            store.end_transaction(ctx.session)
        logger.info("loop %s: the request's rate-limit slot passed before it could be "
                    "sent; reserved again (wait %.2fs)", ctx.loop_id, admitted.wait)
        if admitted.reservation is None \
                or admitted.wait > ctx.state.config.rate_limit_inline_wait:
            break
        slot_at = time.monotonic() + admitted.wait
        if inline:
            time.sleep(max(0.0, slot_at - time.monotonic()))
    _defer_to(ctx, admitted, admitted.wait,
              error_message="not sent: its rate-limit slot passed before it could go; "
                            "deferred to a new slot")
    return None


def _capacity_at(ctx: LlmContext, admitted: admission.Admitted) -> float | None:
    """When the request may go (a ``time.monotonic()`` instant): now, or at a
    slot within SOLIDLOOP_RATE_LIMIT_INLINE_WAIT (or a held slot's job a little
    early: admission.SLOT_EARLY), which the caller sleeps until just before
    sending. A longer wait defers the turn to its slot (the loop
    queued again, its job due then, the reservation kept), and None."""
    wait = admitted.wait
    if wait <= 0:
        return time.monotonic()
    if wait <= ctx.state.config.rate_limit_inline_wait \
            or (admitted.held and wait <= admission.SLOT_EARLY):
        return time.monotonic() + wait
    _defer_to(ctx, admitted, wait)
    return None


def _defer_to(ctx: LlmContext, admitted: admission.Admitted, wait: float, *,
              error_message: str | None = None) -> None:
    """The turn deferred to its rate-limit slot; after a request the provider
    refused with a long wait (``error_message``), its event completed."""
    if ctx.lease is not None and ctx.lease.lost():
        return
    deferred = store.defer_for_capacity(ctx.state, ctx.session, ctx.loop_id,
                                        ctx.execution_token, delay_seconds=wait,
                                        slot=admitted.slot(ctx.loop.step_count),
                                        wire=ctx.wire, event_id=ctx.request_event_id,
                                        error_message=error_message, shell_id=ctx.shell_id)
    if deferred:
        _count(ctx, "deferred")
        metrics.rate_limit_deferral("llm")
        logger.info("loop %s: no rate-limit capacity on %s; deferred %.1fs to its slot",
                    ctx.loop_id, ", ".join(admitted.reservation.keys)
                    if admitted.reservation else "its keys", wait)


def _settle(ctx: LlmContext, model: str | None, usage: Any, tool_calls: int) -> None:
    """The answer's real usage replaces its estimate in the ledger and the
    buckets. The answer is paid for: a failure here is logged and the turn goes
    on (the estimate stays counted, which errs on the safe side)."""
    assert ctx.admitted is not None
    try:
        admission.settle(ctx.session, ctx.admitted, usage=usage,
                         prices=ctx.state.config.prices.get(model or ""),
                         tool_calls=tool_calls,
                         headers=ctx.wire.rate_headers if ctx.wire is not None else None)
    except Exception:
        store.recover(ctx.session)
        logger.warning("loop %s: could not settle the turn's reservation; its estimate "
                       "stays counted", ctx.loop_id, exc_info=True)


def _settle_failed(ctx: LlmContext, exc: ProviderError) -> None:
    """A request that failed: its reservation is given back (a refusal bills
    nothing). A 429/503 with a Retry-After on a rate-limited key blocks the key
    for every worker until then; a wait past the inline wait defers the turn
    (ErrorHandling) instead of failing or sleeping."""
    admitted = ctx.admitted
    assert admitted is not None
    reservation = admitted.reservation
    wait = getattr(exc, "retry_after", None)
    try:
        if reservation is not None and wait is not None:
            rates.block(ctx.session, reservation.keys, wait)
        admission.release(ctx.session, admitted)
    except Exception:
        store.recover(ctx.session)
        logger.warning("loop %s: could not give back a failed request's reservation",
                       ctx.loop_id, exc_info=True)
    if reservation is not None and wait is not None:
        # Deferred to the block's end holding nothing: the turns a block held
        # back then reserve again, spaced by the buckets, not all at once.
        admitted.reservation, admitted.spend_id, admitted.wait = None, None, wait
        return
    ctx.admitted = None


#: Follow-up requests one turn may make for answers the server continues
#: (Gemini's CONTINUATION); beyond it the turn ends as cut short ("length").
MAX_CONTINUATIONS = 8


def _follow_continuations(ctx: LlmContext, dialect: Any, url: str, payload: dict[str, Any],
                          streaming: bool, common: dict[str, Any]) -> None:
    """Send again while the answer says it continues (Gemini ``CONTINUATION`` with
    a ``continuationToken``), as google-genai does by itself, and merge the hops
    into one turn. Each hop's attempts join the turn's wire record."""
    follow = getattr(dialect, "continuation", None)
    hops = 0
    while follow is not None and ctx.response is not None:
        next_payload = follow(payload, ctx.response)
        if next_payload is None:
            return
        hops += 1
        if hops > MAX_CONTINUATIONS:
            ctx.response.finish_reason = "length"
            return
        if streaming:
            if ctx.partial is None:
                ctx.partial = PartialWriter(ctx)
            turn, wire, _ = post_stream(url, next_payload, make_aggregator=dialect.aggregator,
                                        on_delta=ctx.partial, **common)
        else:
            body, wire = post_json(url, next_payload, **common)
            turn = dialect.parse(body)
            _check_length(turn, common["limits"], wire)
        if ctx.wire is not None:
            ctx.wire.attempts.extend({**a, "continuation": hops} for a in wire.attempts)
            ctx.wire.response_body = wire.response_body
        ctx.response = dialect.merge(ctx.response, turn)
        ctx.metrics["continuations"] = hops


def _check_length(turn: Any, limits: TurnLimits, wire: Any) -> None:
    """A whole (non-streamed) answer longer than max_output_chars fails the turn
    as a stream ended there would: the request is done, but the answer is not
    taken into the history."""
    chars = output_chars(turn)
    if limits.max_output_chars is not None and chars > limits.max_output_chars:
        error = TurnLimitError("max_output_chars", limits.length_message(chars))
        error.wire = wire
        raise error


class PartialWriter:
    """Flushes a streaming turn's text as it arrives, coalesced, so watchers (a
    host's page, the admin) see progress (docs/decisions/0024-loop-event-stream.md).

    With text deltas on (SOLIDLOOP_STREAM_MAX_HZ > 0) each flush writes the
    text since the last one as events of the loop's stream; off, it writes the
    text so far onto the hidden shell. The pace is the loop's: every
    SOLIDLOOP_STREAM_UPDATE_INTERVAL seconds while nobody watches, at most
    SOLIDLOOP_STREAM_MAX_HZ events a second while somebody does. It starts
    from what the request's record read, learns a change from each flush's own
    statement, and hears a watcher's arrival (pipeline/watch_arrivals.py): it
    then flushes what it has with the next token. The shell stays hidden and
    ``processing``: a turn that never commits never puts its partial into the
    history the model sees."""

    def __init__(self, ctx: LlmContext) -> None:
        self.ctx = ctx
        config = ctx.state.config
        self.deltas = config.stream_max_hz > 0
        self.reasoning_deltas = self.deltas and bool(ctx.agent.option("stream_reasoning"))
        self.content: list[str] = []
        self.reasoning: list[str] = []
        #: What the stream has been sent of the text and the reasoning.
        self.sent_text = ""
        self.sent_reasoning = 0
        self.pace = Coalescer(max_hz=config.stream_max_hz,
                              idle_interval=config.stream_update_interval,
                              watched_interval=config.observed_stream_update_interval,
                              now=time.monotonic())
        self.pace.watched = ctx.watched
        #: Set from the listener's thread when a watcher arrives: the next token flushes.
        self.arrival = False
        #: Tool calls written as text are the parser's, not the reader's: an observer
        #: never sees their markup, not even half a tag.
        self.text_filter = tool_text.visible_text if _hides_tool_markup(ctx) else None
        #: Async mode (runtime/llm_io.py): deltas arrive on the I/O loop, which must
        #: not wait on the database; a due flush is handed to ``defer``, which runs
        #: :meth:`flush` on a commit thread (coalesced: one pending flush writes
        #: all the text so far). None: flushes run where the deltas arrive.
        self.defer: Callable[[PartialWriter], None] | None = None
        watch_arrivals.listen(ctx.state.broker)
        if watch_arrivals.register(ctx.loop_id, self):
            self.watcher_arrived()

    def watcher_arrived(self) -> None:
        """Somebody started watching the loop (called from another thread)."""
        self.arrival = True

    def __call__(self, delta: StreamDelta) -> None:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        if self.arrival:
            self.arrival = False
            self.pace.watched = True
            self._flush_due()
        elif self.pace.due(time.monotonic()):
            self._flush_due()

    def _flush_due(self) -> None:
        if self.defer is not None:
            self.defer(self)  # async mode: on a commit thread, coalesced
        else:
            self.flush()

    def close(self) -> None:
        """The stream is over: arrivals no longer concern this turn."""
        watch_arrivals.unregister(self.ctx.loop_id, self)

    def _text_so_far(self) -> str:
        """The answer so far as a watcher may see it (tool-call markup hidden)."""
        content = "".join(self.content)
        return self.text_filter(content) if self.text_filter is not None else content

    def flush(self) -> None:
        """Write what arrived since the last flush now."""
        ctx = self.ctx
        if ctx.lease is not None and ctx.lease.lost():
            return
        assert ctx.shell_id is not None
        content = self._text_so_far()
        reasoning = "".join(self.reasoning)
        try:
            if self.deltas:
                # Only text that extends what was sent: a filter that hides a
                # half-written tag may show less than before; the message's
                # completion carries its stored text anyway.
                text = content[len(self.sent_text):] \
                    if content.startswith(self.sent_text) else ""
                thought = reasoning[self.sent_reasoning:] if self.reasoning_deltas else ""
                if not text and not thought:
                    self.pace.flushed(time.monotonic(), events=0)
                    return
                watched = store.record_delta(ctx.session, ctx.shell_id, text,
                                             len(self.sent_text), thought or None,
                                             self.sent_reasoning)
                events = bool(text) + bool(thought)
                self.sent_text += text
                self.sent_reasoning += len(thought)
            else:
                watched = store.record_partial(ctx.session, ctx.shell_id, content,
                                               reasoning or None)
                events = 1
        except Exception as exc:
            if not is_transient(exc):
                raise
            # A flush is a display: a database that fails under it costs the
            # watchers this update, never the turn (the next flush sends it).
            store.recover(ctx.session)
            logger.warning("loop %s: a partial write failed (%s); the stream goes on",
                           ctx.loop_id, type(exc).__name__)
            self.pace.flushed(time.monotonic(), events=0)
            return
        if watched is not None:
            self.pace.watched = watched
        self.pace.flushed(time.monotonic(), events=events)

    def keep(self) -> None:
        """Write the text so far onto the shell (a turn ended at its limit keeps
        what arrived on its failed shell, whatever the stream was sent)."""
        ctx = self.ctx
        if ctx.lease is not None and ctx.lease.lost():
            return
        assert ctx.shell_id is not None
        try:
            store.record_partial(ctx.session, ctx.shell_id, self._text_so_far(),
                                 "".join(self.reasoning) or None)
        except Exception as exc:
            if not is_transient(exc):
                raise
            store.recover(ctx.session)


class Coalescer:
    """When a streaming turn flushes: every ``idle_interval`` seconds while
    nobody watches its loop; while somebody does, as soon as the last flush's
    events fit in ``max_hz`` events a second (a flush of a delta and a reasoning
    delta counts two), or every ``watched_interval`` when deltas are off
    (``max_hz`` 0)."""

    def __init__(self, *, max_hz: float, idle_interval: float, watched_interval: float,
                 now: float) -> None:
        self.max_hz = max_hz
        self.idle_interval = idle_interval
        self.watched_interval = watched_interval
        self.watched = False
        self.last = now
        self.gap = 0.0  # seconds the last flush's events need before the next

    def due(self, now: float) -> bool:
        if not self.watched:
            return now - self.last >= self.idle_interval
        if self.max_hz <= 0:
            return now - self.last >= self.watched_interval
        return now - self.last >= max(self.gap, 1.0 / self.max_hz)

    def flushed(self, now: float, *, events: int) -> None:
        self.last = now
        self.gap = events / self.max_hz if self.max_hz > 0 else 0.0


def _hides_tool_markup(ctx: LlmContext) -> bool:
    """Whether the turn's answers carry tool calls as text (the parser is in the
    agent's stack, or its tools are prompted as text): partials then hide them."""
    return bool(ctx.plan is not None and ctx.plan.parses_tool_text) \
        or ctx.agent.option("tool_prompting") is not None


def _check_lease(ctx: LlmContext) -> None:
    """Before any canonical write: yield silently if the renewer lost our lease."""
    if ctx.lease is not None:
        ctx.lease.check()


def _no_longer_ours(ctx: LlmContext) -> bool:
    if ctx.lease is not None and ctx.lease.lost():
        return True
    try:
        owned = queries.is_owned(ctx.session, ctx.loop_id, ctx.execution_token)
    except Exception as exc:
        if not is_transient(exc):
            raise
        # Unknown: go on (the turn's end is fenced whatever the answer).
        store.recover(ctx.session)
        return False
    ctx.session.rollback()
    return not owned


class ResponseParsing:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        response = ctx.response
        assert response is not None and ctx.shell_id is not None
        _check_lease(ctx)
        model = ctx.agent.provider().model
        meta: dict[str, Any] = {**response.provider_meta, "model": model,
                                "metrics": ctx.metrics,
                                "reasoning_carried": ctx.reasoning_carried}
        meta.pop("gemini_continuation_token", None)  # spent: never sent back
        if ctx.reasoning_strategies is not None:
            meta["reasoning_strategies"] = ctx.reasoning_strategies
        if response.refusal:
            # The model declined: its words are the turn's outcome (finish_reason
            # "refusal"), flagged in the metadata, and the answer where a reader
            # (and the next request) looks for one: OpenAI leaves content empty.
            meta["refusal"] = response.refusal
            if not response.content:
                response = ctx.response = dataclasses.replace(
                    response, content=response.refusal)
        if response.usage is None:
            # The server sent no counts (llama-cpp-python ignores include_usage):
            # say so rather than record zero tokens and zero cost.
            meta["usage_missing"] = True
            ctx.metrics["usage_missing"] = True
            meta["usage_estimate"] = _estimate_usage(ctx, response)
        turn_cost = None
        if response.usage is not None:
            turn_cost = pricing.cost(response.usage, ctx.state.config.prices.get(model))
            if turn_cost is None:
                meta["unpriced"] = True
        _refuse_shared_call_ids(response)
        schema = ctx.output_schema
        checked = None
        if schema is not None:
            response, checked = _check_output(ctx, response, schema, meta)
            if checked is not None and not checked.valid:
                return _invalid_output(ctx, response, meta, turn_cost, checked, model)
        calls = []
        for request in response.tool_calls:
            route = ctx.tools.resolve(request.name) if ctx.tools is not None else None
            arguments = _parse_arguments(request.arguments_raw)
            calls.append(store.NewToolCall(
                call_id=request.call_id or None, name=request.name,
                arguments_raw=request.arguments_raw, arguments=arguments,
                server_name=route.server_name if route else None,
                tool_name=route.tool_name if route else None,
                wait=call_wait(ctx, request.name, route, arguments),
            ))
        shell_id = ctx.shell_id
        # Retried in place while the lease holds: the answer is paid for.
        with tracing.span("solidloop.commit"):
            finished = store.with_database_retry(
                lambda: store.finish_llm_turn(
                    ctx.state, ctx.session, loop_id=ctx.loop_id, token=ctx.execution_token,
                    shell_id=shell_id, response=response, meta=meta, turn_cost=turn_cost,
                    calls=calls, wire=ctx.wire,
                    sequential=bool(ctx.agent.option("sequential_tool_calls")),
                    adopt=ctx.adopt_next, on_wait=ctx.agent.on_wait,
                    ends=store.loop_ends(ctx.state, ctx.loop),
                    streamed=_streamed(ctx), event_id=ctx.request_event_id,
                    output=checked.value if checked is not None else None),
                session=ctx.session, seconds=ctx.state.config.database_retry_seconds,
                still_ours=ctx.still_ours, what=f"loop {ctx.loop_id}: the turn's end")
        ctx.message, ctx.adopted = finished.message, finished.adopted
        ctx.committed = True
        metrics.llm_turn(ctx.agent.agent_name, model, "ok", usage=response.usage,
                         cost=turn_cost, timing=ctx.metrics)
        return self.next_step(ctx)


def _streamed(ctx: LlmContext) -> str | None:
    """The text the loop's stream was sent as deltas (None: it streamed none)."""
    return ctx.partial.sent_text if ctx.partial is not None and ctx.partial.deltas else None


def _check_output(ctx: LlmContext, response: Any, schema: dict[str, Any],
                  meta: dict[str, Any]) -> tuple[Any, output.Checked | None]:
    """A structured-output loop's answer (docs/decisions/0036-structured-output.md):
    an answer given through the output tool lifted into the text, then a final
    answer checked against the schema the loop started with (and by the
    agent's model class, when its schema is still that one). A turn that calls
    tools is no answer yet: None."""
    response, lifted = output.lift_answer(response)
    ctx.response = response
    if lifted is not None:
        meta["output_call"] = lifted
    if response.tool_calls:
        return response, None
    model = output.model_class(ctx.agent.option("output_type"))
    if model is not None and model.model_json_schema() != schema:  # type: ignore[attr-defined]
        model = None  # the class changed since the loop started: its schema rules
    checked = output.check(response.content, schema, model)
    if not checked.valid:
        meta["output_error"] = checked.error
    return response, checked


def _invalid_output(ctx: LlmContext, response: Any, meta: dict[str, Any], turn_cost: Any,
                    checked: output.Checked, model: str | None) -> Any:
    """An answer that does not match: kept as an ordinary message, and the
    validation error sent back for another turn while ``output_retries``
    allow; past them, the loop fails (``output_invalid``)."""
    assert ctx.shell_id is not None and checked.error is not None
    error = checked.error
    allowed = int(ctx.agent.option("output_retries"))
    retried = _output_retries(ctx.history)
    attempts = allowed + 1
    # A refusal, or an answer cut at the token limit, is not retried: the
    # same request would meet the same end, and spend a turn on it.
    final = output.final_failure(response.refusal, response.finish_reason)
    retry = output.retry_message(error, retried + 1, attempts) \
        if retried < allowed and final is None else None
    shell_id = ctx.shell_id
    with tracing.span("solidloop.commit"):
        status = store.with_database_retry(
            lambda: store.end_with_invalid_output(
                ctx.state, ctx.session, loop_id=ctx.loop_id, token=ctx.execution_token,
                shell_id=shell_id, response=response, meta=meta, turn_cost=turn_cost,
                wire=ctx.wire, retry=retry, retry_meta={"output_retry": retried + 1},
                error_message=final or output.failure_message(error, attempts),
                ends=store.loop_ends(ctx.state, ctx.agent.agent_name),
                streamed=_streamed(ctx), event_id=ctx.request_event_id),
            session=ctx.session, seconds=ctx.state.config.database_retry_seconds,
            still_ours=ctx.still_ours, what=f"loop {ctx.loop_id}: the turn's end")
    ctx.committed = True
    logger.info("loop %s: the answer does not match its output schema (attempt %d of %d)%s",
                ctx.loop_id, retried + 1, attempts,
                "; it is sent back" if retry is not None else "; the loop fails")
    metrics.llm_turn(ctx.agent.agent_name, model, "ok" if status == "queued" else "failed",
                     usage=response.usage, cost=turn_cost, timing=ctx.metrics,
                     error=None if status == "queued" else "output_invalid")
    return None


def _output_retries(history: list[Any]) -> int:
    """The validation errors sent back since the last message a person sent
    (each a user message marked ``output_retry``)."""
    count = 0
    for message in reversed(history):
        if message.role != "user":
            continue
        if not message.meta.get("output_retry"):
            break
        count += 1
    return count


def _refuse_shared_call_ids(response: Any) -> None:
    """Tool calls of one answer must have ids of their own: calls that share one
    are a broken answer (a proxy that split one call into several blocks, or
    repeated it), which run as they are would run wrong arguments, and merged
    would guess. The turn fails as a provider answer error, naming the id."""
    seen: dict[str, int] = {}
    for call in response.tool_calls:
        if call.call_id:
            seen[call.call_id] = seen.get(call.call_id, 0) + 1
    shared = {call_id: n for call_id, n in seen.items() if n > 1}
    if shared:
        call_id, n = next(iter(shared.items()))
        raise ProviderAnswerError(
            f"{n} tool calls of one answer share the id {call_id!r} (the provider, or a "
            "proxy in front of it, split or repeated a call); none was run")


def _estimate_usage(ctx: LlmContext, response: Any) -> dict[str, Any]:
    """A rough token count for a turn the server reported none for: characters / 4
    of the request sent and of the answer. Labelled as an estimate; never added to
    the loop's totals or priced."""
    sent = ctx.wire.request_body if ctx.wire is not None else None
    sent_chars = len(json.dumps(sent, default=str)) if sent is not None else 0
    answer = (response.content or "") + (response.reasoning or "") + "".join(
        call.name + (call.arguments_raw or "") for call in response.tool_calls)
    return {"input_tokens": (sent_chars + 3) // 4, "output_tokens": (len(answer) + 3) // 4,
            "method": "characters / 4 (an estimate, not billed counts)"}


def _parse_arguments(raw: str | None) -> dict[str, Any] | None:
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, ValueError, RecursionError):
        # RecursionError: nested deeper than Python parses; the model gets the
        # same correctable "not a JSON object" error as for any bad arguments.
        return None
    return value if isinstance(value, dict) else None


DEFAULT_LLM_STACK = (ErrorHandling, AgentInitialization, NetworkCalling, ResponseParsing)
