"""Inline continuation: the worker thread that commits a loop's turn runs the
loop's next job itself, instead of waking another consumer to claim it.

While a turn runs in a dramatiq worker thread, its canonical commit does one
of two things with the turn's first continuation (a tool call, the next LLM
turn):

* **Adopt it** (the usual case: the LLM turn's end and the tool turn's answer,
  loops/store.py). The commit writes the successor's claim instead of a job:
  the tool call's lease, or the loop's next LLM claim (a fresh generation and
  LLM lease; the loop stays ``running``). Once the commit is confirmed, this
  thread runs the successor under that claim. No job row, no claim
  transaction, no NOTIFY, no wake-up.
* **Reserve a job for it** (any other enqueue of a continuation in the turn,
  or the hop budget's last hop). The dispatcher writes the job due two seconds
  later (no consumer claims it meanwhile, and without its NOTIFY); after the
  turn returns, this thread claims it by its message id with the broker's
  kind of fenced claim (``FOR UPDATE SKIP LOCKED`` on the queued row), set done
  at once inside the transaction of the successor's own claim.

Then it runs the successor, and so on, up to ``SOLIDLOOP_INLINE_MAX_HOPS`` jobs
per delivered job; then it hands the loop's next job back to the queue if
another job waits for a thread (``_work_waiting``), and otherwise starts its
budget over.

Why it is safe:

* An adopted claim is what a consumer's claim would have written, committed
  with the state change that made it due (invariant 1 holds: the successor's
  record, its lease, commits with the state). If this thread dies after that
  commit, the lease lapses after one ``SOLIDLOOP_LIVENESS_TTL`` and the reaper
  takes the call (``stalled_tools``) or the turn (``expired_llm``) over, exactly
  as for a worker that dies inside a claimed job.
* A reserved job's claim is the broker's claim. Were a consumer to claim the
  job first, this thread's claim would find nothing; if the thread dies before
  its claim commits, the job becomes due when its reservation ends and a
  consumer's timed poll (``SOLIDLOOP_POLL_INTERVAL``) claims it.
* A successor this thread will not run (the worker is stopping, the turn
  raised) is handed back at once: an adopted one's claim is released with a
  job queued (compare-and-set on the claim), a reserved job is made due and
  NOTIFYed.

Why it pays: per turn, one commit, one job row and its claim fewer, and the
loop keeps its thread, so a started loop runs to its end (what DBOS does with
a workflow) while new loops wait for a free thread.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from dramatiq import worker as dramatiq_worker

from ..dbapi import execute_on
from ..errors import InvalidArgumentError
from ..loops import queries, store
from ..queue import sql as jobs_sql
from ..queue.current_job import (
    CurrentJob,
    job_done_committed,
    restore_current_job,
    save_current_job,
    set_current_job,
)
from ..queue.dispatch import INLINE_RESERVATION_MS, Adopted, Successor
from ..queue.sql import CHANNEL_PREFIX
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


def _work_waiting(state: SolidLoopState) -> bool:
    """Whether another job waits for a worker thread: one this worker's consumers
    have fetched and no thread has taken yet, or a due job in the queues they
    consume that no consumer has claimed (all of them busy). On any doubt,
    True: the thread yields, as it always did at the end of its budget."""
    thread = threading.current_thread()
    work_queue = getattr(thread, "work_queue", None)
    queues = list(getattr(thread, "consumers", None) or ())
    if work_queue is None or not queues:
        return True
    if work_queue.qsize():
        return True
    session = state.db.session
    try:
        (waiting,), = execute_on(session, jobs_sql.WORK_WAITING, (queues,), fetch=True)
        session.commit()
    except Exception:
        session.rollback()
        logger.debug("inline: could not look for waiting jobs", exc_info=True)
        return True
    return bool(waiting)


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
    # Adopt only a continuation this thread will run: within the hop budget.
    dispatch.capture(adopt=config.inline_max_hops > 0)
    try:
        body()
        # As the body left it: whether its own commit marked the job done (the
        # consumer's acknowledgement then has nothing to do).
        delivered = save_current_job()
        hops = 0
        while True:
            successor = dispatch.take_captured()
            if successor is None:
                return
            if hops >= config.inline_max_hops or not _worker_running():
                _hand_back(state, successor)
                return
            hops += 1
            if hops >= config.inline_max_hops and _worker_running() \
                    and not _work_waiting(state):
                # Nobody waits for a thread: yielding this one would only move
                # the loop to another. The budget starts over.
                hops = 0
            dispatch.capture(adopt=hops < config.inline_max_hops)
            if isinstance(successor, Adopted):
                if not _run_adopted(state, successor):
                    return
            elif not _run_successor(state, successor):
                return
    finally:
        leftover = dispatch.take_captured()
        if leftover is not None:
            _hand_back(state, leftover)
        restore_current_job(delivered)
        _local.active = False


def _run_adopted(state: SolidLoopState, adopted: Adopted) -> bool:
    """Run a continuation whose claim the previous turn's commit wrote (no job
    row to claim: the lease is this thread's already). False when the chain
    ends here."""
    state.db.session.remove()
    set_current_job(None)
    session = state.db.session
    # The rows its commit wrote, as loaded objects (held here: the session's
    # identity map holds them weakly): the step reads them with no SELECT.
    carried = [queries.row_object(session, model, row) for model, row in adopted.carried]
    try:
        _run_body(state, adopted.actor_name, adopted.args, adopted)
    except Exception:
        # The body's own guard already failed the loop where it could; what
        # escapes leaves a lease nobody runs: hand it back now rather than wait
        # for it to lapse (a no-op when the turn moved it on).
        logger.exception("inline %s (adopted) failed", adopted.actor_name)
        _hand_back(state, adopted)
        return False
    del carried  # kept alive until the step has run
    return True


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
        _run_body(state, successor.actor_name, successor.args, None)
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


def _run_body(state: SolidLoopState, actor_name: str, args: tuple[Any, ...],
              adopted: Adopted | None) -> None:
    from .turns import llm_turn_job, tool_call_job

    if actor_name == LLM_TURN_ACTOR:
        llm_turn_job(state, int(args[0]), inline=True, adopted=adopted)
    elif actor_name == TOOL_CALL_ACTOR:
        tool_call_job(state, int(args[0]), str(args[1]),
                      str(args[2]) if len(args) > 2 and args[2] else None, inline=True,
                      adopted=adopted)
    else:  # pragma: no cover - the dispatcher captures only these two
        raise InvalidArgumentError(f"inline continuation cannot run {actor_name!r}")


def _hand_back(state: SolidLoopState, successor: Successor | Adopted) -> None:
    if isinstance(successor, Adopted):
        _release_adopted(state, successor)
    else:
        _wake(state, successor)


def _release_adopted(state: SolidLoopState, adopted: Adopted) -> None:
    """An adopted continuation this thread will not run: its claim released and
    a job queued (loops/store.py), so a consumer takes it at once."""
    session = state.db.session
    try:
        if adopted.actor_name == LLM_TURN_ACTOR:
            assert adopted.execution_token is not None
            store.hand_back_llm_turn(state, session, adopted.loop_id, adopted.execution_token)
        else:
            assert adopted.lease_token is not None
            store.hand_back_tool_call(state, session, loop_id=adopted.loop_id,
                                      tool_call_id=int(adopted.args[0]),
                                      token=uuid.UUID(str(adopted.args[1])),
                                      lease_token=adopted.lease_token)
    except Exception:
        session.rollback()
        # Its lease lapses by itself; the reaper heals it then.
        logger.warning("inline: could not hand %s of loop %s back; the reaper takes it over "
                       "when its lease lapses", adopted.actor_name, adopted.loop_id,
                       exc_info=True)


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
