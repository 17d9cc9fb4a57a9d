"""Loop state: the fence (the primitive), the store (every write of loop,
message and tool-call rows and their successor jobs), the queries (every
read) and control (the host commands)."""

from .fence import lock_loop, owns, transition

__all__ = ["lock_loop", "owns", "transition"]
