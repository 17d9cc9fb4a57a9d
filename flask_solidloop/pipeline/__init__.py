"""Middleware pipelines that wrap each LLM turn and each tool turn."""

from .builder import Builder
from .context import LlmContext, ToolContext

__all__ = ["Builder", "LlmContext", "ToolContext"]
