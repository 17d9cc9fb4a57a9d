"""Test helpers shipped for users: real servers and an in-process job drain."""

from .drain import DrainError, drain
from .llm_emulator import LLMEmulator
from .mcp_emulator import MCPEmulator

__all__ = ["DrainError", "LLMEmulator", "MCPEmulator", "drain"]
