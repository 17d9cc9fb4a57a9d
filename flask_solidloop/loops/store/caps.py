"""Concurrency caps and fair ranks: a capped loop's admission before its first
turn (or its hold), and the fair rank a new loop is created with
(docs/decisions/0023-fair-shares.md).

A loop is *in flight* from its admission until it leaves running, waiting and
queued; while it is, ``capped_at`` is set and it counts against its agent's
``max_concurrent_loops`` and its subject's SOLIDLOOP_MAX_CONCURRENT_PER_SUBJECT.
A loop whose first turn finds a cap full is *held*: its job is marked done and
a new one written due SOLIDLOOP_HELD_LOOP_RECHECK later, and its thread goes
back to the queue. A held loop is woken by the database (the trigger
``solidloop_leave_flight``, migration 0016) in the commit that takes a loop of
its cap out of flight; the recheck is only the safety net.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._typing import SessionLike
from ...models import Loop
from .. import sql
from .transaction import commit_with_job_done, commits, fetch_row, fetch_rows, joins

if TYPE_CHECKING:
    from ...state import AgentLike, SolidLoopState

logger = logging.getLogger("flask_solidloop.store")


@dataclass(frozen=True)
class Caps:
    """The caps that apply to one loop: its agent's and its subject's (None: no cap)."""

    agent: int | None
    subject: int | None


def caps_for(state: SolidLoopState, agent: AgentLike, loop: Loop) -> Caps | None:
    """The caps a loop's turn must pass before it starts, or None when it need
    not ask: the loop is admitted already, or no cap applies to it. In memory:
    the loop row the turn read, the agent's option and the config."""
    if loop.capped_at is not None:
        return None
    agent_cap = agent.option("max_concurrent_loops")
    subject_cap = state.config.max_concurrent_per_subject if loop.subject_id is not None \
        else None
    if agent_cap is None and subject_cap is None:
        return None
    return Caps(agent_cap, subject_cap)


@commits
def admit(state: SolidLoopState, session: SessionLike, loop: Loop, caps: Caps) -> bool:
    """Admit the queued ``loop`` under its caps (True: its first turn may be
    claimed), or hold it (False): its running job is committed done with a new
    one due SOLIDLOOP_HELD_LOOP_RECHECK from now, which a loop of its caps
    leaving flight makes due at once. Rolls back what the session holds first
    (the turn's read). A loop that is no longer queued, or was admitted
    meanwhile, is left to the claim (True)."""
    session.rollback()
    params = {"loop_id": loop.id, "agent_name": loop.agent_name,
              "subject_type": loop.subject_type, "subject_id": loop.subject_id,
              "agent_cap": caps.agent, "subject_cap": caps.subject}
    fetch_rows(session, sql.CAP_LOCKS, params)
    row = fetch_row(session, sql.ADMIT, params)
    if row is None or row["held_by"] is None:
        session.commit()
        return True
    recheck_ms = int(state.config.held_loop_recheck * 1000)
    state.dispatch.llm_turn(session, loop.id, delay_ms=recheck_ms, first=True)
    commit_with_job_done(session)
    logger.info("loop %s held: its %s's cap (%s) is full", loop.id, row["held_by"],
                caps.agent if row["held_by"] == "agent" else caps.subject)
    return False


@joins
def fair_ranks(state: SolidLoopState, session: SessionLike,
               subjects: Sequence[tuple[str | None, str | None]]) -> list[int]:
    """The fair rank of each new loop of ``subjects`` (in order, one per loop):
    its subject's live loops (queued, running or waiting) plus the new loops of
    that subject before it in the list; 0 without a subject, and for every loop
    when fair shares are off (nothing is read then). In the caller's
    transaction, before the new loops are written."""
    if state.config.fair_share_quantum <= 0 or all(sid is None for _, sid in subjects):
        return [0] * len(subjects)
    distinct = list(dict.fromkeys(key for key in subjects if key[1] is not None))
    rows = fetch_rows(session, sql.LIVE_PER_SUBJECT, {
        "subject_types": [key[0] for key in distinct],
        "subject_ids": [key[1] for key in distinct]})
    live = {key: int(row[0]) for key, row in zip(distinct, rows, strict=True)}
    ranks = []
    for key in subjects:
        if key[1] is None:
            ranks.append(0)
            continue
        ranks.append(live[key])
        live[key] += 1
    return ranks
