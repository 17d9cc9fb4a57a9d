"""An RQ-compatible API over the transactional queue: ``Queue``, ``Job``, ``Retry``.

For people who know RQ: ``q = solidloop.queue("default")``, then
``q.enqueue(f, *args, **kwargs)``, ``enqueue_in``, ``enqueue_at`` and
``enqueue_call`` with RQ's option names, plus ``session=`` to commit the job
with the caller's transaction. A job is a message to the ``solidloop.job``
actor carrying ``f``'s import path and arguments (flask_solidloop/jobs/functions.py),
and a ``solidloop_host_jobs`` row carrying what RQ keeps in its job hash:
status, meta, description, return value, failure info and TTLs.

The job's status is RQ's: ``queued``, ``scheduled``, ``started``,
``finished``, ``failed``, ``canceled`` (``deferred`` is never produced:
``depends_on`` is not supported, see docs/guides/jobs.md). Finished, failed
and canceled are recorded on the row; the live ones are read from the job's
latest delivery in ``solidloop_jobs``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.encoder import JSONEncoder
from dramatiq.message import Message

from ..config import RESERVED_QUEUE_PREFIX
from ..errors import InvalidJobError, NoSuchJobError
from ..queue import sql as jobs_sql
from ..queue.broker import PostgresBroker, check_queue_name
from .functions import import_path_of

if TYPE_CHECKING:
    from flask import Flask

    from .registry import JobRegistry

#: RQ's statuses, as ``Job.get_status()`` returns them.
JOB_STATUSES = ("queued", "scheduled", "deferred", "started", "finished", "failed", "canceled")
#: RQ's defaults: results kept 500 s, failures a year. -1 keeps forever.
DEFAULT_RESULT_TTL = 500
DEFAULT_FAILURE_TTL = 365 * 24 * 3600
MAX_JOB_ID = 200

#: RQ options we do not offer, and why (each raises with this text).
UNSUPPORTED = {
    "depends_on": "dependencies are not supported: enqueue the next job at the end of the "
                  "first one (with session= if that job writes), or use a dramatiq pipeline",
    "at_front": "jobs are claimed in due-time order; put urgent work on its own queue "
                "with its own workers instead",
    "ttl": "a queued job never expires here; cancel it (job.cancel()) if it is no longer wanted",
    "on_success": "RQ callbacks are not supported: declare a @solidloop.actor and use "
                  "dramatiq's on_success / on_failure options",
    "on_failure": "RQ callbacks are not supported: declare a @solidloop.actor and use "
                  "dramatiq's on_success / on_failure options",
    "on_stopped": "RQ callbacks are not supported",
    "pipeline": "Redis pipelines do not apply: pass session= to enqueue inside a "
                "database transaction",
}
#: The keyword arguments enqueue() takes for itself; any other goes to the function.
ENQUEUE_OPTIONS = frozenset({"job_timeout", "result_ttl", "failure_ttl", "description",
                             "job_id", "meta", "retry", "session", *UNSUPPORTED})


@dataclass(frozen=True)
class Retry:
    """RQ's retry policy: up to ``max`` more attempts, waiting ``interval``
    seconds before each (one number, or one per retry; the last repeats)."""

    max: int
    interval: int | float | Sequence[int | float] = 0

    def __post_init__(self) -> None:
        if isinstance(self.max, bool) or not isinstance(self.max, int) or self.max < 1:
            raise InvalidJobError(f"Retry(max={self.max!r}): max must be an integer >= 1")
        intervals = self.intervals_ms()
        if not intervals or any(i < 0 for i in intervals):
            raise InvalidJobError(
                f"Retry(interval={self.interval!r}): give seconds >= 0, one number or a list")

    def intervals_ms(self) -> list[int]:
        values = ([self.interval] if isinstance(self.interval, int | float)
                  else list(self.interval))
        try:
            return [int(float(v) * 1000) for v in values]
        except (TypeError, ValueError):
            raise InvalidJobError(
                f"Retry(interval={self.interval!r}): give seconds, one number or a list"
            ) from None


def _seconds(name: str, value: Any) -> float:
    """RQ accepts job_timeout as seconds, a timedelta, or '30s' / '5m' / '2h' / '1d'."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)
        if match:
            unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
            return float(match.group(1)) * unit
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise InvalidJobError(f"{name}={value!r}: give seconds (a number, a timedelta, or '5m')")


def ttl_seconds(name: str, value: Any, default: int) -> int | None:
    """Seconds to keep, None for forever (RQ's -1)."""
    if value is None:
        value = default
    seconds = int(_seconds(name, value))
    if seconds == -1:
        return None
    if seconds < 0:
        raise InvalidJobError(f"{name}={value!r}: give seconds >= 0, or -1 to keep forever")
    return seconds


def describe_call(func_name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """RQ's default description: ``module.func(arg, key=value)``."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    text = f"{func_name.replace(':', '.')}({', '.join(parts)})"
    return text if len(text) <= 500 else text[:497] + "..."


def _decode_value(value: Any) -> Any:
    """A JSONB value written through the encoder, read back through it."""
    encoder = dramatiq.get_encoder()
    if value is None or type(encoder) is JSONEncoder:
        return value
    return encoder.decode(json.dumps(value).encode("utf-8"))


class Queue:
    """An RQ-style queue of plain functions (and lazy actors) on the Postgres broker.

    Declared once, usually at import: ``q = solidloop.queue("reports")``.
    Workers consume it by default (``flask solidloop worker``) when they import
    the module that declares it; ``default`` they consume always.
    """

    def __init__(self, registry: JobRegistry, name: str) -> None:
        self.registry = registry
        self.name = name

    def __repr__(self) -> str:
        return f"Queue({self.name!r})"

    @property
    def broker(self) -> PostgresBroker:
        return self.registry.broker_for(f"queue {self.name!r}")

    # -- enqueue -------------------------------------------------------------------

    def enqueue(self, f: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Job:
        """Enqueue ``f(*args, **kwargs)``. RQ's options (job_id, job_timeout,
        retry, result_ttl, failure_ttl, meta, description) and ``session=``
        are taken from ``kwargs``; pass ``args=``/``kwargs=`` explicitly when
        ``f`` itself takes an argument of one of those names."""
        return self._enqueue(f, args, kwargs)

    def enqueue_in(self, time_delta: timedelta, f: Callable[..., Any] | str, *args: Any,
                   **kwargs: Any) -> Job:
        """Enqueue ``f`` to run ``time_delta`` from now (the database's now)."""
        if not isinstance(time_delta, timedelta):
            raise InvalidJobError(f"enqueue_in() takes a timedelta first, got {time_delta!r}")
        delay = max(0, int(time_delta.total_seconds() * 1000))
        return self._enqueue(f, args, kwargs, delay=delay)

    def enqueue_at(self, datetime_: datetime, f: Callable[..., Any] | str, *args: Any,
                   **kwargs: Any) -> Job:
        """Enqueue ``f`` to run at ``datetime_``, which must be timezone-aware."""
        if not isinstance(datetime_, datetime):
            raise InvalidJobError(f"enqueue_at() takes a datetime first, got {datetime_!r}")
        if datetime_.tzinfo is None or datetime_.utcoffset() is None:
            raise InvalidJobError(
                f"enqueue_at({datetime_.isoformat()}) got a naive datetime, which could mean "
                "any timezone: pass an aware one, e.g. datetime.now(UTC) + timedelta(...) or "
                "dt.replace(tzinfo=UTC)"
            )
        return self._enqueue(f, args, kwargs, eta=datetime_)

    def enqueue_call(self, func: Callable[..., Any] | str, args: Sequence[Any] | None = None,
                     kwargs: dict[str, Any] | None = None, **options: Any) -> Job:
        """RQ's explicit form: ``enqueue_call(func=f, args=(...), kwargs={...}, job_id=...)``."""
        unknown = set(options) - ENQUEUE_OPTIONS - {"timeout"}
        if unknown:
            from .actors import check_options

            check_options(unknown, ENQUEUE_OPTIONS, where="enqueue_call()",
                          extra=("func", "args", "kwargs"))
        if "timeout" in options:  # RQ's old name
            options["job_timeout"] = options.pop("timeout")
        return self._send(func, tuple(args or ()), dict(kwargs or {}), options)

    def _enqueue(self, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 delay: int | None = None, eta: datetime | None = None) -> Job:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in ENQUEUE_OPTIONS}
        if "args" in kwargs or "kwargs" in kwargs:
            if args:
                raise InvalidJobError(
                    "pass the function's arguments either positionally or as args=/kwargs=, "
                    "not both")
            args = tuple(kwargs.pop("args", None) or ())
            kwargs = dict(kwargs.pop("kwargs", None) or {})
        return self._send(f, args, kwargs, options, delay=delay, eta=eta)

    def _send(self, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              options: dict[str, Any], *, delay: int | None = None,
              eta: datetime | None = None) -> Job:
        for name in UNSUPPORTED:
            if options.get(name) not in (None, False):
                raise InvalidJobError(f"{name}= is not supported: {UNSUPPORTED[name]}")
        broker = self.broker
        state = self.registry.state_for(broker)
        func_name = import_path_of(f)
        job_id = options.get("job_id")
        if job_id is None:
            job_id = str(uuid.uuid4())
        elif not isinstance(job_id, str) or not job_id or len(job_id) > MAX_JOB_ID:
            raise InvalidJobError(f"job_id={job_id!r}: give a non-empty string of at most "
                                  f"{MAX_JOB_ID} characters")
        message_options: dict[str, Any] = {"solidloop_job": job_id, "max_retries": 0}
        retry = options.get("retry")
        if retry is not None:
            if not isinstance(retry, Retry):
                raise InvalidJobError(f"retry={retry!r}: pass Retry(max=..., interval=...)")
            message_options["max_retries"] = retry.max
            message_options["solidloop_retry_intervals"] = retry.intervals_ms()
        if options.get("job_timeout") is not None:
            seconds = _seconds("job_timeout", options["job_timeout"])
            if seconds <= 0:
                raise InvalidJobError(f"job_timeout={options['job_timeout']!r}: must be > 0")
            message_options["time_limit"] = int(seconds * 1000)
        meta = options.get("meta") or {}
        if not isinstance(meta, dict):
            raise InvalidJobError(f"meta={meta!r}: give a dict")
        try:
            meta_json = json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise InvalidJobError(f"meta must be JSON-serializable: {exc}") from None
        config = state.config if state is not None else None
        record = {
            "id": job_id,
            "func_name": func_name,
            "description": options.get("description") or describe_call(func_name, args, kwargs),
            "status": "scheduled" if (delay or eta is not None) else "queued",
            "meta": meta_json,
            "result_ttl": ttl_seconds("result_ttl", options.get("result_ttl"),
                               getattr(config, "job_result_ttl", DEFAULT_RESULT_TTL)),
            "failure_ttl": ttl_seconds("failure_ttl", options.get("failure_ttl"),
                                getattr(config, "job_failure_ttl", DEFAULT_FAILURE_TTL)),
        }
        message: Message[Any] = Message(
            queue_name=self.name, actor_name=jobs_sql.HOST_JOB_ACTOR,
            args=(func_name, list(args), kwargs), kwargs={}, options=message_options)
        session = options.get("session")
        if session is not None:
            broker.check_session(session)
            written = broker.enqueue_host_job(message, record, delay=delay, eta=eta,
                                              connection=session)
        else:
            with broker.pool.connection() as conn, conn.transaction():
                written = broker.enqueue_host_job(message, record, delay=delay, eta=eta,
                                                  connection=conn)
        if not written:
            raise InvalidJobError(
                f"a job with id {job_id!r} already exists: pick another job_id, or requeue "
                f"that job (Job.fetch({job_id!r}).requeue())")
        return Job(broker, job_id, queue_name=self.name, func_name=func_name,
                   description=record["description"], meta=meta, status=record["status"],
                   args=list(args), kwargs=kwargs)

    # -- inspection ----------------------------------------------------------------

    @property
    def count(self) -> int:
        """Jobs waiting in this queue (due or not), of any kind."""
        return int(self.broker._run(jobs_sql.HOST_JOB_COUNT_LIVE, (self.name,))[0][0])

    def __len__(self) -> int:
        return self.count

    def fetch_job(self, job_id: str) -> Job | None:
        try:
            return Job.fetch(job_id, broker=self.broker)
        except NoSuchJobError:
            return None

    @property
    def failed_job_registry(self) -> FailedJobRegistry:
        return FailedJobRegistry(self)


class Job:
    """An RQ-style job: read with ``Job.fetch(id)``, changed with ``cancel``/``requeue``."""

    def __init__(self, broker: PostgresBroker, job_id: str, **fields: Any) -> None:
        self.broker = broker
        self.id = job_id
        self.origin: str = fields.get("queue_name", "")
        self.func_name: str = fields.get("func_name", "")
        self.description: str | None = fields.get("description")
        self.meta: dict[str, Any] = dict(fields.get("meta") or {})
        self.args: list[Any] = list(fields.get("args") or [])
        self.kwargs: dict[str, Any] = dict(fields.get("kwargs") or {})
        self._status: str = fields.get("status", "queued")
        self._result: Any = None
        self._exc_info: str | None = None
        self.enqueued_at: datetime | None = None
        self.started_at: datetime | None = None
        self.ended_at: datetime | None = None
        self.attempts: int = 0

    def __repr__(self) -> str:
        return f"Job({self.id!r}, {self.func_name!r}, status={self._status!r})"

    @classmethod
    def fetch(cls, job_id: str, *, app: Flask | None = None,
              broker: PostgresBroker | None = None) -> Job:
        """The job with this id (NoSuchJobError if none), read now."""
        if broker is None:
            from ..state import get_state

            broker = get_state(app).broker
        job = cls(broker, job_id)
        job.refresh()
        return job

    def refresh(self) -> None:
        """Re-read everything from the database."""
        rows = self.broker._run(jobs_sql.HOST_JOB_FETCH, (self.id,))
        if not rows:
            raise NoSuchJobError(
                f"no job with id {self.id!r}: it was never enqueued on this database, or "
                "the janitor pruned it after its result_ttl / failure_ttl")
        (_, queue_name, func_name, description, meta, result, exc_info, created_at, ended_at,
         _row_id, row_state, _eta, started_at, message, attempts, last_error, status) = rows[0]
        self.origin, self.func_name, self.description = queue_name, func_name, description
        self.meta = dict(meta or {})
        self._status = status
        self._result = _decode_value(result)
        self._exc_info = exc_info or (last_error if row_state == "dead" else None)
        self.enqueued_at, self.started_at, self.ended_at = created_at, started_at, ended_at
        self.attempts = attempts or 0
        if message:
            margs = message.get("args") or [None, [], {}]
            self.args, self.kwargs = list(margs[1]), dict(margs[2])

    def get_status(self, refresh: bool = True) -> str:
        if refresh:
            self.refresh()
        return self._status

    def return_value(self, refresh: bool = True) -> Any:
        """What the function returned (None until it finished, or if it returned None)."""
        if refresh:
            self.refresh()
        return self._result

    @property
    def result(self) -> Any:
        return self.return_value()

    @property
    def exc_info(self) -> str | None:
        """The traceback of the latest failure (kept while the job retries)."""
        return self._exc_info

    @property
    def is_finished(self) -> bool:
        return self.get_status() == "finished"

    @property
    def is_failed(self) -> bool:
        return self.get_status() == "failed"

    @property
    def is_queued(self) -> bool:
        return self.get_status() == "queued"

    @property
    def is_started(self) -> bool:
        return self.get_status() == "started"

    @property
    def is_scheduled(self) -> bool:
        return self.get_status() == "scheduled"

    @property
    def is_canceled(self) -> bool:
        return self.get_status() == "canceled"

    def save_meta(self) -> None:
        """Write ``job.meta`` (a job can report progress this way)."""
        self.broker._run(jobs_sql.HOST_JOB_SAVE_META, (json.dumps(self.meta), self.id))

    def cancel(self) -> bool:
        """Cancel a queued or scheduled job: it will not run. A job already
        running finishes, but its result is not recorded. False if it had ended."""
        from .control import cancel_host_job

        return cancel_host_job(self.broker, self.id)

    def requeue(self) -> None:
        """Run a failed job again (with its full retry policy)."""
        from .control import requeue_host_job

        requeue_host_job(self.broker, self.id)
        self._status = "queued"


def lock_job_meta(session: Any, job_id: str) -> dict[str, Any] | None:
    """A job's meta, its row locked in ``session``'s transaction (an update of
    the meta and the jobs it leads to then commit together); None for no such job."""
    row = session.connection().exec_driver_sql(jobs_sql.HOST_JOB_LOCK_META,
                                               (job_id,)).fetchone()
    return None if row is None else dict(row[0] or {})


def write_job_meta(session: Any, job_id: str, meta: dict[str, Any]) -> None:
    """Replace a job's meta in ``session``'s transaction, and keep its record
    one more result TTL (:func:`keep_job`)."""
    session.connection().exec_driver_sql(jobs_sql.HOST_JOB_SAVE_META,
                                         (json.dumps(meta), job_id))
    keep_job(session, job_id)


def keep_job(session: Any, job_id: str) -> None:
    """An ended job's record kept one more of its result TTL from now, in
    ``session``'s transaction (a job whose record others still read)."""
    session.connection().exec_driver_sql(jobs_sql.HOST_JOB_KEEP, (job_id,))


def get_current_job() -> Job | None:
    """RQ's ``get_current_job()``: the RQ-style job this worker thread is running
    (None elsewhere). Needs the app context a worker pushes around each job."""
    from ..queue.middleware.host_jobs import current_host_message

    message = current_host_message()
    if message is None:
        return None
    return Job.fetch(str(message.options["solidloop_job"]))


class FailedJobRegistry:
    """RQ's failed job registry: failed and dead-lettered jobs of one queue."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def get_job_ids(self) -> list[str]:
        return [row[0] for row in self.queue.broker._run(jobs_sql.HOST_JOB_FAILED_IDS,
                                                         (self.queue.name,))]

    @property
    def count(self) -> int:
        return len(self.get_job_ids())

    def __len__(self) -> int:
        return self.count

    def __contains__(self, job: object) -> bool:
        job_id = job.id if isinstance(job, Job) else job
        return job_id in self.get_job_ids()

    def __iter__(self) -> Iterator[str]:
        return iter(self.get_job_ids())

    def requeue(self, job_or_id: Job | str) -> None:
        from .control import requeue_host_job

        requeue_host_job(self.queue.broker, job_or_id.id if isinstance(job_or_id, Job)
                         else job_or_id)


def check_host_queue_name(name: Any) -> str:
    """Queue names of host jobs: dramatiq's rule, and not our reserved prefix."""
    check_queue_name(name)
    if name.startswith(RESERVED_QUEUE_PREFIX):
        raise InvalidJobError(
            f"queue name {name!r} is reserved: names starting with 'solidloop_' belong to "
            "flask-solidloop's own queues; pick another name (e.g. 'default')")
    return str(name)
