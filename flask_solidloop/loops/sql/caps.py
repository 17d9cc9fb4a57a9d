"""Concurrency caps: a capped loop's admission before its first turn, or its hold
(decision 0023). The wake-up of a held loop is the database's own: the trigger
``solidloop_leave_flight`` of migration 0016, in the commit of any transition
that takes an admitted loop out of flight."""

from __future__ import annotations

#: The caps' advisory locks, in the one order the trigger takes them too: the
#: agent's, then the subject's (when the loop has one). Held to the commit, they
#: serialize an admission with the other admissions and the ends of its caps.
CAP_LOCKS = (
    "SELECT pg_advisory_xact_lock(hashtextextended('solidloop.cap.agent:' || "
    "%(agent_name)s::text, 0)), CASE WHEN %(subject_id)s::text IS NOT NULL THEN "
    "pg_advisory_xact_lock(hashtextextended('solidloop.cap.subject:' || "
    "coalesce(%(subject_type)s::text, '') || ':' || %(subject_id)s::text, 0)) END")

#: After CAP_LOCKS, in the same transaction (a snapshot that sees every end
#: committed before the locks were granted): the queued loop is admitted (it
#: counts against its caps from now until it leaves flight) when the loops its
#: caps admitted are fewer than each cap (NULL: no cap), else held by the first
#: cap that is full, keeping its place in line if it was held before.
ADMIT = (
    "WITH verdict AS (SELECT CASE "
    "WHEN %(agent_cap)s::int IS NOT NULL AND (SELECT count(*) FROM solidloop_loops a "
    "WHERE a.agent_name = %(agent_name)s::text AND a.capped_at IS NOT NULL "
    "AND a.id <> %(loop_id)s) >= %(agent_cap)s::int THEN 'agent' "
    "WHEN %(subject_cap)s::int IS NOT NULL AND %(subject_id)s::text IS NOT NULL "
    "AND (SELECT count(*) FROM solidloop_loops s "
    "WHERE s.subject_type = %(subject_type)s::text AND s.subject_id = %(subject_id)s::text "
    "AND s.capped_at IS NOT NULL AND s.id <> %(loop_id)s) >= %(subject_cap)s::int "
    "THEN 'subject' END AS held_by) "
    "UPDATE solidloop_loops l SET held_by = v.held_by, "
    "capped_at = CASE WHEN v.held_by IS NULL THEN now() END, "
    "held_since = CASE WHEN v.held_by IS NOT NULL THEN coalesce(l.held_since, now()) END "
    "FROM verdict v WHERE l.id = %(loop_id)s AND l.status = 'queued' AND l.capped_at IS NULL "
    "RETURNING v.held_by")
