"""The shapes the emulator passes around: the paths and dialect names it serves, a
recorded request, a script, a queued fault, an answer rendered but not yet
delivered, and the reply format every dialect renders (:func:`normalise_reply`
validates a scripted reply and fills in its defaults)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgumentError

Match = str | re.Pattern[str] | Callable[[dict[str, Any]], bool]
Reply = dict[str, Any] | str | Callable[[dict[str, Any]], "dict[str, Any] | str"]

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
ANTHROPIC_PATH = "/v1/messages"
GEMINI_PATH = re.compile(
    r"^/(?:v1beta|v1|v1alpha)/models/(?P<model>[^/:]+):(?P<method>generateContent|"
    r"streamGenerateContent)$"
)
OPENAI, ANTHROPIC, GEMINI = "openai", "anthropic", "gemini"
OPENAI_RESPONSES = "openai_responses"

REPLY_KEYS = frozenset(
    {
        "content",
        "tool_calls",
        "finish_reason",
        "usage",
        "reasoning_content",
        "anthropic_blocks",
        "gemini_parts",
        "refusal",
        "continuation_token",
        "output",
    }
)
#: The tool a structured answer is given through when the request offers it
#: (flask_solidloop/llm/output.py: Anthropic, and Gemini beside other tools).
OUTPUT_TOOL = "final_answer"


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request as the emulator received it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case keys
    json: Any  # parsed body, or None if empty/malformed
    body: str  # raw body, decoded as UTF-8 (invalid bytes replaced)
    query: str = ""  # raw query string, e.g. "alt=sse"


@dataclass
class Script:
    match: Match
    reply: Reply
    remaining: int | None


@dataclass
class Fault:
    kind: str
    options: dict[str, Any]
    remaining: int


class Raw(str):
    """Event data written verbatim (``[DONE]``, a malformed chunk) instead of JSON-dumped."""


@dataclass
class Event:
    data: Any  # JSON-serialisable, or Raw
    name: str | None = None  # the SSE ``event:`` line (Anthropic)


@dataclass
class Rendered:
    """A dialect's answer before faults shape its delivery: a JSON payload or events."""

    payload: Any = None
    events: list[Event] | None = None
    framing: str = "sse"  # "sse" | "json_array" (Gemini stream without alt=sse)
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    #: (prompt, output) tokens the answer costs, reported or not (rate limits settle to it).
    usage: tuple[int, int] | None = None


def normalise_reply(reply: Any) -> dict[str, Any]:
    """Validate a scripted reply and return it as a dict with JSON-string tool arguments."""
    if isinstance(reply, str):
        reply = {"content": reply}
    if not isinstance(reply, dict):
        raise InvalidArgumentError(f"reply must be a dict, str or callable, not {type(reply)!r}")
    unknown = set(reply) - REPLY_KEYS
    if unknown:
        raise InvalidArgumentError(
            f"unknown reply keys {sorted(unknown)}; allowed: {sorted(REPLY_KEYS)}")
    calls: list[dict[str, Any]] = []
    call_ids: list[str | None] = []
    for call in reply.get("tool_calls") or []:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise InvalidArgumentError(f"each tool call needs a 'name': {call!r}")
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_ids.append(call.get("id"))
        calls.append(
            {
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": args},
            }
        )
    if "output" in reply and (calls or reply.get("content") is not None):
        raise InvalidArgumentError("reply 'output' is the whole answer: give it without "
                                   "'content' or 'tool_calls'")
    content = reply.get("content", None if calls else "")
    if content is not None and not isinstance(content, str):
        raise InvalidArgumentError("reply 'content' must be a str or None")
    for key in ("anthropic_blocks", "gemini_parts"):
        value = reply.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            raise InvalidArgumentError(f"reply {key!r} must be a list of dicts")
    return {
        "content": content,
        "tool_calls": calls,
        "finish_reason": reply.get("finish_reason") or ("tool_calls" if calls else "stop"),
        "usage": reply.get("usage"),
        "reasoning_content": reply.get("reasoning_content"),
        "explicit_finish_reason": reply.get("finish_reason"),
        "call_ids": call_ids,
        "anthropic_blocks": reply.get("anthropic_blocks"),
        "gemini_parts": reply.get("gemini_parts"),
        "refusal": reply.get("refusal"),
        "continuation_token": reply.get("continuation_token"),
        **({"output": reply["output"]} if "output" in reply else {}),
    }


def with_output(dialect: str, request: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """A normalised reply whose ``output`` (a structured answer: any JSON value, or
    a string sent as it is, valid JSON or not) is given as the request asks for
    it: the arguments of a call to :data:`OUTPUT_TOOL` when the request offers
    that tool, else the answer's text (OpenAI ``response_format``, Gemini
    ``responseSchema``)."""
    if "output" not in reply:
        return reply
    output = reply.pop("output")
    text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
    if OUTPUT_TOOL in offered_tools(dialect, request):
        reply["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": OUTPUT_TOOL, "arguments": text}}]
        reply["call_ids"] = [None]
        reply["content"] = None
        if reply["explicit_finish_reason"] is None:
            reply["finish_reason"] = "tool_calls"
    else:
        reply["content"] = text
    return reply


def offered_tools(dialect: str, request: dict[str, Any]) -> list[str]:
    """The names of the tools a request offers, in any dialect."""
    names: list[str] = []
    for tool in request.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if "functionDeclarations" in tool:
            names += [str(d.get("name")) for d in tool["functionDeclarations"] or []
                      if isinstance(d, dict)]
        elif isinstance(tool.get("function"), dict):
            names.append(str(tool["function"].get("name")))
        elif "name" in tool:
            names.append(str(tool["name"]))
    return names


def completion_text(reply: dict[str, Any]) -> str:
    return (reply["content"] or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in reply["tool_calls"]
    )


def loads_or_raw(arguments: str) -> Any:
    """Parsed tool arguments; a string that is not JSON passes through (to test clients)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
