"""The statements of child agents (docs/decisions/0037-child-agents.md): a
loop's ancestors (a new child's depth and the cycle check), and its tree of
descendants, locked for a cascading command.

Lock order: a child's ending holds the child's row and then takes its
parent's (the decision on the parent's call). A cascade therefore locks a
tree deepest first and its root last (``LOCK_TREE``), never a parent before
its child, so the two cannot deadlock.
"""

from __future__ import annotations

from .parts import TERMINAL

#: A loop and its ancestors, the loop first (``n`` = 0), then its parent, and
#: so on: each one's id, agent, depth and subject. The walk stops at 1,000
#: levels (the depth cap keeps real chains far shorter).
ANCESTORS = (
    "WITH RECURSIVE up AS ("
    "SELECT id, parent_loop_id, agent_name, depth, subject_type, subject_id, 0 AS n "
    "FROM solidloop_loops WHERE id = %(loop_id)s "
    "UNION ALL SELECT l.id, l.parent_loop_id, l.agent_name, l.depth, l.subject_type, "
    "l.subject_id, up.n + 1 FROM solidloop_loops l JOIN up ON l.id = up.parent_loop_id "
    "WHERE up.n < 1000) "
    "SELECT id, agent_name, depth, subject_type, subject_id FROM up ORDER BY n")

#: A loop and all its descendants (ended ones too: a child resumed after its
#: parent moved on may have children of its own), locked deepest first and
#: the root last: each one's id, status, depth and whether it is frozen.
LOCK_TREE = (
    "WITH RECURSIVE tree AS (SELECT id FROM solidloop_loops WHERE id = %(loop_id)s "
    "UNION SELECT l.id FROM solidloop_loops l JOIN tree ON l.parent_loop_id = tree.id) "
    "SELECT l.id, l.status, l.depth, l.frozen FROM solidloop_loops l JOIN tree ON tree.id = l.id "
    "ORDER BY l.depth DESC, l.id FOR UPDATE OF l")

#: Lift the freeze of a loop and of its descendants; the ids it changed. A
#: loop the freeze paused loses the freeze's own reason (``%(reason)s``) with
#: it: it is paused, no longer frozen, and must not read as such.
UNFREEZE_TREE = (
    "WITH RECURSIVE tree AS (SELECT id FROM solidloop_loops WHERE id = %(loop_id)s "
    "UNION SELECT l.id FROM solidloop_loops l JOIN tree ON l.parent_loop_id = tree.id) "
    "UPDATE solidloop_loops l SET frozen = false, error_message = CASE WHEN "
    "l.status = 'paused' AND l.error_message = %(reason)s THEN NULL ELSE l.error_message END, "
    "updated_at = now() FROM tree WHERE l.id = tree.id AND l.frozen RETURNING l.id")

#: Lock a loop of a frozen tree that is neither live nor ended (paused, init)
#: against resume.
FREEZE_UNENDED = (
    "UPDATE solidloop_loops SET frozen = true, updated_at = now() "
    f"WHERE id = %(loop_id)s AND NOT frozen AND status NOT IN {TERMINAL} RETURNING id")
