"""The default tool turn stack, outermost first: ToolExecution → ResponseCreation.

* ToolExecution runs the tool once and checkpoints its canonical result
  (``executed_at``) under both fences: the loop generation and this call's
  lease. On the continuation path (already executed) it restores the result
  and never runs the tool body again.
* ResponseCreation writes the single tool message that answers the call and,
  when the turn's last call resolves, queues the next LLM turn in the same
  commit (in sequential mode it queues the next call instead).

Host middlewares usually go between the two (audit, redaction) or before
ToolExecution (authorization). One that *replaces* either must keep its fences.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy import func, select, update

from ..errors import LostLeaseError
from ..loops.fence import lock_loop, owns
from ..mcp.registry import ToolRegistry, call_on_server
from ..mcp.toolset import CallContext, ToolResult
from ..models import Event, McpSession, Message, ToolCall
from .builder import Handler
from .context import ToolContext

logger = logging.getLogger("flask_solidloop.tools")


def _lock_and_check(ctx: ToolContext, *, need_lease: bool) -> ToolCall:
    """Lock loop then tool call (always that order) and verify both tokens."""
    loop = lock_loop(ctx.session, ctx.loop_id)
    if not owns(loop, ctx.execution_token):
        ctx.session.rollback()
        raise LostLeaseError(f"loop {ctx.loop_id} changed generation during tool call")
    call = ctx.session.execute(
        select(ToolCall).where(ToolCall.id == ctx.tool_call_id).with_for_update()
        .execution_options(populate_existing=True)
    ).scalar_one()
    if need_lease and call.lease_token != ctx.lease_token:
        ctx.session.rollback()
        raise LostLeaseError(f"tool call {call.id}: its lease was reclaimed")
    return call


class ToolExecution:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: ToolContext) -> Any:
        call = ctx.tool_call
        assert call is not None
        if call.executed_at is not None:
            ctx.result = ToolResult.from_mcp(call.result or {"content": []})
            return self.next_step(ctx)

        result, duration_ms = self._run(ctx, call)
        checkpoint = _lock_and_check(ctx, need_lease=True)
        if checkpoint.executed_at is not None:  # someone else checkpointed first
            ctx.session.rollback()
            raise LostLeaseError(f"tool call {call.id} was already executed")
        checkpoint.result = result.to_mcp()
        checkpoint.is_success = not result.is_error
        checkpoint.error_kind = result.error_kind
        checkpoint.executed_at = func.now()
        checkpoint.duration_ms = duration_ms
        ctx.session.add(Event(
            loop_id=ctx.loop_id, tool_call_id=call.id, kind="tool_call",
            duration_ms=duration_ms,
            error=result.text()[:2000] if result.is_error else None,
            payload={
                "name": call.name, "server": call.server_name, "tool": call.tool_name,
                "arguments": call.arguments if call.arguments is not None else call.arguments_raw,
                "idempotency_key": call.idempotency_key, "result": result.to_mcp(),
            },
        ))
        ctx.session.commit()
        ctx.tool_call = checkpoint
        ctx.result = result
        return self.next_step(ctx)

    def _run(self, ctx: ToolContext, call: ToolCall) -> tuple[ToolResult, float]:
        started = time.monotonic()
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
            stored = ctx.session.scalars(
                select(McpSession).where(McpSession.loop_id == ctx.loop_id,
                                         McpSession.server_name == server_name)
            ).first() if server_name else None
            stored_state = dict(stored.session_state) if stored is not None else None
            # The tool sees a detached snapshot of the loop, so reading it never
            # reopens a transaction on our session.
            loop = ctx.loop
            ctx.session.expunge(loop)
            # End the read transaction: a tool may run for minutes and must not
            # hold a snapshot or a connection's transaction open meanwhile.
            ctx.session.commit()
            call_ctx = CallContext(agent=ctx.agent, loop=loop, idempotency_key=key)
            try:
                # The route was resolved when the model's answer was parsed: call that
                # server directly, without listing any server again.
                routed = (call_on_server(entries, server_name, tool_name, arguments, call_ctx,
                                         stored_state)
                          if server_name and tool_name else None)
                if routed is None:  # a tool no server offers: the model learns which do
                    registry = ToolRegistry.build(entries, agent=str(ctx.agent.agent_name))
                    result = registry.call(name, arguments, call_ctx)
                else:
                    result, new_state = routed
                    if new_state is not None and stored_state is not None \
                            and new_state != stored_state:
                        self._store_session_state(ctx, server_name, new_state)
            finally:
                # A tool that used db.session without committing (or left it failed)
                # must not leak into our checkpoint: its uncommitted writes are
                # discarded here. Tools that want their writes kept commit them.
                ctx.session.rollback()
        return result, (time.monotonic() - started) * 1000


    @staticmethod
    def _store_session_state(ctx: ToolContext, server_name: str | None,
                             state: dict[str, Any]) -> None:
        """Keep the loop's stored MCP session current (a server re-initialized it,
        or the protocol era changed), so the next call resumes instead of probing."""
        ctx.session.rollback()
        ctx.session.execute(
            update(McpSession)
            .where(McpSession.loop_id == ctx.loop_id, McpSession.server_name == server_name)
            .values(session_state=state)
        )
        ctx.session.commit()


class ResponseCreation:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: ToolContext) -> Any:
        session = ctx.session
        call = _lock_and_check(ctx, need_lease=ctx.lease_token is not None)
        if call.response_message_id is not None:  # a duplicate delivery: already answered
            session.rollback()
            ctx.committed = True
            return self.next_step(ctx)
        result = ctx.result
        assert result is not None
        limit = ctx.state.config.tool_output_limit
        text = result.text() or json.dumps(result.to_mcp().get("structuredContent") or "")
        if len(text) > limit:
            text = text[:limit] + f"\n[output truncated: {len(text)} characters, showing {limit}]"
        message = Message(loop_id=ctx.loop_id, role="tool", content=text, tool_call_id=call.id,
                          meta={"is_error": result.is_error, "tool_name": call.name})
        session.add(message)
        session.flush()
        call.response_message_id = message.id
        call.lease_token = None
        call.leased_until = None
        remaining = list(session.scalars(
            select(ToolCall).where(ToolCall.message_id == call.message_id,
                                   ToolCall.response_message_id.is_(None))
            .order_by(ToolCall.position)
        ))
        if not remaining:
            loop = lock_loop(session, ctx.loop_id)
            assert loop is not None
            loop.status = "queued"
            loop.execution_token = None
            loop.lease_expires_at = None
            session.flush()
            ctx.state.dispatch.llm_turn(session, ctx.loop_id)
        elif ctx.agent.option("sequential_tool_calls"):
            ctx.state.dispatch.tool_call(session, remaining[0].id, ctx.execution_token,
                                         loop_id=ctx.loop_id)
        session.commit()
        ctx.committed = True
        return self.next_step(ctx)


DEFAULT_TOOL_STACK = (ToolExecution, ResponseCreation)
