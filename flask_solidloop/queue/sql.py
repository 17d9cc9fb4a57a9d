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

INSERT = (
    "INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, eta, loop_id) "
    "VALUES (%(queue_name)s, %(actor_name)s, %(message_id)s, %(message)s, "
    "coalesce(%(eta)s::timestamptz, now() + make_interval(secs => %(delay)s)), %(loop_id)s) "
    "RETURNING id"
)
#: The insert plus its wake-up. NOTIFY is transactional: a rollback sends nothing.
INSERT_AND_NOTIFY = (
    "WITH job AS (" + INSERT + ") "
    "SELECT job.id, pg_notify(%(channel)s, '') FROM job"
)
NOTIFY = "SELECT pg_notify(%s, '')"

CLAIM = """
UPDATE solidloop_jobs AS j
   SET state = 'running', lease_token = gen_random_uuid(),
       lease_until = now() + make_interval(secs => %(lease)s),
       attempts = j.attempts + 1, started_at = now()
  FROM (SELECT id FROM solidloop_jobs
         WHERE queue_name = %(queue)s AND state = 'queued' AND eta <= now()
         ORDER BY eta, id
         LIMIT %(limit)s
         FOR UPDATE SKIP LOCKED) AS due
 WHERE j.id = due.id
RETURNING j.id, j.lease_token, j.message, j.attempts
"""
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
NACK = (
    "UPDATE solidloop_jobs SET state = 'dead', finished_at = now(), lease_until = NULL, "
    "last_error = %s WHERE id = %s AND lease_token = %s AND state = 'running'"
)
REQUEUE = (
    "UPDATE solidloop_jobs SET state = 'queued', lease_token = NULL, lease_until = NULL, "
    "attempts = greatest(attempts - 1, 0) "
    "WHERE id = %s AND lease_token = %s AND state = 'running'"
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
RECOVER = """
WITH expired AS (
    SELECT id FROM solidloop_jobs
     WHERE state = 'running' AND lease_until < now()
     ORDER BY lease_until
     LIMIT 1000
     FOR UPDATE SKIP LOCKED
)
UPDATE solidloop_jobs AS j
   SET state = CASE WHEN j.attempts >= %(max_deliveries)s THEN 'dead' ELSE 'queued' END,
       finished_at = CASE WHEN j.attempts >= %(max_deliveries)s THEN now() END,
       last_error = 'job lease expired: the worker holding it stopped acknowledging',
       lease_token = NULL, lease_until = NULL
  FROM expired WHERE j.id = expired.id
RETURNING j.id, j.queue_name, j.state
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
