"""LLM providers: dialects that render and parse (no I/O), and one HTTP client."""

from .types import AssistantTurn, ChatMessage, ProviderSettings, ToolCallRequest, Usage

__all__ = ["AssistantTurn", "ChatMessage", "ProviderSettings", "ToolCallRequest", "Usage"]
