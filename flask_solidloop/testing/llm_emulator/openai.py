"""The OpenAI chat-completions dialect as the emulator serves it
(``POST /v1/chat/completions``): its error shape, its auth (``Authorization:
Bearer``), what a request must hold, the text scripts match, and the answer, whole
or as ``data:`` chunks ending in ``data: [DONE]`` (``stream_options.include_usage``
adds the usage chunk)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from .._local_server import Response
from .dialect import body_problem, content_text, estimate_tokens, json_response, last_entry, split
from .types import Event, Raw, Rendered, completion_text


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error response in OpenAI's shape (``type_`` defaults to invalid_request_error)."""
    return json_response(
        status, error_body(message, type_ or "invalid_request_error", code, param), headers
    )


def check_auth(api_key: str, headers: dict[str, str]) -> Response | None:
    """None when ``Authorization: Bearer <api_key>`` was sent, else OpenAI's 401."""
    auth = headers.get("authorization", "")
    if auth == f"Bearer {api_key}":
        return None
    what = "No API key provided." if not auth else "Incorrect API key provided."
    return json_response(401, error_body(what, "invalid_request_error", "invalid_api_key"))


def validate(
    headers: dict[str, str], parsed: Any, body: str, json_error: str | None
) -> Response | None:
    """A 400 when the request is not a usable chat request, else None."""
    problem = body_problem(parsed, body, json_error)
    if problem is not None:
        return error(400, problem)
    messages = parsed.get("messages")
    if not isinstance(messages, list) or not messages:
        return error(400, "'messages' must be a non-empty array.", param="messages")
    return None


def last_message_text(request_json: dict[str, Any]) -> str:
    """What scripts match: the last message's ``content`` (a string or text parts)."""
    last = last_entry(request_json, "messages")
    return content_text(last.get("content")) if last is not None else ""


def prompt_text(request_json: dict[str, Any]) -> str:
    """Every message's text and tool calls, for the prompt's token estimate."""
    chunks: list[str] = []
    for msg in request_json.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        chunks.append(content_text(msg.get("content")))
        for call in msg.get("tool_calls") or []:
            if isinstance(call, dict):
                fn = call.get("function") or {}
                chunks.append(str(fn.get("name", "")))
                chunks.append(str(fn.get("arguments", "")))
    return "".join(chunks)


def output_cap(request_json: dict[str, Any]) -> int:
    """The output tokens the request allows (``max_completion_tokens``, else
    ``max_tokens``); 0 when it sets none."""
    return _int_field(request_json.get("max_completion_tokens")) or _int_field(
        request_json.get("max_tokens"))


def _int_field(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _usage(request_json: dict[str, Any], reply: dict[str, Any]) -> dict[str, int]:
    usage = {
        "prompt_tokens": estimate_tokens(prompt_text(request_json)),
        "completion_tokens": estimate_tokens(completion_text(reply)),
    }
    override = reply.get("usage") or {}
    usage.update({k: int(v) for k, v in override.items()})
    usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
    return usage


def render(
    request_json: dict[str, Any], reply: dict[str, Any], *, stream: bool, with_usage: bool
) -> Rendered:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
    created = int(time.time())
    model = request_json.get("model") or "llm-emulator"
    usage = _usage(request_json, reply)
    cost = (usage["prompt_tokens"], usage["completion_tokens"])

    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if reply["refusal"] is not None:
            message["refusal"] = reply["refusal"]
        if reply["reasoning_content"] is not None:
            message["reasoning_content"] = reply["reasoning_content"]
        if reply["tool_calls"]:
            message["tool_calls"] = reply["tool_calls"]
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply["finish_reason"]}],
        }
        if with_usage:
            payload["usage"] = usage
        return Rendered(payload=payload, usage=cost)

    stream_options = request_json.get("stream_options") or {}
    include_usage = with_usage and bool(
        isinstance(stream_options, dict) and stream_options.get("include_usage")
    )
    events: list[Event] = []

    def emit(delta: dict[str, Any] | None, finish_reason: str | None = None) -> None:
        chunk: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": (
                []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
            ),
        }
        if include_usage:
            chunk["usage"] = usage if delta is None else None
        events.append(Event(chunk))

    emit({"role": "assistant", "content": "" if reply["content"] is not None else None})
    for piece in split(reply["reasoning_content"] or ""):
        emit({"reasoning_content": piece})
    for piece in split(reply["content"] or ""):
        emit({"content": piece})
    for piece in split(reply["refusal"] or ""):
        emit({"refusal": piece})
    for index, call in enumerate(reply["tool_calls"]):
        fn = call["function"]
        emit({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                              "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in split(fn["arguments"]):
            emit({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    emit({}, reply["finish_reason"])
    if include_usage:
        emit(None)
    events.append(Event(Raw("[DONE]")))
    return Rendered(
        events=events,
        content_type="text/event-stream; charset=utf-8",
        headers={"Cache-Control": "no-cache"},
        usage=cost,
    )
