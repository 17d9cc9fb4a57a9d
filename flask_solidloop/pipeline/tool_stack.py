"""The default tool turn stack, outermost first: ToolExecution → ResponseCreation.

* ToolExecution runs the tool once and checkpoints its canonical result
  (``executed_at``) under both fences: the loop generation and this call's
  lease. On the continuation path (already executed) it restores the result
  and never runs the tool body again.
* ResponseCreation writes the single tool message that answers the call and,
  when the turn's last call resolves, queues the next LLM turn in the same
  commit (in sequential mode it queues the next call instead).

With nothing between the two (the default stack: the plan's ``fuse_outcome``),
ToolExecution hands the raw result on and ResponseCreation records the result
and the answer in one statement (``store.checkpoint_and_answer_tool_call``).
A middleware in between sees the recorded result, and the answer commits on
its own. Either way the writes are one statement family (loops/sql.TOOL_OUTCOME).

Host middlewares usually go between the two (audit, redaction) or before
ToolExecution (authorization). One that *replaces* either must keep its fences.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._typing import real_session
from ..dbapi import is_transient
from ..limits import rates
from ..loops import queries, store
from ..mcp.registry import ToolRegistry, call_on_server
from ..mcp.toolset import CallContext, ToolResult
from ..models import ToolCall
from ..telemetry import metrics, tracing
from . import tool_session, tool_threads
from .builder import Handler
from .context import ToolContext, UnrecordedResult

logger = logging.getLogger("flask_solidloop.tools")

T = TypeVar("T")


class ToolExecution:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: ToolContext) -> Any:
        call = ctx.tool_call
        assert call is not None
        if call.executed_at is not None:
            ctx.result = ToolResult.from_mcp(call.result or {"content": []})
            return self.next_step(ctx)

        if not _tool_capacity(ctx, call):
            return None  # deferred: its job is due when its key has capacity
        # Read now: the tool's run ends the session's transaction (expiring it).
        facts = ctx.facts = store.CallFacts.of(call)
        result, duration_ms = self._run(ctx, call)
        metrics.tool_call(ctx.agent.agent_name, facts.tool_name, result.outcome, duration_ms)
        if ctx.plan is not None and ctx.plan.fuse_outcome:
            # Nothing between the two steps: ResponseCreation records the result
            # and its answer in one statement (see ResponseCreation.__call__).
            ctx.unrecorded = UnrecordedResult(result, duration_ms)
            return self.next_step(ctx)
        # From here on the stored (storable) result is the canonical one.
        outcome = _retried(ctx, lambda: store.checkpoint_tool_call(
            ctx.state, ctx.session, facts, token=ctx.execution_token,
            lease=ctx.lease_token, result=result, duration_ms=duration_ms,
            body_limit=ctx.state.config.wire_body_limit), "the result")
        ctx.tool_call, ctx.result = outcome.call, outcome.result
        return self.next_step(ctx)

    def _run(self, ctx: ToolContext, call: ToolCall) -> tuple[ToolResult, float]:
        started = time.monotonic()
        max_attempts = ctx.state.config.tool_max_attempts
        if call.lapsed_runs >= max_attempts:
            logger.error("tool_call %s: %r was started %d times and each run ended without a "
                         "result; it is not run again (SOLIDLOOP_TOOL_MAX_ATTEMPTS=%d)",
                         ctx.tool_call_id, call.name, call.lapsed_runs, max_attempts)
            result = ToolResult.error(
                f"the tool {call.name!r} was started {call.lapsed_runs} times and each run "
                "ended without a result (its worker died, froze or hung, and the call was "
                f"taken over); it is not run again (SOLIDLOOP_TOOL_MAX_ATTEMPTS="
                f"{max_attempts}). It may have done its work: check before calling it again")
            result.error_kind = "attempts"
            store.end_transaction(ctx.session)
            return result, (time.monotonic() - started) * 1000
        if call.arguments is None:
            result = ToolResult.error(
                f"the arguments for tool {call.name!r} are not a JSON object: "
                f"{(call.arguments_raw or '')[:500]!r}. Send the arguments as a JSON object "
                "matching the tool's input schema."
            )
        else:
            entries = ctx.agent.tool_entries()
            name, arguments, key = call.name, call.arguments, call.idempotency_key
            server_name, tool_name = call.server_name, call.tool_name
            # Only a remote server (url= or a transport object) has a stored session.
            remote = any(entry.get("name") == server_name
                         and (entry.get("url") is not None or entry.get("transport") is not None)
                         for entry in entries)
            stored_state = (queries.mcp_session_state(ctx.session, ctx.loop_id, server_name)
                            if server_name and remote else None)
            # The tool sees a detached snapshot of the loop, so reading it never
            # reopens a transaction on our session.
            loop = ctx.loop
            # Asked while the loop is still attached: the default reads its state.
            principal = ctx.agent.mcp_principal()
            ctx.session.expunge(loop)
            # End the read transaction: a tool may run for minutes and must not
            # hold a snapshot or a connection's transaction open meanwhile.
            store.end_transaction(ctx.session)
            in_process = _in_process_timeout(ctx, entries, server_name, tool_name)
            local = in_process is not None and bool(server_name and tool_name)
            # An in-process tool writes through the worker's session: what it leaves
            # uncommitted commits with the call's outcome (pipeline/tool_session).
            call_ctx = CallContext(agent=ctx.agent, loop=loop, idempotency_key=key,
                                   principal=principal,
                                   session=real_session(ctx.session) if local else None)
            returned = False
            try:
                # The route was resolved when the model's answer was parsed: call that
                # server directly, without listing any server again.
                ctx.tool_ran = True
                if local:
                    assert in_process is not None and server_name and tool_name
                    routed = _run_in_process(ctx, name, in_process, lambda: call_on_server(
                        entries, server_name, tool_name, arguments, call_ctx, None))
                else:
                    routed = (call_on_server(entries, server_name, tool_name, arguments,
                                             call_ctx, stored_state)
                              if server_name and tool_name else None)
                if routed is None:  # a tool no server offers: the model learns which do
                    registry = ToolRegistry.build(entries, agent=str(ctx.agent.agent_name))
                    result = registry.call(name, arguments, call_ctx)
                else:
                    result, new_state = routed
                    if new_state is not None and stored_state is not None \
                            and new_state != stored_state:
                        _keep_session_state(ctx, server_name, new_state)
                returned = True
            finally:
                if returned and local:
                    # What the tool left in the session's transaction is its
                    # database effect: it commits with the outcome (never
                    # retried in place, since a rollback would lose it).
                    ctx.joined = tool_session.joins_outcome(ctx.session)
                else:
                    # Nothing of a remote tool's, or of a run that raised, may
                    # leak into the outcome's transaction.
                    store.recover(ctx.session)
        return result, (time.monotonic() - started) * 1000


def _rate_limit_name(entries: list[dict[str, Any]], server_name: str | None,
                     tool_name: str | None) -> str | None:
    """The ``rate_limit`` of a call's tool (an in-process tool's own), else of its
    ``mcps`` entry; None when neither names one."""
    for entry in entries:
        if entry.get("name") != server_name:
            continue
        toolset = entry.get("toolset")
        if toolset is not None and tool_name in toolset:
            own = toolset.get(tool_name).rate_limit
            if own is not None:
                return str(own)
        named = entry.get("rate_limit")
        return str(named) if named else None
    return None


def _tool_capacity(ctx: ToolContext, call: ToolCall) -> bool:
    """Whether the call may run now under its tool's rate limit: a wait up to
    SOLIDLOOP_RATE_LIMIT_INLINE_WAIT is slept here; past it the call is given
    back to the queue (its lease released), its job due when the key has
    capacity, and False. True when the tool has no configured key."""
    config = ctx.state.config
    if not config.rate_limits or ctx.lease_token is None:
        return True
    key = rates.tool_key(config.rate_limits, _rate_limit_name(
        ctx.agent.tool_entries(), call.server_name, call.tool_name))
    if key is None:
        return True
    reservation = rates.reserve(ctx.session, config.rate_limits, (key,), tokens=0.0,
                                inline_wait=config.rate_limit_inline_wait)
    if reservation.wait <= 0:
        return True
    if reservation.wait <= config.rate_limit_inline_wait:
        time.sleep(reservation.wait)
        return True
    # Spread calls that found the key full together over a tenth of the wait,
    # so they do not all come back in the same instant.
    delay = reservation.wait * (1 + random.random() / 10)
    handed = store.hand_back_tool_call(
        ctx.state, ctx.session, loop_id=ctx.loop_id, tool_call_id=ctx.tool_call_id,
        execution_token=ctx.execution_token, lease_token=ctx.lease_token,
        delay_ms=int(delay * 1000))
    metrics.rate_limit_deferral("tool")
    logger.info("tool_call %s: no capacity on %s; %s in %.1fs", ctx.tool_call_id, key,
                "deferred" if handed else "not ours any more, dropped", delay)
    return False


def _in_process_timeout(ctx: ToolContext, entries: list[dict[str, Any]],
                        server_name: str | None, tool_name: str | None) -> float | None:
    """The timeout of a call to an in-process toolset's tool (the tool's own
    ``timeout=``, else its entry's ``timeout``, else SOLIDLOOP_DEFAULT_TOOL_TIMEOUT);
    None for a call to anything else (a remote server bounds its own calls)."""
    for entry in entries:
        if entry.get("name") == server_name and entry.get("toolset") is not None:
            toolset = entry["toolset"]
            definition = toolset.get(tool_name) if tool_name in toolset else None
            own = definition.timeout if definition is not None else None
            return float(own or entry.get("timeout")
                         or ctx.state.config.default_tool_timeout)
    return None


def _run_in_process(ctx: ToolContext, name: str, timeout: float,
                    run: Callable[[], T]) -> T | tuple[ToolResult, None]:
    """``run`` (the call to an in-process tool) on a tool thread, at most ``timeout``
    seconds: past it, the model gets a ``timeout`` error, the worker thread
    goes on, and the tool's thread stays quarantined (pipeline/tool_threads.py)."""
    threads = tool_threads.pool()
    db, lent = ctx.state.db, real_session(ctx.session)
    try:
        return threads.run(tool_session.lent_to_tool(db, lent, name, run),
                           timeout=timeout, app=ctx.state.app,
                           on_abandoned_return=tool_session.discard(lent, name))
    except tool_threads.ToolTimeoutError as exc:
        # The abandoned tool keeps the lent session: the worker takes a new one.
        tool_session.take_back_after_timeout(db)
        logger.error(
            "tool_call %s: %r did not return within its %gs timeout; it is abandoned in a "
            "quarantined thread (%d in this process; past %d the worker restarts) and the "
            "model is told it timed out", ctx.tool_call_id, name, timeout,
            exc.quarantined, threads.quarantine_limit)
        result = ToolResult.error(
            f"the tool {name!r} did not finish within its {timeout:g}s timeout and was "
            "abandoned; it may still complete its work. Do not assume it succeeded; check "
            "before calling it again")
        result.error_kind = "timeout"
        return result, None


def _keep_session_state(ctx: ToolContext, server_name: str | None,
                        new_state: dict[str, Any]) -> None:
    """Keep the server's new session for the loop's next calls; a database that
    fails meanwhile costs only that (the next call probes the server again)."""
    try:
        store.store_mcp_session_state(ctx.session, ctx.loop_id, server_name, new_state)
    except Exception as exc:
        if not is_transient(exc):
            raise
        store.recover(ctx.session)
        logger.warning("tool_call %s: could not keep the MCP session of %r (%s)",
                       ctx.tool_call_id, server_name, type(exc).__name__)


def _retried(ctx: ToolContext, write: Callable[[], T], what: str) -> T:
    """A tool outcome's write, retried in place on a transient database error while
    the call's lease holds (store.with_database_retry): the tool's effect has
    happened, and a lost result would run it again. Not when the write joins
    the tool's own writes (``ctx.joined``): its rollback undid them, so the
    call is left to its lease, and runs again on a clean database."""
    if ctx.joined:
        return write()
    return store.with_database_retry(
        write, session=ctx.session, seconds=ctx.state.config.database_retry_seconds,
        still_ours=ctx.still_ours, what=f"tool_call {ctx.tool_call_id}: {what}")


class ResponseCreation:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: ToolContext) -> Any:
        limit = ctx.state.config.tool_output_limit
        sequential = bool(ctx.agent.option("sequential_tool_calls"))
        next_turn = ctx.plan.next_turn if ctx.plan is not None else store.NextTurn()
        if ctx.facts is None:
            assert ctx.tool_call is not None
            ctx.facts = store.CallFacts.of(ctx.tool_call)
        with tracing.span("solidloop.commit"):
            unrecorded, ctx.unrecorded = ctx.unrecorded, None
            if unrecorded is not None:
                # ToolExecution ran the tool and left its result to us: the result
                # and the answer are one statement (the answer renders the stored result).
                lease, facts = ctx.lease_token, ctx.facts
                assert lease is not None
                outcome = _retried(ctx, lambda: store.checkpoint_and_answer_tool_call(
                    ctx.state, ctx.session, facts, token=ctx.execution_token,
                    lease=lease, result=unrecorded.result,
                    duration_ms=unrecorded.duration_ms,
                    body_limit=ctx.state.config.wire_body_limit,
                    answer_text=lambda stored: answer_text(stored, limit), sequential=sequential,
                    adopt=ctx.adopt_next, next_turn=next_turn,
                    # The lock-free statement may roll back and start over, which
                    # would drop the tool's writes: not when it joins them.
                    sole_call=ctx.sole_call and not ctx.joined),
                    "the result and its answer")
                ctx.tool_call, ctx.result = outcome.call, outcome.result
            else:
                result, facts = ctx.result, ctx.facts
                assert result is not None
                # Not answered for a duplicate delivery (already answered): nothing to do.
                outcome = _retried(ctx, lambda: store.answer_tool_call(
                    ctx.state, ctx.session, facts, token=ctx.execution_token,
                    lease=ctx.lease_token, content=answer_text(result, limit),
                    is_error=result.is_error, sequential=sequential, adopt=ctx.adopt_next,
                    next_turn=next_turn), "the answer")
        ctx.adopted = outcome.adopted
        ctx.committed = True
        return self.next_step(ctx)


def answer_text(result: ToolResult, limit: int) -> str:
    """The tool message's text: the result's text (or its structured content as
    JSON), cut at ``limit`` characters with a note saying so."""
    text = result.text() or json.dumps(result.to_mcp().get("structuredContent") or "")
    if len(text) > limit:
        text = text[:limit] + f"\n[output truncated: {len(text)} characters, showing {limit}]"
    return text


DEFAULT_TOOL_STACK = (ToolExecution, ResponseCreation)
