"""The Gemini dialect as the emulator serves it (``POST
/v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``): Google's
error shape, its auth (``x-goog-api-key`` or ``?key=``), what a request must hold,
the text scripts match, and the answer, whole or streamed (``?alt=sse``: ``data:``
chunks, no terminator; without it, the chunks as one JSON array). The first
``functionCall`` part, else the first text part, carries a deterministic
``thoughtSignature``; a streamed text answer gets it on a later empty-text part."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import uuid
from typing import Any

from .._local_server import Response
from .dialect import body_problem, dumps, estimate_tokens, json_response, last_entry, split
from .types import Event, Rendered, completion_text, loads_or_raw

_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def error_body(status: int, message: str, status_name: str | None = None) -> dict[str, Any]:
    name = status_name or _STATUS.get(status, "UNKNOWN")
    return {"error": {"code": status, "message": message, "status": name}}


def retry_info_body(status: int, delay: str, message: str | None = None) -> dict[str, Any]:
    """Google's error carrying a ``google.rpc.RetryInfo`` detail: wait ``delay`` ("2s")."""
    body = error_body(status, message or (
        "Resource has been exhausted (e.g. check quota). "
        f"Please retry in {delay} (injected by LLMEmulator)."))
    body["error"]["details"] = [
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
    ]
    return body


def error(status: int, message: str, *, headers: dict[str, str] | None = None) -> Response:
    """An error response in Google's shape (the status name follows the code)."""
    return json_response(status, error_body(status, message), headers)


def check_auth(
    api_key: str, headers: dict[str, str], params: dict[str, list[str]]
) -> Response | None:
    """None when ``x-goog-api-key`` (or ``?key=``) holds ``api_key``; else 401 when no
    key was sent, 403 for a wrong one, as Google answers."""
    key = headers.get("x-goog-api-key") or (params.get("key") or [""])[0]
    if key == api_key:
        return None
    if not key:
        return json_response(401, error_body(
            401, "Method doesn't allow unregistered callers (callers without "
            "established identity). Please use API Key or other form of API "
            "consumer identity to call this API."))
    return json_response(403, error_body(
        403, "API key not valid. Please pass a valid API key."))


def validate(
    headers: dict[str, str], parsed: Any, body: str, json_error: str | None
) -> Response | None:
    """A 400 when the request is not a usable GenerateContentRequest, else None."""
    problem = body_problem(parsed, body, json_error)
    if problem is not None:
        return error(400, problem)
    contents = parsed.get("contents")
    if not isinstance(contents, list) or not contents:
        return error(400, "* GenerateContentRequest.contents: contents is not specified")
    return None


def parts_text(parts: Any) -> str:
    """Text of Gemini ``parts``: text parts, and functionResponse ``response`` as JSON."""
    if not isinstance(parts, list):
        return ""
    texts: list[str] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        response = part.get("functionResponse")
        if isinstance(response, dict):
            texts.append(json.dumps(response.get("response"), ensure_ascii=False))
    return "\n".join(texts)


def last_message_text(request_json: dict[str, Any]) -> str:
    """What scripts match: the last content's text parts, or a functionResponse's
    ``response`` as JSON."""
    last = last_entry(request_json, "contents")
    return parts_text(last.get("parts")) if last is not None else ""


def prompt_text(request_json: dict[str, Any]) -> str:
    """The system instruction, every content's text and function calls, for the token
    estimate."""
    chunks: list[str] = []
    system = request_json.get("systemInstruction")
    if isinstance(system, dict):
        chunks.append(parts_text(system.get("parts")))
    for content in request_json.get("contents") or []:
        if not isinstance(content, dict):
            continue
        chunks.append(parts_text(content.get("parts")))
        for part in content.get("parts") or []:
            if isinstance(part, dict) and isinstance(part.get("functionCall"), dict):
                chunks.append(dumps(part["functionCall"]))
    return "".join(chunks)


def output_cap(request_json: dict[str, Any]) -> int:
    """``generationConfig.maxOutputTokens``; 0 when it is not set."""
    config = request_json.get("generationConfig")
    cap = config.get("maxOutputTokens") if isinstance(config, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else 0


_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS",
           "content_filter": "SAFETY"}


def _signature(reply: dict[str, Any]) -> str:
    basis = dumps([reply["reasoning_content"], reply["content"],
                   [c["function"] for c in reply["tool_calls"]]])
    digest = hashlib.sha256(basis.encode("utf-8")).hexdigest()[:32]
    return base64.b64encode(f"sig-{digest}".encode()).decode("ascii")


def _calls(reply: dict[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for call_id, call in zip(reply["call_ids"], reply["tool_calls"], strict=True):
        fn = call["function"]
        function_call: dict[str, Any] = {"name": fn["name"], "args": loads_or_raw(fn["arguments"])}
        if call_id:
            function_call["id"] = call_id
        calls.append({"functionCall": function_call})
    return calls


def _parts(reply: dict[str, Any]) -> list[dict[str, Any]]:
    if reply["gemini_parts"] is not None:
        return copy.deepcopy(reply["gemini_parts"])
    parts: list[dict[str, Any]] = []
    if reply["reasoning_content"]:
        parts.append({"text": reply["reasoning_content"], "thought": True})
    if reply["content"]:
        parts.append({"text": reply["content"]})
    calls = _calls(reply)
    parts.extend(calls)
    signature = _signature(reply)
    carrier = calls[0] if calls else next(
        (p for p in parts if "text" in p and not p.get("thought")), None
    )
    if carrier is None:
        parts.append({"text": "", "thoughtSignature": signature})
    else:
        carrier["thoughtSignature"] = signature
    return parts


def _usage(
    request_json: dict[str, Any], reply: dict[str, Any], parts: list[dict[str, Any]]
) -> dict[str, int]:
    thoughts = 0
    if reply["gemini_parts"] is not None:
        candidates = estimate_tokens(dumps(parts))
    else:
        candidates = estimate_tokens(completion_text(reply))
        if reply["reasoning_content"]:
            thoughts = estimate_tokens(reply["reasoning_content"])
    usage = {
        "promptTokenCount": estimate_tokens(prompt_text(request_json)),
        "candidatesTokenCount": candidates,
    }
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts
    override = dict(reply.get("usage") or {})
    for openai_key, key in (("prompt_tokens", "promptTokenCount"),
                            ("completion_tokens", "candidatesTokenCount")):
        if openai_key in override:
            override.setdefault(key, override[openai_key])
    usage.update({k: int(v) for k, v in override.items()
                  if k in ("promptTokenCount", "candidatesTokenCount", "thoughtsTokenCount",
                           "cachedContentTokenCount", "totalTokenCount")})
    usage.setdefault(
        "totalTokenCount",
        usage["promptTokenCount"] + usage["candidatesTokenCount"]
        + usage.get("thoughtsTokenCount", 0),
    )
    return usage


def render(
    request_json: dict[str, Any],
    reply: dict[str, Any],
    *,
    model: str,
    stream: bool,
    sse: bool,
    with_usage: bool,
) -> Rendered:
    response_id = uuid.uuid4().hex[:22]
    explicit = reply["explicit_finish_reason"]
    finish = _FINISH.get(explicit, explicit) if explicit else "STOP"
    parts = _parts(reply)
    usage = _usage(request_json, reply, parts)
    cost = (usage["promptTokenCount"],
            usage["candidatesTokenCount"] + usage.get("thoughtsTokenCount", 0))

    def chunk(
        chunk_parts: list[dict[str, Any]], usage_now: dict[str, int] | None, last: bool
    ) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": chunk_parts}}
        if last:
            candidate["finishReason"] = finish
            if reply["continuation_token"]:
                candidate["continuationToken"] = reply["continuation_token"]
        candidate["index"] = 0
        data: dict[str, Any] = {"candidates": [candidate]}
        if with_usage and usage_now is not None:
            data["usageMetadata"] = usage_now
        data["modelVersion"] = model
        data["responseId"] = response_id
        return data

    if not stream:
        return Rendered(payload=chunk(parts, usage, last=True), usage=cost)

    per_chunk: list[list[dict[str, Any]]]
    if reply["gemini_parts"] is not None:
        per_chunk = [[part] for part in parts]
    else:
        per_chunk = [[{"text": p, "thought": True}]
                     for p in split(reply["reasoning_content"] or "")]
        per_chunk += [[{"text": p}] for p in split(reply["content"] or "")]
        calls = _calls(reply)
        signature = _signature(reply)
        if calls:
            calls[0]["thoughtSignature"] = signature
            per_chunk += [[call] for call in calls]
        else:  # the real-world shape: the signature arrives later, on an empty text part
            per_chunk.append([{"text": "", "thoughtSignature": signature}])
    if not per_chunk:
        per_chunk = [[{"text": ""}]]
    total = len(per_chunk)
    events: list[Event] = []
    for index, chunk_parts in enumerate(per_chunk):
        share = (index + 1) / total  # usageMetadata is a running total; the last one is exact
        running = dict(usage)
        for key in ("candidatesTokenCount", "thoughtsTokenCount"):
            if key in running:
                running[key] = round(usage[key] * share)
        running["totalTokenCount"] = usage["totalTokenCount"] - sum(
            usage[k] - running[k] for k in ("candidatesTokenCount", "thoughtsTokenCount")
            if k in usage
        )
        events.append(Event(chunk(chunk_parts, running, last=index == total - 1)))
    if sse:
        return Rendered(events=events, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"}, usage=cost)
    return Rendered(events=events, framing="json_array",
                    content_type="application/json; charset=UTF-8", usage=cost)
