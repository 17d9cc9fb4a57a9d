"""The loop state machine: fenced transitions and the turns that drive them."""

from .fence import lock_loop, owns, transition

__all__ = ["lock_loop", "owns", "transition"]
