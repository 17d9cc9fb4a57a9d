"""Testing utilities shipped with flask-solidloop (LLM emulator for offline agent tests)."""

from .llm_emulator import LLMEmulator

__all__ = ["LLMEmulator"]
