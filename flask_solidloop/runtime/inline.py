"""Inline continuation: the worker thread that commits a loop's step runs the
loop's next step itself, instead of waking another consumer to claim it.

A delivered turn job runs with ``adopt`` on (the thread is a dramatiq worker
thread, ``SOLIDLOOP_INLINE_CONTINUATION`` is on, ``SOLIDLOOP_INLINE_MAX_HOPS``
is above 0). The store functions that end a step take that intent
(``adopt=``) and, instead of a job, write the next step's claim into the same
commit: the tool call's lease at an LLM turn's end, the loop's next LLM claim
(a fresh generation and LLM lease; the loop stays ``running``) with a tool
phase's last answer. They return what they claimed (loops/store/adopted.py)
once the commit has happened, and this thread runs it: no job row, no claim
transaction, no NOTIFY, no wake-up. A step whose commit claimed nothing ends
the chain; its successors, if any, are jobs like any others.

The chain runs up to ``SOLIDLOOP_INLINE_MAX_HOPS`` steps per delivered job;
the last of them runs with ``adopt`` off, so its successor is a job and the
thread goes back to its consumer, unless no other job waits for a thread
(``_work_waiting``): yielding would then only move the loop to another
thread, and the budget starts over.

Why it is safe: an adopted claim is what a consumer's claim would have
written, committed with the state change that made it due (the successor's
record, its lease, commits with the state). If this thread dies after that
commit, the lease lapses after one ``SOLIDLOOP_LIVENESS_TTL`` and the reaper
takes the call (``stalled_tools``) or the turn (``expired_llm``) over, exactly
as for a worker that dies inside a claimed job. An adopted step this thread
will not run after all (the worker is stopping, the step raised) is handed
back at once: its claim released with a job queued, compare-and-set on the
claim.

Why it pays: per step, one commit, one job row and its claim fewer, and the
loop keeps its thread, so a started loop runs to its end while new loops wait
for a free thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dramatiq import worker as dramatiq_worker

from ..dbapi import execute_on
from ..loops import queries, store
from ..loops.store import Adopted, AdoptedLlmTurn, AdoptedToolCall
from ..queue import sql as jobs_sql
from ..queue.current_job import restore_current_job, save_current_job, set_current_job
from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.inline")

_local = threading.local()

#: A step's body: run with the adoption intent, return what its commit adopted.
Step = Callable[[bool], "Adopted | None"]

#: dramatiq's worker thread class (``WorkerThread``; ``_WorkerThread`` is its alias).
_WORKER_THREAD: type = getattr(dramatiq_worker, "WorkerThread",
                               getattr(dramatiq_worker, "_WorkerThread", type(None)))


def _in_worker_thread() -> bool:
    """Only dramatiq's worker threads continue inline: the in-process drain and
    direct calls run one job per call, as their callers count on."""
    return isinstance(threading.current_thread(), _WORKER_THREAD)


def _worker_running() -> bool:
    # dramatiq's WorkerThread clears ``running`` when the worker stops: a
    # stopping worker finishes the step at hand and hands the rest back.
    return bool(getattr(threading.current_thread(), "running", True))


def _work_waiting(state: SolidLoopState) -> bool:
    """Whether another job waits for a worker thread: one this worker's consumers
    have fetched and no thread has taken yet, or a due job in the queues they
    consume that no consumer has claimed (all of them busy). On any doubt,
    True: the thread yields."""
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


def run_chain(state: SolidLoopState, first: Step, run_adopted: Callable[
        [Adopted, bool], Adopted | None]) -> None:
    """Run a delivered job's step (``first``), then the steps its commits
    adopted, inline (see the module docstring). ``run_adopted(adopted, adopt)``
    runs one adopted step."""
    config = state.config
    if (not config.inline_continuation or config.inline_max_hops <= 0
            or getattr(_local, "active", False) or not _in_worker_thread()):
        first(False)
        return
    delivered = save_current_job()
    _local.active = True
    adopted: Adopted | None = None
    try:
        adopted = first(True)
        # As the step left it: whether its own commit marked the job done (the
        # consumer's acknowledgement then has nothing to do).
        delivered = save_current_job()
        hops = 0
        while adopted is not None:
            if not _worker_running():
                hand_back(state, adopted)
                return
            hops += 1
            if hops >= config.inline_max_hops and not _work_waiting(state):
                # Nobody waits for a thread: yielding this one would only move
                # the loop to another. The budget starts over.
                hops = 0
            step, adopted = adopted, None
            adopted = _run_adopted(state, step, run_adopted,
                                   adopt=hops < config.inline_max_hops)
    finally:
        restore_current_job(delivered)
        _local.active = False


def _run_adopted(state: SolidLoopState, adopted: Adopted,
                 run_adopted: Callable[[Adopted, bool], Adopted | None], *,
                 adopt: bool) -> Adopted | None:
    """Run a step whose claim the previous step's commit wrote (no job row to
    claim: the claim is this thread's already); what its own commit adopted.
    None when the chain ends here."""
    state.db.session.remove()
    set_current_job(None)
    session = state.db.session
    # The rows its commit wrote, as loaded objects (held here: the session's
    # identity map holds them weakly): the step reads them with no SELECT.
    rows = [queries.row_object(session, model, row) for model, row in adopted.rows]
    try:
        return run_adopted(adopted, adopt)
    except Exception:
        # The step's own guard already failed the loop where it could; what
        # escapes leaves a claim nobody runs: hand it back now rather than wait
        # for its lease to lapse (a no-op when the step moved it on).
        logger.exception("inline step of loop %s failed", adopted.loop_id)
        hand_back(state, adopted)
        return None
    finally:
        del rows  # kept alive until the step has run


def hand_back(state: SolidLoopState, adopted: Adopted) -> None:
    """An adopted step this thread will not run: its claim released and a job
    queued (loops/store), so a consumer takes it at once."""
    session = state.db.session
    try:
        if isinstance(adopted, AdoptedLlmTurn):
            store.requeue_llm_turn(state, session, adopted.loop_id, adopted.claim.token)
        else:
            assert isinstance(adopted, AdoptedToolCall)
            store.release_tool_call(state, session, adopted)
    except Exception:
        session.rollback()
        # Its lease lapses by itself; the reaper heals it then.
        logger.warning("inline: could not hand the next step of loop %s back; the reaper "
                       "takes it over when its lease lapses", adopted.loop_id, exc_info=True)
