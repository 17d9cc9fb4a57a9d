"""The OpenAI-compatible chat-completions dialect: render a request, parse a response.

Pure functions, no I/O. Works with OpenAI, vLLM, llama.cpp, Ollama, LiteLLM and
anything else that speaks ``POST /v1/chat/completions``.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ProviderResponseError
from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

PATH = "/v1/chat/completions"
KNOWN_FINISH_REASONS = {"stop", "tool_calls", "length", "content_filter", "function_call", None}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def render_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_raw or "{}"},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def render_request(
    settings: ProviderSettings,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]],
    *,
    llm_params: dict[str, Any] | None = None,
    reasoning_effort: str | None = None,
    max_tokens: int | None = None,
    stream: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Return (path, payload). ``tools`` are MCP tool dicts (name, description, inputSchema)."""
    payload: dict[str, Any] = {
        "model": settings.model,
        "messages": [render_message(m) for m in messages],
        "stream": stream,
    }
    if tools:
        payload["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "parameters": tool.get("inputSchema") or {"type": "object", "properties": {}},
                },
            }
            for tool in tools
        ]
    if reasoning_effort is not None:
        payload["reasoning_effort"] = reasoning_effort
    if max_tokens is not None:
        payload[settings.max_tokens_param] = max_tokens
    if llm_params:
        payload = deep_merge(payload, llm_params)
    return PATH, payload


def parse_response(body: Any) -> AssistantTurn:
    """Interpret a non-streaming chat.completion body."""
    if not isinstance(body, dict):
        raise ProviderResponseError(f"expected a JSON object, got {type(body).__name__}")
    if "error" in body and not body.get("choices"):
        raise ProviderResponseError(f"provider returned an error object: {body['error']}")
    choices = body.get("choices")
    if not choices or not isinstance(choices, list):
        raise ProviderResponseError(
            f"response has no choices (keys: {', '.join(sorted(body)) or 'none'})"
        )
    choice = choices[0]
    message = choice.get("message") or {}
    finish_reason = choice.get("finish_reason")
    if finish_reason not in KNOWN_FINISH_REASONS:
        raise ProviderResponseError(f"unknown finish_reason {finish_reason!r}")
    content = message.get("content")
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for raw in message.get("tool_calls") or []:
        function = raw.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, dict | list):
            import json

            arguments = json.dumps(arguments)
        calls.append(
            ToolCallRequest(
                call_id=raw.get("id"),
                name=str(function.get("name") or ""),
                arguments_raw=arguments if arguments is not None else "",
            )
        )
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return AssistantTurn(
        content=content,
        tool_calls=calls,
        finish_reason=finish_reason,
        usage=parse_usage(body.get("usage")),
        reasoning=reasoning if isinstance(reasoning, str) else None,
        raw=body,
    )


def parse_usage(data: Any) -> Usage | None:
    if not isinstance(data, dict):
        return None
    prompt_details = data.get("prompt_tokens_details") or {}
    completion_details = data.get("completion_tokens_details") or {}
    return Usage(
        input_tokens=int(data.get("prompt_tokens") or 0),
        cached_input_tokens=int(prompt_details.get("cached_tokens") or 0),
        output_tokens=int(data.get("completion_tokens") or 0),
        reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0),
    )


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
