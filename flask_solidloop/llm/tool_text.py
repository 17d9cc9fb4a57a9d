"""Tool calls written as text, for models and servers without native tool calling. No I/O.

This module owns the pure half of text tool calling:

* :func:`parse_tool_calls` finds the calls an answer writes in its text, in the
  forms open models are trained on, and returns the answer with them removed:

  - Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one block per call, as many as the model wants;
  - the same JSON object (or a list of them) in a fenced block (```` ```json ````,
    ```` ```tool_call ````), taken as a call only when its ``name`` is one of the
    agent's tools, so a JSON example written for the reader stays text;
  - Llama 3.x: ``<|python_tag|>`` followed by JSON calls (``;``-separated), the
    ``<function=name>{...}</function>`` form, and an answer that is nothing but a
    ``{"name": ..., "parameters": {...}}`` object naming a known tool.

  A block that cannot be read (bad JSON, no name) still becomes a call, with its
  raw text as the arguments: the tool phase answers it with the same correctable
  "not a JSON object" error as a native call with broken arguments.
* :func:`call_id` gives each call a stable id derived from where it was written.
* :func:`visible_text` is the streaming filter: the text an observer may see
  while the answer is still arriving, never half a tag.
* :func:`prepare_request` is the request side: the tools rendered into the system
  prompt (Hermes style) instead of the ``tools`` field, and earlier calls and
  results turned into text (``<tool_call>`` blocks in the assistant message,
  ``<tool_response>`` blocks in a user message) for servers with no tool roles.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from .dialect import input_schema
from .types import ChatMessage, ToolCallRequest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
#: Llama's end-of-message tokens, when a server leaves them in the text.
_LLAMA_END = ("<|eom_id|>", "<|eot_id|>")

#: How tool results go back to the model (the agent's ``tool_result_format``).
RESULT_FORMATS = ("tool", "user_xml")
#: How the tools reach the model (the agent's ``tool_prompting``); None: the ``tools`` field.
PROMPTING = ("xml",)

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"```[ \t]*(json|tool_call|tool_code|javascript)?[ \t]*\n(.*?)```",
                    re.DOTALL | re.IGNORECASE)
_FUNCTION_TAG = re.compile(r"<function=([A-Za-z0-9_.\-]+)>(.*?)</function>", re.DOTALL)
_NAME_IN_TEXT = re.compile(r'"name"\s*:\s*"([^"\\]{1,200})"')


@dataclass
class TextToolCall:
    """One call found in the text. ``arguments_raw`` is a JSON object's text, or
    the block's raw text when it could not be read (``error`` says why)."""

    name: str
    arguments_raw: str
    error: str | None = None


@dataclass
class ParsedText:
    """An answer's text split into what the reader sees and the calls it made."""

    content: str | None
    calls: list[TextToolCall] = field(default_factory=list)
    #: hermes | fenced | llama (the first form found), None when no call was written.
    format: str | None = None


def _decode(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as exc:
        return None, f"not valid JSON ({exc})"


def _from_object(value: Any, raw: str) -> TextToolCall:
    """A call from one decoded JSON value; a readable error when it is not a call."""
    if not isinstance(value, dict):
        return TextToolCall("", raw, "the call is not a JSON object with a name")
    if isinstance(value.get("function"), dict):  # {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return TextToolCall("", raw, "the call has no \"name\"")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, as the OpenAI wire does.
        decoded, error = _decode(arguments) if arguments.strip() else ({}, None)
        if error is not None:
            return TextToolCall(name, arguments, f"the arguments are {error}")
        arguments = decoded
    if arguments is None:
        arguments = {}
    # Not an object (a list, a number): kept as JSON, answered as bad arguments.
    return TextToolCall(name, json.dumps(arguments, ensure_ascii=False),
                        None if isinstance(arguments, dict) else "the arguments are not an object")


def _from_block(text: str) -> list[TextToolCall]:
    """The call(s) in one block's text: an object, a list of objects, or garbage."""
    body = text.strip()
    if body.startswith("```"):  # a fence inside the tags: its language line, then JSON
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rstrip().removesuffix("```").strip()
    value, error = _decode(body)
    if error is not None:
        found = _NAME_IN_TEXT.search(body)
        return [TextToolCall(found.group(1) if found else "", body, f"the call is {error}")]
    if isinstance(value, list) and value:
        return [_from_object(item, json.dumps(item, ensure_ascii=False)) for item in value]
    return [_from_object(value, body)]


def _is_known_call(value: Any, names: Collection[str] | None) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_is_known_call(item, names) for item in value)
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    has_arguments = "arguments" in value or "parameters" in value
    return (isinstance(name, str) and has_arguments
            and (names is None or name in names))


def _tidy(text: str) -> str | None:
    for end in _LLAMA_END:
        text = text.replace(end, "")
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text or None


def parse_tool_calls(text: str | None, tool_names: Collection[str] | None = None) -> ParsedText:
    """The calls ``text`` writes and the text without them.

    ``tool_names``: the agent's tools. Forms that could be ordinary prose (a
    fenced JSON block, an answer that is one JSON object) count as calls only
    when they name one of them; the explicit tags always do.
    """
    if not text:
        return ParsedText(content=text)
    calls: list[TextToolCall] = []
    kind: str | None = None
    rest = text
    if TOOL_CALL_OPEN in rest:
        kind = "hermes"
        for match in _HERMES.finditer(rest):
            calls.extend(_from_block(match.group(1)))
        rest = _HERMES.sub("", rest)
    if PYTHON_TAG in rest:
        kind = kind or "llama"
        before, _, after = rest.partition(PYTHON_TAG)
        for end in _LLAMA_END:
            after = after.split(end, 1)[0]
        for piece in _split_calls(after):
            calls.extend(_from_block(piece))
        rest = before
    if _FUNCTION_TAG.search(rest):
        kind = kind or "llama"
        for match in _FUNCTION_TAG.finditer(rest):
            arguments = match.group(2).strip() or "{}"
            value, error = _decode(arguments)
            if error is not None:
                calls.append(TextToolCall(match.group(1), arguments, f"the arguments are {error}"))
            else:
                calls.append(_from_object({"name": match.group(1), "arguments": value}, arguments))
        rest = _FUNCTION_TAG.sub("", rest)
    if not calls:
        fenced_calls: list[TextToolCall] = []

        def take(match: re.Match[str]) -> str:
            value, error = _decode(match.group(2).strip())
            if error is None and _is_known_call(value, tool_names):
                fenced_calls.extend(_from_block(match.group(2)))
                return ""
            return match.group(0)

        rest = _FENCE.sub(take, rest)
        if fenced_calls:
            calls, kind = fenced_calls, "fenced"
    if not calls:
        stripped = rest.strip()
        if stripped.startswith(("{", "[")):
            value, error = _decode(stripped)
            if error is None and _is_known_call(value, tool_names):
                return ParsedText(content=None, calls=_from_block(stripped), format="llama")
        return ParsedText(content=text)
    return ParsedText(content=_tidy(rest), calls=calls, format=kind)


def _split_calls(text: str) -> list[str]:
    """Llama's ``<|python_tag|>`` text: one JSON call, or several joined by ``;``
    (or newlines). Split on separators that lie outside any JSON string."""
    pieces: list[str] = []
    depth, start, quoted, escaped = 0, 0, False, False
    for index, char in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif depth == 0 and char in ";\n":
            pieces.append(text[start:index])
            start = index + 1
    pieces.append(text[start:])
    return [piece for piece in pieces if piece.strip()]


def call_id(seed: str, index: int) -> str:
    """A stable id for the ``index``-th call written in one answer: the same answer
    (``seed``: the loop and message it belongs to) always gets the same ids, and
    they fit every dialect's id rules (Anthropic: ``^[a-zA-Z0-9_-]+$``)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def to_requests(parsed: ParsedText, seed: str) -> list[ToolCallRequest]:
    return [ToolCallRequest(call_id=call_id(seed, index), name=call.name,
                            arguments_raw=call.arguments_raw)
            for index, call in enumerate(parsed.calls)]


# --------------------------------------------------------------------------- streaming


_HIDDEN_OPENERS = (TOOL_CALL_OPEN, PYTHON_TAG, "<function=")


def visible_text(text: str) -> str:
    """What a streamed answer may show so far: complete ``<tool_call>`` blocks and
    ``<function=...>`` blocks removed, everything from an unclosed opener or from
    ``<|python_tag|>`` on held back, and a trailing prefix of any opener (``<tool_c``)
    held back until the next piece says what it is."""
    shown = _HERMES.sub("", text) if TOOL_CALL_OPEN in text else text
    shown = _FUNCTION_TAG.sub("", shown) if "<function=" in shown else shown
    cut = len(shown)
    for opener in _HIDDEN_OPENERS:
        at = shown.find(opener)
        if at != -1:
            cut = min(cut, at)
    shown = shown[:cut]
    # A trailing "<", "<tool_", "<|python" ... may be the start of an opener.
    last = shown.rfind("<")
    if last != -1 and any(opener.startswith(shown[last:]) for opener in _HIDDEN_OPENERS):
        shown = shown[:last]
    return shown


# --------------------------------------------------------------------------- request side


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The agent's tools described in the system prompt, in the layout Hermes and
    Qwen chat templates use, so a model trained on it recognises it."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for tool in tools:
        lines.append(json.dumps({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": input_schema(tool)}}, ensure_ascii=False))
    lines += [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    return "\n".join(lines)


def _call_text(call: ToolCallRequest) -> str:
    arguments, error = _decode(call.arguments_raw or "{}")
    body = {"name": call.name, "arguments": arguments if error is None else call.arguments_raw}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _response_text(message: ChatMessage) -> str:
    body = {"name": message.name or "", "content": message.content or ""}
    return f"<tool_response>\n{json.dumps(body, ensure_ascii=False)}\n</tool_response>"


def result_format(option: str | None, prompting: str | None) -> str:
    """The agent's ``tool_result_format``; by default ``user_xml`` when the tools
    are prompted as text (such a server has no tool role either), else ``tool``."""
    if option is not None:
        return option
    return "user_xml" if prompting == "xml" else "tool"


def prepare_request(history: list[ChatMessage], tools: list[dict[str, Any]], *,
                    prompting: str | None, result_format: str
                    ) -> tuple[list[ChatMessage], list[dict[str, Any]]]:
    """The history and the tool list a dialect renders, for these options.

    * ``prompting="xml"``: the tools go into the system prompt (appended to the
      first system message, or a new one) and none into the request's ``tools``.
    * ``result_format="user_xml"``: every earlier call goes back as ``<tool_call>``
      text in its assistant message, and each run of tool results as one user
      message of ``<tool_response>`` blocks, as Hermes/Qwen templates render them
      (a server without tool roles sees plain turns). ``"tool"``: unchanged.
    """
    out = list(history)
    if result_format == "user_xml":
        out = []
        for message in history:
            if message.role == "assistant" and message.tool_calls:
                text = "\n".join([*([message.content] if message.content else []),
                                  *(_call_text(call) for call in message.tool_calls)])
                out.append(replace(message, content=text, tool_calls=[]))
            elif message.role == "tool":
                block = _response_text(message)
                previous = out[-1] if out else None
                if previous is not None and previous.role == "user" \
                        and previous.meta.get("tool_responses"):
                    out[-1] = replace(previous, content=f"{previous.content}\n{block}")
                else:
                    out.append(ChatMessage(role="user", content=block,
                                           meta={"tool_responses": True}))
            else:
                out.append(message)
        # The marker only groups the results; it is no provider data.
        out = [replace(m, meta={}) if m.meta.get("tool_responses") else m for m in out]
    if prompting == "xml" and tools:
        prompt = tools_prompt(tools)
        if out and out[0].role == "system":
            first = out[0]
            out[0] = replace(first, content=f"{first.content}\n\n{prompt}"
                             if first.content else prompt)
        else:
            out.insert(0, ChatMessage(role="system", content=prompt))
        return out, []
    return out, tools
