"""The indexes migration 0008 added are the ones the admin, the janitor and the
foreign keys really use: EXPLAIN of the statements the code itself runs
(captured from the session), over tables of some thousands of rows, names the
index and scans no table sequentially. Each is checked under the plan the
statement gets on its first runs (a custom plan, parameters known) and under a
generic plan (what a statement psycopg has prepared may get later)."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import event

from flask_solidloop.loops import queries
from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.maintenance import janitor
from flask_solidloop.queue.broker import libpq_url


@contextmanager
def captured(session):
    """Every (statement, parameters) the session's engine runs inside the block."""
    statements: list[tuple[str, Any]] = []
    engine = session.get_bind()

    def listen(conn, cursor, statement, parameters, context, executemany):
        statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", listen)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", listen)


def one(statements, needle: str) -> tuple[str, Any]:
    found = [s for s in statements if needle in s[0]]
    assert len(found) == 1, [s[0] for s in statements]
    return found[0]


def plans(pg, statement: str, params: Any) -> tuple[str, str]:
    """(custom plan, generic plan) of a pyformat ``statement`` with ``params``."""
    params = params or {}
    custom = "\n".join(r[0] for r in pg.execute("EXPLAIN " + statement, params).fetchall())
    # The same statement PREPAREd, planned generically ($n in place of each value).
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", number, statement).replace("%%", "%")
    pg.execute("DEALLOCATE ALL")
    pg.execute(f"PREPARE probe AS {prepared}")
    pg.execute("SET plan_cache_mode = force_generic_plan")
    try:
        args = sql.SQL(", ").join(sql.Literal(params[n]) for n in names)
        execute = (sql.SQL("EXPLAIN EXECUTE probe({})").format(args) if names
                   else sql.SQL("EXPLAIN EXECUTE probe"))
        generic = "\n".join(r[0] for r in pg.execute(execute).fetchall())
    finally:
        pg.execute("RESET plan_cache_mode")
        pg.execute("DEALLOCATE probe")
    return custom, generic


def assert_uses(plan: str, index: str, table: str) -> None:
    assert index in plan, plan
    assert f"Seq Scan on {table}" not in plan, plan


def run_captured(session, fn: Callable[[], Any]) -> list[tuple[str, Any]]:
    with captured(session) as statements:
        fn()
    session.rollback()
    return statements


def test_the_dashboards_dead_job_count_reads_the_dead_index(session, pg):
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state,"
               " finished_at) SELECT 'solidloop_llm', 'x', gen_random_uuid(), '{}',"
               " CASE WHEN i % 1000 = 0 THEN 'dead' ELSE 'done' END, now()"
               " FROM generate_series(1, 20000) AS i")
    pg.execute("VACUUM ANALYZE solidloop_jobs")
    statements = run_captured(session, lambda: queries.dashboard(session))
    statement, params = one(statements, "state = 'dead'")
    for plan in plans(pg, statement, params):
        assert_uses(plan, "ix_solidloop_jobs_dead", "solidloop_jobs")
    assert queries.dashboard(session).dead_jobs == 20


def test_inbound_events_are_read_and_pruned_by_session_through_their_indexes(session, pg):
    # Many loop events, a few inbound ones over 50 sessions, in between.
    pg.execute("INSERT INTO solidloop_events (kind, payload) SELECT 'llm_request', "
               "jsonb_build_object('session_id', 's' || (i % 50)) "
               "FROM generate_series(1, 30000) AS i")
    pg.execute("INSERT INTO solidloop_events (kind, payload) SELECT 'mcp_inbound', "
               "jsonb_build_object('session_id', 's' || (i % 50), 'method', 'tools/call') "
               "FROM generate_series(1, 2000) AS i")
    pg.execute("INSERT INTO solidloop_events (kind, payload) SELECT 'llm_request', '{}' "
               "FROM generate_series(1, 30000)")
    pg.execute("INSERT INTO solidloop_mcp_inbound_sessions (id, server_name, principal_label,"
               " protocol_version, created_at) SELECT 's' || i, 'tools', 'p', '2025-06-18',"
               " now() - interval '2 days' FROM generate_series(0, 49) AS i")
    pg.execute("VACUUM ANALYZE solidloop_events")
    pg.execute("VACUUM ANALYZE solidloop_mcp_inbound_sessions")

    # The admin's Inbound MCP page: one session's requests, and everyone's.
    statements = run_captured(session, lambda: queries.inbound_requests(
        session, limit=51, session_id="s7"))
    statement, params = one(statements, "mcp_inbound")
    for plan in plans(pg, statement, params):
        assert_uses(plan, "ix_solidloop_events_mcp_inbound_session", "solidloop_events")
    statements = run_captured(session, lambda: queries.inbound_requests(session, limit=51))
    statement, params = one(statements, "mcp_inbound")
    for plan in plans(pg, statement, params):
        assert_uses(plan, "ix_solidloop_events_mcp_inbound", "solidloop_events")
    rows = queries.inbound_requests(session, limit=51, session_id="s7")
    assert len(rows) == 40 and {r.payload["session_id"] for r in rows} == {"s7"}
    assert [r.id for r in rows] == sorted((r.id for r in rows), reverse=True)

    # The janitor deleting old sessions with their events.
    params = {"batch": 1000, "age": "1 day"}
    for plan in plans(pg, janitor._PRUNE_INBOUND_SESSIONS.replace(":age", "%(age)s::interval")
                      .replace(":batch", "%(batch)s"), params):
        assert "Seq Scan on solidloop_events" not in plan, plan
        assert "ix_solidloop_events_mcp_inbound" in plan, plan


def test_every_foreign_key_has_an_index_that_leads_with_its_column(pg):
    """A foreign key's ON DELETE action looks the referencing rows up by its
    column, once per deleted row: without an index that leads with the column
    it scans the whole table each time (migration 0011 found two on the
    events). A partial index serves it only when its predicate is the column
    being set."""
    rows = pg.execute(
        "SELECT c.conrelid::regclass::text, c.conname, a.attname, "
        "ARRAY(SELECT coalesce(pg_get_expr(i.indpred, i.indrelid), '') FROM pg_index i "
        "      WHERE i.indrelid = c.conrelid AND i.indkey[0] = c.conkey[1]) "
        "FROM pg_constraint c "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1] "
        "WHERE c.contype = 'f' AND c.conrelid::regclass::text LIKE 'solidloop_%'").fetchall()
    assert rows  # the schema has foreign keys: the query sees them
    unindexed = [(table, name) for table, name, column, predicates in rows
                 if not any(p in ("", f"({column} IS NOT NULL)") for p in predicates)]
    assert unindexed == []


def test_deleting_a_message_finds_the_tool_call_it_answers_by_index(pg):
    loop_id = pg.execute("INSERT INTO solidloop_loops (agent_name, status) "
                         "VALUES ('assistant', 'completed') RETURNING id").fetchone()[0]
    ids = [r[0] for r in pg.execute(
        "INSERT INTO solidloop_messages (loop_id, role) SELECT %s, "
        "CASE WHEN i <= 5000 THEN 'assistant' ELSE 'tool' END "
        "FROM generate_series(1, 10000) AS i RETURNING id", (loop_id,)).fetchall()]
    calls, answers = sorted(ids)[:5000], sorted(ids)[5000:]
    pg.execute("INSERT INTO solidloop_tool_calls (loop_id, message_id, position, name, "
               "response_message_id) SELECT %s, c, 0, 'calc__add', a "
               "FROM unnest(%s::bigint[], %s::bigint[]) AS u(c, a)", (loop_id, calls, answers))
    pg.execute("VACUUM ANALYZE solidloop_tool_calls")
    # The statement PostgreSQL's ON DELETE SET NULL trigger runs for each deleted
    # message (ri_triggers.c); no code of ours filters on the column by value.
    ri = ("UPDATE ONLY solidloop_tool_calls SET response_message_id = NULL "
          "WHERE %(id)s = response_message_id")
    for plan in plans(pg, ri, {"id": answers[7]}):
        assert_uses(plan, "ix_solidloop_tool_calls_response_message_id", "solidloop_tool_calls")
    pg.execute("DELETE FROM solidloop_messages WHERE id = %s", (answers[7],))
    assert pg.execute("SELECT message_id FROM solidloop_tool_calls "
                      "WHERE response_message_id IS NULL").fetchall() == [(calls[7],)]


def test_deleting_a_tool_call_finds_its_answer_by_the_partial_unique_index(pg):
    """Migration 0010: only tool answers have an entry in the unique index on
    messages.tool_call_id, and the ON DELETE CASCADE lookup still uses it."""
    loop_id = pg.execute("INSERT INTO solidloop_loops (agent_name, status) "
                         "VALUES ('assistant', 'completed') RETURNING id").fetchone()[0]
    asks = [r[0] for r in pg.execute(
        "INSERT INTO solidloop_messages (loop_id, role) SELECT %s, 'assistant' "
        "FROM generate_series(1, 5000) RETURNING id", (loop_id,)).fetchall()]
    calls = [r[0] for r in pg.execute(
        "INSERT INTO solidloop_tool_calls (loop_id, message_id, position, name) "
        "SELECT %s, m, 0, 'calc__add' FROM unnest(%s::bigint[]) AS m RETURNING id",
        (loop_id, asks)).fetchall()]
    pg.execute("INSERT INTO solidloop_messages (loop_id, role, tool_call_id) "
               "SELECT %s, 'tool', c FROM unnest(%s::bigint[]) AS c", (loop_id, calls))
    pg.execute("VACUUM ANALYZE solidloop_messages")
    # The statement the ON DELETE CASCADE trigger runs for each deleted call.
    ri = "DELETE FROM ONLY solidloop_messages WHERE %(id)s = tool_call_id"
    for plan in plans(pg, ri, {"id": calls[7]}):
        assert_uses(plan, "uq_solidloop_messages_tool_call_id", "solidloop_messages")
    (entries,), = pg.execute(
        "SELECT reltuples FROM pg_class WHERE relname = 'uq_solidloop_messages_tool_call_id'")
    assert entries == len(calls)  # the 5000 assistant messages have none
    with pytest.raises(psycopg.errors.UniqueViolation):
        pg.execute("INSERT INTO solidloop_messages (loop_id, role, tool_call_id) "
                   "VALUES (%s, 'tool', %s)", (loop_id, calls[0]))


def test_a_turns_history_reads_its_loops_rows_by_index(pg):
    """queries.history's one statement reads the loop's calls and messages
    through their loop_id indexes, among many other loops' rows."""
    loop_ids = [r[0] for r in pg.execute(
        "INSERT INTO solidloop_loops (agent_name, status) SELECT 'assistant', 'completed' "
        "FROM generate_series(1, 2000) RETURNING id").fetchall()]
    pg.execute("INSERT INTO solidloop_messages (loop_id, role, content) "
               "SELECT l, 'assistant', 'x' FROM unnest(%s::bigint[]) AS l, "
               "generate_series(1, 10)", (loop_ids,))
    pg.execute("INSERT INTO solidloop_tool_calls (loop_id, message_id, position, name) "
               "SELECT m.loop_id, m.id, 0, 'calc__add' FROM solidloop_messages m")
    pg.execute("VACUUM ANALYZE solidloop_messages")
    pg.execute("VACUUM ANALYZE solidloop_tool_calls")
    for plan in plans(pg, loop_sql.HISTORY, {"loop_id": loop_ids[7]}):
        assert_uses(plan, "ix_solidloop_messages_loop_id_id", "solidloop_messages")
        assert_uses(plan, "ix_solidloop_tool_calls_", "solidloop_tool_calls")


# -- migration 0009: a running loop's updates are HOT ---------------------------------


def test_a_running_loops_mid_run_update_is_hot(database_url):
    """What a running loop's turns write (the end of an LLM turn entering its tool
    phase, the adoption of its next turn) changes no indexed column, so
    PostgreSQL updates the row in place (HOT): no index entry is written. The
    transaction's own counters say so (pg_stat_get_xact_tuples_hot_updated)."""
    with psycopg.connect(libpq_url(database_url)) as pg:
        hot_updates(pg)


def hot_updates(pg) -> None:
    (loop_id,) = pg.execute(
        "INSERT INTO solidloop_loops (agent_name, status, execution_token, lease_expires_at)"
        " VALUES ('a', 'running', gen_random_uuid(), now() + interval '20 s')"
        " RETURNING id").fetchone()
    pg.commit()

    def counts() -> tuple[int, int]:
        # This backend's not yet reported counts: they do not move within a transaction.
        return pg.execute("SELECT pg_stat_get_xact_tuples_updated(c.oid),"
                          " pg_stat_get_xact_tuples_hot_updated(c.oid) FROM pg_class c"
                          " WHERE c.relname = 'solidloop_loops'").fetchone()

    def update(statement: str) -> tuple[int, int]:
        """(rows updated, of them HOT) by ``statement``, in a transaction of its own."""
        before = counts()
        pg.execute(statement, (loop_id,))
        after = counts()
        pg.commit()
        return after[0] - before[0], after[1] - before[1]

    # the turn's end entering the tool phase (loops/sql.FINISH_TURN's loop part):
    # the status is set to itself, so the update stays HOT
    assert update(
        "UPDATE solidloop_loops SET step_count = step_count + 1, lease_holder = NULL,"
        " lease_expires_at = NULL, input_tokens = input_tokens + 10,"
        " output_tokens = output_tokens + 5, cost = cost + 0.001,"
        " status = CASE WHEN false THEN 'completed' ELSE status END,"
        " execution_token = CASE WHEN false THEN NULL ELSE execution_token END,"
        " finished_at = CASE WHEN false THEN now() ELSE finished_at END,"
        " error_message = CASE WHEN false THEN NULL ELSE error_message END,"
        " updated_at = now() WHERE id = %s") == (1, 1)
    # the tool answer claiming the next LLM turn (loops/sql.TOOL_OUTCOME's claim)
    assert update(
        "UPDATE solidloop_loops SET status = 'running', execution_token = gen_random_uuid(),"
        " lease_expires_at = now() + interval '20 s', lease_holder = 'vm:1',"
        " started_at = coalesce(started_at, now()),"
        " run_started_at = coalesce(run_started_at, now()), updated_at = now() WHERE id = %s"
    ) == (1, 1)
    # Leaving running changes the status, which is indexed: not HOT, as it must not be.
    assert update("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s") == (1, 0)


def test_the_reapers_loop_scans_read_the_status_and_queued_at_indexes(pg):
    """With no index on the lease or updated_at (above), the reaper's scans of
    running and queued loops still find them by index, among many finished loops."""


    pg.execute("INSERT INTO solidloop_loops (agent_name, status, lease_expires_at)"
               " SELECT 'a', CASE WHEN i % 500 = 0 THEN 'running' WHEN i % 500 = 1"
               " THEN 'queued' ELSE 'completed' END,"
               " CASE WHEN i % 500 = 0 THEN now() - interval '1 s' END"
               " FROM generate_series(1, 30000) AS i")
    pg.execute("VACUUM ANALYZE solidloop_loops")
    for statement, index in ((loop_sql.EXPIRED_LLM, "ix_solidloop_loops_status"),
                             (loop_sql.STUCK_QUEUED, "ix_solidloop_loops_queued_at")):
        for plan in plans(pg, statement, {"grace": 300}):
            assert_uses(plan, index, "solidloop_loops")


def test_the_janitors_event_retention_reads_by_index_with_a_brin_created_at(pg):
    """Migration 0009 made the events' created_at index a BRIN (no B-tree entry per
    event). Over an append-only table a retention batch still reads by index
    and deletes by primary key, under both plans: no scan of the whole table."""
    pg.execute("INSERT INTO solidloop_events (kind, payload, created_at)"
               " SELECT 'llm_request', '{}', now() - make_interval(secs => 200000 - i)"
               " FROM generate_series(1, 200000) AS i")
    pg.execute("VACUUM ANALYZE solidloop_events")
    (method,) = pg.execute(
        "SELECT am.amname FROM pg_class c JOIN pg_am am ON am.oid = c.relam"
        " WHERE c.relname = 'ix_solidloop_events_created_at'").fetchone()
    assert method == "brin"
    statement = janitor.prune_events_sql(199000).replace(":batch", "%(batch)s")
    custom, generic = plans(pg, statement, {"batch": 500})
    assert_uses(custom, "ix_solidloop_events_created_at", "solidloop_events")
    # Generic (the batch size unknown): it may walk the primary key from the
    # oldest event instead (append-only: the oldest ids first, so old rows are
    # met at once); the delete probes it by id. When nothing is old enough, the
    # age written into the statement keeps it on the BRIN (the next test).
    assert_uses(generic, "pk_solidloop_events", "solidloop_events")


def test_the_default_janitor_finds_old_events_and_done_jobs_through_their_indexes(session, pg):
    """Workers sweep every five minutes by default, mostly to find nothing: the
    sweep's statements read the created_at BRIN of the events and the partial
    index of done jobs, never the whole table, loop guard included."""
    pg.execute("INSERT INTO solidloop_loops (agent_name, status) SELECT 'a', "
               "CASE WHEN i % 2 = 0 THEN 'completed' ELSE 'running' END "
               "FROM generate_series(1, 200) AS i")
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload) SELECT "
               "(SELECT min(id) FROM solidloop_loops) + i % 200, 'llm_request', '{}' "
               "FROM generate_series(1, 30000) AS i")
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state,"
               " loop_id, finished_at) SELECT 'solidloop_llm', 'x', gen_random_uuid(), '{}', "
               "CASE WHEN i % 50 = 0 THEN 'queued' ELSE 'done' END, "
               "(SELECT min(id) FROM solidloop_loops) + i % 200, "
               "CASE WHEN i % 50 = 0 THEN NULL ELSE now() END FROM generate_series(1, 20000) AS i")
    for table in ("solidloop_loops", "solidloop_events", "solidloop_jobs"):
        pg.execute(f"VACUUM ANALYZE {table}")

    params = {"batch": 1000}
    for plan in plans(pg, janitor.prune_events_sql(30 * 86400).replace(":batch", "%(batch)s"),
                      params):
        assert_uses(plan, "ix_solidloop_events_created_at", "solidloop_events")
    for plan in plans(pg, janitor.prune_jobs_sql(7 * 86400).replace(":batch", "%(batch)s"),
                      params):
        assert_uses(plan, "ix_solidloop_jobs_finished", "solidloop_jobs")
