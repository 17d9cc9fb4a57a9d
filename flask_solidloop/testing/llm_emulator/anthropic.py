"""The Anthropic Messages dialect as the emulator serves it (``POST /v1/messages``):
its error shape, its auth (``x-api-key``), what a request must hold
(``anthropic-version``, ``max_tokens``), the text scripts match, and the answer,
whole or as ``event:`` lines (message_start, content_block_start/_delta/_stop,
ping, message_delta, message_stop). A thinking block is signed
``"sig-" + sha256(thinking)``."""

from __future__ import annotations

import copy
import hashlib
import uuid
from typing import Any

from .._local_server import Response
from .dialect import (
    body_problem,
    content_text,
    dumps,
    estimate_tokens,
    json_response,
    last_entry,
    split,
)
from .types import Event, Rendered, completion_text, loads_or_raw

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    error_type = type_ or _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error(
    status: int, message: str, *, type_: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error response in Anthropic's shape (the type follows the status by default)."""
    return json_response(status, error_body(status, message, type_), headers)


def check_auth(api_key: str, headers: dict[str, str]) -> Response | None:
    """None when ``x-api-key`` holds ``api_key``, else Anthropic's 401."""
    key = headers.get("x-api-key", "")
    if key == api_key:
        return None
    what = "x-api-key header is required" if not key else "invalid x-api-key"
    return json_response(401, error_body(401, what))


def validate(
    headers: dict[str, str], parsed: Any, body: str, json_error: str | None
) -> Response | None:
    """A 400 when the request is not a usable Messages request, else None."""
    if not headers.get("anthropic-version"):
        return error(400, "anthropic-version: header is required")
    problem = body_problem(parsed, body, json_error)
    if problem is not None:
        return error(400, problem)
    messages = parsed.get("messages")
    if not isinstance(messages, list) or not messages:
        return error(400, "'messages' must be a non-empty array.")
    max_tokens = parsed.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        return error(400, "max_tokens: Field required")
    return None


def blocks_text(content: Any) -> str:
    """Text of an Anthropic ``content``: text blocks, and tool_result blocks' content text."""
    if not isinstance(content, list):
        return content_text(content)
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            if block.get("type") == "tool_result":
                parts.append(content_text(block.get("content")))
            elif block.get("type", "text") == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
    return "\n".join(parts)


def last_message_text(request_json: dict[str, Any]) -> str:
    """What scripts match: the last message's text blocks, or a tool_result's content."""
    last = last_entry(request_json, "messages")
    return blocks_text(last.get("content")) if last is not None else ""


def prompt_text(request_json: dict[str, Any]) -> str:
    """The system prompt, every message's text and tool calls, for the token estimate."""
    chunks: list[str] = [blocks_text(request_json.get("system"))]
    for msg in request_json.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        chunks.append(blocks_text(content))
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                chunks.append(str(block.get("name", "")) + dumps(block.get("input")))
    return "".join(chunks)


def output_cap(request_json: dict[str, Any]) -> int:
    """The request's ``max_tokens`` (required; 0 if it is not a positive int)."""
    cap = request_json.get("max_tokens")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else 0


_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
         "content_filter": "refusal"}


def _signature(thinking: str) -> str:
    return "sig-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    if reply["anthropic_blocks"] is not None:
        return copy.deepcopy(reply["anthropic_blocks"])
    blocks: list[dict[str, Any]] = []
    thinking = reply["reasoning_content"]
    if thinking:
        blocks.append(
            {"type": "thinking", "thinking": thinking, "signature": _signature(thinking)}
        )
    if reply["content"]:
        blocks.append({"type": "text", "text": reply["content"]})
    for call_id, call in zip(reply["call_ids"], reply["tool_calls"], strict=True):
        fn = call["function"]
        blocks.append({
            "type": "tool_use",
            "id": call_id or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": fn["name"],
            "input": loads_or_raw(fn["arguments"]),
        })
    return blocks


def _usage(
    request_json: dict[str, Any], reply: dict[str, Any], blocks: list[dict[str, Any]]
) -> dict[str, int]:
    if reply["anthropic_blocks"] is not None:
        output = dumps(blocks)
    else:
        output = (reply["reasoning_content"] or "") + completion_text(reply)
    usage = {
        "input_tokens": estimate_tokens(prompt_text(request_json)),
        "output_tokens": estimate_tokens(output),
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    override = dict(reply.get("usage") or {})
    for openai_key, key in (("prompt_tokens", "input_tokens"),
                            ("completion_tokens", "output_tokens")):
        if openai_key in override:
            override.setdefault(key, override[openai_key])
    usage.update({k: int(v) for k, v in override.items() if k in usage})
    return usage


def render(
    request_json: dict[str, Any], reply: dict[str, Any], *, stream: bool, with_usage: bool
) -> Rendered:
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    model = request_json.get("model") or "llm-emulator"
    blocks = _blocks(reply)
    explicit = reply["explicit_finish_reason"]
    if reply["refusal"]:
        blocks.append({"type": "text", "text": reply["refusal"]})
        stop_reason = "refusal"
    elif explicit:
        stop_reason = _STOP.get(explicit, explicit)
    else:
        has_tool = any(b.get("type") == "tool_use" for b in blocks)
        stop_reason = "tool_use" if has_tool else "end_turn"
    usage = _usage(request_json, reply, blocks)
    cost = (usage["input_tokens"], usage["output_tokens"])
    headers = {"request-id": f"req_{uuid.uuid4().hex[:24]}"}

    if not stream:
        payload: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": None,
        }
        if with_usage:
            payload["usage"] = usage
        return Rendered(payload=payload, headers=headers, usage=cost)

    events: list[Event] = []

    def emit(data: dict[str, Any]) -> None:
        events.append(Event(data, data["type"]))

    start: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
    }
    if with_usage:
        start["usage"] = {**usage, "output_tokens": 1}
    emit({"type": "message_start", "message": start})
    for index, block in enumerate(blocks):
        kind = block.get("type")
        deltas: list[dict[str, Any]] = []
        # the start block keeps every key but the streamed one, which starts empty
        if kind == "text":
            first: dict[str, Any] = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in split(block.get("text") or "")]
        elif kind == "thinking":
            first = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p}
                      for p in split(block.get("thinking") or "")]
            if block.get("signature"):
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            first = {**block, "input": {}}
            raw = block.get("input")
            partial = raw if isinstance(raw, str) else dumps(raw if raw is not None else {})
            # the real API opens with an empty partial_json
            deltas = [{"type": "input_json_delta", "partial_json": p}
                      for p in ["", *split(partial)]]
        else:  # redacted_thinking, server tool blocks, ...: whole in the start event
            first = block
        emit({"type": "content_block_start", "index": index, "content_block": first})
        if index == 0:
            emit({"type": "ping"})
        for delta in deltas:
            emit({"type": "content_block_delta", "index": index, "delta": delta})
        emit({"type": "content_block_stop", "index": index})
    if not blocks:
        emit({"type": "ping"})
    message_delta: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
    }
    if with_usage:
        message_delta["usage"] = {"output_tokens": usage["output_tokens"]}
    emit(message_delta)
    emit({"type": "message_stop"})
    return Rendered(
        events=events,
        content_type="text/event-stream; charset=utf-8",
        headers={**headers, "Cache-Control": "no-cache"},
        usage=cost,
    )
