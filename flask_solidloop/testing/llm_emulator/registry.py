"""Dialects by name: which one a path speaks (:func:`route`), and each step that
differs by dialect handed to that dialect's module (openai, openai_responses,
anthropic, gemini), for
the server, the faults and strict mode."""

from __future__ import annotations

from typing import Any

from .._local_server import Response
from . import anthropic, gemini, openai, openai_responses
from .types import (
    ANTHROPIC,
    ANTHROPIC_PATH,
    CHAT_PATH,
    GEMINI,
    GEMINI_PATH,
    OPENAI,
    OPENAI_RESPONSES,
    RESPONSES_PATH,
)


def route(path: str) -> tuple[str, str | None, str | None] | None:
    """``(dialect, model from the path, Gemini method)`` for a served path, else None."""
    clean = path.rstrip("/") or "/"
    if clean == CHAT_PATH:
        return OPENAI, None, None
    if clean == RESPONSES_PATH:
        return OPENAI_RESPONSES, None, None
    if clean == ANTHROPIC_PATH:
        return ANTHROPIC, None, None
    found = GEMINI_PATH.match(clean)
    if found:
        return GEMINI, found["model"], found["method"]
    return None


def dialect_error(
    dialect: str,
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error response shaped like ``dialect``'s (``type_``: OpenAI/Anthropic type)."""
    if dialect == ANTHROPIC:
        return anthropic.error(status, message, type_=type_, headers=headers)
    if dialect == GEMINI:
        return gemini.error(status, message, headers=headers)
    return openai.error(status, message, type_=type_, code=code, param=param, headers=headers)


def check_auth(
    dialect: str, api_key: str, headers: dict[str, str], params: dict[str, list[str]]
) -> Response | None:
    """None when the request carries ``api_key`` where ``dialect`` sends it, else the
    dialect's refusal."""
    if dialect == ANTHROPIC:
        return anthropic.check_auth(api_key, headers)
    if dialect == GEMINI:
        return gemini.check_auth(api_key, headers, params)
    return openai.check_auth(api_key, headers)


def validate(
    dialect: str, headers: dict[str, str], parsed: Any, body: str, json_error: str | None
) -> Response | None:
    """A 400 in the dialect's shape when the request is not a usable chat request."""
    if dialect == ANTHROPIC:
        return anthropic.validate(headers, parsed, body, json_error)
    if dialect == OPENAI_RESPONSES:
        return openai_responses.validate(headers, parsed, body, json_error)
    if dialect == GEMINI:
        return gemini.validate(headers, parsed, body, json_error)
    return openai.validate(headers, parsed, body, json_error)


def last_message_text(request_json: dict[str, Any], dialect: str) -> str:
    """The text scripts match: the last message's, read the dialect's way."""
    if dialect == ANTHROPIC:
        return anthropic.last_message_text(request_json)
    if dialect == OPENAI_RESPONSES:
        return openai_responses.last_message_text(request_json)
    if dialect == GEMINI:
        return gemini.last_message_text(request_json)
    return openai.last_message_text(request_json)


def prompt_text(request_json: dict[str, Any], dialect: str = OPENAI) -> str:
    """The whole prompt's text, read the dialect's way, for token estimates."""
    if dialect == ANTHROPIC:
        return anthropic.prompt_text(request_json)
    if dialect == OPENAI_RESPONSES:
        return openai_responses.prompt_text(request_json)
    if dialect == GEMINI:
        return gemini.prompt_text(request_json)
    return openai.prompt_text(request_json)


def output_cap(request_json: dict[str, Any], dialect: str = OPENAI) -> int:
    """The output tokens the request allows (0 when it sets no cap), read the dialect's way."""
    if dialect == ANTHROPIC:
        return anthropic.output_cap(request_json)
    if dialect == OPENAI_RESPONSES:
        return openai_responses.output_cap(request_json)
    if dialect == GEMINI:
        return gemini.output_cap(request_json)
    return openai.output_cap(request_json)
