"""The summary turn's end (pipeline/compaction.py): the summary message, the
messages it replaces marked ``compacted_by`` it, and the loop queued for its
real turn with that turn's job, in one commit (docs/decisions/0038-compaction.md);
and the host's pins, the user messages no summary replaces.

A summary turn that dies before this commit wrote nothing: its next run
summarises again. After it, the next turn reads the compacted history. The
summarised messages are never deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NamedTuple

from psycopg.types.json import Jsonb

from ..._typing import SessionLike
from ...errors import InvalidArgumentError, LostLeaseError
from .. import sql, storable
from .transaction import commits, fetch_row, joins
from .wirelog import llm_event

if TYPE_CHECKING:
    from ...llm.client import WireRecord
    from ...llm.types import Usage
    from ...state import SolidLoopState


class Compacted(NamedTuple):
    """A summary turn's end: the summary's id (None when the span it was to
    replace was no longer whole, and nothing was replaced) and how many
    messages it replaced."""

    summary_id: int | None
    replaced: int


@commits
def finish_summary_turn(state: SolidLoopState, session: SessionLike, *, loop_id: int,
                        token: uuid.UUID, content: str, message_ids: Sequence[int],
                        meta: dict[str, Any], usage: Usage | None, cost: Decimal | None,
                        wire: WireRecord | None, event_id: int | None) -> Compacted:
    """The summary turn's canonical write (loops/sql.FINISH_SUMMARY_TURN), one
    statement under the loop row's lock and the generation fence: the summary
    inserted, each of ``message_ids`` marked ``compacted_by`` it (all of them
    or none: a span replaced already is never summarised twice), the usage and
    cost counted on the loop and the summary, the request's event
    (``event_id``) answered with ``wire``, and the loop queued for its real
    turn; that turn's job is enqueued in the same commit. LostLeaseError, with
    nothing written, when the loop changed hands. Rolls back what the session
    holds first."""
    session.rollback()
    text, altered = storable.text(content)
    meta, meta_altered, _ = storable.json_value(meta)
    sanitized = storable.sanitized({"content": altered, "metadata": meta_altered})
    if sanitized:
        meta["sanitized"] = sanitized
    config = state.config
    row = fetch_row(session, sql.FINISH_SUMMARY_TURN, {
        "loop_id": loop_id, "token": token, "shell_id": None, "content": text,
        "message_ids": list(message_ids), "message_meta": Jsonb(meta),
        "input_tokens": usage.input_tokens if usage is not None else None,
        "output_tokens": usage.output_tokens if usage is not None else None,
        "usage": Jsonb(usage.to_dict()) if usage is not None else None,
        "cost": cost if usage is not None else None,
        **llm_event(wire, body_limit=config.wire_body_limit,
                    repeat_history=config.event_repeat_history, event_id=event_id)})
    if row is None:
        session.rollback()
        raise LostLeaseError(f"loop {loop_id} changed hands during its summary turn")
    state.dispatch.llm_turn(session, loop_id)
    session.commit()
    return Compacted(row["summary_id"], int(row["marked"]))


@joins
def pin_message(session: SessionLike, loop_id: int, message_id: int, pinned: bool) -> None:
    """Pin (or unpin) a user message of the loop: a summary never replaces a
    pinned message (loops/sql.FINISH_SUMMARY_TURN). The caller commits.
    InvalidArgumentError, naming the fix, for a message that is not one of
    the loop's visible user messages, or that a summary replaced already."""
    params = {"loop_id": loop_id, "message_id": message_id, "pinned": pinned}
    if fetch_row(session, sql.PIN_MESSAGE, params) is not None:
        return
    point = fetch_row(session, sql.PIN_POINT, params)
    if point is None or point["loop_id"] != loop_id:
        raise InvalidArgumentError(
            f"message {message_id} is not one of loop {loop_id}'s: pin a message id that "
            f"`flask solidloop status {loop_id}` lists")
    if point["compacted_by"] is not None:
        raise InvalidArgumentError(
            f"message {message_id} was compacted into summary {point['compacted_by']} "
            "already: pin a message before a summary replaces it")
    what = "a summary" if point["kind"] == "summary" else \
        "a hidden shell" if point["is_hidden"] else f"a {point['role']} message"
    raise InvalidArgumentError(f"message {message_id} is {what}: only the loop's own user "
                               "messages can be pinned")
