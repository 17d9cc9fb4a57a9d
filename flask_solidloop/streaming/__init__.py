"""A loop's live event stream: typed events with ids that resume exactly, one
LISTEN connection per process, and SSE for Flask views
(docs/decisions/0024-loop-event-stream.md, docs/guides/streaming.md).

Layer: above ``loops`` (it reads the tables the store writes, through their
triggers), below the faces (``extension``, ``agent``, ``admin``).
"""

from .events import KINDS, TERMINAL_KINDS, StreamEvent, parse_after, read_events
from .follow import (
    SETTLED_STATUSES,
    follow,
    hub_for,
    mark_watched,
    require_loop,
    wait_settled,
)
from .hub import LISTEN_APPLICATION_NAME, LiveHub
from .many import claim_client, follow_many, new_stream_token, release_client
from .sse import HEADERS, RETRY_MS, frame, sse_response

__all__ = [
    "HEADERS",
    "KINDS",
    "LISTEN_APPLICATION_NAME",
    "RETRY_MS",
    "SETTLED_STATUSES",
    "TERMINAL_KINDS",
    "LiveHub",
    "StreamEvent",
    "claim_client",
    "follow",
    "follow_many",
    "frame",
    "hub_for",
    "mark_watched",
    "new_stream_token",
    "parse_after",
    "read_events",
    "release_client",
    "require_loop",
    "sse_response",
    "wait_settled",
]
