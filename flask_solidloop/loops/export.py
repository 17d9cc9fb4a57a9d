"""A loop's conversation exported: one versioned JSON document (``SCHEMA_NAME``,
its JSON Schema in ``SCHEMA``) with every visible message, its tool calls and
costs, and the same as Markdown for people. The admin's export routes and
``flask solidloop export`` both render from :func:`conversation`; fields are
described in docs/guides/admin.md (Export).

The JSON shape only grows within one version: a consumer (an eval harness)
may rely on every field listed in ``SCHEMA``; a change that removes or
retypes one takes a new version name.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from .._typing import SessionLike
from ..models import Loop, Message, ToolCall
from . import queries

#: The document's ``schema`` value: name and major version.
SCHEMA_NAME = "solidloop.conversation/1"

_TIME = {"type": ["string", "null"], "format": "date-time"}
_MONEY = {"type": ["number", "null"], "description": "US dollars; null when unpriced"}
_USAGE = {"type": ["object", "null"], "properties": {
    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}

#: The JSON Schema (draft 2020-12) every exported document validates against.
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_NAME,
    "title": "A SolidLoop conversation",
    "type": "object",
    "required": ["schema", "exported_at", "loop", "totals", "messages"],
    "properties": {
        "schema": {"const": SCHEMA_NAME},
        "exported_at": _TIME,
        "loop": {
            "type": "object",
            "required": ["id", "agent", "status", "subject", "created_at", "finished_at",
                         "error_message", "state", "output"],
            "properties": {
                "id": {"type": "integer"}, "agent": {"type": "string"},
                "status": {"type": "string"},
                "subject": {"type": ["object", "null"], "properties": {
                    "type": {"type": ["string", "null"]}, "id": {"type": ["string", "null"]}}},
                "created_at": _TIME, "finished_at": _TIME,
                "error_message": {"type": ["string", "null"]},
                "state": {"type": ["object", "null"]},
                "output": {"description": "a structured-output loop's validated answer"},
                "forked_from": {"type": ["object", "null"], "properties": {
                    "loop_id": {"type": "integer"}, "message_id": {"type": ["integer", "null"]}}},
                "parent_loop_id": {"type": ["integer", "null"]},
            },
        },
        "totals": {
            "type": "object", "required": ["steps", "input_tokens", "output_tokens", "cost_usd"],
            "properties": {"steps": {"type": "integer"}, "input_tokens": {"type": "integer"},
                           "output_tokens": {"type": "integer"}, "cost_usd": _MONEY},
        },
        "messages": {"type": "array", "items": {
            "type": "object",
            "required": ["id", "role", "kind", "status", "created_at", "content", "reasoning",
                         "usage", "cost_usd", "tool_calls"],
            "properties": {
                "id": {"type": "integer"},
                "role": {"enum": ["system", "user", "assistant", "tool"]},
                "kind": {"type": ["string", "null"]},
                "status": {"type": "string"}, "created_at": _TIME,
                "content": {"type": ["string", "null"]},
                "reasoning": {"type": ["string", "null"]},
                "tool_call_id": {"type": ["integer", "null"],
                                 "description": "a tool message: the tool call (id) it answers"},
                "finish_reason": {"type": ["string", "null"]},
                "usage": _USAGE, "cost_usd": _MONEY,
                "compacted_by": {"type": ["integer", "null"],
                                 "description": "the summary message that replaced it"},
                "tool_calls": {"type": "array", "items": {
                    "type": "object",
                    "required": ["id", "call_id", "name", "arguments", "result", "is_success"],
                    "properties": {
                        "id": {"type": "integer"}, "call_id": {"type": ["string", "null"]},
                        "name": {"type": "string"}, "server": {"type": ["string", "null"]},
                        "tool": {"type": ["string", "null"]},
                        "arguments": {"description": "the parsed arguments, or null"},
                        "arguments_raw": {"type": ["string", "null"]},
                        "result": {"description": "the MCP result as recorded, or null"},
                        "is_success": {"type": ["boolean", "null"]},
                        "error_kind": {"type": ["string", "null"]},
                        "executed_at": _TIME,
                        "duration_ms": {"type": ["number", "null"]},
                        "decision": {"type": ["object", "null"]},
                    },
                }},
            },
        }},
    },
}


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    moment = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return moment.isoformat().replace("+00:00", "Z")


def _money(value: Any) -> float | None:
    return None if value is None else float(Decimal(str(value)))


def _call(call: ToolCall) -> dict[str, Any]:
    decision = None
    if call.decision is not None:
        decision = {"decision": call.decision, "by": call.decided_by,
                    "at": _iso(call.decided_at), "reason": call.decision_reason,
                    "requested_arguments": call.requested_arguments}
    return {"id": call.id, "call_id": call.call_id, "name": call.name,
            "server": call.server_name, "tool": call.tool_name,
            "arguments": call.arguments, "arguments_raw": call.arguments_raw,
            "result": call.result, "is_success": call.is_success,
            "error_kind": call.error_kind, "executed_at": _iso(call.executed_at),
            "duration_ms": None if call.duration_ms is None else float(call.duration_ms),
            "decision": decision}


def _message(message: Message, calls: list[ToolCall]) -> dict[str, Any]:
    usage = message.usage or None
    return {"id": message.id, "role": message.role, "kind": message.kind,
            "status": message.status, "created_at": _iso(message.created_at),
            "content": message.content, "reasoning": message.reasoning,
            "tool_call_id": message.tool_call_id, "finish_reason": message.finish_reason,
            "usage": None if usage is None else {
                "input_tokens": int(usage.get("input_tokens") or 0),
                "output_tokens": int(usage.get("output_tokens") or 0)},
            "cost_usd": _money(message.cost), "compacted_by": message.compacted_by,
            "tool_calls": [_call(call) for call in calls]}


def conversation(session: SessionLike, loop: Loop) -> dict[str, Any]:
    """The loop's conversation as a ``solidloop.conversation/1`` document: its
    visible messages in order (hidden shells of unfinished turns are left
    out; the totals count them), each assistant turn with its tool calls."""
    calls: dict[int, list[ToolCall]] = {}
    for call in queries.tool_calls(session, loop.id):
        calls.setdefault(call.message_id, []).append(call)
    subject = None
    if loop.subject_type is not None or loop.subject_id is not None:
        subject = {"type": loop.subject_type, "id": loop.subject_id}
    forked = None
    if loop.forked_from_loop_id is not None:
        forked = {"loop_id": loop.forked_from_loop_id, "message_id": loop.forked_at_message_id}
    return {
        "schema": SCHEMA_NAME,
        "exported_at": _iso(datetime.now(UTC)),
        "loop": {"id": loop.id, "agent": loop.agent_name, "status": loop.status,
                 "subject": subject, "created_at": _iso(loop.created_at),
                 "finished_at": _iso(loop.finished_at), "error_message": loop.error_message,
                 "state": loop.state, "output": loop.output, "forked_from": forked,
                 "parent_loop_id": loop.parent_loop_id},
        "totals": {"steps": loop.step_count, "input_tokens": loop.input_tokens,
                   "output_tokens": loop.output_tokens, "cost_usd": _money(loop.cost)},
        "messages": [_message(m, calls.get(m.id, []))
                     for m in queries.messages(session, loop.id)],
    }


def to_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False, default=str) + "\n"


def fence(text: str, info: str = "") -> str:
    """``text`` in a code fence no line of it can close: the fence is one
    backtick longer than the longest run of backticks inside (at least 3)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    bar = "`" * max(3, longest + 1)
    return f"{bar}{info}\n{text}\n{bar}"


def _code(text: str) -> str:
    """Inline code that holds any backticks in ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    bar = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{bar}{pad}{text}{pad}{bar}"


def _cost(value: float | None) -> str:
    return "unpriced" if value is None else f"${value:.6f}".rstrip("0").rstrip(".")


def _json_block(value: Any) -> str:
    return fence(json.dumps(value, indent=2, ensure_ascii=False, default=str), "json")


def to_markdown(document: dict[str, Any]) -> str:
    """The document for people: a header with the totals, then each message
    (content fenced, never interpreted), its tool calls with arguments and
    results, and its tokens and cost."""
    loop, totals = document["loop"], document["totals"]
    lines = [f"# Loop {loop['id']} ({_code(loop['agent'])})", "",
             f"- status: {loop['status']}"]
    if loop["subject"]:
        lines.append(f"- subject: {_code(str(loop['subject']['type']))} "
                     f"{_code(str(loop['subject']['id']))}")
    lines += [f"- created: {loop['created_at']} (UTC); finished: {loop['finished_at'] or '-'}",
              f"- steps: {totals['steps']}; tokens: {totals['input_tokens']} in / "
              f"{totals['output_tokens']} out; cost: {_cost(totals['cost_usd'])}",
              f"- exported: {document['exported_at']} ({document['schema']})"]
    if loop["error_message"]:
        lines += ["", "Error:", "", fence(loop["error_message"], "text")]
    for message in document["messages"]:
        lines += ["", f"## {message['role']} (message {message['id']})", ""]
        meta = [f"{message['status']}", f"{message['created_at']}"]
        if message["usage"]:
            meta.append(f"{message['usage']['input_tokens']} in / "
                        f"{message['usage']['output_tokens']} out")
        if message["cost_usd"] is not None:
            meta.append(_cost(message["cost_usd"]))
        if message["compacted_by"]:
            meta.append(f"compacted into summary {message['compacted_by']}")
        lines += ["_" + " · ".join(meta) + "_", ""]
        if message["reasoning"]:
            lines += ["Reasoning:", "", fence(message["reasoning"], "text"), ""]
        lines.append(fence(message["content"] or "", "text"))
        for call in message["tool_calls"]:
            outcome = {True: "succeeded", False: "failed", None: "no result"}[call["is_success"]]
            lines += ["", f"### Tool call {_code(call['name'])} (call {call['id']}): {outcome}",
                      "", "Arguments:", "",
                      _json_block(call["arguments"]) if call["arguments"] is not None
                      else fence(call["arguments_raw"] or "", "text")]
            if call["result"] is not None:
                lines += ["", "Result:", "", _json_block(call["result"])]
            if call["decision"]:
                lines += ["", f"Decision: {call['decision']['decision']}"
                              f" by {_code(str(call['decision']['by']))}"]
    return "\n".join(lines) + "\n"
