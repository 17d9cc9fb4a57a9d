"""Reads the integration tests share: a loop's row as the database holds it
now, and a loop's visible messages in order."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from flask_solidloop.models import Loop, Message


def loop_of(session: Any, loop_id: int) -> Loop:
    """The loop's row, read again (nothing the session cached)."""
    session.expire_all()
    return session.get(Loop, loop_id)


def visible(session: Any, loop_id: int) -> list[Message]:
    """The loop's visible messages (not hidden), oldest first."""
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.is_hidden.is_(False)).order_by(Message.id)))
