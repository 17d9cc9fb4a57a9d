"""The Gemini ``generateContent`` dialect: render a request, parse a response, stream.

Pure, no I/O. Speaks ``POST /v1beta/models/{model}:generateContent`` (the
agent's ``url_model`` in place of ``models/{model}`` when set) and, for
streams, ``:streamGenerateContent?alt=sse`` (every SSE event is one
GenerateContentResponse chunk; there is no ``[DONE]``: a chunk carrying a
``finishReason`` ends the response).

Round trip of thoughts. A thinking model returns ``thoughtSignature`` fields on
its parts (on the first ``functionCall`` of a turn, and on text). They must go
back exactly where they were received. :func:`parse_response` and the
aggregator hand out the parts as received in ``provider_meta["gemini_parts"]``;
with the ``"gemini_signed"`` strategy the renderer sends those parts back
unchanged and in order. Without it, the parts are rebuilt from the neutral
message (text, welded ``<think>`` when asked, function calls): no signatures,
no thought parts.

Decisions worth knowing:

* All ``system`` messages, wherever they sit, become ``systemInstruction``
  parts in their order (Gemini has no system role inside ``contents``).
* Consecutive ``tool`` messages become ONE ``user`` turn of ``functionResponse``
  parts. The function name is that of the call the result answers, found by
  ``tool_call_id`` in the nearest earlier assistant message (then the tool
  message's own ``name``). ``functionResponse.id`` is sent only when the call's
  id came from Gemini itself (it is in that message's ``gemini_parts``), never
  for the ids this module makes up.
* A ``functionCall`` without an ``id`` gets an invented ``call_<16 hex>`` id,
  unique per response: a hash of the response's ``responseId``, the call's
  position, name and args (so a stream and the equivalent body agree), or
  random when the response has no ``responseId``. A bare ``call_0`` would
  repeat every turn, which other dialects reject (Anthropic wants tool_use ids
  unique across the conversation) should the agent switch dialect later.
* Function-declaration parameters lose the JSON-schema keys Gemini's schema
  subset rejects, at every depth: :data:`UNSUPPORTED_SCHEMA_KEYS`. Property
  *names* are never touched (a property called ``title`` stays). An object
  schema left with no properties is omitted (Gemini rejects an OBJECT with
  empty ``properties``).
* An assistant message that would render to no parts at all is skipped
  (Gemini rejects a turn with empty ``parts``).
* With ``"xml!"`` next to a signed plan, the signed parts go unchanged and a
  ``<think>`` text part is put in front of them.
* Stream merging (see :class:`GeminiAggregator`): consecutive text parts of the
  same kind (thought or not) are merged into one; a ``thoughtSignature`` closes
  a part (later text starts a new one). A signature that arrives on a later
  part with empty text is attached to the part right before it when that part
  has none yet; otherwise the empty part is kept as it came. With parallel calls
  only the first ``functionCall`` carries a signature and the others are left
  without one, as received. The text of the part being merged is kept as a list
  of pieces and joined once (never appended to a growing string).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from typing import Any

from ..errors import (
    InvalidArgumentError,
    ProviderAnswerError,
    ProviderResponseError,
    ToolDefinitionError,
)
from . import output as _output
from . import reasoning as reasoning_mod
from .dialect import RenderedRequest, RenderOptions, SSEEvent, StreamDelta
from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

API_VERSION = "v1beta"
NAME = "gemini"

#: reasoning_effort -> thinkingConfig.thinkingBudget (tokens).
THINKING_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}

#: JSON-schema keys removed from tool parameters, at every depth, because
#: Gemini's OpenAPI-subset Schema rejects them.
UNSUPPORTED_SCHEMA_KEYS = frozenset(
    {"$schema", "$id", "$comment", "additionalProperties", "title", "default"}
)

#: Gemini finishReason -> the neutral finish_reason ("STOP" becomes "tool_calls"
#: when the turn has function calls). Every value google-genai's ``FinishReason``
#: knows is here, in :data:`FAILING_FINISH_REASONS` or is CONTINUATION (handled
#: by sending again, see :meth:`GeminiDialect.continuation`); anything else
#: (FINISH_REASON_UNSPECIFIED, values added later) is a ProviderAnswerError.
FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    # Stopped by a content policy (LANGUAGE: a language Gemini refuses to answer in;
    # ESCALATION: an escalation rule; MODEL_ARMOR: Model Armor blocked the answer).
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "LANGUAGE": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "IMAGE_RECITATION": "content_filter",
    "ESCALATION": "content_filter",
    "MODEL_ARMOR": "content_filter",
    "OTHER": "other",
    "IMAGE_OTHER": "other",
    "NO_IMAGE": "other",  # an image was expected and none came
    # The model's function calling went wrong; the turn carries no usable call.
    "MALFORMED_FUNCTION_CALL": "malformed_function_call",
    "UNEXPECTED_TOOL_CALL": "unexpected_tool_call",
    "TOO_MANY_TOOL_CALLS": "too_many_tool_calls",
    # The server could not produce a well-formed answer.
    "MALFORMED_RESPONSE": "malformed_response",
}
#: finishReason values that fail the turn (ProviderAnswerError, never retried:
#: the same request gets the same answer), with what to do about them.
FAILING_FINISH_REASONS = {
    "MISSING_THOUGHT_SIGNATURE": (
        "the request lacks a thoughtSignature Gemini needs back on an earlier model "
        "turn; keep 'gemini_signed' in the agent's reasoning_strategies (the default)"
    ),
    "PUP_LIMITED_DISABLED": (
        "the account is limited or disabled for Prohibited Use Policy violations"
    ),
}
CONTINUATION = "CONTINUATION"
_UNDERSTOOD = (*FINISH_REASONS, *FAILING_FINISH_REASONS, CONTINUATION)
#: How many follow-up requests one turn may make for CONTINUATION answers.
MAX_CONTINUATIONS = 8
#: Hex digits of an invented call id after ``call_``.
CALL_ID_DIGITS = 16

_TEXT_PART_KEYS = frozenset({"text", "thought", "thoughtSignature"})
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*s?\s*$")


# --------------------------------------------------------------------- render


def render_request(settings: ProviderSettings, messages: list[ChatMessage],
                   tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
                   ) -> RenderedRequest:
    """The request for this history (see the module docstring for the rules)."""
    generation: dict[str, Any] = {}
    if options.max_tokens is not None:
        generation["maxOutputTokens"] = options.max_tokens
    effort = options.reasoning_effort
    if effort is not None:
        if effort not in THINKING_BUDGETS:
            raise InvalidArgumentError(
                f"gemini dialect: reasoning_effort {effort!r} is not supported; "
                f"accepted: {', '.join(repr(k) for k in THINKING_BUDGETS)} or None"
            )
        generation["thinkingConfig"] = {
            "thinkingBudget": THINKING_BUDGETS[effort],
            "includeThoughts": True,
        }

    system_parts: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    pending_results: list[dict[str, Any]] = []

    def flush_results() -> None:
        if pending_results:
            contents.append({"role": "user", "parts": list(pending_results)})
            pending_results.clear()

    for index, message in enumerate(messages):
        if message.role == "tool":
            pending_results.append(_function_response(messages, index))
            continue
        flush_results()
        if message.role == "system":
            system_parts.append({"text": message.content or ""})
        elif message.role == "assistant":
            parts = _model_parts(message, options.reasoning_strategies)
            if parts:
                contents.append({"role": "model", "parts": parts})
        else:
            contents.append({"role": "user", "parts": [{"text": message.content or ""}]})
    flush_results()

    payload: dict[str, Any] = {"contents": contents}
    if system_parts:
        payload["systemInstruction"] = {"parts": system_parts}
    if tools:
        payload["tools"] = [{"functionDeclarations": [_declaration(t) for t in tools]}]
    if options.output_schema is not None:
        _ask_for_output(payload, generation, options.output_schema)
    if generation:
        payload["generationConfig"] = generation

    method = "streamGenerateContent" if options.stream else "generateContent"
    return RenderedRequest(
        path=f"/{API_VERSION}/{model_resource(settings)}:{method}",
        payload=options.merge_llm_params(payload),
        params={"alt": "sse"} if options.stream else {},
    )


def _ask_for_output(payload: dict[str, Any], generation: dict[str, Any],
                   schema: dict[str, Any]) -> None:
    """Structured output, Gemini's way: ``responseSchema`` (the schema in Gemini's
    subset, :func:`clean_schema`) with ``responseMimeType: application/json``.
    Beside function declarations, where models before Gemini 3 refuse a JSON
    response type, the answer is a function call instead
    (:data:`.output.OUTPUT_TOOL`, its parameters the schema), and the model
    must call one of the functions (``mode: ANY``): the agent's tools, then
    this one."""
    cleaned = clean_schema(schema)
    if payload.get("tools"):
        payload["tools"][0]["functionDeclarations"].append({
            "name": _output.OUTPUT_TOOL, "description": _output.OUTPUT_TOOL_DESCRIPTION,
            "parameters": cleaned})
        payload["toolConfig"] = {"functionCallingConfig": {"mode": "ANY"}}
        return
    generation["responseMimeType"] = "application/json"
    generation["responseSchema"] = cleaned


def model_resource(settings: ProviderSettings) -> str:
    """The model's resource path in the URL. ``url_model`` wins over ``model``
    and, when it holds a ``/``, is the whole path (``tunedModels/my-model``);
    otherwise the name goes under ``models/`` (a ``models/`` it already has is
    not doubled)."""
    if settings.url_model and "/" in settings.url_model:
        return settings.url_model
    name = (settings.url_model or settings.model).removeprefix("models/")
    return f"models/{name}"


def _model_parts(message: ChatMessage, strategies: list[str] | None) -> list[dict[str, Any]]:
    chosen = reasoning_mod.plan(message, strategies, NAME)
    if chosen.signed == "gemini_signed":
        parts = copy.deepcopy(list(message.meta["gemini_parts"]))
        if chosen.weld:  # "xml!": the <think> text too, in front of the signed parts
            parts.insert(0, {"text": reasoning_mod.weld(None, message.reasoning)})
        return parts
    parts = []
    text = reasoning_mod.weld(message.content, message.reasoning) if chosen.weld \
        else message.content
    if text:
        parts.append({"text": text})
    wire_ids = _wire_call_ids(message)
    for call in message.tool_calls:
        function: dict[str, Any] = {"name": call.name, "args": _arguments(call.arguments_raw)}
        if call.call_id and call.call_id in wire_ids:
            function["id"] = call.call_id
        parts.append({"functionCall": function})
    return parts


def _arguments(raw: str | None) -> dict[str, Any]:
    """Gemini wants args as an object: parse the JSON text; keep anything else visible."""
    if not raw or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"_raw_arguments": raw}
    return value if isinstance(value, dict) else {"value": value}


def _wire_call_ids(message: ChatMessage) -> set[str]:
    """The functionCall ids Gemini itself gave in this message's parts."""
    ids = set()
    for part in (message.meta or {}).get("gemini_parts") or []:
        call = part.get("functionCall") if isinstance(part, dict) else None
        if isinstance(call, dict) and call.get("id"):
            ids.add(str(call["id"]))
    return ids


def _function_response(messages: list[ChatMessage], index: int) -> dict[str, Any]:
    message = messages[index]
    name = None
    wire_id = False
    for earlier in reversed(messages[:index]):
        if earlier.role != "assistant":
            continue
        for call in earlier.tool_calls:
            if call.call_id is not None and call.call_id == message.tool_call_id:
                name = call.name
                wire_id = call.call_id in _wire_call_ids(earlier)
                break
        if name is not None:
            break
    name = name or message.name
    if not name:
        raise InvalidArgumentError(
            f"gemini dialect: tool result for call {message.tool_call_id!r} answers no "
            "function call in an earlier assistant message, and has no name; Gemini needs "
            "the function name in functionResponse"
        )
    text = message.content or ""
    response: dict[str, Any] = {
        "name": name,
        "response": {"error": text} if message.is_error else {"result": text},
    }
    if wire_id:
        response["id"] = message.tool_call_id
    return {"functionResponse": response}


def _declaration(tool: dict[str, Any]) -> dict[str, Any]:
    declaration: dict[str, Any] = {
        "name": tool["name"],
        "description": tool.get("description") or "",
    }
    parameters = clean_schema(tool.get("inputSchema") or {})
    if isinstance(parameters, dict) and not _empty_object(parameters):
        declaration["parameters"] = parameters
    return declaration


def _empty_object(schema: dict[str, Any]) -> bool:
    if not schema:
        return True
    return schema.get("type") in ("object", "OBJECT") and not schema.get("properties") and \
        set(schema) <= {"type", "properties", "required", "description"}


def clean_schema(schema: Any) -> Any:
    """``schema`` in the shape Gemini's ``Schema`` accepts, at every depth.

    * ``$ref`` is replaced by the definition it names (``#/$defs/...`` or
      ``#/definitions/...`` of the root schema), and ``$defs`` / ``definitions``
      are dropped: google-genai inlines definitions the same way before calling
      the API, and Gemini's Schema has no ``$defs`` / ``$ref``. A recursive model
      (a definition reached again through its own references) cannot be inlined:
      ValueError, naming the chain.
    * keys Gemini's Schema does not know are dropped (:data:`UNSUPPORTED_SCHEMA_KEYS`
      and any JSON-schema keyword outside :data:`SCHEMA_KEYS`); ``const`` becomes a
      one-value ``enum``, ``oneOf`` becomes ``anyOf``, a one-item ``allOf`` is
      merged in, and a ``type`` list (``["string", "null"]``) becomes its type
      plus ``nullable``.

    Keys of ``properties`` are names, not keywords: kept as they are, their
    schemas cleaned.
    """
    if not isinstance(schema, dict):
        return _clean(schema, {}, ())
    definitions: dict[str, Any] = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            definitions.update({f"#/{key}/{name}": sub for name, sub in schema[key].items()})
    return _clean(schema, definitions, ())


#: The keywords of Gemini's ``Schema`` that we send (google-genai's Schema fields,
#: less those we strip).
SCHEMA_KEYS = frozenset({
    "type", "format", "description", "nullable", "enum", "items", "maxItems", "minItems",
    "properties", "required", "minProperties", "maxProperties", "minLength", "maxLength",
    "pattern", "example", "anyOf", "propertyOrdering", "minimum", "maximum",
})


def _clean(schema: Any, definitions: dict[str, Any], chain: tuple[str, ...]) -> Any:
    if isinstance(schema, list):
        return [_clean(item, definitions, chain) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in chain:
            names = " -> ".join(r.rsplit("/", 1)[-1] for r in (*chain, ref))
            raise ToolDefinitionError(
                f"gemini dialect: the tool schema is recursive ({names}); Gemini's Schema "
                "cannot refer to itself and a recursive model cannot be inlined. Give the "
                "tool a non-recursive argument type (e.g. a depth-limited model, or a JSON "
                "string argument parsed by the tool)"
            )
        target = definitions.get(ref)
        if target is None:
            raise ToolDefinitionError(
                f"gemini dialect: the tool schema refers to {ref!r}, which it does not "
                "define (only local #/$defs refs are inlined)")
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        merged = {**target, **siblings}  # a description beside the $ref wins
        return _clean(merged, definitions, (*chain, ref))
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict):
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        return _clean({**all_of[0], **rest}, definitions, chain)
    cleaned: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "oneOf":
            key = "anyOf"
        if key == "const":
            cleaned.setdefault("enum", [copy.deepcopy(value)])
            continue
        if key in UNSUPPORTED_SCHEMA_KEYS or key not in SCHEMA_KEYS:
            continue
        if key == "properties" and isinstance(value, dict):
            cleaned[key] = {name: _clean(sub, definitions, chain) for name, sub in value.items()}
        elif key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            if kinds:
                cleaned["type"] = kinds[0]
            if "null" in value:
                cleaned["nullable"] = True
        elif key in ("enum", "required", "example", "propertyOrdering"):
            cleaned[key] = copy.deepcopy(value)  # data, not schemas
        else:
            cleaned[key] = _clean(value, definitions, chain)
    return cleaned


# ---------------------------------------------------------------------- parse


def parse_response(body: Any) -> AssistantTurn:
    """Interpret a non-streaming GenerateContentResponse."""
    if not isinstance(body, dict):
        raise ProviderResponseError(f"expected a JSON object, got {type(body).__name__}")
    _raise_for_error(body)
    candidates = body.get("candidates")
    if not candidates or not isinstance(candidates, list):
        _raise_for_block(body)
        raise ProviderResponseError(
            f"response has no candidates (keys: {', '.join(sorted(body)) or 'none'})"
        )
    candidate = candidates[0] if isinstance(candidates[0], dict) else {}
    content = candidate.get("content") or {}
    parts = (content.get("parts") or []) if isinstance(content, dict) else []
    if not isinstance(parts, list):
        raise ProviderResponseError(f"candidate parts is not a list: {parts!r}")

    text: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCallRequest] = []
    response_id = body.get("responseId")
    for part in parts:
        if not isinstance(part, dict):
            continue
        call = part.get("functionCall")
        if isinstance(call, dict):
            args = call.get("args")
            name = str(call.get("name") or "")
            arguments = json.dumps(args if args is not None else {})
            calls.append(ToolCallRequest(
                call_id=str(call["id"]) if call.get("id")
                else _invent_call_id(response_id, len(calls), name, arguments),
                name=name,
                arguments_raw=arguments,
            ))
        elif isinstance(part.get("text"), str):
            (thoughts if part.get("thought") else text).append(part["text"])

    meta: dict[str, Any] = {"gemini_parts": copy.deepcopy(parts)}
    finish_reason = _finish_reason(candidate, bool(calls))
    if finish_reason == "continuation":
        meta["gemini_continuation_token"] = candidate["continuationToken"]
    return AssistantTurn(
        content="".join(text) or None,
        tool_calls=calls,
        finish_reason=finish_reason,
        usage=parse_usage(body.get("usageMetadata")),
        reasoning="".join(thoughts) or None,
        raw=body,
        provider_meta=meta,
    )


def continuation_payload(payload: dict[str, Any], turn: AssistantTurn) -> dict[str, Any] | None:
    """The request that continues a CONTINUATION answer: the same one, with the
    token at the top level (``continuationToken``, as google-genai sends it), or
    None when ``turn`` is complete."""
    token = turn.provider_meta.get("gemini_continuation_token")
    if turn.finish_reason != "continuation" or not token:
        return None
    return {**payload, "continuationToken": token}


def merge_continuation(first: AssistantTurn, second: AssistantTurn) -> AssistantTurn:
    """One turn from two hops: parts, text, reasoning and calls joined in order,
    usage summed (each hop is a request of its own, as google-genai counts it),
    the finish reason and token of the later hop."""
    parts = [*first.provider_meta.get("gemini_parts", []),
             *second.provider_meta.get("gemini_parts", [])]
    meta = {**first.provider_meta, **second.provider_meta, "gemini_parts": parts}
    if "gemini_continuation_token" not in second.provider_meta:
        meta.pop("gemini_continuation_token", None)
    usage = None
    if first.usage is not None or second.usage is not None:
        a, b = first.usage or Usage(), second.usage or Usage()
        usage = Usage(input_tokens=a.input_tokens + b.input_tokens,
                      cached_input_tokens=a.cached_input_tokens + b.cached_input_tokens,
                      output_tokens=a.output_tokens + b.output_tokens,
                      reasoning_tokens=a.reasoning_tokens + b.reasoning_tokens)

    def join(x: str | None, y: str | None) -> str | None:
        return ((x or "") + (y or "")) or None

    calls = [*first.tool_calls, *second.tool_calls]
    finish = second.finish_reason
    if finish == "stop" and calls:
        finish = "tool_calls"
    return AssistantTurn(
        content=join(first.content, second.content), tool_calls=calls,
        finish_reason=finish, usage=usage,
        reasoning=join(first.reasoning, second.reasoning),
        raw={"continued": [first.raw, second.raw]}, provider_meta=meta,
    )


def _invent_call_id(response_id: Any, index: int, name: str, arguments: str) -> str:
    """An id for a functionCall that came without one, unique per response.

    Derived from the ``responseId`` when there is one, so the streamed and the
    non-streamed form of a response get the same ids; random otherwise.
    """
    if not response_id:
        return f"call_{uuid.uuid4().hex[:CALL_ID_DIGITS]}"
    basis = json.dumps([str(response_id), index, name, arguments], ensure_ascii=False)
    return f"call_{hashlib.sha256(basis.encode('utf-8')).hexdigest()[:CALL_ID_DIGITS]}"


def _finish_reason(candidate: dict[str, Any], has_calls: bool) -> str | None:
    reason = candidate.get("finishReason")
    if reason is None:
        return None
    if reason == CONTINUATION:
        # Sent again with the token (GeminiDialect.continuation); without one
        # the answer is as cut short as MAX_TOKENS.
        return "continuation" if candidate.get("continuationToken") else "length"
    if reason in FAILING_FINISH_REASONS:
        detail = candidate.get("finishMessage")
        raise ProviderAnswerError(
            f"Gemini stopped with finishReason {reason!r}: {FAILING_FINISH_REASONS[reason]}"
            + (f" ({detail})" if detail else "")
        )
    if reason not in FINISH_REASONS:
        detail = candidate.get("finishMessage")
        raise ProviderAnswerError(
            f"unknown finishReason {reason!r}" + (f": {detail}" if detail else "")
            + f" (understood: {', '.join(_UNDERSTOOD)})"
        )
    if reason == "STOP" and has_calls:
        return "tool_calls"
    return FINISH_REASONS[reason]


def _raise_for_error(body: dict[str, Any]) -> None:
    error = body.get("error")
    if error is None:
        return
    if isinstance(error, dict):
        summary = " ".join(str(error[k]) for k in ("code", "status") if error.get(k))
        message = error.get("message") or error
        raise ProviderResponseError(
            f"provider returned an error object: {summary + ': ' if summary else ''}{message}"
        )
    raise ProviderResponseError(f"provider returned an error object: {error}")


def _raise_for_block(body: dict[str, Any]) -> None:
    feedback = body.get("promptFeedback")
    if isinstance(feedback, dict) and feedback.get("blockReason"):
        detail = feedback.get("blockReasonMessage")
        raise ProviderAnswerError(
            f"prompt blocked: {feedback['blockReason']}" + (f" ({detail})" if detail else "")
        )


def parse_usage(data: Any) -> Usage | None:
    """usageMetadata -> Usage. Thoughts are not in candidatesTokenCount: both are billed."""
    if not isinstance(data, dict):
        return None
    thoughts = int(data.get("thoughtsTokenCount") or 0)
    return Usage(
        input_tokens=int(data.get("promptTokenCount") or 0),
        cached_input_tokens=int(data.get("cachedContentTokenCount") or 0),
        output_tokens=int(data.get("candidatesTokenCount") or 0) + thoughts,
        reasoning_tokens=thoughts,
    )


def retry_after_from_body(body: Any) -> float | None:
    """RetryInfo.retryDelay ("37s", "1.5s") from an error body, in seconds; else None."""
    if isinstance(body, str | bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if isinstance(body, list) and body:  # streamGenerateContent without alt=sse
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    for detail in body["error"].get("details") or []:
        if not isinstance(detail, dict):
            continue
        if not str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, dict):  # the proto shape, should a proxy send it
            try:
                return max(0.0, float(delay.get("seconds") or 0)
                           + float(delay.get("nanos") or 0) / 1e9)
            except (TypeError, ValueError):
                return None
        if isinstance(delay, int | float) and not isinstance(delay, bool):
            return max(0.0, float(delay))
        if isinstance(delay, str):
            match = _DURATION.match(delay)
            if match:
                return float(match.group(1))
        return None
    return None


# ------------------------------------------------------------------ streaming


class GeminiAggregator:
    """Assembles one ``streamGenerateContent?alt=sse`` response.

    Every event is a GenerateContentResponse chunk. Function calls arrive
    whole. Parts are accumulated (merge and signature rules in the module
    docstring); ``usageMetadata`` is a running total, so the last one wins; the
    stream is complete once a chunk carried ``finishReason``. :meth:`result`
    assembles the equivalent non-streaming body and parses it with
    :func:`parse_response`, so both paths give the same turn.
    """

    def __init__(self) -> None:
        self._parts: list[dict[str, Any]] = []
        #: Text pieces of the last part while text is being merged into it (its
        #: "text" is stale until :meth:`_join_open` writes the joined pieces).
        self._open: list[str] | None = None
        self._finish: str | None = None
        self._finish_message: str | None = None
        self._usage: dict[str, Any] | None = None
        self._extra: dict[str, Any] = {}
        self._continuation_token: str | None = None

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def feed(self, event: SSEEvent) -> StreamDelta | None:
        data = (event.data or "").strip()
        if not data:
            return None
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise ProviderResponseError(f"unparseable stream chunk: {data[:200]!r}") from exc
        if isinstance(chunk, list) and len(chunk) == 1:
            chunk = chunk[0]
        if not isinstance(chunk, dict):
            raise ProviderResponseError(f"stream chunk is not an object: {data[:200]!r}")
        _raise_for_error(chunk)
        if chunk.get("usageMetadata") is not None:
            self._usage = chunk["usageMetadata"]
        for key in ("modelVersion", "responseId"):
            if key in chunk:
                self._extra[key] = chunk[key]
        candidates = chunk.get("candidates")
        if not candidates:
            _raise_for_block(chunk)
            return None
        candidate = candidates[0] if isinstance(candidates[0], dict) else {}
        content = candidate.get("content") or {}
        delta = StreamDelta()
        for part in (content.get("parts") or []) if isinstance(content, dict) else []:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str) and "functionCall" not in part:
                if part.get("thought"):
                    delta.reasoning += part["text"]
                else:
                    delta.content += part["text"]
            self._add(part)
        if candidate.get("continuationToken"):
            self._continuation_token = candidate["continuationToken"]
        reason = candidate.get("finishReason")
        if reason is not None:
            if candidate.get("finishMessage"):
                self._finish_message = candidate["finishMessage"]
            _finish_reason({"finishReason": reason, "finishMessage": self._finish_message},
                           False)  # an unknown reason fails now, not at the end
            self._finish = reason
        return delta or None

    def _add(self, part: dict[str, Any]) -> None:
        # ``part`` was parsed from this chunk and is referenced nowhere else: it is
        # kept (and later mutated) as is, no copy needed.
        last = self._parts[-1] if self._parts else None
        signature = part.get("thoughtSignature")
        if _is_text(part):
            if (last is not None and _is_text(last) and "thoughtSignature" not in last
                    and bool(last.get("thought")) == bool(part.get("thought"))):
                if self._open is None:
                    self._open = [last.get("text", "")]
                self._open.append(part.get("text", ""))
                if signature:
                    last["thoughtSignature"] = signature
                return
            if not part.get("text"):
                if not signature:
                    return  # nothing in it
                if last is not None and "thoughtSignature" not in last:
                    last["thoughtSignature"] = signature  # a late signature
                    return
        self._join_open()
        self._parts.append(part)

    def _join_open(self) -> None:
        """Write the merged text into the last part (once per part, or per result())."""
        if self._open is not None:
            self._parts[-1]["text"] = "".join(self._open)
            self._open = None

    def result(self) -> AssistantTurn:
        if self._finish is None:
            raise ProviderResponseError(
                "stream ended without a finishReason (the response is incomplete)"
            )
        self._join_open()
        candidate: dict[str, Any] = {
            "content": {"role": "model", "parts": self._parts},
            "finishReason": self._finish,
            "index": 0,
        }
        if self._finish_message:
            candidate["finishMessage"] = self._finish_message
        if self._continuation_token:
            candidate["continuationToken"] = self._continuation_token
        body: dict[str, Any] = {"candidates": [candidate]}
        if self._usage is not None:
            body["usageMetadata"] = self._usage
        body.update(self._extra)
        return parse_response(body)


def _is_text(part: dict[str, Any]) -> bool:
    """A part holding only text (possibly empty or absent), the thought flag, a signature."""
    return isinstance(part.get("text", ""), str) and set(part) <= _TEXT_PART_KEYS


# -------------------------------------------------------------------- dialect


class GeminiDialect:
    """The Gemini generateContent wire format (see the module docstring)."""

    name = NAME

    def render(self, settings: ProviderSettings, messages: list[ChatMessage],
               tools: list[dict[str, Any]], options: RenderOptions = RenderOptions(),
               ) -> RenderedRequest:
        return render_request(settings, messages, tools, options)

    def auth_headers(self, settings: ProviderSettings, api_key: str | None) -> dict[str, str]:
        return {"x-goog-api-key": api_key} if api_key else {}

    def parse(self, body: Any) -> AssistantTurn:
        return parse_response(body)

    def aggregator(self) -> GeminiAggregator:
        return GeminiAggregator()

    def retry_after_from_body(self, body: Any) -> float | None:
        return retry_after_from_body(body)

    def continuation(self, payload: dict[str, Any], turn: AssistantTurn) -> dict[str, Any] | None:
        """The follow-up request for a CONTINUATION answer (see
        :func:`continuation_payload`); None when the turn is complete."""
        return continuation_payload(payload, turn)

    def merge(self, first: AssistantTurn, second: AssistantTurn) -> AssistantTurn:
        return merge_continuation(first, second)
