"""Test helpers shipped for users: real servers and an in-process job drain."""

from .drain import DrainError, drain
from .llm_emulator import LLMEmulator, RateLimitStats
from .mcp_emulator import MCPEmulator

__all__ = ["DrainError", "LLMEmulator", "MCPEmulator", "RateLimitStats", "drain"]
