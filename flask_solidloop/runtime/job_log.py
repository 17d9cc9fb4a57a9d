"""One log line when a solidloop job ends, readable at INFO, and one when it
starts: at INFO for a job a consumer took off the queue, at DEBUG for a step
the thread continued inline.

``job start llm_turn loop=12 agent=support job=345 attempt=1`` and
``job done llm_turn loop=12 agent=support job=345 in 1.24s`` (or ``job failed
... in 0.31s: ProviderHTTPError``). The timestamp comes from the handler's
format (dramatiq's worker format has one). The ids are also passed as
``extra=`` fields (``solidloop_job``, ``solidloop_loop_id``,
``solidloop_agent``, ``solidloop_job_id``, ``solidloop_tool_call_id``,
``solidloop_duration_ms``, ``solidloop_outcome``, ``solidloop_inline``), so a
JSON formatter picks them up without parsing the message (docs/guides/workers.md
has a recipe). A job a thread ran inline after the loop's previous one (see
runtime/inline.py) says ``inline`` at the end of its lines.

Why the inline steps' start lines are DEBUG: they are most of a loop's steps
(every step after the first, on a loop that runs on its thread), a line
costs the worker about 0.1 ms of CPU under dramatiq's log pipe (its master
process copies every line), and four lines a turn were a tenth of a fast
turn's CPU in bench/turns.py. A queue's job is still seen when it starts;
a loop's progress is seen as its steps end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from ..queue.current_job import current_job
from ..telemetry import metrics

logger = logging.getLogger("flask_solidloop.jobs")


def _ids(kind: str, *, loop_id: int | None, agent: str | None,
         tool_call_id: int | None) -> dict[str, Any]:
    """The ids of a job's lines (the turn read its rows already: logging reads
    nothing)."""
    job = current_job()
    return {"solidloop_job": kind, "solidloop_loop_id": loop_id, "solidloop_agent": agent,
            "solidloop_tool_call_id": tool_call_id,
            "solidloop_job_id": job.job_id if job else None,
            "solidloop_attempt": job.attempts if job else None}


def _describe(ids: dict[str, Any]) -> str:
    parts = [ids["solidloop_job"]]
    for key, label in (("solidloop_loop_id", "loop"), ("solidloop_agent", "agent"),
                       ("solidloop_tool_call_id", "tool_call"), ("solidloop_job_id", "job")):
        if ids.get(key) is not None:
            parts.append(f"{label}={ids[key]}")
    return " ".join(parts)


@contextlib.contextmanager
def logged_job(kind: str, *, loop_id: int | None = None, agent: str | None = None,
               tool_call_id: int | None = None, inline: bool = False) -> Iterator[None]:
    """Log the start and the end (with its duration) of the job run inside.
    ``inline``: the thread that ran the loop's previous step continued with
    this one (runtime/inline.py); its lines say ``inline``, and its start line
    is DEBUG."""
    metrics.step(kind, inline)
    ids = _ids(kind, loop_id=loop_id, agent=agent, tool_call_id=tool_call_id)
    ids["solidloop_inline"] = inline
    what = _describe(ids)
    attempt = ids.get("solidloop_attempt")
    how = " inline" if inline else ""
    logger.log(logging.DEBUG if inline else logging.INFO, "job start %s%s%s", what,
               f" attempt={attempt}" if attempt else "", how, extra=ids)
    started = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        took = time.perf_counter() - started
        logger.info("job failed %s in %.2fs%s: %s", what, took, how, type(exc).__name__,
                    extra={**ids, "solidloop_duration_ms": round(took * 1000, 1),
                           "solidloop_outcome": "failed"})
        raise
    took = time.perf_counter() - started
    logger.info("job done %s in %.2fs%s", what, took, how,
                extra={**ids, "solidloop_duration_ms": round(took * 1000, 1),
                       "solidloop_outcome": "done"})
