"""Inline continuation: the worker thread that commits a loop's turn runs the
loop's next job itself, instead of waking another consumer to claim it.

A turn's canonical commit enqueues its successor (a tool call, the next LLM
turn) in the same transaction, as always: the job row is the record, and
nothing about recovery changes. What changes is who runs it first. While a
turn runs in a dramatiq worker thread, the dispatcher writes the turn's first
continuation reserved for this thread (due two seconds later, so no consumer
claims it meanwhile, and without its NOTIFY) and hands it back here; after the
turn returns, this thread claims that job by its message id with the same
fenced claim a consumer makes (``FOR UPDATE SKIP LOCKED`` on the queued row), set
done at once inside the transaction of the successor's own claim: the job's
claim and its done mark commit with the turn's first commit, or not at all.
Then it runs the successor, and so on, up to ``SOLIDLOOP_INLINE_MAX_HOPS`` jobs
per delivered job.

Why it is safe:

* The claim is the broker's claim: ``FOR UPDATE SKIP LOCKED`` on a queued
  row. Were a consumer to claim the job first, this thread's claim would find
  nothing.
* If this thread dies before its claim commits, the job is still queued; when
  its reservation ends a consumer's timed poll (``SOLIDLOOP_POLL_INTERVAL``)
  claims it, about three seconds later at most. If it dies after, the loop's
  or the tool call's lease is what recovery follows, exactly as for a
  consumer-delivered job.
* A successor this thread will not run (the hop budget is spent, the worker
  is stopping, the turn raised) is handed back at once: due now, NOTIFYed.

Why it pays: no NOTIFY, no wake-up, no separate claim transaction per job, and
the loop keeps its thread, so a started loop runs to its end (what DBOS does
with a workflow) while new loops wait for a free thread.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from dramatiq import worker as dramatiq_worker

from ..queue import sql as jobs_sql
from ..queue.broker import CHANNEL_PREFIX, execute_on
from ..queue.current_job import (
    CurrentJob,
    job_done_committed,
    restore_current_job,
    save_current_job,
    set_current_job,
)
from ..queue.dispatch import INLINE_RESERVATION_MS, Successor
from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.inline")

_local = threading.local()

LLM_TURN_ACTOR = "solidloop.llm_turn"
TOOL_CALL_ACTOR = "solidloop.tool_call"


#: dramatiq's worker thread class (``WorkerThread``; ``_WorkerThread`` is its alias).
_WORKER_THREAD: type = getattr(dramatiq_worker, "WorkerThread",
                               getattr(dramatiq_worker, "_WorkerThread", type(None)))


def _in_worker_thread() -> bool:
    """Only dramatiq's worker threads continue inline: the in-process drain and
    direct calls run one job per call, as their callers count on."""
    return isinstance(threading.current_thread(), _WORKER_THREAD)


def _worker_running() -> bool:
    # dramatiq's _WorkerThread clears ``running`` when the worker stops: a
    # stopping worker finishes the job at hand and hands the rest back.
    return bool(getattr(threading.current_thread(), "running", True))


def run_chain(state: SolidLoopState, body: Callable[[], None]) -> None:
    """Run a delivered turn job, then its continuations inline (see module doc)."""
    config = state.config
    if (not config.inline_continuation or getattr(_local, "active", False)
            or not _in_worker_thread()):
        body()
        return
    dispatch = state.dispatch
    delivered = save_current_job()
    _local.active = True
    dispatch.capture()
    try:
        body()
        hops = 0
        while True:
            successor = dispatch.take_captured()
            if successor is None:
                return
            if hops >= config.inline_max_hops or not _worker_running():
                _wake(state, successor)
                return
            hops += 1
            dispatch.capture()
            if not _run_successor(state, successor):
                return
    finally:
        leftover = dispatch.take_captured()
        if leftover is not None:
            _wake(state, leftover)
        restore_current_job(delivered)
        _local.active = False


def _run_successor(state: SolidLoopState, successor: Successor) -> bool:
    """Claim and run one continuation. False when the chain ends here."""
    # A fresh session: the previous turn's objects are of no use to this one.
    state.db.session.remove()
    session = state.db.session
    rows = execute_on(session, jobs_sql.CLAIM_INLINE, {
        "loop_id": successor.loop_id, "message_id": uuid.UUID(str(successor.message_id)),
    }, fetch=True)
    if not rows:
        # Claimed by a consumer meanwhile, or its transaction never committed.
        session.rollback()
        return False
    job_id, lease_token, attempts = rows[0]
    set_current_job(CurrentJob(job_id, lease_token, attempts, marked_in_claim=True))
    try:
        _run_body(state, successor)
    except Exception:
        # The body's own guard already failed the loop where it could; what
        # escapes is for a retry. A claim that rolled back with the error left
        # the job queued and reserved: hand it back now. One that committed is
        # done, and the loop's or the call's lease is what recovery follows.
        logger.exception("inline %s (job %s) failed", successor.actor_name, job_id)
        session.rollback()
        _wake(state, successor)
        return False
    if not job_done_committed(job_id):
        # A body that returned without committing its claim (a stale job, a lost
        # claim): the job is done all the same, as a consumer would ack it.
        session.rollback()
        execute_on(session, jobs_sql.FINISH_INLINE, (job_id,))
        session.commit()
    return True


def _run_body(state: SolidLoopState, successor: Successor) -> None:
    from .turns import llm_turn_job, tool_call_job

    args = successor.args
    if successor.actor_name == LLM_TURN_ACTOR:
        llm_turn_job(state, int(args[0]), inline=True)
    elif successor.actor_name == TOOL_CALL_ACTOR:
        tool_call_job(state, int(args[0]), str(args[1]),
                      str(args[2]) if len(args) > 2 and args[2] else None, inline=True)
    else:  # pragma: no cover - the dispatcher captures only these two
        raise ValueError(f"inline continuation cannot run {successor.actor_name!r}")


def _wake(state: SolidLoopState, successor: Successor) -> None:
    """Hand a reserved successor back: due now, and its queue woken."""
    session = state.db.session
    try:
        session.rollback()
        execute_on(session, jobs_sql.RELEASE_INLINE, {
            "loop_id": successor.loop_id, "message_id": uuid.UUID(str(successor.message_id)),
            "channel": CHANNEL_PREFIX + successor.queue_name})
        session.commit()
    except Exception:
        session.rollback()
        # Its reservation ends by itself; the consumers' timed poll finds it then.
        logger.warning("inline: could not hand job %s back to queue %s; it is due in %.0f s",
                       successor.message_id, successor.queue_name,
                       INLINE_RESERVATION_MS / 1000, exc_info=True)
