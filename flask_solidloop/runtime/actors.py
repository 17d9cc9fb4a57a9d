"""Declare solidloop's actors on an app's broker: ids in, nothing returned."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.middleware import TimeLimit

from ..config import QUEUE_LLM, QUEUE_MAINTENANCE, QUEUE_TOOL
from ..state import SolidLoopState

#: Thirty days: effectively no dramatiq time limit for the solidloop actors.
NO_TIME_LIMIT_MS = 30 * 24 * 3600 * 1000


def declare_actors(state: SolidLoopState) -> dict[str, dramatiq.Actor]:
    """Bind llm_turn, tool_call, wait_timeout, maintenance and bulk_action to
    ``state.broker``."""
    from ..maintenance import run_maintenance
    from ..pipeline import watch_arrivals
    from .bulk import run_bulk_chunk
    from .inline import run_chain
    from .job_log import logged_job
    from .turns import llm_turn_job, run_adopted, tool_call_job, wait_timeout_job

    # The streaming turns of a worker hear a watcher's arrival (decision 0031).
    watch_arrivals.listen(state.broker)
    config = state.config
    common: dict[str, Any] = {"max_retries": config.job_max_retries, "min_backoff": 1000,
                              "max_backoff": 30000}
    if any(isinstance(m, TimeLimit) for m in state.broker.middleware):
        # dramatiq's TimeLimit kills a thread asynchronously, possibly mid-commit.
        # Turn length is bounded by our own leases and max_duration instead.
        common["time_limit"] = NO_TIME_LIMIT_MS

    def adopted_step(adopted: Any, adopt: bool) -> Any:
        return run_adopted(state, adopted, adopt)

    def llm_turn(loop_id: int) -> None:
        # Then the loop's next steps, inline (runtime/inline.py).
        run_chain(state, lambda adopt: llm_turn_job(state, loop_id, adopt=adopt), adopted_step)

    def tool_call(tool_call_id: int, execution_token: str,
                  reaper_lease_token: str | None = None) -> None:
        run_chain(state, lambda adopt: tool_call_job(
            state, tool_call_id, execution_token, reaper_lease_token, adopt=adopt),
            adopted_step)

    def wait_timeout(tool_call_id: int) -> None:
        wait_timeout_job(state, tool_call_id)

    def maintenance(task: str) -> None:
        with logged_job(f"maintenance {task}"):
            run_maintenance(state, task)

    def bulk_action(bulk_id: int) -> None:
        with logged_job(f"bulk action {bulk_id}"):
            run_bulk_chunk(state, bulk_id)

    broker = state.broker
    return {
        "llm_turn": dramatiq.Actor(llm_turn, broker=broker, actor_name="solidloop.llm_turn",
                                   queue_name=QUEUE_LLM, priority=0, options=dict(common)),
        "tool_call": dramatiq.Actor(tool_call, broker=broker, actor_name="solidloop.tool_call",
                                    queue_name=QUEUE_TOOL, priority=0, options=dict(common)),
        "wait_timeout": dramatiq.Actor(wait_timeout, broker=broker,
                                       actor_name="solidloop.wait_timeout",
                                       queue_name=QUEUE_TOOL, priority=0, options=dict(common)),
        "maintenance": dramatiq.Actor(maintenance, broker=broker,
                                      actor_name="solidloop.maintenance",
                                      queue_name=QUEUE_MAINTENANCE, priority=10,
                                      options=dict(common)),
        "bulk_action": dramatiq.Actor(bulk_action, broker=broker,
                                      actor_name="solidloop.bulk_action",
                                      queue_name=QUEUE_MAINTENANCE, priority=10,
                                      options=dict(common)),
    }
