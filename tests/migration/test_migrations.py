"""Migrations match the models and run both ways, standalone and under Flask-Migrate."""

from __future__ import annotations

import logging

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import create_engine, inspect

from flask_solidloop import SolidLoop
from flask_solidloop.database import ensure_database
from flask_solidloop.migrations import (
    VERSION_TABLE,
    configure_flask_migrate,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from flask_solidloop.models import metadata
from flask_solidloop.queue.broker import libpq_url

from ..conftest import drop_database


@pytest.fixture
def scratch_url(database_url):
    url = database_url + "_migrations"
    ensure_database(url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    yield url
    drop_database(url)


def tables(url):
    engine = create_engine(url)
    try:
        return {t for t in inspect(engine).get_table_names() if t.startswith("solidloop_")}
    finally:
        engine.dispose()


def test_migrations_match_the_models(scratch_url):
    upgrade(scratch_url)
    engine = create_engine(scratch_url)
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), metadata)
    finally:
        engine.dispose()
    diff = [d for d in diff if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []


def test_upgrade_and_downgrade_both_ways(scratch_url):
    upgrade(scratch_url)
    assert current_revision(scratch_url) == head_revision()
    assert {"solidloop_loops", "solidloop_jobs", "solidloop_messages", "solidloop_tool_calls",
            "solidloop_events"} <= tables(scratch_url)
    downgrade(scratch_url, "base")
    assert tables(scratch_url) == {VERSION_TABLE}
    upgrade(scratch_url)
    assert current_revision(scratch_url) == head_revision()


def test_flask_migrate_host_picks_up_our_branch(scratch_url, tmp_path):
    from flask_migrate import Migrate
    from flask_migrate import init as fm_init
    from flask_migrate import upgrade as fm_upgrade

    app = Flask("host")
    app.config["SQLALCHEMY_DATABASE_URI"] = scratch_url
    db = SQLAlchemy(app)

    class Note(db.Model):
        id = db.Column(db.Integer, primary_key=True)

    directory = str(tmp_path / "migrations")
    migrate = Migrate(app, db, directory=directory)
    SolidLoop(app, db)
    configure_flask_migrate(migrate)
    try:
        with app.app_context():
            fm_init(directory)
            fm_upgrade(directory, "heads")
    finally:
        # Flask-Migrate's env.py runs logging.config.fileConfig, which disables
        # every logger that already exists; undo that for the tests after us.
        for logger in logging.Logger.manager.loggerDict.values():
            if isinstance(logger, logging.Logger):
                logger.disabled = False
    assert "solidloop_loops" in tables(scratch_url)
    with psycopg.connect(libpq_url(scratch_url)) as conn:
        versions = [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")]
    assert head_revision() in versions
    app.extensions["solidloop"].broker.close()


def test_0008_builds_its_indexes_concurrently_on_existing_rows_and_downgrades(scratch_url):
    new_indexes = {"ix_solidloop_jobs_dead", "ix_solidloop_tool_calls_response_message_id",
                   "ix_solidloop_events_mcp_inbound", "ix_solidloop_events_mcp_inbound_session"}
    upgrade(scratch_url, "0007")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        conn.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message,"
                     " state) SELECT 'q', 'a', gen_random_uuid(), '{}', 'dead'"
                     " FROM generate_series(1, 50)")
        conn.execute("INSERT INTO solidloop_events (kind, payload) SELECT 'mcp_inbound',"
                     " jsonb_build_object('session_id', 's' || i) FROM generate_series(1, 50) i")
    upgrade(scratch_url, "0008")
    assert current_revision(scratch_url) == "0008"
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        valid = dict(conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c"
            " ON c.oid = i.indexrelid WHERE c.relname = ANY(%s)", (list(new_indexes),)))
        assert valid == dict.fromkeys(new_indexes, True)
        assert conn.execute("SELECT count(*) FROM solidloop_maintenance_runs").fetchone() == (0,)
    downgrade(scratch_url, "0007")
    assert "solidloop_maintenance_runs" not in tables(scratch_url)
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        left = conn.execute("SELECT relname FROM pg_class WHERE relname = ANY(%s)",
                            (list(new_indexes),)).fetchall()
        assert left == []
        assert conn.execute("SELECT count(*) FROM solidloop_jobs").fetchone() == (50,)


def test_0009_moves_the_queued_age_to_queued_at_and_downgrades(scratch_url):
    upgrade(scratch_url, "0008")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        conn.execute("INSERT INTO solidloop_loops (agent_name, status, updated_at)"
                     " SELECT 'a', s, now() - interval '2 hours'"
                     " FROM unnest(ARRAY['queued', 'running', 'completed']) s")
    upgrade(scratch_url, "0009")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        ages = dict(conn.execute(
            "SELECT status, queued_at = updated_at FROM solidloop_loops").fetchall())
        # A loop queued before the upgrade keeps its age; the others start now.
        assert ages == {"queued": True, "running": False, "completed": False}
        indexes = dict(conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c"
            " ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid"
            " WHERE t.relname = 'solidloop_loops'").fetchall())
        assert indexes == dict.fromkeys({
            "pk_solidloop_loops", "ix_solidloop_loops_status", "ix_solidloop_loops_subject",
            "ix_solidloop_loops_queued_at"}, True)
        (options,) = conn.execute(
            "SELECT reloptions FROM pg_class WHERE relname = 'solidloop_loops'").fetchone()
        assert options == ["fillfactor=80"]
        shapes = dict(conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE indexname = ANY(%s)",
            (["ix_solidloop_events_created_at",
              "ix_solidloop_tool_calls_response_message_id"],)).fetchall())
        assert "USING brin (created_at)" in shapes["ix_solidloop_events_created_at"]
        assert shapes["ix_solidloop_tool_calls_response_message_id"].endswith(
            "WHERE (response_message_id IS NOT NULL)")
    downgrade(scratch_url, "0008")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        names = {r[0] for r in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'solidloop_loops'")}
        assert {"ix_solidloop_loops_queued_since", "ix_solidloop_loops_running_lease"} <= names
        assert "ix_solidloop_loops_queued_at" not in names
        assert conn.execute("SELECT count(*) FROM solidloop_loops").fetchone() == (3,)
        (events_index,) = conn.execute(
            "SELECT indexdef FROM pg_indexes"
            " WHERE indexname = 'ix_solidloop_events_created_at'").fetchone()
        assert "USING btree (created_at)" in events_index


def test_0010_makes_the_tool_answer_index_partial_and_downgrades(scratch_url):
    upgrade(scratch_url, "0009")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status) "
                               "VALUES ('a', 'completed') RETURNING id").fetchone()[0]
        ask = conn.execute("INSERT INTO solidloop_messages (loop_id, role) "
                           "VALUES (%s, 'assistant') RETURNING id", (loop_id,)).fetchone()[0]
        call = conn.execute("INSERT INTO solidloop_tool_calls (loop_id, message_id, position, "
                            "name) VALUES (%s, %s, 0, 'add') RETURNING id",
                            (loop_id, ask)).fetchone()[0]
        conn.execute("INSERT INTO solidloop_messages (loop_id, role, tool_call_id) "
                     "VALUES (%s, 'tool', %s)", (loop_id, call))
    upgrade(scratch_url, "0010")

    def shape(conn):
        return conn.execute(
            "SELECT i.indisunique, i.indisvalid, pg_get_expr(i.indpred, i.indrelid), "
            "(SELECT count(*) FROM pg_constraint WHERE conname = c.relname) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = 'uq_solidloop_messages_tool_call_id'").fetchone()

    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        assert shape(conn) == (True, True, "(tool_call_id IS NOT NULL)", 0)
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("INSERT INTO solidloop_messages (loop_id, role, tool_call_id) "
                         "VALUES (%s, 'tool', %s)", (loop_id, call))
        assert conn.execute("SELECT count(*) FROM solidloop_messages").fetchone() == (2,)
    downgrade(scratch_url, "0009")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # The UNIQUE constraint again, over every row.
        assert shape(conn) == (True, True, None, 1)
        assert conn.execute("SELECT count(*) FROM solidloop_messages").fetchone() == (2,)


def test_0011_drops_the_events_unindexed_references_and_downgrades(scratch_url):
    upgrade(scratch_url, "0011")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status) "
                               "VALUES ('a', 'completed') RETURNING id").fetchone()[0]
        message = conn.execute("INSERT INTO solidloop_messages (loop_id, role) "
                               "VALUES (%s, 'assistant') RETURNING id", (loop_id,)).fetchone()[0]
        kept = conn.execute("INSERT INTO solidloop_messages (loop_id, role) "
                            "VALUES (%s, 'assistant') RETURNING id", (loop_id,)).fetchone()[0]
        for ref in (message, kept):
            conn.execute("INSERT INTO solidloop_events (loop_id, message_id, kind, payload) "
                         "VALUES (%s, %s, 'llm_request', '{}')", (loop_id, ref))
        # No key: deleting a message leaves its event's id as written.
        conn.execute("DELETE FROM solidloop_messages WHERE id = %s", (message,))
        assert sorted(r[0] for r in conn.execute(
            "SELECT message_id FROM solidloop_events")) == sorted([message, kept])
    downgrade(scratch_url, "0010")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # The keys again, valid: the reference that no longer resolved is NULL.
        assert conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'solidloop_events'::regclass "
            "AND contype = 'f' AND convalidated").fetchone() == (3,)
        refs = [r[0] for r in conn.execute("SELECT message_id FROM solidloop_events")]
        assert sorted(refs, key=str) == sorted([None, kept], key=str)
        # The loop's cascade removes its events, both ways.
        conn.execute("DELETE FROM solidloop_loops WHERE id = %s", (loop_id,))
        assert conn.execute("SELECT count(*) FROM solidloop_events").fetchone() == (0,)


def test_0012_adds_the_waiting_status_and_the_call_waits_and_downgrades(scratch_url):
    upgrade(scratch_url, "0011")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn, \
            pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO solidloop_loops (agent_name, status) VALUES ('a', 'waiting')")
    upgrade(scratch_url, "0012")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status, "
                               "execution_token) VALUES ('a', 'waiting', gen_random_uuid()) "
                               "RETURNING id").fetchone()[0]
        message = conn.execute("INSERT INTO solidloop_messages (loop_id, role) "
                               "VALUES (%s, 'assistant') RETURNING id", (loop_id,)).fetchone()[0]
        conn.execute("INSERT INTO solidloop_tool_calls (loop_id, message_id, position, name, "
                      "waits_for, wait_deadline) VALUES (%s, %s, 0, 'refund', 'approval', "
                      "now())", (loop_id, message))
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("UPDATE solidloop_tool_calls SET decision = 'maybe'")
        # The awaiting call is in the partial index, valid (built concurrently).
        assert conn.execute(
            "SELECT indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = 'ix_solidloop_tool_calls_awaiting'").fetchone() == (True,)
    downgrade(scratch_url, "0011")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # The waiting loop is paused, its generation cleared; the columns are gone.
        assert conn.execute("SELECT status, execution_token FROM solidloop_loops").fetchone() \
            == ("paused", None)
        columns = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'solidloop_tool_calls'")}
        assert not columns & {"waits_for", "decision", "wait_deadline"}


def test_0013_adds_the_provider_wait_columns_and_downgrades(scratch_url):
    upgrade(scratch_url, "0012")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        conn.execute("INSERT INTO solidloop_loops (agent_name, status) VALUES ('a', 'running')")
    upgrade(scratch_url, "0013")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # An existing loop waits on no provider: no outage, no deferred turns.
        assert conn.execute("SELECT provider_wait_since, provider_wait_attempts, "
                            "provider_wait_error FROM solidloop_loops").fetchone() \
            == (None, 0, None)
        conn.execute("UPDATE solidloop_loops SET provider_wait_since = now(), "
                     "provider_wait_attempts = 2, provider_wait_error = 'HTTP 503'")
    downgrade(scratch_url, "0012")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        columns = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'solidloop_loops'")}
        assert not columns & {"provider_wait_since", "provider_wait_attempts",
                              "provider_wait_error"}
        assert conn.execute("SELECT status FROM solidloop_loops").fetchone() == ("running",)


def test_0014_counts_lapsed_runs_on_tool_calls_and_downgrades(scratch_url):
    upgrade(scratch_url, "0013")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status) "
                               "VALUES ('a', 'running') RETURNING id").fetchone()[0]
        message = conn.execute("INSERT INTO solidloop_messages (loop_id, role) "
                               "VALUES (%s, 'assistant') RETURNING id", (loop_id,)).fetchone()[0]
        conn.execute("INSERT INTO solidloop_tool_calls (loop_id, message_id, position, name) "
                     "VALUES (%s, %s, 0, 'add')", (loop_id, message))
    upgrade(scratch_url, "0014")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # An existing call has lost no lease.
        assert conn.execute("SELECT lapsed_runs FROM solidloop_tool_calls").fetchone() == (0,)
        conn.execute("UPDATE solidloop_tool_calls SET lapsed_runs = lapsed_runs + 1")
    downgrade(scratch_url, "0013")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        columns = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'solidloop_tool_calls'")}
        assert "lapsed_runs" not in columns
        assert conn.execute("SELECT count(*) FROM solidloop_tool_calls").fetchone() == (1,)


def test_0026_adds_the_loop_trace_and_downgrades(scratch_url):
    upgrade(scratch_url, "0025")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        conn.execute("INSERT INTO solidloop_loops (agent_name, status) VALUES ('a', 'running')")
    upgrade(scratch_url, "0026")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # A loop started before the column has no trace context.
        assert conn.execute("SELECT trace FROM solidloop_loops").fetchone() == (None,)
        conn.execute("UPDATE solidloop_loops SET trace = '{\"traceparent\": \"x\"}'")
    downgrade(scratch_url, "0025")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        columns = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'solidloop_loops'")}
        assert "trace" not in columns
        assert conn.execute("SELECT status FROM solidloop_loops").fetchone() == ("running",)


def test_0027_answers_in_their_own_rows_and_the_downgrade_merges_them_back(scratch_url):
    upgrade(scratch_url, "0027")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status) "
                               "VALUES ('a', 'completed') RETURNING id").fetchone()[0]
        answered, pending = (conn.execute(
            "INSERT INTO solidloop_events (loop_id, kind, payload) VALUES "
            "(%s, 'llm_request', '{\"request\": {\"body\": 1}}') RETURNING id",
            (loop_id,)).fetchone()[0] for _ in range(2))
        conn.execute("INSERT INTO solidloop_llm_answers (event_id, status_code, duration_ms, "
                     "error, answer) VALUES (%s, 200, 12.5, NULL, '{\"response\": 2}')",
                     (answered,))
    downgrade(scratch_url, "0026")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        rows = conn.execute("SELECT id, status_code, duration_ms, payload FROM solidloop_events "
                            "ORDER BY id").fetchall()
        assert rows == [(answered, 200, 12.5, {"request": {"body": 1}, "response": 2}),
                        (pending, None, None, {"request": {"body": 1}})]
        assert conn.execute("SELECT to_regclass('solidloop_llm_answers')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname = "
                            "'solidloop_llm_answers_events_deleted'").fetchone() == (0,)


def test_0030_adds_the_message_kind_and_compacted_by_and_downgrades(scratch_url):
    upgrade(scratch_url, "0027")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        loop_id = conn.execute("INSERT INTO solidloop_loops (agent_name, status) "
                               "VALUES ('a', 'running') RETURNING id").fetchone()[0]
        conn.execute("INSERT INTO solidloop_messages (loop_id, role, content) "
                     "VALUES (%s, 'user', 'hi')", (loop_id,))
    upgrade(scratch_url, "0030")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # A message written before the columns is an ordinary one, replaced by nothing.
        assert conn.execute("SELECT kind, compacted_by FROM solidloop_messages").fetchone() \
            == ("message", None)
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO solidloop_messages (loop_id, role, kind) "
                         "VALUES (%s, 'user', 'other')", (loop_id,))
        summary = conn.execute("INSERT INTO solidloop_messages (loop_id, role, content, kind) "
                               "VALUES (%s, 'user', 'gist', 'summary') RETURNING id",
                               (loop_id,)).fetchone()[0]
        conn.execute("UPDATE solidloop_messages SET compacted_by = %s WHERE content = 'hi'",
                     (summary,))
    downgrade(scratch_url, "0027")
    with psycopg.connect(libpq_url(scratch_url), autocommit=True) as conn:
        # The replaced message is back in the history; the summary leaves it.
        assert conn.execute("SELECT content, is_hidden FROM solidloop_messages "
                            "ORDER BY id").fetchall() == [("hi", False), ("gist", True)]
