"""The one fenced transition primitive every state change goes through.

A transition locks the loop row (SELECT ... FOR UPDATE), checks the expected
status and, optionally, the expected execution token, and applies the change.
The caller adds whatever else belongs to the same step (messages, jobs) and
commits: state and successor job land together or not at all.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select

from .._typing import SessionLike
from ..errors import InvalidArgumentError
from ..models import Loop
from ..models.loop import ALL_STATUSES, TERMINAL_STATUSES

_ANY: Any = object()


def lock_loop(session: SessionLike, loop_id: int) -> Loop | None:
    """Load the loop with a row lock held until the transaction ends."""
    return session.execute(
        select(Loop).where(Loop.id == loop_id).with_for_update().execution_options(
            populate_existing=True
        )
    ).scalar_one_or_none()


def owns(loop: Loop | None, execution_token: uuid.UUID | None) -> bool:
    """True when ``execution_token``'s generation still owns the running loop."""
    return (
        loop is not None
        and loop.status == "running"
        and execution_token is not None
        and loop.execution_token == execution_token
    )


def transition(
    session: SessionLike,
    loop_id: int,
    *,
    from_: str | tuple[str, ...] | list[str],
    to: str,
    expected_token: uuid.UUID | None = _ANY,
    **changes: Any,
) -> Loop | None:
    """Move the loop from one of ``from_`` to ``to`` under the row lock.

    ``expected_token`` fences on the generation: pass the token your turn
    claimed, and a worker whose generation was rotated away changes nothing.
    Entering a terminal or paused state clears the token and lease unless
    ``changes`` says otherwise. Returns the loop, or None when the check failed.
    Does not commit.
    """
    allowed = (from_,) if isinstance(from_, str) else tuple(from_)
    for status in (*allowed, to):
        if status not in ALL_STATUSES:
            raise InvalidArgumentError(
                f"unknown loop status {status!r}; statuses: {', '.join(ALL_STATUSES)}")
    loop = lock_loop(session, loop_id)
    if loop is None or loop.status not in allowed:
        return None
    if expected_token is not _ANY and loop.execution_token != expected_token:
        return None
    loop.status = to
    if to == "queued":
        changes.setdefault("queued_at", func.now())
    if to in (*TERMINAL_STATUSES, "paused", "queued"):
        changes.setdefault("execution_token", None)
        changes.setdefault("lease_expires_at", None)
        changes.setdefault("lease_holder", None)
    if to in TERMINAL_STATUSES:
        changes.setdefault("finished_at", func.now())
    if to in ("completed",):
        changes.setdefault("error_message", None)
    for key, value in changes.items():
        if not hasattr(Loop, key):
            raise InvalidArgumentError(f"Loop has no column {key!r}")
        setattr(loop, key, value)
    session.flush()
    return loop
