"""Strict mode (``LLMEmulator(strict=True)``, on in this project's own tests):
refuse what the real servers refuse, before faults and scripts answer.

OpenAI chat requests outside the keys of the official SDK's request types, or with a
``content`` that is not a string (``null`` beside ``tool_calls`` is llama-cpp-python's
HTTP 500 "Input should be a valid string"); Anthropic Messages outside Anthropic's
request schema (unknown keys, block types, a ``tool_use`` input that is not an
object, a thinking block without its signature); Gemini requests outside the REST
``GenerateContentRequest``, with no unknown key in any ``Schema`` (``$defs``,
``$ref``). Each refusal is shaped like the server's own error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ...errors import SolidLoopError
from .._local_server import Response
from . import gemini, registry
from .dialect import json_response
from .types import ANTHROPIC, GEMINI

# The key sets are those of the official SDKs' request types (openai 3.57, anthropic
# 2.14, google-genai 3.6) and the REST references; the content rules add what
# llama-cpp-python's pydantic-validated server refuses on top of OpenAI's own.

_OPENAI_TOP = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model",
    "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
})
_OPENAI_MESSAGE_KEYS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "refusal", "audio",
                            "function_call"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
_ANTHROPIC_TOP = frozenset({
    "cache_control", "container", "diagnostics", "inference_geo", "max_tokens", "messages",
    "metadata", "model", "output_config", "service_tier", "speed", "stop_sequences", "stream",
    "system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
    "user_profile_id", "workspace_id", "mcp_servers", "context_management",
})
_ANTHROPIC_BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "image": frozenset({"type", "source", "cache_control"}),
    "document": frozenset({"type", "source", "cache_control", "citations", "context", "title"}),
}
_ANTHROPIC_TOOL_KEYS = frozenset({"name", "description", "input_schema", "cache_control",
                                  "type", "strict", "input_examples"})
_TOOL_USE_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
_GEMINI_TOP = frozenset({"contents", "systemInstruction", "tools", "toolConfig",
                         "safetySettings", "generationConfig", "cachedContent", "labels",
                         "continuationToken", "serviceTier"})
_GEMINI_PART_KEYS = frozenset({"text", "thought", "thoughtSignature", "functionCall",
                               "functionResponse", "inlineData", "fileData", "executableCode",
                               "codeExecutionResult", "videoMetadata", "mediaResolution",
                               "partMetadata"})
_GEMINI_DECLARATION_KEYS = frozenset({"name", "description", "parameters",
                                      "parametersJsonSchema", "response",
                                      "responseJsonSchema", "behavior"})
#: google-genai's Schema fields, camelCase, less "defs" and "ref": the Gemini API
#: takes no references (the SDK inlines them before sending).
_GEMINI_SCHEMA_KEYS = frozenset({
    "additionalProperties", "anyOf", "default", "description", "enum", "example", "format",
    "items", "maxItems", "maxLength", "maxProperties", "maximum", "minItems", "minLength",
    "minProperties", "minimum", "nullable", "pattern", "properties", "propertyOrdering",
    "required", "title", "type",
})
_GEMINI_TYPES = frozenset({"TYPE_UNSPECIFIED", "STRING", "NUMBER", "INTEGER", "BOOLEAN",
                           "ARRAY", "OBJECT", "NULL"})
_GEMINI_GENERATION_KEYS = frozenset({
    "audioTimestamp", "audioTranscriptionConfig", "candidateCount", "enableAffectiveDialog",
    "enableEnhancedCivicAnswers", "frequencyPenalty", "logprobs", "maxOutputTokens",
    "mediaResolution", "modelSelectionConfig", "presencePenalty", "responseFormat",
    "responseJsonSchema", "responseLogprobs", "responseMimeType", "responseModalities",
    "responseSchema", "routingConfig", "seed", "speechConfig", "stopSequences", "temperature",
    "thinkingConfig", "topK", "topP", "translationConfig",
})


class _Refused(SolidLoopError):
    """A request a real server refuses: its status and message."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def strict_check(dialect: str, request: dict[str, Any]) -> Response | None:
    """The error a real server answers ``request`` with, or None when it is accepted."""
    try:
        if dialect == ANTHROPIC:
            _strict_anthropic(request)
        elif dialect == GEMINI:
            _strict_gemini(request)
        else:
            _strict_openai(request)
    except _Refused as refused:
        if dialect == GEMINI:
            return json_response(refused.status, gemini.error_body(
                refused.status, refused.message))
        return registry.dialect_error(dialect, refused.status, refused.message, code=refused.code)
    return None


def _unknown(keys: Iterable[str], known: frozenset[str]) -> list[str]:
    return sorted(k for k in keys if k not in known)


def _strict_openai(request: dict[str, Any]) -> None:
    extra = _unknown(request, _OPENAI_TOP)
    if extra:
        raise _Refused(400, f"Unrecognized request argument supplied: {', '.join(extra)}",
                       "unknown_parameter")
    for index, message in enumerate(request.get("messages") or []):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _Refused(400, f"Invalid type for '{where}': expected an object.")
        role = message.get("role")
        if role not in _OPENAI_MESSAGE_KEYS:
            raise _Refused(400, f"Invalid value: '{role}'. Supported values are: "
                           f"{', '.join(map(repr, _OPENAI_MESSAGE_KEYS))}.", "invalid_value")
        extra = _unknown(message, _OPENAI_MESSAGE_KEYS[role])
        if extra:
            raise _Refused(400, f"Unknown parameter: '{where}.{extra[0]}'.",
                           "unknown_parameter")
        content = message.get("content")
        # llama-cpp-python validates content as a string (or parts) on every role:
        # a null or missing content is a pydantic error, answered with HTTP 500.
        if not isinstance(content, str | list):
            raise _Refused(500, f"1 validation error for ChatCompletionRequest: {where}."
                           f"content: Input should be a valid string [type=string_type, "
                           f"input_value={content!r}]", "validation_error")
        for number, call in enumerate(message.get("tool_calls") or []):
            spot = f"{where}.tool_calls[{number}]"
            if not isinstance(call, dict) or call.get("type") != "function" \
                    or not isinstance(call.get("id"), str):
                raise _Refused(400, f"Invalid value for '{spot}': needs an id and "
                               "type 'function'.")
            extra = _unknown(call, frozenset({"id", "type", "function"}))
            function = call.get("function") or {}
            extra += _unknown(function, frozenset({"name", "arguments"}))
            if extra:
                raise _Refused(400, f"Unknown parameter: '{spot}.{extra[0]}'.",
                               "unknown_parameter")
            if not isinstance(function.get("arguments"), str):
                raise _Refused(400, f"Invalid type for '{spot}.function.arguments': "
                               "expected a string.")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _Refused(400, f"Missing required parameter: '{where}.tool_call_id'.")
    for index, tool in enumerate(request.get("tools") or []):
        spot = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _Refused(400, f"Invalid value for '{spot}.type': expected 'function'.")
        extra = _unknown(tool, frozenset({"type", "function"})) + _unknown(
            tool.get("function") or {},
            frozenset({"name", "description", "parameters", "strict"}))
        if extra:
            raise _Refused(400, f"Unknown parameter: '{spot}.{extra[0]}'.", "unknown_parameter")
    if "response_format" in request:
        _strict_response_format(request["response_format"])


_RESPONSE_FORMAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _strict_response_format(value: Any) -> None:
    """OpenAI's ``response_format``: text, json_object, or json_schema with a
    name and a schema; a strict schema must be an object whose every object
    forbids other properties and requires all of its own, as the API checks."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise _Refused(400, f"Invalid value: {kind!r}. Supported values are: 'text', "
                       "'json_object' and 'json_schema'.", "invalid_value")
    if kind != "json_schema":
        extra = _unknown(value, frozenset({"type"}))
        if extra:
            raise _Refused(400, f"Unknown parameter: 'response_format.{extra[0]}'.",
                           "unknown_parameter")
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _Refused(400, "Missing required parameter: 'response_format.json_schema'.",
                       "missing_required_parameter")
    extra = _unknown(value, frozenset({"type", "json_schema"})) + [
        f"json_schema.{k}" for k in _unknown(spec, frozenset({"name", "description", "schema",
                                                              "strict"}))]
    if extra:
        raise _Refused(400, f"Unknown parameter: 'response_format.{extra[0]}'.",
                       "unknown_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not _RESPONSE_FORMAT_NAME.match(name):
        raise _Refused(400, f"Invalid 'response_format.json_schema.name': string does not "
                       f"match pattern. Expected a string that matches the pattern "
                       f"'^[a-zA-Z0-9_-]+$' (at most 64 characters), got {name!r}.",
                       "invalid_value")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _Refused(400, "Invalid type for 'response_format.json_schema.schema': expected "
                       "an object.", "invalid_type")
    if spec.get("strict") is True:
        if schema.get("type") != "object":
            raise _Refused(400, f"Invalid schema for response_format '{name}': schema must be "
                           f"a JSON Schema of 'type: \"object\"', got 'type: "
                           f"\"{schema.get('type')}\"'.", "invalid_value")
        _strict_openai_schema(schema, name, ())


def _strict_openai_schema(node: Any, name: str, context: tuple[str, ...]) -> None:
    if isinstance(node, list):
        for item in node:
            _strict_openai_schema(item, name, context)
        return
    if not isinstance(node, dict):
        return
    where = f"Invalid schema for response_format '{name}': In context={context!r}, "
    if node.get("type") == "object" or "properties" in node:
        if node.get("additionalProperties") is not False:
            raise _Refused(400, where + "'additionalProperties' is required to be supplied "
                           "and to be false.", "invalid_value")
        properties = node.get("properties") or {}
        required = node.get("required")
        missing = [key for key in properties
                   if not isinstance(required, list) or key not in required]
        if missing:
            raise _Refused(400, where + "'required' is required to be supplied and to be an "
                           f"array including every key in properties. Missing '{missing[0]}'.",
                           "invalid_value")
        for key, sub in properties.items():
            _strict_openai_schema(sub, name, (*context, "properties", key))
    for key in ("$defs", "definitions"):
        for sub_name, sub in (node.get(key) or {}).items():
            _strict_openai_schema(sub, name, (*context, key, sub_name))
    for key in ("items", "anyOf", "allOf", "oneOf"):
        if key in node:
            _strict_openai_schema(node[key], name, (*context, key))


def _strict_anthropic(request: dict[str, Any]) -> None:
    extra = _unknown(request, _ANTHROPIC_TOP)
    if extra:
        raise _Refused(400, f"{extra[0]}: Extra inputs are not permitted")
    system = request.get("system")
    if system is not None and not isinstance(system, str | list):
        raise _Refused(400, "system: Input should be a valid string or list of text blocks")
    for index, message in enumerate(request.get("messages") or []):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _Refused(400, f"{where}.role: Input should be 'user' or 'assistant'")
        extra = _unknown(message, frozenset({"role", "content"}))
        if extra:
            raise _Refused(400, f"{where}.{extra[0]}: Extra inputs are not permitted")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise _Refused(400, f"{where}: all messages must have non-empty content")
        for number, block in enumerate(content):
            spot = f"{where}.content.{number}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _ANTHROPIC_BLOCK_KEYS:
                raise _Refused(400, f"{spot}.type: Input tag {kind!r} does not match any of "
                               f"the expected tags: {', '.join(_ANTHROPIC_BLOCK_KEYS)}")
            extra = _unknown(block, _ANTHROPIC_BLOCK_KEYS[kind])
            if extra:
                raise _Refused(400, f"{spot}.{kind}.{extra[0]}: Extra inputs are not permitted")
            if kind == "tool_use":
                if not isinstance(block.get("input"), dict):
                    raise _Refused(400, f"{spot}.tool_use.input: Input should be a valid "
                                   "dictionary")
                if not _TOOL_USE_ID.match(str(block.get("id") or "")):
                    raise _Refused(400, f"{spot}.tool_use.id: String should match pattern "
                                   "'^[a-zA-Z0-9_-]+$'")
            if kind == "text" and not isinstance(block.get("text"), str):
                raise _Refused(400, f"{spot}.text.text: Field required")
            if kind == "thinking" and not block.get("signature"):
                raise _Refused(400, f"{spot}.thinking.signature: Field required")
    for index, tool in enumerate(request.get("tools") or []):
        extra = _unknown(tool, _ANTHROPIC_TOOL_KEYS) if isinstance(tool, dict) else ["tool"]
        if extra:
            raise _Refused(400, f"tools.{index}.custom.{extra[0]}: Extra inputs are not "
                           "permitted")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise _Refused(400, f"tools.{index}.custom.input_schema.type: Input should be "
                           "'object'")
    if "tool_choice" in request:
        _strict_tool_choice(request)


_TOOL_CHOICE_KEYS = {"auto": frozenset({"type", "disable_parallel_tool_use"}),
                     "any": frozenset({"type", "disable_parallel_tool_use"}),
                     "tool": frozenset({"type", "name", "disable_parallel_tool_use"}),
                     "none": frozenset({"type"})}


def _strict_tool_choice(request: dict[str, Any]) -> None:
    """Anthropic's ``tool_choice``: its type's keys, a named tool that is offered,
    and no forced tool use with extended thinking, as the API refuses them."""
    choice = request["tool_choice"]
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _TOOL_CHOICE_KEYS:
        raise _Refused(400, f"tool_choice.type: Input tag {kind!r} does not match any of the "
                       f"expected tags: {', '.join(map(repr, _TOOL_CHOICE_KEYS))}")
    extra = _unknown(choice, _TOOL_CHOICE_KEYS[kind])
    if extra:
        raise _Refused(400, f"tool_choice.{kind}.{extra[0]}: Extra inputs are not permitted")
    names = [tool.get("name") for tool in request.get("tools") or [] if isinstance(tool, dict)]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _Refused(400, "tool_choice.tool.name: Field required")
        if choice["name"] not in names:
            raise _Refused(400, f"Tool '{choice['name']}' not found in the provided tools")
    if kind in ("any", "tool") and not names:
        raise _Refused(400, "tool_choice may only be specified while providing tools.")
    thinking = request.get("thinking")
    if kind in ("any", "tool") and isinstance(thinking, dict) \
            and thinking.get("type") == "enabled":
        raise _Refused(400, "Thinking may not be enabled when tool_choice forces tool use.")


def _gemini_unknown(name: str, where: str) -> _Refused:
    return _Refused(400, f'Invalid JSON payload received. Unknown name "{name}" at '
                    f"'{where}': Cannot find field.")


def _strict_gemini(request: dict[str, Any]) -> None:
    for key in _unknown(request, _GEMINI_TOP):
        raise _gemini_unknown(key, "")
    blocks = [("contents", c) for c in request.get("contents") or []]
    if request.get("systemInstruction") is not None:
        blocks.append(("system_instruction", request["systemInstruction"]))
    for index, (where, content) in enumerate(blocks):
        if not isinstance(content, dict):
            raise _Refused(400, f"* GenerateContentRequest.{where}: must be an object")
        for key in _unknown(content, frozenset({"role", "parts"})):
            raise _gemini_unknown(key, f"{where}[{index}]")
        if where == "contents" and content.get("role") not in ("user", "model"):
            raise _Refused(400, "Please use a valid role: user, model.")
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            raise _Refused(400, f"* GenerateContentRequest.{where}[{index}].parts: contents.parts "
                           "must not be empty.")
        for number, part in enumerate(parts):
            for key in _unknown(part, _GEMINI_PART_KEYS):
                raise _gemini_unknown(key, f"{where}[{index}].parts[{number}]")
    for index, tool in enumerate(request.get("tools") or []):
        for number, declaration in enumerate(tool.get("functionDeclarations") or []):
            where = f"tools[{index}].function_declarations[{number}]"
            for key in _unknown(declaration, _GEMINI_DECLARATION_KEYS):
                raise _gemini_unknown(key, where)
            if "parameters" in declaration and "parametersJsonSchema" in declaration:
                raise _Refused(400, f"{where}: parameters and parametersJsonSchema are "
                               "mutually exclusive")
            if "parameters" in declaration:
                _strict_gemini_schema(declaration["parameters"], f"{where}.parameters")
    for key in _unknown(request.get("generationConfig") or {}, _GEMINI_GENERATION_KEYS):
        raise _gemini_unknown(key, "generation_config")
    _strict_gemini_output(request)


_GEMINI_SCHEMA_MIME_TYPES = ("application/json", "text/x.enum")
_GEMINI_CALLING_MODES = ("MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED")


def _strict_gemini_output(request: dict[str, Any]) -> None:
    """Gemini's ``responseSchema`` (its Schema subset, with a JSON response type;
    never beside ``responseJsonSchema``) and ``toolConfig`` (a known calling
    mode; allowed function names that are declared)."""
    generation = request.get("generationConfig") or {}
    if "responseSchema" in generation:
        if "responseJsonSchema" in generation:
            raise _Refused(400, "* GenerateContentRequest.generation_config: response_schema "
                           "and response_json_schema are mutually exclusive")
        if generation.get("responseMimeType") not in _GEMINI_SCHEMA_MIME_TYPES:
            raise _Refused(400, "* GenerateContentRequest.generation_config.response_mime_type: "
                           "a response_schema needs response_mime_type "
                           f"{' or '.join(_GEMINI_SCHEMA_MIME_TYPES)}, got "
                           f"{generation.get('responseMimeType')!r}")
        _strict_gemini_schema(generation["responseSchema"], "generation_config.response_schema")
    config = request.get("toolConfig")
    if config is None:
        return
    for key in _unknown(config, frozenset({"functionCallingConfig", "retrievalConfig"})):
        raise _gemini_unknown(key, "tool_config")
    calling = config.get("functionCallingConfig") or {}
    for key in _unknown(calling, frozenset({"mode", "allowedFunctionNames"})):
        raise _gemini_unknown(key, "tool_config.function_calling_config")
    mode = calling.get("mode", "MODE_UNSPECIFIED")
    if mode not in _GEMINI_CALLING_MODES:
        raise _Refused(400, f"Invalid value at 'tool_config.function_calling_config.mode' "
                       f"({mode!r}): expected one of {', '.join(_GEMINI_CALLING_MODES)}")
    declared = {d.get("name") for tool in request.get("tools") or []
                for d in tool.get("functionDeclarations") or []}
    if mode == "ANY" and not declared:
        raise _Refused(400, "* GenerateContentRequest.tool_config.function_calling_config.mode:"
                       " mode ANY needs function declarations in tools")
    for name in calling.get("allowedFunctionNames") or []:
        if name not in declared:
            raise _Refused(400, "* GenerateContentRequest.tool_config.function_calling_config."
                           f"allowed_function_names: {name!r} is not a declared function")


def _strict_gemini_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise _Refused(400, f"Invalid value at '{where}': expected a Schema object")
    for key in _unknown(schema, _GEMINI_SCHEMA_KEYS):
        raise _gemini_unknown(key, where)
    kind = schema.get("type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in _GEMINI_TYPES):
        raise _Refused(400, f"Invalid value at '{where}.type' ({kind!r}): expected one of "
                       + ", ".join(sorted(_GEMINI_TYPES)))
    if kind is not None and kind.upper() == "OBJECT" and "properties" in schema \
            and not schema["properties"]:
        raise _Refused(400, f"* {where}.properties: should be non-empty for OBJECT type")
    for name, sub in (schema.get("properties") or {}).items():
        _strict_gemini_schema(sub, f"{where}.properties[{name}].value")
    if "items" in schema:
        _strict_gemini_schema(schema["items"], f"{where}.items")
    for number, sub in enumerate(schema.get("anyOf") or []):
        _strict_gemini_schema(sub, f"{where}.any_of[{number}]")
