"""The tables flask-solidloop owns, all prefixed ``solidloop_``.

They live on their own SQLAlchemy metadata (:data:`metadata`), not on the host's
``db.Model``, so the host's Alembic autogenerate never mistakes them for its own
and our migrations (flask_solidloop/migrations) stay the only thing that shapes
them. The host's session still reads and writes them, in the host's transaction.
"""

from .base import Base, metadata
from .bulk_action import BULK_STATUSES, BulkAction
from .event import Event
from .host_job import HOST_JOB_STATUSES, HostJob, JobResult, PeriodicRun
from .job import Job
from .limits import RateBucket, Spend
from .llm_answer import LlmAnswer
from .loop import RESUMABLE_STATUSES, TERMINAL_STATUSES, Loop, LoopStatus
from .maintenance_run import MaintenanceRun
from .mcp_inbound import McpInboundSession
from .mcp_session import McpSession
from .message import Message
from .oauth_token import McpOAuthToken
from .stream_event import StreamEventRow
from .tool_call import ToolCall
from .turn_stats import RollupMark, TurnStat
from .worker import Leader, Worker

__all__ = [
    "BULK_STATUSES",
    "HOST_JOB_STATUSES",
    "RESUMABLE_STATUSES",
    "TERMINAL_STATUSES",
    "Base",
    "BulkAction",
    "Event",
    "HostJob",
    "Job",
    "JobResult",
    "Leader",
    "LlmAnswer",
    "Loop",
    "LoopStatus",
    "MaintenanceRun",
    "McpInboundSession",
    "McpOAuthToken",
    "McpSession",
    "Message",
    "PeriodicRun",
    "RateBucket",
    "RollupMark",
    "Spend",
    "StreamEventRow",
    "ToolCall",
    "TurnStat",
    "Worker",
    "metadata",
]
