"""The offline model: the deterministic replies the demo gives when no API key is
configured (``LLMEmulator(offline_model=True)``), in every dialect.

Asked with tools, it calls the tool whose name and description share the most words
with the user's message, its required arguments filled from that message
(capitalised phrases first); given tool results, it sums them up in one sentence
each; otherwise it echoes the message. An Anthropic or Gemini request is read
through its OpenAI view (:func:`openai_view`).
"""

from __future__ import annotations

import re
from typing import Any

from .dialect import content_text, dumps
from .openai_responses import openai_view as responses_view
from .types import ANTHROPIC, OPENAI, OPENAI_RESPONSES

_TOOL_RESULT_SNIPPET = 500

_STOPWORDS = frozenset(
    {
        "a", "an", "the", "and", "or", "but", "if", "of", "to", "in", "on", "at", "for", "from",
        "by", "with", "about", "into", "over", "under", "as", "is", "are", "was", "were", "be",
        "been", "am", "do", "does", "did", "what", "whats", "which", "who", "whom", "whose", "when",
        "where", "why", "how", "s", "t", "it", "its", "this", "that", "these", "those", "there",
        "here", "i", "im", "me", "my", "mine", "we", "us", "our", "you", "your", "yours", "he",
        "she", "they", "them", "their", "his", "her", "please", "can", "could", "would", "should",
        "will", "shall", "may", "might", "must", "tell", "give", "show", "let", "lets", "some",
        "any", "much", "many", "very", "just", "also", "than", "then", "so", "not", "no", "yes",
        "hi", "hello", "hey", "thanks", "thank", "today", "now", "currently", "current",
    }
)
_SENTENCE_END = (".", "!", "?", ":", ";")
_PUNCT = "\"'`\u201c\u201d\u2018()[]{}<>,.!?:;*_"


def _words(text: str) -> set[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", text)  # camelCase -> camel Case
    out: set[str] = set()
    for w in re.findall(r"[a-z0-9]+", spaced.lower()):
        if w in _STOPWORDS:
            continue
        if len(w) > 3 and w.endswith("s"):
            w = w[:-1]
        out.add(w)
    return out


def _tool_function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        return {}
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


def _clean_word(raw: str) -> str:
    word = raw.replace("\u2019", "'").strip(_PUNCT + "-")
    if word.endswith("'s"):
        word = word[:-2]
    return word


def _capitalised_phrases(text: str) -> list[str]:
    """Capitalised words/phrases ("Paris", "New York") that do not start a sentence."""
    phrases: list[str] = []
    current: list[str] = []
    sentence_start = True
    for raw in text.split():
        word = _clean_word(raw)
        is_candidate = (
            bool(word)
            and word[0].isupper()
            and not sentence_start
            and word.lower().replace("'", "") not in _STOPWORDS
        )
        if is_candidate:
            current.append(word)
        elif current:
            phrases.append(" ".join(current))
            current = []
        ends = raw.rstrip("\"')]}\u201d\u2019").endswith(_SENTENCE_END)
        if is_candidate and (ends or raw.rstrip().endswith(",")) and current:
            phrases.append(" ".join(current))
            current = []
        sentence_start = ends
    if current:
        phrases.append(" ".join(current))
    return phrases


def _last_word(text: str) -> str:
    for raw in reversed(text.split()):
        word = _clean_word(raw)
        if word:
            return word
    return text.strip()


def _schema_type(schema: dict[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t.lower() if isinstance(t, str) else None  # Gemini writes "STRING"


def _offline_arguments(parameters: Any, user_text: str) -> dict[str, Any]:
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties") or {}
    required = parameters.get("required") or []
    candidates = _capitalised_phrases(user_text)
    lowered = user_text.lower()
    args: dict[str, Any] = {}
    for name in required:
        schema = props.get(name) if isinstance(props, dict) else None
        schema = schema if isinstance(schema, dict) else {}
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            args[name] = next((v for v in enum if str(v).lower() in lowered), enum[0])
            continue
        type_ = _schema_type(schema)
        if type_ == "integer":
            args[name] = 1
        elif type_ == "number":
            args[name] = 1.0
        elif type_ == "boolean":
            args[name] = True
        elif type_ == "array":
            args[name] = []
        elif type_ == "object":
            args[name] = {}
        else:  # string, or untyped
            args[name] = candidates.pop(0) if candidates else _last_word(user_text)
    return args


def offline_reply(request_json: dict[str, Any]) -> dict[str, Any]:
    """The deterministic built-in "offline model" policy (see module docstring)."""
    messages = [m for m in request_json.get("messages") or [] if isinstance(m, dict)]
    last = messages[-1] if messages else {}
    role = last.get("role")
    text = content_text(last.get("content"))
    tools = [t for t in request_json.get("tools") or [] if _tool_function(t).get("name")]

    if role == "user" and tools:
        user_words = _words(text)
        best_fn: dict[str, Any] = _tool_function(tools[0])
        best_score = -1
        for tool in tools:
            fn = _tool_function(tool)
            score = len(user_words & _words(f"{fn['name']} {fn.get('description') or ''}"))
            if score > best_score:
                best_fn, best_score = fn, score
        name = best_fn["name"]
        return {
            "content": f"Let me call {name}.",
            "tool_calls": [
                {"name": name, "arguments": _offline_arguments(best_fn.get("parameters"), text)}
            ],
        }

    if role == "tool":
        # the current turn's tool results are the trailing run of tool messages
        start = len(messages)
        while start > 0 and messages[start - 1].get("role") == "tool":
            start -= 1
        names: dict[str, str] = {}
        for msg in reversed(messages[:start]):
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                for call in msg["tool_calls"]:
                    if isinstance(call, dict):
                        fn = call.get("function") or {}
                        names[str(call.get("id"))] = str(fn.get("name") or "tool")
                break
        sentences: list[str] = []
        for msg in messages[start:]:
            name = names.get(str(msg.get("tool_call_id"))) or msg.get("name") or "tool"
            result = content_text(msg.get("content")).strip()
            if len(result) > _TOOL_RESULT_SNIPPET:
                result = result[:_TOOL_RESULT_SNIPPET] + "…"
            if not result.endswith((".", "!", "?", "…")):
                result += "."
            sentences.append(f"{name} returned: {result}")
        return {"content": " ".join(sentences), "finish_reason": "stop"}

    return {"content": f"(offline model) You said: {text}"}


def openai_view(request_json: dict[str, Any], dialect: str) -> dict[str, Any]:
    """An Anthropic or Gemini request as OpenAI ``messages``/``tools`` (for the offline model).

    Tool results become ``tool`` messages placed after any text of the same turn, so the
    offline model summarises them rather than calling a tool again.
    """
    if dialect == OPENAI:
        return request_json
    if dialect == OPENAI_RESPONSES:
        return responses_view(request_json)
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if dialect == ANTHROPIC:
        for tool in request_json.get("tools") or []:
            if isinstance(tool, dict) and tool.get("name"):
                tools.append({"type": "function", "function": {
                    "name": tool["name"], "description": tool.get("description") or "",
                    "parameters": tool.get("input_schema") or {}}})
        for msg in request_json.get("messages") or []:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            blocks = content if isinstance(content, list) else []
            text = "\n".join(
                b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"
            ) if blocks else content_text(content)
            if msg.get("role") == "assistant":
                calls = [
                    {"id": b.get("id"), "type": "function", "function": {
                        "name": b.get("name"), "arguments": dumps(b.get("input") or {})}}
                    for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"
                ]
                messages.append({"role": "assistant", "content": text, "tool_calls": calls})
                continue
            results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
            if text or not results:
                messages.append({"role": "user", "content": text})
            for block in results:
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": content_text(block.get("content"))})
        return {"messages": messages, "tools": tools}
    for entry in request_json.get("tools") or []:
        for decl in (entry.get("functionDeclarations") or []) if isinstance(entry, dict) else []:
            if isinstance(decl, dict) and decl.get("name"):
                params = decl.get("parameters") or decl.get("parametersJsonSchema") or {}
                tools.append({"type": "function", "function": {
                    "name": decl["name"], "description": decl.get("description") or "",
                    "parameters": params}})
    for content in request_json.get("contents") or []:
        if not isinstance(content, dict):
            continue
        parts = [p for p in content.get("parts") or [] if isinstance(p, dict)]
        text = "\n".join(
            p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought")
        )
        if content.get("role") == "model":
            calls = [
                {"id": p["functionCall"].get("id") or f"_call_{i}", "type": "function",
                 "function": {"name": p["functionCall"].get("name"),
                              "arguments": dumps(p["functionCall"].get("args") or {})}}
                for i, p in enumerate(parts) if isinstance(p.get("functionCall"), dict)
            ]
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
            continue
        results = [p["functionResponse"] for p in parts
                   if isinstance(p.get("functionResponse"), dict)]
        if text or not results:
            messages.append({"role": "user", "content": text})
        for i, result in enumerate(results):
            messages.append({"role": "tool", "name": result.get("name"),
                             "tool_call_id": result.get("id") or f"_result_{i}",
                             "content": dumps(result.get("response"))})
    return {"messages": messages, "tools": tools}
