"""flask-solidloop: durable, crash-proof LLM agent loops for Flask.

Each agent turn (one LLM call, or one tool execution) is a dramatiq job on a
PostgreSQL-backed queue; all state lives in PostgreSQL, so any worker can die
at any moment and every loop still finishes.
"""

from ._version import __version__
from .agent import Agent
from .errors import (
    AgentDefinitionError,
    ConfigurationError,
    LimitExceededError,
    LostLeaseError,
    ProviderError,
    SolidLoopError,
    UnknownAgentError,
    UnknownMiddlewareError,
)
from .extension import SolidLoop
from .mcp.toolset import CallContext, ToolResult, Toolset
from .models import RESUMABLE_STATUSES
from .pipeline.builder import Builder

__all__ = [
    "RESUMABLE_STATUSES",
    "Agent",
    "AgentDefinitionError",
    "Builder",
    "CallContext",
    "ConfigurationError",
    "LimitExceededError",
    "LostLeaseError",
    "ProviderError",
    "SolidLoop",
    "SolidLoopError",
    "ToolResult",
    "Toolset",
    "UnknownAgentError",
    "UnknownMiddlewareError",
    "__version__",
]
