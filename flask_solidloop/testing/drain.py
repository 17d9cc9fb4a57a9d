"""Run queued jobs synchronously in this process: fast, deterministic tests.

:func:`drain` claims due jobs from the job table exactly as a worker would
(same claim SQL, same leases, same broker middleware: one app context per
message, the current job published for transactional completion) and runs
them one at a time until none is due. It is the in-process twin of a real
``dramatiq`` worker, not a mock of it, and like a worker started without
``-Q`` it runs every queue the app's broker declares: solidloop's three,
``default``, and every queue of the host's actors and ``solidloop.queue()``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dramatiq.message import Message
from flask import Flask

from ..errors import SolidLoopError
from ..queue import sql as jobs_sql
from ..queue.broker import PostgresMessageProxy
from ..state import get_state


class DrainError(SolidLoopError, AssertionError):
    """A drained job raised; the original exception is chained."""


def _claim_one(broker: Any, conn: Any,
               queues: tuple[str, ...] | None) -> PostgresMessageProxy | None:
    # Read the declared queues before each claim, not once: a job may declare a
    # queue (``solidloop.queue("reports")`` in its body) and enqueue on it.
    for queue in queues if queues is not None else tuple(broker.queues):
        rows = conn.execute(jobs_sql.CLAIM, {"lease": broker.job_lease, "queue": queue, "limit": 1})
        row = rows.fetchone()
        if row:
            job_id, lease_token, data, attempts = row
            if isinstance(data, str | bytes):
                data = json.loads(data)
            return PostgresMessageProxy(Message(**data), job_id, lease_token, attempts)
    return None


def drain(
    app: Flask,
    *,
    queues: tuple[str, ...] | None = None,
    max_jobs: int = 1000,
    raise_errors: bool = True,
    timeout: float = 60.0,
) -> int:
    """Process due jobs until none is left; return how many ran.

    ``queues`` None (the default) means every queue the app's broker declares,
    in declaration order: solidloop's three first, then ``default`` and the
    host's. Name queues to stop at a phase boundary, e.g. ``("solidloop_llm",)``.
    With ``raise_errors`` an actor exception is re-raised (as DrainError) after
    the broker middleware has handled it, so a test sees the real failure.
    """
    state = get_state(app)
    broker = state.broker
    try:
        return _drain(broker, queues, max_jobs, raise_errors, timeout)
    finally:
        # Turns start this process's lease renewer; a test helper must not leave
        # its thread and connection behind. The next turn starts it again.
        state.stop_renewer()


def _drain(broker: Any, queues: tuple[str, ...] | None, max_jobs: int, raise_errors: bool,
           timeout: float) -> int:
    processed = 0
    deadline = time.monotonic() + timeout
    with broker.connect() as conn:
        while processed < max_jobs:
            if time.monotonic() > deadline:
                raise DrainError(f"drain did not finish within {timeout}s ({processed} jobs)")
            message = _claim_one(broker, conn, queues)
            if message is None:
                return processed
            processed += 1
            error: BaseException | None = None
            broker.emit_before("process_message", message)
            try:
                actor = broker.get_actor(message.actor_name)
                result = actor.fn(*message.args, **message.kwargs)
                broker.emit_after("process_message", message, result=result)
            except BaseException as exc:
                error = exc
                message.stuff_exception(exc)
                broker.emit_after("process_message", message, exception=exc)
            if message.failed:
                conn.execute(jobs_sql.NACK, (str(error) if error else None, message.job_id,
                                     message.lease_token))
            else:
                conn.execute(jobs_sql.MARK_DONE, (message.job_id, message.lease_token))
            if error is not None and raise_errors:
                raise DrainError(
                    f"job {message.job_id} ({message.actor_name}) raised "
                    f"{type(error).__name__}: {error}"
                ) from error
    return processed
