"""The reaper: finds loops that lost their worker and puts them back on their feet.

Idempotent and safe to run from any number of processes at once: every case
selects candidates with ``FOR UPDATE SKIP LOCKED`` (or re-checks its condition
under the loop row lock) and changes rows with a compare-and-set, so two
reapers racing on one loop resolve to one repair. Each repair and the job it
implies commit together, like every other transition.

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
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import text

if TYPE_CHECKING:
    from ..extension import SolidLoopState

logger = logging.getLogger("flask_solidloop.reaper")

BATCH = 500

_LIVE_JOB = (
    "EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = l.id "
    "AND j.state IN ('queued', 'running'))"
)

_EXPIRED_LLM = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'running' AND l.lease_expires_at < now()
 ORDER BY l.lease_expires_at
 LIMIT {BATCH}
 FOR UPDATE SKIP LOCKED
"""

# A job already queued for the call (a reclaim waiting behind a backlog) will
# adopt or re-claim the lease when it runs: minting yet another one would only
# churn, so such calls are left alone.
_LIVE_TOOL_JOB = (
    "EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = t.loop_id "
    "AND j.state IN ('queued', 'running') AND j.actor_name = 'solidloop.tool_call' "
    "AND j.message->'args'->>0 = t.id::text)"
)

_STALLED_TOOLS = f"""
SELECT t.id, t.lease_token, t.loop_id, l.execution_token
  FROM solidloop_tool_calls t
  JOIN solidloop_loops l ON l.id = t.loop_id
 WHERE t.response_message_id IS NULL AND t.executed_at IS NULL
   AND t.lease_token IS NOT NULL AND t.leased_until < now()
   AND l.status = 'running'
   AND NOT {_LIVE_TOOL_JOB}
 ORDER BY t.leased_until
 LIMIT {BATCH}
 FOR UPDATE OF l SKIP LOCKED
"""

# A tool call nobody holds (no lease, or executed and waiting for its answer)
# while its loop has no live job at all: its job was lost.
_DROPPED_TOOLS = f"""
SELECT t.id, t.loop_id, l.execution_token
  FROM solidloop_tool_calls t
  JOIN solidloop_loops l ON l.id = t.loop_id
 WHERE t.response_message_id IS NULL
   AND (t.lease_token IS NULL OR t.executed_at IS NOT NULL)
   AND l.status = 'running' AND l.lease_expires_at IS NULL
   AND t.updated_at < now() - make_interval(secs => :grace)
   AND NOT {_LIVE_JOB}
 ORDER BY t.id
 LIMIT {BATCH}
 FOR UPDATE OF l SKIP LOCKED
"""

_STUCK_TOOL_PHASE = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'running' AND l.lease_expires_at IS NULL
   AND l.updated_at < now() - make_interval(secs => :grace)
   AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls t
                    WHERE t.loop_id = l.id AND t.response_message_id IS NULL)
   AND NOT {_LIVE_JOB}
 LIMIT {BATCH}
 FOR UPDATE SKIP LOCKED
"""

_STUCK_QUEUED = f"""
SELECT l.id FROM solidloop_loops l
 WHERE l.status = 'queued'
   AND l.updated_at < now() - make_interval(secs => :grace)
   AND NOT {_LIVE_JOB}
 LIMIT {BATCH}
 FOR UPDATE SKIP LOCKED
"""

_ORPHAN_SHELLS = f"""
UPDATE solidloop_messages m SET status = 'failed', is_hidden = true, updated_at = now()
 WHERE m.id IN (SELECT m2.id FROM solidloop_messages m2
                  JOIN solidloop_loops l ON l.id = m2.loop_id
                 WHERE m2.status = 'processing' AND l.status <> 'running'
                 LIMIT {BATCH})
RETURNING m.id
"""


@dataclass
class ReapReport:
    expired_llm: list[int] = field(default_factory=list)
    stalled_tools: list[int] = field(default_factory=list)
    dropped_tools: list[int] = field(default_factory=list)
    stuck_tool_phase: list[int] = field(default_factory=list)
    stuck_queued: list[int] = field(default_factory=list)
    orphan_shells: list[int] = field(default_factory=list)
    expired_jobs: int = 0
    duration_ms: float = 0.0

    @property
    def healed(self) -> int:
        return (len(self.expired_llm) + len(self.stalled_tools) + len(self.dropped_tools)
                + len(self.stuck_tool_phase) + len(self.stuck_queued)
                + len(self.orphan_shells) + self.expired_jobs)

    def summary(self) -> str:
        parts = [f"{name}={len(value) if isinstance(value, list) else value}"
                 for name, value in vars(self).items() if name != "duration_ms"]
        return ", ".join(parts) + f" ({self.duration_ms:.1f} ms)"


def reap(state: SolidLoopState) -> ReapReport:
    """One reaper pass over every case. Commits per case; returns what it healed."""
    started = time.perf_counter()
    report = ReapReport()
    session = state.db.session
    dispatch = state.dispatch
    grace = float(state.config.lease_margin)
    try:
        report.expired_jobs = state.broker.recover_expired()

        ids = list(session.execute(text(_EXPIRED_LLM)).scalars())
        for loop_id in ids:
            session.execute(text(
                "UPDATE solidloop_loops SET status = 'queued', execution_token = NULL, "
                "lease_expires_at = NULL, updated_at = now() WHERE id = :id"), {"id": loop_id})
            session.execute(text(
                "UPDATE solidloop_messages SET status = 'failed', is_hidden = true, "
                "updated_at = now() WHERE loop_id = :id AND status = 'processing'"),
                {"id": loop_id})
            dispatch.llm_turn(session, loop_id)
        session.commit()
        report.expired_llm = ids

        rows = session.execute(text(_STALLED_TOOLS)).all()
        for call_id, old_lease, loop_id, token in rows:
            new_lease = uuid.uuid4()
            lease = state.config.tool_lease_seconds(_http_timeouts(state, loop_id))
            claimed = session.execute(text(
                "UPDATE solidloop_tool_calls SET lease_token = :new, updated_at = now(), "
                "leased_until = now() + :lease WHERE id = :id AND lease_token = :old "
                "AND executed_at IS NULL"),
                {"new": new_lease, "lease": timedelta(seconds=lease), "id": call_id,
                 "old": old_lease}).rowcount  # type: ignore[attr-defined]
            if claimed:
                dispatch.tool_call(session, call_id, token, loop_id=loop_id,
                                   reaper_lease_token=new_lease)
                report.stalled_tools.append(call_id)
        session.commit()

        rows = session.execute(text(_DROPPED_TOOLS), {"grace": grace}).all()
        for call_id, loop_id, token in rows:
            session.execute(text("UPDATE solidloop_tool_calls SET updated_at = now() "
                                 "WHERE id = :id"), {"id": call_id})
            dispatch.tool_call(session, call_id, token, loop_id=loop_id)
            report.dropped_tools.append(call_id)
        session.commit()

        ids = list(session.execute(text(_STUCK_TOOL_PHASE), {"grace": grace}).scalars())
        for loop_id in ids:
            session.execute(text(
                "UPDATE solidloop_loops SET status = 'queued', execution_token = NULL, "
                "updated_at = now() WHERE id = :id"), {"id": loop_id})
            dispatch.llm_turn(session, loop_id)
        session.commit()
        report.stuck_tool_phase = ids

        ids = list(session.execute(
            text(_STUCK_QUEUED), {"grace": float(state.config.queued_reap_threshold)}).scalars())
        for loop_id in ids:
            session.execute(text("UPDATE solidloop_loops SET updated_at = now() WHERE id = :id"),
                            {"id": loop_id})
            dispatch.llm_turn(session, loop_id)
        session.commit()
        report.stuck_queued = ids

        report.orphan_shells = list(session.execute(text(_ORPHAN_SHELLS)).scalars())
        session.commit()
    except Exception:
        session.rollback()
        raise
    report.duration_ms = (time.perf_counter() - started) * 1000
    state.last_reaped_at = time.time()
    if report.healed:
        logger.warning("reaper healed: %s", report.summary())
    else:
        logger.debug("reaper: nothing to heal (%.1f ms)", report.duration_ms)
    return report


def _http_timeouts(state: SolidLoopState, loop_id: int) -> list[float]:
    from ..loops.turns import agent_http_timeouts
    from ..models import Loop

    loop = state.db.session.get(Loop, loop_id)
    try:
        return agent_http_timeouts(state.agent_for(loop.agent_name, loop)) if loop else []
    except Exception:
        return []
