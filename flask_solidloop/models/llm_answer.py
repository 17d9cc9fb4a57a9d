"""The answer to an LLM request put on record before it was sent, one row per
request (docs/decisions/0032-turn-cost.md, migration 0027).

A turn puts its request on record as an ``llm_request`` row of
``solidloop_events`` before sending it (decision 0025); the write that ends the
turn inserts the answer here instead of rewriting that row: an update would
have written the whole request again (the row, its index entries, its WAL).
:class:`~flask_solidloop.models.Event` reads the two as one record. Written
only by loops/sql (``llm_event``'s ``answered`` part); no foreign key to the
event (its check would lock the event's row, a WAL record per turn): a
statement trigger on the events table deletes the answers of deleted events.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class LlmAnswer(Base):
    """What came back for request ``event_id``: ``answer`` is merged into the
    request's payload when read (the response, the attempts, the timings);
    ``status_code``, ``duration_ms`` and ``error`` are the request's."""

    __tablename__ = "solidloop_llm_answers"

    event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    status_code: Mapped[int | None] = mapped_column(Integer)
    duration_ms: Mapped[float] = mapped_column(nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    answer: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())
