"""Test helpers shipped for users: real servers and an in-process job drain."""

from .drain import DrainError, drain
from .llm_emulator import LLMEmulator

__all__ = ["DrainError", "LLMEmulator", "drain"]
