"""Periodic jobs: ``@solidloop.periodic("*/5 * * * *")`` or ``every=timedelta(...)``.

Every worker process runs the scheduler tick (queue/middleware/scheduler.py
owns the thread). A tick computes, for each schedule, the start of the period
it is in (cron periods via croniter, in UTC; ``every`` periods aligned to the
Unix epoch, so all processes agree), and claims that period with a
conditional upsert on ``solidloop_periodic`` (the row only moves forward).
Exactly one process gets the row back, and it enqueues the job in the same
transaction: one job per period across any number of workers, and a crash
between the claim and the enqueue loses neither nor doubles them.

Missed periods are not replayed: after downtime the tick claims only the
current period, so a schedule runs at most once late, never in a burst. A
schedule seen for the first time does not run for a period that began more
than :data:`FIRST_RUN_GRACE` seconds ago (deploying a daily job at noon does
not run it at noon); it waits for its next period.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from dramatiq.message import Message

from ..errors import InvalidJobError
from ..queue import sql as jobs_sql
from ..queue.broker import PostgresBroker

logger = logging.getLogger("flask_solidloop.periodic")

FIRST_RUN_GRACE = 5.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class Schedule:
    """One periodic job: what to run, where, and how often."""

    name: str
    func_name: str
    queue_name: str
    cron: str | None = None
    every: float | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every is None):
            raise InvalidJobError(
                f"periodic job {self.name!r}: give a cron expression or every=, not both "
                "and not neither (e.g. periodic('*/5 * * * *') or periodic(every=timedelta("
                "minutes=5)))")
        if self.cron is not None:
            from croniter import croniter

            if not isinstance(self.cron, str) or not croniter.is_valid(self.cron):
                raise InvalidJobError(
                    f"periodic job {self.name!r}: {self.cron!r} is not a cron expression; "
                    "use five fields, minute hour day month weekday (e.g. '*/5 * * * *')")
        elif not (isinstance(self.every, int | float) and self.every > 0
                  and math.isfinite(self.every)):
            raise InvalidJobError(
                f"periodic job {self.name!r}: every={self.every!r} must be a positive "
                "timedelta or number of seconds")

    def period_start(self, now: datetime) -> datetime:
        """The start of the period ``now`` falls in."""
        if self.every is not None:
            n = math.floor((now - EPOCH).total_seconds() / self.every)
            return EPOCH + timedelta(seconds=n * self.every)
        from croniter import croniter

        # get_prev is strictly before its base: nudge it so a boundary starts its own period.
        start: datetime = croniter(self.cron, now + timedelta(microseconds=1)).get_prev(datetime)
        return start

    def next_start(self, start: datetime) -> datetime:
        if self.every is not None:
            return start + timedelta(seconds=self.every)
        from croniter import croniter

        following: datetime = croniter(self.cron, start).get_next(datetime)
        return following

    def job_id(self, start: datetime) -> str:
        return f"periodic:{self.name}:{start.isoformat()}"


def every_seconds(every: timedelta | float | int | None) -> float | None:
    if every is None:
        return None
    if isinstance(every, timedelta):
        return every.total_seconds()
    if isinstance(every, bool) or not isinstance(every, int | float):
        raise InvalidJobError(f"every={every!r}: give a timedelta or a number of seconds")
    return float(every)


class Scheduler:
    """The per-process tick over a registry's schedules, for one broker."""

    def __init__(self, broker: PostgresBroker, schedules: dict[str, Schedule],
                 config: Any = None) -> None:
        self.broker = broker
        self.schedules = schedules
        self.config = config
        #: Period each schedule was last handled for in this process (claimed or not).
        self.handled: dict[str, datetime] = {}

    def tick(self, now: datetime | None = None) -> float:
        """Claim and enqueue every due period; return seconds until the next one."""
        now = now or datetime.now(UTC)
        wait = 60.0
        for schedule in list(self.schedules.values()):
            start = schedule.period_start(now)
            if self.handled.get(schedule.name) != start:
                self.claim(schedule, start, now)
                self.handled[schedule.name] = start
            wait = min(wait, (schedule.next_start(start) - now).total_seconds())
        return max(0.0, wait)

    def claim(self, schedule: Schedule, start: datetime, now: datetime) -> bool:
        """Claim ``start`` for ``schedule`` and enqueue its job, atomically. True if
        this process enqueued it."""
        from .rq import DEFAULT_FAILURE_TTL, DEFAULT_RESULT_TTL, describe_call, ttl_seconds

        with self.broker.pool.connection() as conn, conn.transaction():
            row = conn.execute(jobs_sql.PERIODIC_CLAIM, (schedule.name, start)).fetchone()
            if row is None:
                return False  # another process has this period
            if row[1] and (now - start).total_seconds() > FIRST_RUN_GRACE:
                logger.info("periodic job %s first seen mid-period; it first runs at %s",
                            schedule.name, schedule.next_start(start).isoformat())
                return False
            job_id = schedule.job_id(start)
            message: Message[Any] = Message(
                queue_name=schedule.queue_name, actor_name=jobs_sql.HOST_JOB_ACTOR,
                args=(schedule.func_name, list(schedule.args), dict(schedule.kwargs)),
                kwargs={}, options={"solidloop_job": job_id, "max_retries": 0})
            record = {
                "id": job_id, "func_name": schedule.func_name, "status": "queued",
                "description": describe_call(schedule.func_name, schedule.args,
                                             schedule.kwargs),
                "meta": json.dumps({"periodic": schedule.name}),
                "result_ttl": ttl_seconds("result_ttl", None, getattr(
                    self.config, "job_result_ttl", DEFAULT_RESULT_TTL)),
                "failure_ttl": ttl_seconds("failure_ttl", None, getattr(
                    self.config, "job_failure_ttl", DEFAULT_FAILURE_TTL)),
            }
            written = self.broker.enqueue_host_job(message, record, connection=conn)
            if written:
                logger.info("periodic job %s enqueued for the period starting %s",
                            schedule.name, start.isoformat())
            return written
