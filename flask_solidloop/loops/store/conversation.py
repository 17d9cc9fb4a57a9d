"""A conversation's new user message (``Agent(loop).send_message``): delivered
now, kept in the loop's inbox for later, or delivered by interrupting the
loop's work, in one locked transaction with the job it implies
(docs/decisions/0026-conversations.md).

Where the message goes depends on the loop's status when the row lock is
taken, and on the agent's ``on_new_message`` policy:

- at rest (``init``, ``paused``, ``failed``, ``completed``): the loop is
  resumed with the message (``store.resume``: one implementation of that
  transition), and so re-enters;
- ``queued``: its next turn has not read the history yet, which is
  consistent, so the message joins it at once (behind the inbox's messages);
- ``running`` or ``waiting`` with ``"queue"``: kept in the inbox
  (``solidloop_loops.inbox``, outside the history) and delivered when the
  loop would otherwise end (``FINISH_TURN``), or by the next resume;
- ``running`` or ``waiting`` with ``"interrupt"``: the loop is resumed with
  the message from its live status: a new generation fences the running
  turn off, its shell is failed and hidden, calls without a result (waiting
  ones included) are answered as interrupted, and the next turn is queued;
- any live status with ``"reject"``: ``ConversationBusyError``, nothing written.

A frozen loop keeps the message in its inbox: its resume is the operator's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg.types.json import Jsonb

from ..._typing import SessionLike
from ...errors import ConversationBusyError, InvalidArgumentError
from ...models import RESUMABLE_STATUSES
from ...models.loop import LoopStatus
from .. import sql, storable
from .commands import RESUMED, resume
from .transaction import commits, fetch_row, fetch_rows

if TYPE_CHECKING:
    from ...state import SolidLoopState

#: The values of the agent option ``on_new_message``.
POLICIES = ("queue", "interrupt", "reject")
#: What a call without a result is answered with when a message interrupts.
INTERRUPTED = "the conversation was interrupted by a new message"

#: What ``send_message`` did (:attr:`SentMessage.outcome`).
STARTED = "started"
APPENDED = "appended"
QUEUED = "queued"
INTERRUPTED_OUTCOME = "interrupted"


@dataclass(frozen=True)
class SentMessage:
    """What ``send_message`` did with a message, committed.

    ``outcome``: ``"started"`` (the loop was at rest and re-entered with it),
    ``"appended"`` (the loop was queued: its next turn reads it),
    ``"queued"`` (the loop is busy: the message waits in its inbox, ``waiting``
    of them now, and is delivered when the loop's current work ends) or
    ``"interrupted"`` (the loop's work was cancelled and its next turn answers
    the message). ``status`` is the loop's status before the message."""

    loop_id: int
    outcome: str
    status: str
    waiting: int = 0


@commits
def send_message(state: SolidLoopState, session: SessionLike, loop_id: int, message: str, *,
                 policy: str, sequential: Callable[[int], bool]) -> SentMessage:
    """Deliver, keep or interrupt with ``message`` (see the module), in one
    transaction under the loop row's lock, which it commits; rolled back (and
    ``ConversationBusyError`` raised) when ``policy`` rejects it."""
    locked = fetch_row(session, sql.LOCK_LOOP, {"loop_id": loop_id})
    if locked is None:
        session.rollback()
        raise InvalidArgumentError(f"there is no loop {loop_id}")
    status = str(locked["status"])
    live = status not in RESUMABLE_STATUSES
    if live and policy == "reject":
        session.rollback()
        raise ConversationBusyError(loop_id, status)
    if locked["frozen"] or (live and policy == "queue" and status != LoopStatus.QUEUED):
        content, meta = storable.message_content(message, None)
        row = fetch_row(session, sql.QUEUE_MESSAGE,
                        {"loop_id": loop_id, "content": content, "meta": Jsonb(meta)})
        assert row is not None  # the row is locked
        session.commit()
        return SentMessage(loop_id, QUEUED, status, int(row["waiting"]))
    if status == LoopStatus.QUEUED:
        # Nothing has read the history since the loop was queued: the message
        # joins it now, after those that waited in the inbox.
        fetch_rows(session, sql.DELIVER_INBOX, {"loop_id": loop_id})
        content, meta = storable.message_content(message, None)
        appended = fetch_row(session, sql.APPEND_TO_QUEUED,
                             {"loop_id": loop_id, "content": content, "meta": Jsonb(meta)})
        assert appended is not None  # queued, under the lock
        session.commit()
        return SentMessage(loop_id, APPENDED, status)
    # At rest, or an interrupt: the resume's transition, from this status.
    resumed = resume(state, session, loop_id, (status,), message=message,
                     sequential=sequential, cancel_reason=INTERRUPTED if live else RESUMED)
    assert resumed  # the status it was locked in
    return SentMessage(loop_id, INTERRUPTED_OUTCOME if live else STARTED, status)
