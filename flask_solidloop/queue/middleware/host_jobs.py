"""Record the outcome of RQ-style host jobs on their ``solidloop_host_jobs`` row.

Only messages of the ``solidloop.job`` actor that carry a ``solidloop_job`` id
are touched. ``init_app`` places this middleware *before* dramatiq's
``Retries`` in the chain; since dramatiq runs ``after_*`` hooks in reverse
order, this one runs after Retries has decided whether the message will be
retried, and records the right outcome:

* success: ``finished``, with the return value (encoded like messages) and the
  expiry ``result_ttl`` gives it;
* failure that Retries re-enqueued: back to ``queued``, the traceback kept;
* failure for good (retries exhausted, or an error the job declares final):
  ``failed``, the traceback in ``exc_info``, expiry from ``failure_ttl``.

``started`` is never written: it is read from the delivery row a worker
holds (see the status view in queue/sql.py), which spares a write per job.
The job body hands its return value over with :func:`set_return_value`
rather than returning it, so dramatiq's Results middleware does not warn
about a discarded value.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback
from typing import Any

import dramatiq
from dramatiq.encoder import JSONEncoder

from .. import sql as jobs_sql
from ..broker import PostgresBroker

logger = logging.getLogger("flask_solidloop.jobs")

_local = threading.local()
_NOTHING = object()


def current_host_message() -> Any:
    """The host-job message this worker thread is processing (None outside one)."""
    return getattr(_local, "message", None)


def set_return_value(value: Any) -> None:
    """Called by the job body with the function's return value."""
    _local.result = value


def format_failure(exception: BaseException) -> str:
    """The traceback a job's ``exc_info`` shows: the original error, not the
    ``dramatiq.Retry`` the job body wraps it in to choose the retry delay."""
    if isinstance(exception, dramatiq.Retry) and exception.__cause__ is not None:
        exception = exception.__cause__
    return "".join(traceback.format_exception(exception))


def encode_value(value: Any) -> str | None:
    """A return value as JSON text for the JSONB column, or None (logged) when
    the encoder cannot represent it: the job still counts as finished."""
    encoder = dramatiq.get_encoder()
    try:
        data = encoder.encode(value)
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else str(data)
        if type(encoder) is not JSONEncoder:
            json.loads(text)
        return text
    except Exception as exc:
        logger.warning("a job's return value is not JSON-encodable and was not stored "
                       "(%s: %s); return ids or plain data instead", type(exc).__name__, exc)
        return None


def host_job_id(message: Any) -> str | None:
    if message.actor_name != jobs_sql.HOST_JOB_ACTOR:
        return None
    job_id = message.options.get("solidloop_job")
    return str(job_id) if job_id is not None else None


class HostJobMiddleware(dramatiq.Middleware):
    """Writes finished / failed / retrying on the host job row of each message."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if host_job_id(message) is not None:
            _local.message = message
            _local.result = _NOTHING

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *,
                              result: Any = None,
                              exception: BaseException | None = None) -> None:
        job_id = host_job_id(message)
        if job_id is None:
            return
        value = getattr(_local, "result", _NOTHING)
        _local.message = None
        _local.result = _NOTHING
        assert isinstance(broker, PostgresBroker)
        if exception is None:
            encoded = encode_value(None if value is _NOTHING else value)
            broker._run(jobs_sql.HOST_JOB_FINISH, {"id": job_id, "result": encoded})
        elif message.failed:
            broker._run(jobs_sql.HOST_JOB_FAIL, {"id": job_id,
                                                 "exc_info": format_failure(exception)})
        else:
            broker._run(jobs_sql.HOST_JOB_RETRYING, {"id": job_id,
                                                     "exc_info": format_failure(exception)})

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if host_job_id(message) is not None:
            _local.message = None
            _local.result = _NOTHING
