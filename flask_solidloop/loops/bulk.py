"""Bulk actions on loops, run as jobs (docs/decisions/0046-bulk-actions-as-jobs.md).

:func:`request_bulk` writes a ``solidloop_bulk_actions`` row (the action, the
set frozen at confirmation, the form's idempotency token) and its first job in
one transaction; a second request with the same token finds the first row and
enqueues nothing. :func:`walk` is that job: it reads the next chunk of the set
below the row's ``cursor`` and acts on each loop through ``loops.control`` (the
transitions the single-loop actions use), the cursor and the counters advanced
in the transaction of each loop's own transition. A walk killed anywhere
resumes below the cursor when the broker redelivers its job, and no loop is
acted on twice. A chunk ends by enqueueing the next one in the commit that
marks its own job done.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, text

from ..dbapi import is_transient
from ..errors import InvalidArgumentError
from ..models import RESUMABLE_STATUSES, BulkAction
from ..state import SolidLoopState
from . import control, queries
from .store.transaction import commit_with_job_done

logger = logging.getLogger("flask_solidloop.bulk")

#: The actions a bulk action may take.
ACTIONS = ("resume", "pause", "stop", "freeze", "unfreeze")

_INSERT = text(
    "INSERT INTO solidloop_bulk_actions (token, action, options, search, max_id, loop_ids, "
    "total, cursor, requested_by) VALUES (:token, :action, CAST(:options AS jsonb), "
    "CAST(:search AS jsonb), :max_id, :loop_ids, :total, :cursor, :requested_by) "
    "ON CONFLICT (token) DO NOTHING RETURNING id")
_START = text(
    "UPDATE solidloop_bulk_actions SET status = 'running', updated_at = now(), "
    "started_at = coalesce(started_at, now()) WHERE id = :id AND status = 'queued'")
#: Take one loop of the walk: only while the cursor is above it (a loop the
#: walk passed already is never taken again); the row lock serialises walkers.
_TAKE = text(
    "UPDATE solidloop_bulk_actions SET cursor = :loop_id, done = done + 1, updated_at = now() "
    "WHERE id = :id AND cursor > :loop_id AND status = 'running' RETURNING id")
#: A loop the action did not apply to: counted skipped. A transition that
#: commits even when it changes nothing (unfreeze) committed the take's
#: ``done``; it is moved to ``skipped``.
_SKIP = text(
    "UPDATE solidloop_bulk_actions SET skipped = skipped + 1, "
    "done = done - CASE WHEN cursor = :loop_id THEN 1 ELSE 0 END, cursor = :loop_id, "
    "updated_at = now() WHERE id = :id AND cursor >= :loop_id AND status = 'running'")
_FINISH = text(
    "UPDATE solidloop_bulk_actions SET status = :status, error = :error, finished_at = now(), "
    "updated_at = now() WHERE id = :id AND status IN ('queued', 'running')")
_SELECTED_IDS = text(
    "SELECT id FROM solidloop_loops WHERE id = ANY(:ids) AND id < :cursor "
    "ORDER BY id DESC LIMIT :limit")
_SELECTED_COUNT = text("SELECT count(*) FROM solidloop_loops WHERE id = ANY(:ids)")


@dataclass(frozen=True)
class Requested:
    """What :func:`request_bulk` did: the action's id, and whether this request
    created it (False: the token's action existed already)."""

    id: int
    created: bool


def search_to_json(search: queries.LoopSearch) -> dict[str, Any]:
    """The filters of ``search`` as JSON (``max_id`` is stored beside them)."""
    data = asdict(search)
    data.pop("max_id")
    data["statuses"] = list(search.statuses)
    for key in ("created_from", "created_to"):
        if data[key] is not None:
            data[key] = data[key].isoformat()
    return data


def search_from_json(data: dict[str, Any], max_id: int | None) -> queries.LoopSearch:
    values = dict(data)
    values["statuses"] = tuple(values.get("statuses") or ())
    for key in ("created_from", "created_to"):
        if values.get(key):
            values[key] = datetime.fromisoformat(values[key])
    return queries.LoopSearch(**values, max_id=max_id)


def check_action(action: str, options: dict[str, Any]) -> None:
    """InvalidArgumentError, naming the fix, for an action or option a walk cannot run."""
    if action not in ACTIONS:
        raise InvalidArgumentError(f"bulk action {action!r} is unknown; use one of "
                                   f"{', '.join(ACTIONS)}")
    if action == "resume":
        control.check_resumable(options.get("resume_from") or RESUMABLE_STATUSES)
    if action == "stop" and not options.get("reason"):
        raise InvalidArgumentError("a bulk stop needs options={'reason': ...}: the loops "
                                   "record why they were stopped")


def request_bulk(state: SolidLoopState, *, token: str, action: str, options: dict[str, Any],
                 limit: int, search: queries.LoopSearch | None = None,
                 loop_ids: list[int] | None = None,
                 requested_by: str | None = None) -> Requested:
    """Record a bulk action on ``search`` (its ``max_id`` freezes the set) or on
    the selected ``loop_ids``, acting on at most ``limit`` loops, and enqueue
    its walk, in one transaction (committed). A token already used returns
    that action, and nothing more is recorded or enqueued."""
    import json

    check_action(action, options)
    if (search is None) == (loop_ids is None):
        raise InvalidArgumentError("give request_bulk a search or loop_ids, not both")
    if not token or len(token) > 64:
        raise InvalidArgumentError("a bulk action needs its confirmation's token (1-64 "
                                   "characters); confirm from the confirmation page")
    session = state.db.session
    existing = _by_token(session, token)
    if existing is not None:
        session.rollback()
        return Requested(existing, False)
    if loop_ids is not None:
        ids = sorted({int(i) for i in loop_ids})
        total = int(session.execute(_SELECTED_COUNT, {"ids": ids}).scalar_one())
        top = ids[-1] if ids else 0
    else:
        assert search is not None
        if search.max_id is None:
            raise InvalidArgumentError("a bulk search needs max_id (the newest loop id at "
                                       "confirmation): it freezes the set")
        ids, top = [], search.max_id
        total = queries.count_loops(session, search, cap=limit)
    row = session.execute(_INSERT, {
        "token": token, "action": action,
        "options": json.dumps({**options, "limit": limit}),
        "search": json.dumps(search_to_json(search)) if search is not None else None,
        "max_id": search.max_id if search is not None else None,
        "loop_ids": ids if loop_ids is not None else None,
        "total": min(total, limit), "cursor": top + 1, "requested_by": requested_by,
    }).first()
    if row is None:  # the same token, committed by a concurrent request meanwhile
        session.rollback()
        found = _by_token(session, token)
        session.rollback()
        assert found is not None
        return Requested(found, False)
    state.dispatch.bulk_action(session, int(row[0]))
    session.commit()
    return Requested(int(row[0]), True)


def _by_token(session: Any, token: str) -> int | None:
    return session.scalar(select(BulkAction.id).where(BulkAction.token == token))


def get_bulk(session: Any, bulk_id: int) -> BulkAction | None:
    """The bulk action as it is now (read afresh)."""
    return session.scalars(select(BulkAction).where(BulkAction.id == bulk_id)
                           .execution_options(populate_existing=True)).first()


def act(state: SolidLoopState, action: str, loop_id: int, options: dict[str, Any]) -> bool:
    """One loop's transition, the same the single-loop action runs; commits
    when it changed the loop (and with it what the session holds)."""
    if action == "pause":
        return control.pause(state, loop_id)
    if action == "resume":
        return control.resume(state, loop_id,
                              from_=tuple(options.get("resume_from") or RESUMABLE_STATUSES),
                              message=options.get("message") or None)
    if action == "stop":
        return control.stop(state, loop_id, reason=str(options["reason"]))
    if action == "freeze":
        return control.freeze(state, loop_id)
    if action == "unfreeze":
        return control.unfreeze(state, loop_id)
    raise InvalidArgumentError(f"bulk action {action!r} is unknown; use one of "
                               f"{', '.join(ACTIONS)}")


def walk(state: SolidLoopState, bulk_id: int, *, chunk: int) -> None:
    """One chunk of the walk of bulk action ``bulk_id`` (the job's body); the
    next chunk's job is enqueued in the commit that marks this one done."""
    session = state.db.session
    bulk = get_bulk(session, bulk_id)
    if bulk is None or bulk.finished:
        session.rollback()
        commit_with_job_done(session)
        return
    session.execute(_START, {"id": bulk_id})
    session.commit()
    bulk = get_bulk(session, bulk_id)
    assert bulk is not None
    limit = int(bulk.options.get("limit") or bulk.total)
    room = limit - bulk.done - bulk.skipped
    ids = _next_ids(session, bulk, min(chunk, room)) if room > 0 else []
    action, options, search = bulk.action, dict(bulk.options), bulk.search
    session.rollback()
    for loop_id in ids:
        _act_once(state, bulk_id, action, options, loop_id)
    if len(ids) == chunk and room > chunk:
        state.dispatch.bulk_action(session, bulk_id)
        commit_with_job_done(session)
        return
    session.execute(_FINISH, {"id": bulk_id, "status": "done", "error": None})
    commit_with_job_done(session)
    logger.info("bulk action %s (%s%s) finished", bulk_id, action,
                " on a search" if search is not None else " on selected loops")


def _next_ids(session: Any, bulk: BulkAction, limit: int) -> list[int]:
    if bulk.loop_ids is not None:
        return [int(r[0]) for r in session.execute(_SELECTED_IDS, {
            "ids": list(bulk.loop_ids), "cursor": bulk.cursor, "limit": limit})]
    search = search_from_json(bulk.search or {}, bulk.max_id)
    return queries.search_loop_ids(session, search, limit=limit, before_id=bulk.cursor)


def _act_once(state: SolidLoopState, bulk_id: int, action: str, options: dict[str, Any],
              loop_id: int) -> None:
    """Act on one loop of the walk, at most once: the cursor moves below it in
    the transaction of its transition (or, when the action did not apply, in
    its own)."""
    session = state.db.session
    if session.execute(_TAKE, {"id": bulk_id, "loop_id": loop_id}).first() is None:
        session.rollback()  # passed already (a walk that died after this loop), or finished
        return
    try:
        changed = act(state, action, loop_id, options)
    except Exception as exc:
        session.rollback()
        if is_transient(exc):
            raise  # the job runs again, from the cursor
        logger.warning("bulk action %s: %s on loop %s failed; skipped", bulk_id, action,
                       loop_id, exc_info=True)
        changed = False
    if not changed:
        session.rollback()
        session.execute(_SKIP, {"id": bulk_id, "loop_id": loop_id})
        session.commit()


def fail(state: SolidLoopState, bulk_id: int, error: str) -> None:
    """End a bulk action with ``error`` (its walk cannot go on)."""
    session = state.db.session
    session.rollback()
    session.execute(_FINISH, {"id": bulk_id, "status": "failed", "error": error[:2000]})
    session.commit()
