"""The reaper's repairs."""

from __future__ import annotations

from .parts import HEAL_BATCH, HIDDEN_SET, QUEUED, REQUEUE_SET, RUNNING, WAITING, hide_shells

# -- the reaper's repairs ----------------------------------------------------------------
#
# Each selects its candidates with FOR UPDATE SKIP LOCKED and changes them in
# the same statement, so reapers racing on one loop resolve to one repair; the
# caller enqueues the jobs each repair implies in the same commit.

#: A loop has a live job.
_LIVE_JOB = ("EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = l.id "
             "AND j.state IN ('queued', 'running'))")
#: A job is already queued for the call (a reclaim waiting behind a backlog): it
#: adopts or re-claims the lease when it runs, so minting another would churn.
_LIVE_CALL_JOB = ("EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = t.loop_id "
                  "AND j.state IN ('queued', 'running') "
                  "AND j.actor_name = 'solidloop.tool_call' "
                  "AND j.message->'args'->>0 = t.id::text)")


def _expired_llm(columns: str) -> str:
    """Running loops whose LLM lease expired: ``columns`` of each."""
    return (f"SELECT {columns} FROM solidloop_loops l WHERE l.status = {RUNNING} "
            "AND l.lease_expires_at < now() ORDER BY l.lease_expires_at "
            f"LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")


#: What a lapsed LLM attempt left on record: the run's trace context, the agent,
#: the holder, when the turn was claimed (the loop's last write: renewals touch
#: only the lease) and when its lease lapsed.
_LAPSED_LLM = "l.id, l.trace, l.agent_name, l.lease_holder, l.updated_at, l.lease_expires_at"
#: Running loops whose LLM lease expired (HEAL_EXPIRED_LLM picks the same rows,
#: with what their lapsed attempts left on record).
EXPIRED_LLM = _expired_llm("l.id")
#: Tool phases with nothing left to answer and no live job.
STUCK_TOOL_PHASE = (
    f"SELECT l.id FROM solidloop_loops l WHERE l.status = {RUNNING} "
    "AND l.lease_expires_at IS NULL "
    "AND l.updated_at < now() - make_interval(secs => %(grace)s) "
    "AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls t WHERE t.loop_id = l.id "
    f"AND t.response_message_id IS NULL) AND NOT {_LIVE_JOB} "
    f"LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")
#: Queued loops with no live job (a dead-lettered one, say).
STUCK_QUEUED = (
    f"SELECT l.id FROM solidloop_loops l WHERE l.status = {QUEUED} "
    "AND l.queued_at < now() - make_interval(secs => %(grace)s) "
    f"AND NOT {_LIVE_JOB} LIMIT {HEAL_BATCH} FOR UPDATE SKIP LOCKED")


def _requeue_picked(picked: str) -> str:
    """Requeue the loops ``picked`` selects (their generation rotated away, their
    shells hidden) and return their ids."""
    return (f"WITH picked AS ({picked}), "
            f"requeued AS (UPDATE solidloop_loops l SET {REQUEUE_SET} FROM picked "
            "WHERE l.id = picked.id RETURNING l.id), "
            f"hidden AS ({hide_shells('SELECT id FROM requeued')}) "
            "SELECT id FROM requeued")


#: Expired LLM leases: the turn goes back to the queue. Each row also says what
#: the lapsed attempt left on record (_LAPSED_LLM), for its span.
HEAL_EXPIRED_LLM = (
    f"WITH picked AS ({_expired_llm(_LAPSED_LLM)}), "
    f"requeued AS (UPDATE solidloop_loops l SET {REQUEUE_SET} FROM picked "
    "WHERE l.id = picked.id RETURNING l.id), "
    f"hidden AS ({hide_shells('SELECT id FROM requeued')}) "
    "SELECT p.id, p.trace, p.agent_name, p.lease_holder, p.updated_at, p.lease_expires_at "
    "FROM picked p JOIN requeued r ON r.id = p.id")
#: A tool phase with nothing left to answer: the next LLM turn.
HEAL_STUCK_TOOL_PHASE = _requeue_picked(STUCK_TOOL_PHASE)
#: Queued loops with no live job: touched (their age starts over) for a new job.
HEAL_STUCK_QUEUED = (
    f"WITH picked AS ({STUCK_QUEUED}) "
    "UPDATE solidloop_loops l SET updated_at = now(), queued_at = now() FROM picked "
    "WHERE l.id = picked.id RETURNING l.id")
#: Unexecuted calls whose lease lapsed while their loop runs: a fresh lease
#: (compare-and-set on the old one) for a new job, so healthy siblings are not
#: fenced, and one more lapsed run counted (SOLIDLOOP_TOOL_MAX_ATTEMPTS) when a
#: worker held the lapsed lease (a lease the reaper minted has no holder until a
#: worker claims it: one that lapsed unclaimed ran nothing). Returns each call's
#: id, loop, new lease and the loop's generation.
HEAL_STALLED_TOOLS = (
    "WITH picked AS (SELECT t.id, t.lease_token, t.loop_id, l.execution_token, "
    "t.name, t.call_id, t.lease_holder, t.updated_at, t.leased_until, l.trace, l.agent_name "
    "FROM solidloop_tool_calls t JOIN solidloop_loops l ON l.id = t.loop_id "
    "WHERE t.response_message_id IS NULL AND t.executed_at IS NULL "
    "AND t.lease_token IS NOT NULL AND t.leased_until < now() "
    f"AND l.status = {RUNNING} AND NOT {_LIVE_CALL_JOB} "
    f"ORDER BY t.leased_until LIMIT {HEAL_BATCH} FOR UPDATE OF l SKIP LOCKED), "
    "minted AS (UPDATE solidloop_tool_calls t SET lease_token = gen_random_uuid(), "
    "lease_holder = NULL, updated_at = now(), leased_until = now() + %(ttl)s, "
    "lapsed_runs = t.lapsed_runs + (t.lease_holder IS NOT NULL)::int "
    "FROM picked WHERE t.id = picked.id AND t.lease_token = picked.lease_token "
    "AND t.executed_at IS NULL RETURNING t.id, t.lease_token) "
    "SELECT minted.id, picked.loop_id, minted.lease_token, picked.execution_token, "
    "picked.name, picked.call_id, picked.lease_holder, picked.updated_at, "
    "picked.leased_until, picked.trace, picked.agent_name "
    "FROM minted JOIN picked ON picked.id = minted.id ORDER BY minted.id")
#: Calls of a running tool phase that nobody holds (no lease, or executed and
#: waiting for its answer) while the loop has no live job at all: their job was
#: lost. A sibling running under a live lease means the phase is in hand (in
#: sequential mode the calls behind the head wait for it by design); a call that
#: awaits a decision or a result has no job by design.
DROPPED_TOOLS = (
    "SELECT t.id, t.loop_id, l.execution_token "
    "FROM solidloop_tool_calls t JOIN solidloop_loops l ON l.id = t.loop_id "
    "WHERE t.response_message_id IS NULL "
    "AND (t.lease_token IS NULL OR t.executed_at IS NOT NULL) "
    "AND NOT (t.waits_for IS NOT NULL AND t.decision IS NULL) "
    f"AND l.status = {RUNNING} AND l.lease_expires_at IS NULL "
    "AND t.updated_at < now() - make_interval(secs => %(grace)s) "
    f"AND NOT {_LIVE_JOB} "
    "AND NOT EXISTS (SELECT 1 FROM solidloop_tool_calls s WHERE s.loop_id = t.loop_id "
    "AND s.response_message_id IS NULL AND s.executed_at IS NULL "
    "AND s.lease_token IS NOT NULL AND s.leased_until >= now()) "
    f"ORDER BY t.loop_id, t.position LIMIT {HEAL_BATCH} FOR UPDATE OF l SKIP LOCKED")
#: Waits past their deadline whose timeout job is gone (dead-lettered, deleted)
#: while their loop runs or waits: the caller enqueues a timeout job again.
EXPIRED_WAITS = (
    "SELECT t.id, t.loop_id FROM solidloop_tool_calls t "
    "JOIN solidloop_loops l ON l.id = t.loop_id "
    "WHERE t.waits_for IS NOT NULL AND t.decision IS NULL "
    "AND t.wait_deadline < now() - make_interval(secs => %(grace)s) "
    f"AND t.response_message_id IS NULL AND l.status IN ({RUNNING}, {WAITING}) "
    "AND NOT EXISTS (SELECT 1 FROM solidloop_jobs j WHERE j.loop_id = t.loop_id "
    "AND j.state IN ('queued', 'running') AND j.actor_name = 'solidloop.wait_timeout' "
    "AND j.message->'args'->>0 = t.id::text) "
    f"ORDER BY t.wait_deadline LIMIT {HEAL_BATCH} FOR UPDATE OF l SKIP LOCKED")
#: A dropped call about to get a new job: its age starts over.
TOUCH_CALLS = ("UPDATE solidloop_tool_calls SET updated_at = now() "
               "WHERE id = ANY(%(call_ids)s::bigint[])")
#: ``processing`` shells of loops that are not running: failed and hidden. The
#: loops' rows are locked first, as every history writer's are (a shell's end is
#: an event of its loop's stream, drawn under that lock); a loop busy elsewhere
#: is left for the next pass.
HEAL_ORPHAN_SHELLS = (
    f"UPDATE solidloop_messages m SET {HIDDEN_SET} "
    "WHERE m.id IN (SELECT m2.id FROM solidloop_messages m2 "
    "JOIN solidloop_loops l ON l.id = m2.loop_id "
    f"WHERE m2.status = 'processing' AND l.status <> {RUNNING} LIMIT {HEAL_BATCH} "
    "FOR UPDATE OF l SKIP LOCKED) RETURNING m.id")
