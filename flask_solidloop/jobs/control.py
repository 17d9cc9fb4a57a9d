"""Operator commands on jobs, shared by ``Job``, the failed registry and the CLI.

One place for each: list job rows, requeue a dead-lettered one (or an RQ job
that failed), discard a dead-lettered one, cancel a queued one. Requeue and cancel each run in one
transaction on the broker's pool: the dead row is locked, copied into a new
delivery and closed together, so two operators requeueing at once produce one
new delivery, not two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dramatiq.message import Message

from ..dbapi import execute_on
from ..errors import InvalidJobError, NoSuchJobError
from ..queue import sql as jobs_sql
from ..queue.broker import PostgresBroker, decode_message

#: Option names a delivery collects while failing; a requeued copy starts clean.
_FAILURE_OPTIONS = ("retries", "traceback", "requeue_timestamp")
#: RQ's words for the row states, accepted by ``flask solidloop jobs --state``.
STATE_ALIASES = {"started": "running", "finished": "done", "failed": "dead",
                 "scheduled": "queued", "canceled": "done"}
ROW_STATES = ("queued", "running", "done", "dead")


@dataclass(frozen=True)
class JobRow:
    """One delivery in ``solidloop_jobs``, as the CLI lists it."""

    id: int
    queue_name: str
    actor_name: str
    state: str
    attempts: int
    eta: datetime
    created_at: datetime
    finished_at: datetime | None
    last_error: str | None
    host_job_id: str | None
    func_name: str | None


def list_jobs(broker: PostgresBroker, *, states: Sequence[str] = (),
              queues: Sequence[str] = (), limit: int = 50) -> list[JobRow]:
    """The newest job rows, filtered by state (ours or RQ's names) and queue."""
    wanted = sorted({STATE_ALIASES.get(s, s) for s in states})
    bad = [s for s in wanted if s not in ROW_STATES]
    if bad:
        raise InvalidJobError(
            f"unknown job state {bad[0]!r}; use one of {', '.join(ROW_STATES)} "
            f"(or RQ's {', '.join(STATE_ALIASES)})")
    rows = broker._run(jobs_sql.LIST_JOBS, {"states": wanted or None,
                                            "queues": list(queues) or None, "limit": limit})
    return [JobRow(*row) for row in rows]


def requeue_row(broker: PostgresBroker, conn: Any, row_id: int) -> str | None:
    """Copy the dead row ``row_id`` into a fresh delivery and close it, on ``conn``
    (inside the caller's transaction). Returns the RQ job id it belongs to, if any."""
    rows = execute_on(conn, jobs_sql.LOCK_DEAD, (row_id,), fetch=True)
    if not rows:
        raise InvalidJobError(
            f"job row {row_id} is not dead-lettered (or does not exist): only failed jobs "
            "can be retried; see `flask solidloop jobs --state dead`")
    message = decode_message(rows[0][1])
    options = {k: v for k, v in message.options.items() if k not in _FAILURE_OPTIONS}
    # The same message id, so an RQ job's deliveries stay linked to its record.
    broker.enqueue(Message(queue_name=message.queue_name, actor_name=message.actor_name,
                           args=message.args, kwargs=message.kwargs, options=options,
                           message_id=message.message_id,
                           message_timestamp=message.message_timestamp), connection=conn)
    execute_on(conn, jobs_sql.CLOSE_REQUEUED, (row_id,))
    host_job_id = options.get("solidloop_job")
    if host_job_id is not None:
        execute_on(conn, jobs_sql.HOST_JOB_REQUEUED, (str(host_job_id),))
    return host_job_id


def requeue_host_job(broker: PostgresBroker, job_id: str) -> None:
    """Requeue the RQ job ``job_id`` from its latest (dead) delivery."""
    with broker.pool.connection() as conn, conn.transaction():
        rows = conn.execute(jobs_sql.LATEST_DEAD_OF_HOST_JOB, (job_id,)).fetchall()
        if not rows:
            raise NoSuchJobError(f"no job with id {job_id!r} to requeue")
        try:
            requeue_row(broker, conn, rows[0][0])
        except InvalidJobError:
            raise InvalidJobError(
                f"job {job_id!r} has not failed, so there is nothing to requeue; "
                "see job.get_status()") from None


def retry(broker: PostgresBroker, job_id: str) -> str:
    """Requeue one job by row id (digits) or RQ job id; a sentence saying what happened."""
    if job_id.isdigit():
        with broker.pool.connection() as conn, conn.transaction():
            host = requeue_row(broker, conn, int(job_id))
        return f"job row {job_id} requeued" + (f" (job {host})" if host else "")
    requeue_host_job(broker, job_id)
    return f"job {job_id} requeued"


def retry_failed(broker: PostgresBroker, queues: Sequence[str] = ()) -> list[int]:
    """Requeue every dead row of the host's queues (never solidloop's own: the
    reaper decides about those). Returns the row ids requeued."""
    ids = [row[0] for row in broker._run(jobs_sql.DEAD_IDS, {"queues": list(queues) or None})]
    done = []
    for row_id in ids:
        with broker.pool.connection() as conn, conn.transaction():
            try:
                requeue_row(broker, conn, row_id)
            except InvalidJobError:  # requeued meanwhile by someone else
                continue
        done.append(row_id)
    return done


def discard(broker: PostgresBroker, row_id: int) -> str:
    """Discard one dead-lettered job row: it is closed and never retried."""
    rows = broker._run(jobs_sql.DISCARD_DEAD, (row_id,))
    if not rows:
        raise InvalidJobError(f"job row {row_id} is not dead-lettered (or does not exist); "
                              "only dead jobs can be discarded")
    host = rows[0][0]
    return f"job row {row_id} discarded" + (f" (job {host})" if host else "")


def cancel_host_job(broker: PostgresBroker, job_id: str,
                    reason: str = "canceled") -> bool:
    rows = broker._run(jobs_sql.HOST_JOB_CANCEL, {"id": job_id, "reason": reason})
    return bool(rows and rows[0][0])


def cancel(broker: PostgresBroker, job_id: str) -> str:
    """Cancel one queued job by row id (digits) or RQ job id."""
    reason = "canceled from the command line"
    if job_id.isdigit():
        rows = broker._run(jobs_sql.CANCEL_QUEUED, (reason, int(job_id)))
        if not rows:
            raise InvalidJobError(f"job row {job_id} is not queued (or does not exist); "
                                  "only queued jobs can be canceled")
        host = rows[0][0]
        if host:
            cancel_host_job(broker, host, reason)
        return f"job row {job_id} canceled" + (f" (job {host})" if host else "")
    if not cancel_host_job(broker, job_id, reason):
        raise InvalidJobError(f"job {job_id!r} is not queued or scheduled (or does not "
                              "exist); only jobs that have not ended can be canceled")
    return f"job {job_id} canceled"
