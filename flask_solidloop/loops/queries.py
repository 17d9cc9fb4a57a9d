"""Every read of loops, messages, tool calls and MCP sessions that the turns, the
CLI, the Agent facade and (later) the admin and MCP server need.

Nothing here writes or commits; a caller that must not hold a snapshot open
(a turn about to make a network call) ends its own read transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text

from .._typing import SessionLike
from ..llm.types import ChatMessage, ToolCallRequest
from ..models import Loop, McpSession, Message, ToolCall

#: Keys of a message's metadata that its dialect gets back next turn.
PROVIDER_META_KEYS = ("anthropic_blocks", "gemini_parts")


def get_loop(session: SessionLike, loop_id: int) -> Loop | None:
    return session.get(Loop, loop_id)


def get_tool_call(session: SessionLike, tool_call_id: int) -> ToolCall | None:
    return session.get(ToolCall, tool_call_id)


def is_owned(session: SessionLike, loop_id: int, token: uuid.UUID) -> bool:
    """True while ``token``'s generation still owns the running loop (no lock)."""
    row = session.execute(
        select(Loop.status, Loop.execution_token).where(Loop.id == loop_id)
    ).one_or_none()
    return row is not None and row.status == "running" and row.execution_token == token


def run_elapsed_seconds(session: SessionLike, loop_id: int) -> float | None:
    """Seconds since this run's first claim, by the database clock."""
    elapsed = session.scalar(
        select(func.extract("epoch", func.now() - Loop.run_started_at)).where(Loop.id == loop_id)
    )
    return None if elapsed is None else float(elapsed)


def unresolved_tool_calls(session: SessionLike, loop_id: int) -> list[ToolCall]:
    """Tool calls of the newest assistant turn that have no tool message yet."""
    last_assistant = session.scalar(
        select(Message.id)
        .where(Message.loop_id == loop_id, Message.role == "assistant",
               Message.status == "completed")
        .order_by(Message.id.desc())
        .limit(1)
    )
    if last_assistant is None:
        return []
    return list(session.scalars(
        select(ToolCall)
        .where(ToolCall.message_id == last_assistant, ToolCall.response_message_id.is_(None))
        .order_by(ToolCall.position)
    ))


def tool_snapshots(session: SessionLike, loop_id: int) -> dict[str, Any]:
    """The tools each remote server listed for this loop, by server name."""
    return {row.server_name: row.tools for row in session.scalars(
        select(McpSession).where(McpSession.loop_id == loop_id))}


def mcp_session_state(session: SessionLike, loop_id: int,
                      server_name: str) -> dict[str, Any] | None:
    """The stored MCP session of the loop's server (to resume, not re-initialize)."""
    stored = session.scalars(
        select(McpSession).where(McpSession.loop_id == loop_id,
                                 McpSession.server_name == server_name)
    ).first()
    return dict(stored.session_state) if stored is not None else None


def messages(session: SessionLike, loop_id: int, *,
             include_hidden: bool = False) -> list[Message]:
    query = select(Message).where(Message.loop_id == loop_id)
    if not include_hidden:
        query = query.where(Message.is_hidden.is_(False))
    return list(session.scalars(query.order_by(Message.id)))


def tool_calls(session: SessionLike, loop_id: int) -> list[ToolCall]:
    return list(session.scalars(
        select(ToolCall).where(ToolCall.loop_id == loop_id).order_by(ToolCall.id)))


def history(session: SessionLike, loop_id: int) -> list[ChatMessage]:
    """The visible, completed history in the provider-neutral shape a dialect renders."""
    visible = list(session.scalars(
        select(Message)
        .where(Message.loop_id == loop_id, Message.is_hidden.is_(False),
               Message.status == "completed")
        .order_by(Message.id)
    ))
    calls_by_message: dict[int, list[ToolCall]] = {}
    calls_by_id: dict[int, ToolCall] = {}
    call_ids: dict[int, str] = {}
    for call in session.scalars(
        select(ToolCall).where(ToolCall.loop_id == loop_id).order_by(ToolCall.position)
    ):
        calls_by_message.setdefault(call.message_id, []).append(call)
        calls_by_id[call.id] = call
        call_ids[call.id] = call.call_id or f"call_{call.id}"
    result = []
    for message in visible:
        if message.role == "assistant":
            meta = message.meta or {}
            result.append(ChatMessage(
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
            result.append(ChatMessage(
                role="tool", content=message.content,
                tool_call_id=call_ids.get(message.tool_call_id or -1),
                name=answered.name if answered else None,
                is_error=bool((message.meta or {}).get("is_error")),
            ))
        else:
            result.append(ChatMessage(role=message.role, content=message.content))
    return result


@dataclass(frozen=True)
class ToolCallState:
    """Where a tool call stands, for status and the admin."""

    #: answered | executed (result recorded, answer pending) | running (a live
    #: lease) | stalled (its lease lapsed: the reaper takes it over) | queued (a
    #: job waits for it) | waiting (nothing holds it yet: sequential mode, or a
    #: paused loop)
    state: str
    holder: str | None = None
    leased_until: datetime | None = None


_TOOL_JOBS = text(
    "SELECT (message->'args'->>0)::bigint FROM solidloop_jobs "
    "WHERE loop_id = :loop_id AND actor_name = 'solidloop.tool_call' "
    "AND state IN ('queued', 'running')"
)


def tool_call_states(session: SessionLike, loop_id: int) -> dict[int, ToolCallState]:
    """The state of each of the loop's tool calls, by id, on the database clock."""
    now = session.scalar(select(func.now()))
    with_jobs = set(session.execute(_TOOL_JOBS, {"loop_id": loop_id}).scalars())
    states = {}
    for call in tool_calls(session, loop_id):
        if call.response_message_id is not None:
            state = ToolCallState("answered")
        elif call.executed_at is not None:
            state = ToolCallState("executed")
        elif call.lease_token is not None and call.leased_until is not None:
            live = now is None or call.leased_until >= now
            state = ToolCallState("running" if live else "stalled", call.lease_holder,
                                  call.leased_until)
        elif call.id in with_jobs:
            state = ToolCallState("queued")
        else:
            state = ToolCallState("waiting")
        states[call.id] = state
    return states


@dataclass(frozen=True)
class LoopFilter:
    """Filters of a loop listing; every field is optional."""

    statuses: Sequence[str] = ()
    agent: str | None = None
    since: datetime | None = None
    failed_only: bool = False


def list_loops(session: SessionLike, filters: LoopFilter = LoopFilter(), *,
               limit: int = 50, before_id: int | None = None) -> list[Loop]:
    """Loops newest first, with keyset pagination (``before_id``: the last id of
    the previous page), never an OFFSET or a COUNT over the whole table."""
    query = select(Loop)
    statuses = list(filters.statuses)
    if filters.failed_only:
        statuses = ["failed"]
    if statuses:
        query = query.where(Loop.status.in_(statuses))
    if filters.agent:
        query = query.where(Loop.agent_name == filters.agent)
    if filters.since is not None:
        query = query.where(Loop.created_at >= filters.since)
    if before_id is not None:
        query = query.where(Loop.id < before_id)
    return list(session.scalars(query.order_by(Loop.id.desc()).limit(limit)))
