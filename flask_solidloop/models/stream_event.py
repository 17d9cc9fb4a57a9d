"""A loop's event stream, one row per event (docs/decisions/0024-loop-event-stream.md).

Written only by the database: the triggers of migration 0017 and
``solidloop_stream_delta()`` (a streaming turn's flush). No foreign key to the
loop (migration 0024: its check locked the loop row once more per event); a
statement trigger on the loops table deletes a deleted loop's events. Read by
flask_solidloop.streaming, which joins the message and the tool call an event
names (they are immutable once the event exists).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Sequence, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base

#: One sequence for every loop's events, cache 1: ids are drawn under the
#: loop's row lock, so per loop they commit in order.
EVENT_IDS = Sequence("solidloop_stream_events_id_seq", cache=1)


class StreamEventRow(Base):
    """One event of one loop: ``kind`` names it; ``message_id`` and
    ``tool_call_id`` what it is about; ``data`` its small facts (a status, a
    decision); ``text`` a delta's text."""

    __tablename__ = "solidloop_stream_events"

    loop_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    id: Mapped[int] = mapped_column(BigInteger, EVENT_IDS, primary_key=True,
                                    server_default=EVENT_IDS.next_value())
    kind: Mapped[str] = mapped_column(String(30), nullable=False)
    message_id: Mapped[int | None] = mapped_column(BigInteger)
    tool_call_id: Mapped[int | None] = mapped_column(BigInteger)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    text: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())
