"""Every statement on the rate buckets and the subjects' spend ledger, named once.

Parameters use psycopg's ``%(name)s`` style and run on the DBAPI connection
under a session (dbapi.py). The buckets are a generic cell rate algorithm: a
row's ``level`` drains at ``capacity / period`` per second since
``drained_at``; a reservation adds its amount, and may take the level past the
capacity (a future slot: the turn goes when its amount has drained).
"""

from __future__ import annotations

#: The buckets of the keys a process is about to use, created once (a no-op
#: for rows that exist: reservations need them to lock).
ENSURE_BUCKETS = (
    "INSERT INTO solidloop_rate_buckets (key, dimension) "
    "SELECT * FROM unnest(%(keys)s::text[], %(dimensions)s::text[]) "
    "ON CONFLICT (key, dimension) DO NOTHING RETURNING 1"
)

#: The level of a bucket row ``b`` drained to now, given its capacity and period.
_DRAINED = ("greatest(0, b.level - extract(epoch FROM clock_timestamp() - b.drained_at) "
            "* w.capacity / w.period)")

#: Reserve ``amounts`` on the rows of ``keys`` x ``dimensions`` (with their
#: capacities and periods), locked in key order. Returns ``wait``: seconds until
#: every amount has drained below its capacity and any block has ended (0: go
#: now). The amounts are added when the wait is at most ``horizon`` (the caller
#: sleeps it, or holds that slot while it is deferred to it); beyond, nothing is
#: reserved. A wait past ``inline_wait`` counts a deferral on the keys' own
#: rows. An amount larger than its capacity waits for an empty bucket.
RESERVE = (
    "WITH w AS (SELECT * FROM unnest(%(keys)s::text[], %(dimensions)s::text[], "
    "%(capacities)s::float8[], %(periods)s::float8[], %(amounts)s::float8[]) "
    "AS t(key, dimension, capacity, period, amount)), "
    "locked AS (SELECT b.key, b.dimension, w.capacity, w.period, w.amount, b.blocked_until, "
    + _DRAINED + " AS level FROM solidloop_rate_buckets b "
    "JOIN w ON b.key = w.key AND b.dimension = w.dimension "
    "ORDER BY b.key, b.dimension FOR UPDATE OF b), "
    "verdict AS (SELECT coalesce(max(greatest("
    "CASE WHEN capacity > 0 AND level + least(amount, capacity) > capacity "
    "THEN (level + least(amount, capacity) - capacity) * period / capacity ELSE 0 END, "
    "coalesce(extract(epoch FROM blocked_until - clock_timestamp()), 0))), 0)::float8 AS wait "
    "FROM locked), "
    "go AS (SELECT wait <= %(horizon)s AS go FROM verdict), "
    "moved AS (UPDATE solidloop_rate_buckets b SET "
    "level = CASE WHEN g.go THEN l.level + l.amount ELSE b.level END, "
    "drained_at = CASE WHEN g.go THEN clock_timestamp() ELSE b.drained_at END, "
    "deferrals = b.deferrals + CASE WHEN b.dimension = '-' AND v.wait > %(inline_wait)s "
    "THEN 1 ELSE 0 END "
    "FROM locked l, verdict v, go g WHERE b.key = l.key AND b.dimension = l.dimension "
    "RETURNING g.go) "
    "SELECT v.wait, (SELECT count(*) FROM moved WHERE moved.go) AS moved FROM verdict v"
)

#: Settle reservations: add each ``delta`` (real use minus the estimate) to its
#: row, drained to now and clamped at zero, and raise the level to ``floor``
#: where the provider reported less room than we counted (NULL: no report).
SETTLE = (
    "UPDATE solidloop_rate_buckets b SET level = greatest(0, " + _DRAINED
    + " + w.delta, coalesce(w.floor, 0)), drained_at = clock_timestamp() "
    "FROM unnest(%(keys)s::text[], %(dimensions)s::text[], %(capacities)s::float8[], "
    "%(periods)s::float8[], %(deltas)s::float8[], %(floors)s::float8[]) "
    "AS w(key, dimension, capacity, period, delta, floor) "
    "WHERE b.key = w.key AND b.dimension = w.dimension RETURNING 1"
)

#: The provider refused (a 429 or 503 with Retry-After): block ``keys`` until
#: ``seconds`` from now for every worker, and count the refusal.
BLOCK = (
    "UPDATE solidloop_rate_buckets SET blocked_until = greatest(coalesce(blocked_until, "
    "clock_timestamp()), clock_timestamp() + make_interval(secs => %(seconds)s)), "
    "refusals = refusals + 1 "
    "WHERE key = ANY(%(keys)s) AND dimension = '-' RETURNING 1"
)

#: Every bucket as it stands now (the CLI and the admin).
BUCKETS = (
    "SELECT key, dimension, level, drained_at, blocked_until, deferrals, refusals "
    "FROM solidloop_rate_buckets ORDER BY key, dimension"
)

#: A subject's reservation: under a transaction-scoped advisory lock on the
#: subject, the window's spend (settled rows at their use, unsettled ones at
#: their estimate); the new row is inserted only while every limit is unreached
#: (``exempt``: a loop an operator released from the subject's budget writes its
#: row whatever the sum). Returns the sums before the row, and its id (NULL
#: when refused).
RESERVE_SPEND = (
    "WITH lock AS (SELECT pg_advisory_xact_lock(hashtextextended("
    "'solidloop_spend:' || %(subject)s, 0))), "
    "spent AS (SELECT coalesce(sum(cost), 0)::float8 AS cost_usd, "
    "coalesce(sum(tokens), 0)::float8 AS tokens, "
    "coalesce(sum(llm_turns), 0)::float8 AS llm_turns, "
    "coalesce(sum(tool_calls), 0)::float8 AS tool_calls "
    "FROM solidloop_spend, lock WHERE subject = %(subject)s "
    "AND at > clock_timestamp() - make_interval(secs => %(window)s)), "
    "ok AS (SELECT %(exempt)s OR ("
    "(%(cost_limit)s::float8 IS NULL OR cost_usd < %(cost_limit)s) "
    "AND (%(tokens_limit)s::float8 IS NULL OR tokens < %(tokens_limit)s) "
    "AND (%(turns_limit)s::float8 IS NULL OR llm_turns < %(turns_limit)s) "
    "AND (%(calls_limit)s::float8 IS NULL OR tool_calls < %(calls_limit)s)) AS go FROM spent), "
    "row AS (INSERT INTO solidloop_spend (subject, loop_id, at, cost, tokens, llm_turns) "
    "SELECT %(subject)s, %(loop_id)s, clock_timestamp(), %(cost)s, %(tokens)s, 1 "
    "FROM ok WHERE ok.go RETURNING id) "
    "SELECT s.cost_usd, s.tokens, s.llm_turns, s.tool_calls, (SELECT id FROM row) AS id "
    "FROM spent s"
)

#: A reservation settled to the turn's real usage (zero for a request that was
#: refused or failed before the provider billed it).
SETTLE_SPEND = (
    "UPDATE solidloop_spend SET cost = %(cost)s, tokens = %(tokens)s, "
    "llm_turns = %(llm_turns)s, tool_calls = %(tool_calls)s, settled = true "
    "WHERE id = %(id)s RETURNING id"
)

#: What a subject spent over a window (status, the admin).
SUBJECT_SPEND = (
    "SELECT coalesce(sum(cost), 0)::float8 AS cost_usd, "
    "coalesce(sum(tokens), 0)::float8 AS tokens, "
    "coalesce(sum(llm_turns), 0)::float8 AS llm_turns, "
    "coalesce(sum(tool_calls), 0)::float8 AS tool_calls "
    "FROM solidloop_spend WHERE subject = %(subject)s "
    "AND at > clock_timestamp() - make_interval(secs => %(window)s)"
)

#: A loop and each of its ancestors (``level`` 0 the loop, 1 its parent, ...),
#: each with the spend of its whole tree: itself and all its descendants
#: (child agents, recursively), by limit. Run only for a loop with a budget of
#: its own or a parent (limits/admission.check_loop); rows ordered by level.
TREE_SPEND = (
    "WITH RECURSIVE up AS (SELECT id, parent_loop_id, agent_name, budget, 0 AS level "
    "FROM solidloop_loops WHERE id = %(loop_id)s "
    "UNION ALL SELECT l.id, l.parent_loop_id, l.agent_name, l.budget, up.level + 1 "
    "FROM solidloop_loops l JOIN up ON l.id = up.parent_loop_id), "
    "down AS (SELECT id AS top, id FROM up "
    "UNION ALL SELECT d.top, l.id FROM solidloop_loops l JOIN down d "
    "ON l.parent_loop_id = d.id) "
    "SELECT up.id, up.agent_name, up.budget, up.level, t.loops, t.cost_usd, t.tokens, "
    "t.llm_turns, (SELECT count(*) FROM solidloop_tool_calls c JOIN down d "
    "ON c.loop_id = d.id WHERE d.top = up.id)::float8 AS tool_calls "
    "FROM up CROSS JOIN LATERAL (SELECT count(*) AS loops, "
    "coalesce(sum(l.cost), 0)::float8 AS cost_usd, "
    "coalesce(sum(l.input_tokens + l.output_tokens), 0)::float8 AS tokens, "
    "coalesce(sum(l.step_count), 0)::float8 AS llm_turns "
    "FROM down d JOIN solidloop_loops l ON l.id = d.id WHERE d.top = up.id) t "
    "ORDER BY up.level"
)
