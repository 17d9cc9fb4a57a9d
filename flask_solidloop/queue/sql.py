"""Every SQL statement the broker runs on ``solidloop_jobs``, each written once.

The broker, the consumer, the current-job helper, the in-process drain and
the reaper's job recovery all take their statements from here (procrastinate
keeps its queries in one file for the same reason: one place to review what
the queue does to the table, and to EXPLAIN it). Parameters use psycopg's
``%(name)s`` / ``%s`` style: these run on raw psycopg connections, or on the
DBAPI connection underneath a caller's SQLAlchemy session.
"""

from __future__ import annotations

#: Prefix of the NOTIFY channel of each queue (``solidloop_q_<queue>``).
CHANNEL_PREFIX = "solidloop_q_"
#: Prefix of a process listener's own control channel (``solidloop_listener_<hex>``),
#: poked to make it LISTEN on a new queue or stop (queue/listener.py).
LISTENER_CHANNEL_PREFIX = "solidloop_listener_"
#: The channels the current session LISTENs on, as PostgreSQL reports them.
LISTENING = "SELECT pg_listening_channels()"

#: A job's due time, from an absolute ``eta`` or a ``delay`` in seconds.
_DUE = "coalesce(%(eta)s::timestamptz, now() + make_interval(secs => %(delay)s))"
#: A loop's job's place in the claim order (fair shares, decision 0023): its due
#: time moved back by its loop's fair rank x ``quantum`` seconds; NULL (its due
#: time) for a job of no loop, and when fairness is off (the rank is not read).
_FAIR_AT = ("CASE WHEN %(quantum)s::float8 > 0 THEN {due} + make_interval(secs => "
            "%(quantum)s::float8 * (SELECT l.fair_rank FROM solidloop_loops l "
            "WHERE l.id = {loop_id})) END")
INSERT = (
    "INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, eta, fair_at, "
    "loop_id, tier) "
    "VALUES (%(queue_name)s, %(actor_name)s, %(message_id)s, %(message)s, " + _DUE + ", "
    + _FAIR_AT.format(due=_DUE, loop_id="%(loop_id)s::bigint") + ", %(loop_id)s, "
    "%(tier)s) "
    "RETURNING id"
)
#: The insert plus its wake-up. NOTIFY is transactional: a rollback sends nothing.
INSERT_AND_NOTIFY = (
    "WITH job AS (" + INSERT + ") "
    "SELECT job.id, pg_notify(%(channel)s, '') FROM job"
)
NOTIFY = "SELECT pg_notify(%s, '')"
#: Many jobs of one actor at once, due now, and one wake-up for them all
#: (a bulk start: one statement and one NOTIFY, not one of each per job).
INSERT_MANY_AND_NOTIFY = (
    "WITH job AS (INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, "
    "eta, fair_at, loop_id, tier) SELECT %(queue_name)s, %(actor_name)s, message_id, "
    "message::jsonb, now(), " + _FAIR_AT.format(due="now()", loop_id="t.loop_id") + ", "
    "loop_id, %(tier)s FROM unnest(%(message_ids)s::uuid[], %(messages)s::text[], "
    "%(loop_ids)s::bigint[]) AS t(message_id, message, loop_id) RETURNING 1) "
    "SELECT count(*), pg_notify(%(channel)s, '') FROM job"
)

#: Claim order: continuation-first's tier, then the job's fair place (its due
#: time, moved back by its loop's rank: fair shares), then age. The claim index
#: (``ix_solidloop_jobs_claim``) is that order over queued rows.
CLAIM = """
UPDATE solidloop_jobs AS j
   SET state = 'running', lease_token = gen_random_uuid(),
       lease_until = now() + make_interval(secs => %(lease)s),
       attempts = j.attempts + 1, started_at = now()
  FROM (SELECT id FROM solidloop_jobs
         WHERE queue_name = %(queue)s AND state = 'queued' AND eta <= now()
         ORDER BY tier, coalesce(fair_at, eta), id
         LIMIT %(limit)s
         FOR UPDATE SKIP LOCKED) AS due
 WHERE j.id = due.id
RETURNING j.id, j.lease_token, j.message, j.attempts
"""
#: A due job no consumer of these queues has claimed (inline continuation asks
#: before it yields its thread at the end of its hop budget).
WORK_WAITING = (
    "SELECT EXISTS (SELECT 1 FROM solidloop_jobs WHERE queue_name = ANY(%s) "
    "AND state = 'queued' AND eta <= now())")
NEXT_ETA = (
    "SELECT EXTRACT(EPOCH FROM (min(eta) - now())) FROM solidloop_jobs "
    "WHERE queue_name = %s AND state = 'queued'"
)
#: The ack, and an actor marking its own job done inside its state change's
#: transaction: fenced on the lease token, so a stale holder changes nothing.
MARK_DONE = (
    "UPDATE solidloop_jobs SET state = 'done', finished_at = now(), lease_until = NULL "
    "WHERE id = %s AND lease_token = %s AND state = 'running'"
)
#: :data:`MARK_DONE` as a part of a larger statement: named parameters, and the
#: statement's own condition in place of ``{condition}``.
MARK_DONE_WHEN = (
    "UPDATE solidloop_jobs SET state = 'done', finished_at = now(), lease_until = NULL "
    "WHERE id = %(job_id)s AND lease_token = %(job_lease)s AND state = 'running' {condition}"
)
NACK = (
    "UPDATE solidloop_jobs SET state = 'dead', finished_at = now(), lease_until = NULL, "
    "last_error = %s WHERE id = %s AND lease_token = %s AND state = 'running'"
)
#: A claim handed back (never run: a lapsed claim, a stopping worker), and the
#: wake-up of its queue's consumers, who look at the table only when notified.
REQUEUE_AND_NOTIFY = (
    "WITH job AS (UPDATE solidloop_jobs SET state = 'queued', lease_token = NULL, "
    "lease_until = NULL, attempts = greatest(attempts - 1, 0) "
    "WHERE id = %(id)s AND lease_token = %(lease_token)s AND state = 'running' RETURNING 1) "
    "SELECT pg_notify(%(channel)s, '') FROM job"
)
# Fenced on the lease token too: a consumer whose job was redelivered to
# another holder must not keep extending the new holder's lease.
RENEW = (
    "UPDATE solidloop_jobs AS j SET lease_until = now() + make_interval(secs => %s) "
    "FROM unnest(%s::bigint[], %s::uuid[]) AS h(id, lease_token) "
    "WHERE j.id = h.id AND j.lease_token = h.lease_token AND j.state = 'running'"
)
# A job whose holder died returns to the queue; one that has been delivered
# max_deliveries times without an ack is presumed poisonous and dead-lettered.
# The same statement applies continuation-first's starvation bound, given
# ``promote_after``, so a recovery pass is one transaction.
RECOVER = """
WITH expired AS (
    SELECT id FROM solidloop_jobs
     WHERE state = 'running' AND lease_until < now()
     ORDER BY lease_until
     LIMIT 1000
     FOR UPDATE SKIP LOCKED
), recovered AS (
    UPDATE solidloop_jobs AS j
       SET state = CASE WHEN j.attempts >= %(max_deliveries)s THEN 'dead' ELSE 'queued' END,
           finished_at = CASE WHEN j.attempts >= %(max_deliveries)s THEN now() END,
           last_error = 'job lease expired: the worker holding it stopped acknowledging',
           lease_token = NULL, lease_until = NULL
      FROM expired WHERE j.id = expired.id
    RETURNING j.id, j.queue_name, j.state
), promoted AS (
    -- Continuation-first's starvation bound: a tier-1 job (a new loop's first
    -- turn, a host job) that has waited promote_after seconds joins tier 0,
    -- where age decides. None when promote_after is NULL.
    UPDATE solidloop_jobs SET tier = 0
     WHERE %(promote_after)s::float8 IS NOT NULL AND state = 'queued' AND tier = 1
       AND eta < now() - make_interval(secs => %(promote_after)s::float8)
)
SELECT id, queue_name, state FROM recovered
"""
#: A force-stopped loop's queued jobs are done, with the reason kept.
CANCEL_LOOP_JOBS = (
    "UPDATE solidloop_jobs SET state = 'done', finished_at = now(), last_error = %s "
    "WHERE loop_id = %s AND state = 'queued'"
)
FLUSH = "DELETE FROM solidloop_jobs WHERE queue_name = %s AND state = 'queued'"
LIVE_COUNT = (
    "SELECT count(*) FROM solidloop_jobs WHERE queue_name = %s "
    "AND state IN ('queued', 'running')"
)

# -- host jobs (flask_solidloop.jobs): RQ-style job records ----------------------

#: The actor that runs every RQ-style job (``q.enqueue(f, ...)``): its message
#: carries the function's import path, the arguments, and the RQ job id in the
#: ``solidloop_job`` option. A partial index finds its rows by message id.
HOST_JOB_ACTOR = "solidloop.job"

_HOST_JOB_INSERT = (
    "INSERT INTO solidloop_host_jobs (id, message_id, queue_name, func_name, description, "
    "status, meta, result_ttl, failure_ttl) VALUES (%(id)s, %(message_id)s::uuid, "
    "%(queue_name)s, %(func_name)s, %(description)s, %(status)s, %(meta)s::jsonb, "
    "%(result_ttl)s, %(failure_ttl)s) "
    # A taken job id must not abort the caller's transaction: report it instead.
    "ON CONFLICT (id) DO NOTHING RETURNING id"
)
#: The job record and its first delivery in one statement: both or neither (a
#: taken job id inserts nothing), so a caller's transaction never holds half a job.
_HOST_JOB_ENQUEUE = (
    "WITH h AS (" + _HOST_JOB_INSERT + "), job AS ("
    "INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, eta) "
    "SELECT %(queue_name)s, %(actor_name)s, %(message_id)s::uuid, %(message)s::jsonb, "
    "coalesce(%(eta)s::timestamptz, now() + make_interval(secs => %(delay)s)) FROM h "
    "RETURNING id) "
)
HOST_JOB_ENQUEUE_AND_NOTIFY = (
    _HOST_JOB_ENQUEUE + "SELECT job.id, pg_notify(%(channel)s, '') FROM job"
)
HOST_JOB_FINISH = (
    "UPDATE solidloop_host_jobs SET status = 'finished', result = %(result)s, exc_info = NULL, "
    "ended_at = now(), expires_at = now() + make_interval(secs => result_ttl) "
    "WHERE id = %(id)s AND status <> 'canceled'"
)
HOST_JOB_FAIL = (
    "UPDATE solidloop_host_jobs SET status = 'failed', exc_info = %(exc_info)s, "
    "ended_at = now(), expires_at = now() + make_interval(secs => failure_ttl) "
    "WHERE id = %(id)s AND status <> 'canceled'"
)
#: A failed attempt that dramatiq's Retries re-enqueued: the job is live again.
HOST_JOB_RETRYING = (
    "UPDATE solidloop_host_jobs SET status = 'queued', exc_info = %(exc_info)s "
    "WHERE id = %(id)s AND status <> 'canceled'"
)
HOST_JOB_SAVE_META = "UPDATE solidloop_host_jobs SET meta = %s WHERE id = %s"
HOST_JOB_LOCK_META = "SELECT meta FROM solidloop_host_jobs WHERE id = %s FOR UPDATE"
#: A job's record kept one more of its result TTL from now (an ended job only).
HOST_JOB_KEEP = ("UPDATE solidloop_host_jobs SET expires_at = now() + make_interval(secs => "
                 "result_ttl) WHERE id = %s AND expires_at IS NOT NULL")

#: A host job with its latest delivery (one row of solidloop_jobs per attempt).
#: Live statuses come from that row: a running row is RQ's ``started``, a queued
#: one due later is ``scheduled``, a dead-lettered one is ``failed``; finished,
#: failed and canceled are recorded on the job itself.
_HOST_JOB_VIEW = """
SELECT h.id, h.queue_name, h.func_name, h.description, h.meta, h.result, h.exc_info,
       h.created_at, h.ended_at, j.id AS row_id, j.state, j.eta, j.started_at, j.message,
       j.attempts, j.last_error,
       CASE WHEN h.status IN ('finished', 'failed', 'canceled') THEN h.status
            WHEN j.state = 'dead' THEN 'failed'
            WHEN j.state = 'running' THEN 'started'
            WHEN j.state = 'queued' AND j.eta > now() THEN 'scheduled'
            WHEN j.state = 'queued' THEN 'queued'
            ELSE h.status END AS status
  FROM solidloop_host_jobs AS h
  LEFT JOIN LATERAL (
        SELECT * FROM solidloop_jobs
         WHERE actor_name = 'solidloop.job' AND message_id = h.message_id
         ORDER BY id DESC LIMIT 1) AS j ON true
"""
HOST_JOB_FETCH = _HOST_JOB_VIEW + " WHERE h.id = %s"
#: RQ's failed job registry: failed jobs, and live ones whose delivery was dead-lettered.
HOST_JOB_FAILED_IDS = (
    "SELECT id FROM (" + _HOST_JOB_VIEW + " WHERE h.queue_name = %s "
    "AND h.status IN ('failed', 'queued', 'scheduled')) AS v "
    "WHERE status = 'failed' ORDER BY created_at, id"
)
HOST_JOB_COUNT_LIVE = (
    "SELECT count(*) FROM solidloop_jobs WHERE queue_name = %s AND state = 'queued'"
)
#: Cancel a job that has not finished: its queued deliveries are closed too.
HOST_JOB_CANCEL = """
WITH h AS (
    UPDATE solidloop_host_jobs SET status = 'canceled', ended_at = now(),
           expires_at = now() + make_interval(secs => failure_ttl)
     WHERE id = %(id)s AND status IN ('queued', 'scheduled')
 RETURNING message_id
), j AS (
    UPDATE solidloop_jobs AS j SET state = 'done', finished_at = now(),
           last_error = %(reason)s
      FROM h WHERE j.actor_name = 'solidloop.job' AND j.message_id = h.message_id
       AND j.state = 'queued'
 RETURNING j.id
)
SELECT (SELECT count(*) FROM h), (SELECT count(*) FROM j)
"""
#: Requeued from the failed registry or the CLI: live again, its end forgotten.
HOST_JOB_REQUEUED = (
    "UPDATE solidloop_host_jobs SET status = 'queued', ended_at = NULL, expires_at = NULL "
    "WHERE id = %s"
)

# -- any job row: the operator's view (flask solidloop jobs) ----------------------

#: Lock a dead-lettered row so exactly one requeue copies it.
LOCK_DEAD = (
    "SELECT id, message FROM solidloop_jobs WHERE id = %s AND state = 'dead' FOR UPDATE"
)
#: The latest dead delivery of a host job (what requeue copies).
LATEST_DEAD_OF_HOST_JOB = (
    "SELECT j.id FROM solidloop_host_jobs AS h JOIN solidloop_jobs AS j "
    "ON j.actor_name = 'solidloop.job' AND j.message_id = h.message_id "
    "WHERE h.id = %s ORDER BY j.id DESC LIMIT 1"
)
#: A requeued dead row is closed (kept for history), so it is not requeued twice.
CLOSE_REQUEUED = (
    "UPDATE solidloop_jobs SET state = 'done', "
    "last_error = 'requeued; it had failed with: ' || coalesce(last_error, '') WHERE id = %s"
)
DEAD_IDS = (
    "SELECT id FROM solidloop_jobs WHERE state = 'dead' "
    "AND (%(queues)s::text[] IS NULL OR queue_name = ANY(%(queues)s)) "
    "AND NOT queue_name LIKE 'solidloop\\_%%' ORDER BY id"
)
#: Discard a dead-lettered row: closed (kept for history, pruned as done rows
#: are), never requeued; returns its RQ job id, if any.
DISCARD_DEAD = (
    "UPDATE solidloop_jobs SET state = 'done', "
    "last_error = 'discarded; it had failed with: ' || coalesce(last_error, '') "
    "WHERE id = %s AND state = 'dead' RETURNING message->'options'->>'solidloop_job'"
)
CANCEL_QUEUED = (
    "UPDATE solidloop_jobs SET state = 'done', finished_at = now(), last_error = %s "
    "WHERE id = %s AND state = 'queued' RETURNING message->'options'->>'solidloop_job'"
)
LIST_JOBS = """
SELECT j.id, j.queue_name, j.actor_name, j.state, j.attempts, j.eta, j.created_at,
       j.finished_at, j.last_error, h.id, h.func_name
  FROM solidloop_jobs AS j
  LEFT JOIN solidloop_host_jobs AS h ON h.id = j.message->'options'->>'solidloop_job'
 WHERE (%(states)s::text[] IS NULL OR j.state = ANY(%(states)s))
   AND (%(queues)s::text[] IS NULL OR j.queue_name = ANY(%(queues)s))
 ORDER BY j.id DESC
 LIMIT %(limit)s
"""

# -- the dramatiq Results backend on PostgreSQL ----------------------------------

RESULT_GET = "SELECT value FROM solidloop_results WHERE key = %s AND expires_at > now()"
RESULT_STORE = (
    "INSERT INTO solidloop_results (key, value, expires_at) "
    "VALUES (%s, %s, now() + make_interval(secs => %s)) "
    "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at"
)

# -- periodic jobs -----------------------------------------------------------------

#: Claim a period for a schedule: the row moves forward only, so of all the
#: workers ticking at once exactly one gets a row back and enqueues the job.
PERIODIC_CLAIM = (
    "INSERT INTO solidloop_periodic (name, last_period) VALUES (%s, %s) "
    "ON CONFLICT (name) DO UPDATE SET last_period = EXCLUDED.last_period, updated_at = now() "
    "WHERE solidloop_periodic.last_period < EXCLUDED.last_period "
    # xmax = 0 on a freshly inserted row: the schedule's first period ever.
    "RETURNING name, (xmax = 0) AS first"
)

# -- maintenance leaders (queue/middleware/periodic.py) ----------------------------
# One row per in-worker periodic task. The UPDATE matches only for the holder or
# once the leadership lapsed, so a follower's check writes and locks nothing.

LEADER_TAKE = """
WITH taken AS (
    UPDATE solidloop_leaders
       SET holder = %(holder)s, until = now() + make_interval(secs => %(ttl)s),
           since = CASE WHEN holder = %(holder)s THEN since ELSE now() END
     WHERE name = %(name)s AND (holder = %(holder)s OR until < now())
    RETURNING since
), first AS (  -- the task's first leader ever: no row yet
    INSERT INTO solidloop_leaders (name, holder, until)
    SELECT %(name)s, %(holder)s, now() + make_interval(secs => %(ttl)s)
     WHERE NOT EXISTS (SELECT 1 FROM solidloop_leaders WHERE name = %(name)s)
    ON CONFLICT (name) DO NOTHING
    RETURNING since
)
SELECT since FROM taken UNION ALL SELECT since FROM first
"""
#: A clean shutdown hands the leadership over at once.
LEADER_RELEASE = (
    "UPDATE solidloop_leaders SET until = now() - interval '1 second' "
    "WHERE name = %(name)s AND holder = %(holder)s"
)

# -- the worker registry (queue/middleware/worker_registry.py) ---------------------
# One row per worker process, keyed by ``host:pid`` (the lease_holder value), so
# a pid reused by a restarted container takes its row over instead of adding one.

WORKER_REGISTER = """
INSERT INTO solidloop_workers (identity, host, pid, queues, threads)
VALUES (%(identity)s, %(host)s, %(pid)s, %(queues)s, %(threads)s)
ON CONFLICT (identity) DO UPDATE
   SET host = EXCLUDED.host, pid = EXCLUDED.pid, queues = EXCLUDED.queues,
       threads = EXCLUDED.threads, started_at = now(), last_seen_at = now(), stopped_at = NULL
"""
WORKER_HEARTBEAT = (
    "UPDATE solidloop_workers SET last_seen_at = now() "
    "WHERE identity = %(identity)s AND stopped_at IS NULL RETURNING 1"
)
WORKER_STOPPED = (
    "UPDATE solidloop_workers SET last_seen_at = now(), stopped_at = now() "
    "WHERE identity = %(identity)s RETURNING 1"
)
#: Rows of workers that stopped, or went silent, longer than ``%(age)s`` seconds ago.
_WORKERS_GONE = "coalesce(stopped_at, last_seen_at) < now() - make_interval(secs => %(age)s)"
WORKER_PRUNE = "DELETE FROM solidloop_workers WHERE " + _WORKERS_GONE + " RETURNING 1"
#: How many rows WORKER_PRUNE would delete (``flask solidloop prune --dry-run``).
WORKER_PRUNE_COUNT = "SELECT count(*) FROM solidloop_workers WHERE " + _WORKERS_GONE
#: The queues that live workers consume: registered, not stopped, and heard
#: from within ``%(silent)s`` seconds (WorkerRow.state's "live").
WORKER_LIVE_QUEUES = (
    "SELECT DISTINCT queue FROM solidloop_workers, jsonb_array_elements_text(queues) AS queue "
    "WHERE stopped_at IS NULL AND last_seen_at >= now() - make_interval(secs => %(silent)s)"
)
#: Live workers and those gone within ``%(recent)s`` seconds, with what each holds
#: now: running LLM turns and leased, unanswered tool calls naming it as holder.
WORKER_LIST = """
SELECT w.identity, w.host, w.pid, w.queues, w.threads, w.started_at, w.last_seen_at,
       w.stopped_at, extract(epoch FROM now() - w.last_seen_at)::float8 AS silent_for,
       coalesce((SELECT array_agg(l.id ORDER BY l.id) FROM solidloop_loops l
                  WHERE l.status = 'running' AND l.lease_holder = w.identity), '{}') AS loops,
       coalesce((SELECT array_agg(t.id ORDER BY t.id) FROM solidloop_tool_calls t
                  WHERE t.lease_holder = w.identity AND t.lease_token IS NOT NULL
                    AND t.response_message_id IS NULL), '{}') AS tool_calls
  FROM solidloop_workers w
 WHERE w.identity = ANY(%(identities)s::text[])
    OR (cardinality(%(identities)s::text[]) = 0 AND coalesce(w.stopped_at, w.last_seen_at)
                                  >= now() - make_interval(secs => %(recent)s))
 ORDER BY w.stopped_at IS NOT NULL, w.started_at DESC, w.identity
"""

# -- the fleet's figures, read at each metrics scrape (runtime/metrics.py) ----------

#: Per queue: jobs due and waiting, jobs scheduled for later, jobs running, and
#: the age in seconds of the oldest due one (0 when none waits). Reads only the
#: live rows (the partial indexes cover them), never the finished ones.
QUEUE_FIGURES = """
SELECT queue_name,
       count(*) FILTER (WHERE state = 'queued' AND eta <= now()),
       count(*) FILTER (WHERE state = 'queued' AND eta > now()),
       count(*) FILTER (WHERE state = 'running'),
       coalesce(extract(epoch FROM now() - min(eta) FILTER (
           WHERE state = 'queued' AND eta <= now())), 0)::float8
  FROM solidloop_jobs
 WHERE state IN ('queued', 'running')
 GROUP BY queue_name
"""
#: Worker processes alive (heard from within ``%(silent)s`` seconds, not
#: stopped) and lost (silent longer, never stopped cleanly), in the registry.
WORKER_FIGURES = """
SELECT count(*) FILTER (WHERE last_seen_at >= now() - make_interval(secs => %(silent)s)),
       count(*) FILTER (WHERE last_seen_at < now() - make_interval(secs => %(silent)s))
  FROM solidloop_workers
 WHERE stopped_at IS NULL
"""
