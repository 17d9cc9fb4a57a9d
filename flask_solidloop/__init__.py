"""flask-solidloop: durable, crash-proof LLM agent loops for Flask.

Each agent turn (one LLM call, or one tool execution) is a dramatiq job on a
PostgreSQL-backed queue; all state lives in PostgreSQL, so any worker can die
at any moment and every loop still finishes.

This module is the public face: everything in ``__all__`` is the supported API,
the whole exception tree of :mod:`flask_solidloop.errors` included.
"""

from ._version import __version__
from .agent import Agent
from .errors import (
    AbortedError,
    AgentDefinitionError,
    AgentError,
    BrokerError,
    BrokerUnavailableError,
    BudgetExceededError,
    ClaimLapsedError,
    ConfigurationError,
    ConversationBusyError,
    DatabaseUnavailableError,
    DecisionConflictError,
    HistoryTooLargeError,
    InvalidArgumentError,
    InvalidJobError,
    JobEncodeError,
    JobError,
    JobImportError,
    LimitExceededError,
    LoopFailedError,
    LostLeaseError,
    McpAuthError,
    McpTokenRefusedError,
    McpTransportError,
    NoSuchJobError,
    NotInitializedError,
    ProviderAnswerError,
    ProviderConnectionLostError,
    ProviderError,
    ProviderHTTPError,
    ProviderResponseError,
    ProviderUnavailableError,
    QueueNotDeclaredError,
    SetupError,
    SolidLoopError,
    ToolDefinitionError,
    TurnLimitError,
    UnknownAgentError,
    UnknownMiddlewareError,
    UnknownToolError,
    WaitTimeoutError,
)
from .extension import SolidLoop
from .jobs import FailedJobRegistry, Job, LazyActor, Queue, Retry
from .loops.store import ArchivedLoop, Decision, SentMessage, WaitRequest
from .mcp.toolset import CallContext, ToolResult, Toolset
from .models import RESUMABLE_STATUSES
from .pipeline.builder import Builder
from .pipeline.compaction import Compaction
from .streaming import StreamEvent

__all__ = [
    "RESUMABLE_STATUSES",
    "AbortedError",
    "Agent",
    "AgentDefinitionError",
    "AgentError",
    "ArchivedLoop",
    "BrokerError",
    "BrokerUnavailableError",
    "BudgetExceededError",
    "Builder",
    "CallContext",
    "ClaimLapsedError",
    "Compaction",
    "ConfigurationError",
    "ConversationBusyError",
    "DatabaseUnavailableError",
    "Decision",
    "DecisionConflictError",
    "FailedJobRegistry",
    "HistoryTooLargeError",
    "InvalidArgumentError",
    "InvalidJobError",
    "Job",
    "JobEncodeError",
    "JobError",
    "JobImportError",
    "LazyActor",
    "LimitExceededError",
    "LoopFailedError",
    "LostLeaseError",
    "McpAuthError",
    "McpTokenRefusedError",
    "McpTransportError",
    "NoSuchJobError",
    "NotInitializedError",
    "ProviderAnswerError",
    "ProviderConnectionLostError",
    "ProviderError",
    "ProviderHTTPError",
    "ProviderResponseError",
    "ProviderUnavailableError",
    "Queue",
    "QueueNotDeclaredError",
    "Retry",
    "SentMessage",
    "SetupError",
    "SolidLoop",
    "SolidLoopError",
    "StreamEvent",
    "ToolDefinitionError",
    "ToolResult",
    "Toolset",
    "TurnLimitError",
    "UnknownAgentError",
    "UnknownMiddlewareError",
    "UnknownToolError",
    "WaitRequest",
    "WaitTimeoutError",
    "__version__",
]
