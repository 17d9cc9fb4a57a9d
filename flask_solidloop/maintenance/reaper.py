"""The reaper: finds loops that lost their worker and puts them back on their feet.

Idempotent and safe to run from any number of processes at once: every case
selects candidates with ``FOR UPDATE SKIP LOCKED`` (or re-checks its condition
under the loop row lock) and changes rows with a compare-and-set, so two
reapers racing on one loop resolve to one repair. Each repair and the job it
implies commit together, like every other transition. The repairs themselves
are the ``heal_*`` transitions of loops/store/heals.py; this module orders them,
reports what they did, and owns nothing else.

Cases, in the order one pass runs them (after first returning broker jobs
with expired leases to their queue, case 7):

1. ``expired_llm``: a running loop whose LLM lease expired (its worker died or
   its renewer lost the lease). The generation is rotated away (token cleared,
   status queued), any ``processing`` shell is failed and hidden, and a new
   llm_turn job is enqueued.
2. ``stalled_tools``: an unexecuted tool call whose per-call lease expired. The
   reaper mints a fresh lease (CAS on the old token) and hands it to a new
   tool job, so its healthy siblings are not fenced.
3. ``dropped_tools``: a tool call of a running tool phase that nobody holds
   and no live job will run: never claimed (its job was lost), or executed but
   never answered (the continuation was dropped). A new tool job is enqueued;
   the executed_at checkpoint keeps the tool body from running twice.
4. ``stuck_tool_phase``: a running loop in its tool phase with nothing left to
   answer and no live job: queued for its next LLM turn.
5. ``stuck_queued``: a queued loop with no live job in the job table (for
   example its job was dead-lettered). A new llm_turn job is enqueued.
6. ``orphan_shells``: ``processing`` assistant shells on loops that are not
   running: failed and hidden, so a partial never enters the history.
7. ``expired_jobs``: broker jobs whose holder stopped renewing: back to queued,
   or dead after too many deliveries.
8. ``expired_waits``: a tool call of a running or waiting loop whose wait is
   past its deadline with no live timeout job (it was dead-lettered or
   deleted): a new wait_timeout job, which decides the wait as its tool says.

A call that awaits a decision or a result has no job and no lease by design:
``dropped_tools`` and ``stalled_tools`` leave it alone, and a ``waiting`` loop
is not ``running``, so the LLM and tool-phase cases never touch it.

Each pass, successful or not, ends with one upsert of the ``reap`` row of
solidloop_maintenance_runs (maintenance/runs.py), which the admin shows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import SolidLoopError
from ..loops import queries, store
from ..state import SolidLoopState
from ..telemetry import metrics
from . import runs

logger = logging.getLogger("flask_solidloop.reaper")


@dataclass
class ReapReport:
    expired_llm: list[int] = field(default_factory=list)
    stalled_tools: list[int] = field(default_factory=list)
    dropped_tools: list[int] = field(default_factory=list)
    stuck_tool_phase: list[int] = field(default_factory=list)
    stuck_queued: list[int] = field(default_factory=list)
    orphan_shells: list[int] = field(default_factory=list)
    expired_waits: list[int] = field(default_factory=list)
    expired_jobs: int = 0
    duration_ms: float = 0.0

    @property
    def healed(self) -> int:
        return (len(self.expired_llm) + len(self.stalled_tools) + len(self.dropped_tools)
                + len(self.stuck_tool_phase) + len(self.stuck_queued)
                + len(self.orphan_shells) + len(self.expired_waits) + self.expired_jobs)

    def counts(self) -> dict[str, int]:
        """How many of each case this pass healed (what its record stores)."""
        return {name: len(value) if isinstance(value, list) else int(value)
                for name, value in vars(self).items() if name != "duration_ms"}

    def summary(self) -> str:
        parts = [f"{name}={count}" for name, count in self.counts().items()]
        return ", ".join(parts) + f" ({self.duration_ms:.1f} ms)"


def reap(state: SolidLoopState) -> ReapReport:
    """One reaper pass over every case. Commits per case; returns what it healed."""
    started = time.perf_counter()
    report = ReapReport()
    session = state.db.session
    grace = float(state.config.lease_margin)
    try:
        report.expired_jobs = state.broker.recover_expired()
        report.expired_llm = store.heal_expired_llm(state, session)
        report.stalled_tools = store.heal_stalled_tools(
            state, session, lease_seconds=state.config.liveness_ttl)
        report.dropped_tools = store.heal_dropped_tools(
            state, session, grace=grace, sequential=lambda loop_id: _sequential(state, loop_id))
        report.stuck_tool_phase = store.heal_stuck_tool_phase(state, session, grace=grace)
        report.stuck_queued = store.heal_stuck_queued(
            state, session, threshold=float(state.config.queued_reap_threshold))
        report.orphan_shells = store.heal_orphan_shells(session)
        report.expired_waits = store.heal_expired_waits(state, session, grace=grace)
    except Exception as exc:
        session.rollback()
        report.duration_ms = (time.perf_counter() - started) * 1000
        runs.record(state, "reap", duration_ms=report.duration_ms, total=report.healed,
                    counts=report.counts(), error=exc)
        raise
    report.duration_ms = (time.perf_counter() - started) * 1000
    state.last_reaped_at = time.time()
    runs.record(state, "reap", duration_ms=report.duration_ms, total=report.healed,
                counts=report.counts())
    metrics.reaper_pass(report.counts())
    if report.healed:
        logger.warning("reaper healed: %s", report.summary())
    else:
        logger.debug("reaper: nothing to heal (%.1f ms)", report.duration_ms)
    return report


def _sequential(state: SolidLoopState, loop_id: int) -> bool:
    """Whether the loop's agent runs its tool calls one at a time (False when
    the agent is not registered here: healing every call is the safe side)."""
    loop = queries.get_loop(state.db.session, loop_id)
    try:
        agent = state.agent_for(loop.agent_name, loop) if loop is not None else None
    except SolidLoopError:
        return False
    return bool(agent is not None and agent.option("sequential_tool_calls"))
