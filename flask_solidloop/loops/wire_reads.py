"""The reads of the wire log's LLM requests that have no answer on record: a
request is written before it is sent (decision 0025), so a slow or hung
model call shows while it runs (the CLI's ``status``, the admin's loop page),
and one its turn abandoned shows as unanswered rather than in flight for ever.

Nothing here writes; loops/queries.py holds the other reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text

from .._typing import SessionLike
from . import sql

#: A loop's ``llm_request`` events not completed yet (decision 0025), oldest
#: first, each with the time since it was written (the database's clock) and
#: whether its request is in flight: its turn still holds the loop (running,
#: its LLM lease unexpired, its shell unfinished). Every exit of a turn that
#: does not answer it (a worker killed, a lease lost, a pause or a stop)
#: fails and hides the shell, or lets the lease lapse: the row is then
#: unanswered.
PENDING_REQUESTS = text(
    "SELECT e.id, e.message_id, e.created_at, "
    "extract(epoch FROM clock_timestamp() - e.created_at)::float8 AS seconds, "
    "e.payload ->> 'url' AS url, e.payload -> 'request' -> 'body' ->> 'model' AS model, "
    "coalesce(l.status = 'running' AND l.lease_expires_at > now() "
    "AND m.status = 'processing', false) AS in_flight "
    "FROM solidloop_events e JOIN solidloop_loops l ON l.id = e.loop_id "
    "LEFT JOIN solidloop_messages m ON m.id = e.message_id "
    f"WHERE e.loop_id = :loop_id AND e.kind = 'llm_request' AND {sql.request_pending('e')} "
    "ORDER BY e.id")


@dataclass(frozen=True)
class PendingRequest:
    """An ``llm_request`` event written before its request was sent and not
    completed: ``in_flight`` while its turn still waits for the answer, else
    unanswered (its turn ended without one: see :data:`PENDING_REQUESTS`)."""

    event_id: int
    message_id: int | None
    sent_at: datetime
    #: Seconds since it was written, by the database's clock.
    seconds: float
    #: The endpoint, as the wire log keeps it (no credentials).
    url: str | None
    model: str | None
    in_flight: bool

    @property
    def state(self) -> str:
        return "in flight" if self.in_flight else "unanswered"


def pending_requests(session: SessionLike, loop_id: int) -> list[PendingRequest]:
    """The loop's ``llm_request`` events with no answer recorded, oldest first."""
    return [PendingRequest(row.id, row.message_id, row.created_at, float(row.seconds), row.url,
                           row.model or _model_in_url(row.url), bool(row.in_flight))
            for row in session.execute(PENDING_REQUESTS, {"loop_id": loop_id})]


def request_in_flight(session: SessionLike, loop_id: int) -> PendingRequest | None:
    """The loop's LLM request being answered now, if one is."""
    flying = [r for r in pending_requests(session, loop_id) if r.in_flight]
    return flying[-1] if flying else None


def _model_in_url(url: str | None) -> str | None:
    """The model a URL names (Gemini's ``.../models/<model>:generateContent``)."""
    if not url or "/models/" not in url:
        return None
    return url.split("/models/", 1)[1].split(":", 1)[0].split("?", 1)[0] or None
