"""Dialects by name: the ``dialect`` value of an agent's ``llm`` settings."""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .dialect import Dialect
from .types import DIALECTS


def get_dialect(name: str) -> Dialect:
    if name == "openai":
        from .openai import OpenAIDialect

        return OpenAIDialect()
    if name == "openai_responses":
        from .openai_responses import OpenAIResponsesDialect

        return OpenAIResponsesDialect()
    if name == "anthropic":
        from .anthropic import AnthropicDialect

        return AnthropicDialect()
    if name == "gemini":
        from .gemini import GeminiDialect

        return GeminiDialect()
    raise InvalidArgumentError(f"unknown llm dialect {name!r}; known: {', '.join(DIALECTS)}")
