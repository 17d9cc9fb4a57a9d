"""The OpenAI Responses API as the emulator serves it (``POST /v1/responses``): what a
request must hold, strict mode's checks, the text scripts match, and the answer,
whole or as named events (``response.created`` ... ``response.completed``; no
``[DONE]``). Auth and the error shape are the Chat dialect's (:mod:`.openai`).

The server's memory is :class:`ResponsesState`: the ``encrypted_content`` of
every reasoning item it issued (one it did not issue is refused), and the
responses it was asked to store (``store: true``), so ``previous_response_id``
chains and a ``function_call_output`` can answer a call of an earlier response.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from typing import Any

from ...errors import SolidLoopError
from .._local_server import Response
from .dialect import body_problem, content_text, estimate_tokens, split
from .openai import check_auth as check_auth
from .openai import error
from .types import Event, Rendered

# The key sets of the openai SDK's ResponseCreateParams (openai 3.60) and of the
# input items and tools this project sends.
TOP_KEYS = frozenset({
    "access_programs", "background", "background_options", "context_management",
    "conversation", "image", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "moderation", "parallel_tool_calls",
    "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store",
    "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "user",
})
ITEM_KEYS = {
    "message": frozenset({"type", "role", "content", "phase", "id", "status"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status",
                                "caller", "namespace"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content",
                            "status"}),
}
FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict",
                                "allowed_callers", "defer_loading", "output_schema"})
ROLES = ("user", "assistant", "system", "developer")
INCLUDABLE = frozenset({"reasoning.encrypted_content", "message.output_text.logprobs",
                        "file_search_call.results", "web_search_call.results",
                        "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs"})


class Refused(SolidLoopError):
    """A request the real API refuses: its message and error code."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status


class ResponsesState:
    """What the server remembers between requests (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.issued: set[str] = set()
        #: response id -> (its previous_response_id, the call_ids of its calls)
        self.stored: dict[str, tuple[str | None, list[str]]] = {}
        #: function_call item id -> the reasoning item id it followed
        self.call_reasoning: dict[str, str] = {}

    def reset(self) -> None:
        with self._lock:
            self.issued.clear()
            self.stored.clear()
            self.call_reasoning.clear()

    def chain_calls(self, response_id: str | None) -> set[str]:
        calls: set[str] = set()
        with self._lock:
            while response_id is not None and response_id in self.stored:
                response_id, ids = self.stored[response_id]
                calls.update(ids)
        return calls

    def check(self, request: dict[str, Any]) -> Response | None:
        """Strict mode: the 400 the real API answers ``request`` with, or None."""
        try:
            self._check(request)
        except Refused as refused:
            return error(refused.status, refused.message, code=refused.code, param=refused.param)
        return None

    def _check(self, request: dict[str, Any]) -> None:
        extra = sorted(set(request) - TOP_KEYS)
        if extra:
            raise Refused(f"Unknown parameter: '{extra[0]}'.", "unknown_parameter", extra[0])
        for value in request.get("include") or []:
            if value not in INCLUDABLE:
                raise Refused(f"Invalid value: '{value}'. Supported values are: "
                              f"{', '.join(sorted(map(repr, INCLUDABLE)))}.",
                              "invalid_value", "include")
        previous = request.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            raise Refused(f"Previous response with id '{previous}' not found.",
                          "previous_response_not_found", "previous_response_id")
        store = request.get("store", True) is not False
        known_calls = self.chain_calls(previous)
        items = request.get("input")
        items = items if isinstance(items, list) else []
        reasoning_ids = {i.get("id") for i in items
                         if isinstance(i, dict) and i.get("type") == "reasoning"}
        for index, item in enumerate(items):
            where = f"input[{index}]"
            if not isinstance(item, dict):
                raise Refused(f"Invalid type for '{where}': expected an object.", "invalid_type")
            kind = item.get("type", "message")
            if kind not in ITEM_KEYS:
                raise Refused(f"Invalid value: '{kind}'. Supported values are: "
                              f"{', '.join(map(repr, ITEM_KEYS))}.", "invalid_value",
                              f"{where}.type")
            extra = sorted(set(item) - ITEM_KEYS[kind])
            if extra:
                raise Refused(f"Unknown parameter: '{where}.{extra[0]}'.", "unknown_parameter",
                              f"{where}.{extra[0]}")
            self._check_item(kind, item, where, store, known_calls)
            following = items[index + 1] if index + 1 < len(items) else None
            if kind == "reasoning" and not _follows_reasoning(following):
                raise Refused(f"Item '{item.get('id')}' of type 'reasoning' was provided "
                              "without its required following item.", None, "input")
            needed = self.call_reasoning.get(str(item.get("id")))
            if kind == "function_call" and needed and needed not in reasoning_ids:
                raise Refused(f"Item '{item['id']}' of type 'function_call' was provided "
                              f"without its required 'reasoning' item: '{needed}'.", None,
                              "input")
        for index, tool in enumerate(request.get("tools") or []):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise Refused(f"Invalid value for '{where}.type': expected 'function'.",
                              "invalid_value", f"{where}.type")
            extra = sorted(set(tool) - FUNCTION_TOOL_KEYS)
            if extra:
                raise Refused(f"Unknown parameter: '{where}.{extra[0]}'.", "unknown_parameter")
            for key in ("name", "parameters", "strict"):
                if key not in tool:
                    raise Refused(f"Missing required parameter: '{where}.{key}'.",
                                  "missing_required_parameter", f"{where}.{key}")
        fmt = (request.get("text") or {}).get("format") if isinstance(
            request.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
            if extra or not isinstance(fmt.get("name"), str) \
                    or not isinstance(fmt.get("schema"), dict):
                raise Refused("Invalid 'text.format': a json_schema format takes type, name, "
                              "schema, strict and description.", "invalid_value", "text.format")

    def _check_item(self, kind: str, item: dict[str, Any], where: str, store: bool,
                    known_calls: set[str]) -> None:
        if kind == "message":
            if item.get("role") not in ROLES:
                raise Refused(f"Invalid value: '{item.get('role')}'. Supported values are: "
                              f"{', '.join(map(repr, ROLES))}.", "invalid_value", f"{where}.role")
            if not isinstance(item.get("content"), str | list):
                raise Refused(f"Invalid type for '{where}.content': expected a string or an "
                              "array of content parts.", "invalid_type", f"{where}.content")
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise Refused(f"Missing required parameter: '{where}.{key}'.",
                                  "missing_required_parameter", f"{where}.{key}")
            known_calls.add(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise Refused(f"No tool call found for function call output with call_id "
                              f"{call_id}.", None, "input")
            if not isinstance(item.get("output"), str | list):
                raise Refused(f"Missing required parameter: '{where}.output'.",
                              "missing_required_parameter", f"{where}.output")
        elif kind == "reasoning":
            if not isinstance(item.get("id"), str) or not isinstance(item.get("summary"), list):
                raise Refused(f"Missing required parameter: '{where}.summary'.",
                              "missing_required_parameter", f"{where}.summary")
            encrypted = item.get("encrypted_content")
            if encrypted is None:
                if not store:
                    raise Refused(f"Item with id '{item['id']}' not found. Items are not "
                                  "persisted when `store` is set to false. Try again with "
                                  "`store` set to true, or remove this item from your input.",
                                  None, "input", status=404)
            elif encrypted not in self.issued:
                raise Refused(f"The encrypted content for item {item['id']} could not be "
                              "verified.", "invalid_encrypted_content", "input")


def _follows_reasoning(item: Any) -> bool:
    """Whether ``item`` may follow a reasoning item: the output it led to (an
    assistant message, a function call) or another reasoning item."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type", "message")
    return kind in ("reasoning", "function_call") or (
        kind == "message" and item.get("role") == "assistant")


def validate(headers: dict[str, str], parsed: Any, body: str, json_error: str | None
             ) -> Response | None:
    """A 400 when the request is not a usable Responses request, else None."""
    problem = body_problem(parsed, body, json_error)
    if problem is not None:
        return error(400, problem)
    if not parsed.get("model"):
        return error(400, "Missing required parameter: 'model'.",
                     code="missing_required_parameter", param="model")
    items = parsed.get("input")
    if not isinstance(items, str) and (not isinstance(items, list) or not items):
        return error(400, "'input' must be a string or a non-empty array of items.",
                     param="input")
    return None


def _item_text(item: Any) -> str:
    if not isinstance(item, dict):
        return ""
    kind = item.get("type", "message")
    if kind == "function_call_output":
        return content_text(item.get("output"))
    if kind == "function_call":
        return str(item.get("name", "")) + str(item.get("arguments", ""))
    if kind == "message":
        return content_text(item.get("content"))
    return ""


def last_message_text(request_json: dict[str, Any]) -> str:
    """What scripts match: the last input item's text (a tool output's included)."""
    items = request_json.get("input")
    if isinstance(items, str):
        return items
    return _item_text(items[-1]) if isinstance(items, list) and items else ""


def prompt_text(request_json: dict[str, Any]) -> str:
    items = request_json.get("input")
    if isinstance(items, str):
        return items
    return "".join(_item_text(item) for item in items or [])


def output_cap(request_json: dict[str, Any]) -> int:
    value = request_json.get("max_output_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def openai_view(request_json: dict[str, Any]) -> dict[str, Any]:
    """The request as Chat ``messages``/``tools``, for the offline model."""
    messages: list[dict[str, Any]] = []
    items = request_json.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": content_text(
                item.get("content"))})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": content_text(item.get("output"))})
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description") or "",
        "parameters": t.get("parameters") or {}}}
        for t in request_json.get("tools") or [] if isinstance(t, dict)]
    return {"messages": messages, "tools": tools}


def _usage(request_json: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    text = (reply["content"] or "") + (reply["refusal"] or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in reply["tool_calls"])
    reasoning = estimate_tokens(reply["reasoning_content"]) if reply["reasoning_content"] \
        else 0
    usage: dict[str, Any] = {
        "input_tokens": estimate_tokens(prompt_text(request_json)),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": estimate_tokens(text) + reasoning,
        "output_tokens_details": {"reasoning_tokens": reasoning},
    }
    for key, value in (reply.get("usage") or {}).items():
        native = {"prompt_tokens": "input_tokens", "completion_tokens": "output_tokens"}
        usage[native.get(key, key)] = value
    usage["total_tokens"] = int(usage["input_tokens"]) + int(usage["output_tokens"])
    return usage


def render(request_json: dict[str, Any], reply: dict[str, Any], state: ResponsesState, *,
           stream: bool, with_usage: bool) -> Rendered:
    """The answer (a ``response`` object, or its events), remembered as a real server
    would: issued encrypted reasoning, and the response itself when ``store`` is on."""
    response_id = f"resp_{uuid.uuid4().hex}"
    output: list[dict[str, Any]] = []
    include = request_json.get("include") or []
    if reply["reasoning_content"] is not None:
        item_id = f"rs_{uuid.uuid4().hex}"
        reasoning: dict[str, Any] = {
            "type": "reasoning", "id": item_id,
            "summary": [{"type": "summary_text", "text": reply["reasoning_content"]}]}
        if "reasoning.encrypted_content" in include:
            encrypted = "enc-" + hashlib.sha256(
                f"{item_id}:{reply['reasoning_content']}".encode()).hexdigest()
            reasoning["encrypted_content"] = encrypted
            with state._lock:
                state.issued.add(encrypted)
        output.append(reasoning)
    parts: list[dict[str, Any]] = []
    if reply["content"]:
        parts.append({"type": "output_text", "text": reply["content"], "annotations": [],
                      "logprobs": []})
    if reply["refusal"] is not None:
        parts.append({"type": "refusal", "refusal": reply["refusal"]})
    if parts:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                       "status": "completed", "content": parts})
    reasoning_id = output[0]["id"] if output and output[0]["type"] == "reasoning" else None
    for call in reply["tool_calls"]:
        call_item_id = f"fc_{uuid.uuid4().hex}"
        if reasoning_id is not None:
            with state._lock:
                state.call_reasoning[call_item_id] = reasoning_id
        output.append({"type": "function_call", "id": call_item_id,
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    usage = _usage(request_json, reply)
    finish = reply["explicit_finish_reason"]
    status, incomplete = "completed", None
    if finish in ("length", "max_output_tokens", "content_filter"):
        status = "incomplete"
        incomplete = {"reason": "content_filter" if finish == "content_filter"
                      else "max_output_tokens"}
    store = request_json.get("store", True) is not False
    previous = request_json.get("previous_response_id")
    if store:
        with state._lock:
            state.stored[response_id] = (previous, [c["id"] for c in reply["tool_calls"]])
    response: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": status, "error": None, "incomplete_details": incomplete,
        "instructions": request_json.get("instructions"), "metadata": {},
        "model": request_json.get("model") or "llm-emulator", "output": output,
        "parallel_tool_calls": request_json.get("parallel_tool_calls", True),
        "previous_response_id": previous, "store": store,
        "temperature": 1.0, "top_p": 1.0, "tool_choice": request_json.get("tool_choice", "auto"),
        "tools": request_json.get("tools") or [],
    }
    if with_usage:
        response["usage"] = usage
    cost = (int(usage["input_tokens"]), int(usage["output_tokens"]))
    if not stream:
        return Rendered(payload=response, usage=cost)
    return Rendered(events=_events(response), content_type="text/event-stream; charset=utf-8",
                    headers={"Cache-Control": "no-cache"}, usage=cost)


def _events(response: dict[str, Any]) -> list[Event]:
    events: list[Event] = []

    def emit(kind: str, **data: Any) -> None:
        events.append(Event({"type": kind, "sequence_number": len(events), **data}, kind))

    start = {**response, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for index, item in enumerate(response["output"]):
        kind, item_id = item["type"], item["id"]
        if kind == "reasoning":
            emit("response.output_item.added", output_index=index,
                 item={"type": "reasoning", "id": item_id, "summary": []})
            for summary_index, part in enumerate(item["summary"]):
                for piece in split(part["text"]):
                    emit("response.reasoning_summary_text.delta", item_id=item_id,
                         output_index=index, summary_index=summary_index, delta=piece)
        elif kind == "message":
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            for content_index, part in enumerate(item["content"]):
                field = "text" if part["type"] == "output_text" else "refusal"
                emit("response.content_part.added", item_id=item_id, output_index=index,
                     content_index=content_index, part={**part, field: ""})
                for piece in split(part[field]):
                    if field == "text":
                        emit("response.output_text.delta", item_id=item_id,
                             output_index=index, content_index=content_index, delta=piece,
                             logprobs=[])
                    else:
                        emit("response.refusal.delta", item_id=item_id, output_index=index,
                             content_index=content_index, delta=piece)
                emit("response.content_part.done", item_id=item_id, output_index=index,
                     content_index=content_index, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "arguments": "", "status": "in_progress"})
            for piece in split(item["arguments"]):
                emit("response.function_call_arguments.delta", item_id=item_id,
                     output_index=index, delta=piece)
            emit("response.function_call_arguments.done", item_id=item_id,
                 output_index=index, arguments=item["arguments"], name=item["name"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed",
         response=response)
    return events


def stream_error_data(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` event a failing stream ends with."""
    return {"type": "error", "code": "server_error", "param": None, "sequence_number": 0,
            "message": opts.get("message") or "The server had an error while processing "
            "your request (injected by LLMEmulator)."}
