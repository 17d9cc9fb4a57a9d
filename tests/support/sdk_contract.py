"""Validate request bodies against the official SDKs' published request types, with no
unknown keys at any depth (issue 11). Test-only: needs the ``openai``, ``anthropic``
and ``google-genai`` packages of the ``test`` extra.

openai and anthropic publish their request bodies as TypedDicts, which pydantic
validates without refusing extra keys in nested dicts; :func:`check` walks the
annotations itself and refuses any key the type does not declare. google-genai's
types are pydantic models with ``extra="forbid"`` and camelCase aliases, so the
REST body's pieces are validated with them directly.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Literal, Union

import pydantic
from typing_extensions import is_typeddict


class ContractError(AssertionError):
    pass


def check(value: Any, annotation: Any, where: str = "$") -> None:
    """Raise ContractError unless ``value`` fits ``annotation`` with no unknown keys."""
    errors = _errors(value, annotation, where)
    if errors:
        raise ContractError("; ".join(errors[:5]))


def _errors(value: Any, tp: Any, where: str) -> list[str]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return []
    if origin in (typing.Required, typing.NotRequired, typing.Annotated) or \
            str(origin).endswith(("Required", "NotRequired", "ReadOnly")):
        return _errors(value, args[0], where)
    if origin is Union or origin is types.UnionType:
        found: list[str] = []
        for option in args:
            errors = _errors(value, option, where)
            if not errors:
                return []
            found.extend(errors)
        return [f"{where}: fits none of {len(args)} options ({'; '.join(found[:3])})"]
    if tp is type(None):
        return [] if value is None else [f"{where}: expected null"]
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} not in {args}"]
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: expected an object for {tp.__name__}"]
        hints = typing.get_type_hints(tp, include_extras=True)
        errors = [f"{where}: unknown key {k!r} for {tp.__name__}" for k in value
                  if k not in hints]
        errors += [f"{where}: missing {k!r} for {tp.__name__}"
                   for k in getattr(tp, "__required_keys__", ()) if k not in value]
        for key, sub in value.items():
            if key in hints:
                errors += _errors(sub, hints[key], f"{where}.{key}")
        return errors
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        out: list[str] = []
        for index, item in enumerate(value):
            out += _errors(item, args[0] if args else Any, f"{where}[{index}]")
        return out
    if origin in (dict, collections.abc.Mapping, dict):
        return [] if isinstance(value, dict) else [f"{where}: expected an object"]
    if tp is str:
        return [] if isinstance(value, str) else [f"{where}: expected a string, got {value!r}"]
    if tp is bool:
        return [] if isinstance(value, bool) else [f"{where}: expected a boolean"]
    if tp is int:
        return [] if isinstance(value, int) and not isinstance(value, bool) \
            else [f"{where}: expected an integer"]
    if tp is float:
        return [] if isinstance(value, int | float) and not isinstance(value, bool) \
            else [f"{where}: expected a number"]
    if isinstance(tp, typing.TypeAliasType if hasattr(typing, "TypeAliasType") else ()):
        return _errors(value, tp.__value__, where)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        # The SDKs also accept their response models here (a Message's blocks sent
        # back); a plain dict body must fit a Param TypedDict instead.
        return [f"{where}: only an SDK object fits {tp.__name__}"]
    return []  # other types (bytes, file types): not used in our bodies


def check_openai(body: dict[str, Any]) -> None:
    from openai.types.chat import completion_create_params as params

    kind = (params.CompletionCreateParamsStreaming if body.get("stream")
            else params.CompletionCreateParamsNonStreaming)
    check(body, kind)


def check_openai_responses(body: dict[str, Any]) -> None:
    from openai.types.responses import response_create_params as params

    kind = (params.ResponseCreateParamsStreaming if body.get("stream")
            else params.ResponseCreateParamsNonStreaming)
    check(body, kind)


def check_anthropic(body: dict[str, Any]) -> None:
    from anthropic.types import message_create_params as params

    kind = (params.MessageCreateParamsStreaming if body.get("stream")
            else params.MessageCreateParamsNonStreaming)
    check(body, kind)


#: The top-level keys of the REST GenerateContentRequest we may send.
GEMINI_REQUEST_KEYS = {"contents", "systemInstruction", "tools", "toolConfig",
                       "safetySettings", "generationConfig", "cachedContent",
                       "continuationToken"}


def check_gemini(body: dict[str, Any]) -> None:
    from google.genai import types as gt

    unknown = set(body) - GEMINI_REQUEST_KEYS
    if unknown:
        raise ContractError(f"unknown GenerateContentRequest keys {sorted(unknown)}")
    try:
        for content in body["contents"]:
            gt.Content.model_validate(content)
        if "systemInstruction" in body:
            gt.Content.model_validate(body["systemInstruction"])
        for tool in body.get("tools") or []:
            gt.Tool.model_validate(tool)
        if "generationConfig" in body:
            gt.GenerationConfig.model_validate(body["generationConfig"])
    except Exception as exc:  # pydantic.ValidationError
        raise ContractError(str(exc)) from None
