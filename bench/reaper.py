"""Benchmark the reaper: one pass with nothing to heal, over a large finished history.

Run it from the project root with the project's virtualenv::

    python bench/reaper.py            # 1,000,000 loops / 10,000,000 messages (minutes to build)
    python bench/reaper.py --reuse    # keep the data when its row counts already match
    python bench/reaper.py --loops 100000 --messages-per-loop 10 --passes 50

The issue's target: one ``reap(state)`` pass with nothing to heal, over 1,000,000
terminal loops and 10,000,000 messages, takes under 50 ms, because every reaper
query reads a partial index that holds only live rows.

What it does:

1. Builds a dedicated database (``solidloop_bench_reaper``; created if missing):
   schema from our migrations, then a finished history written with set-based SQL
   (``INSERT ... SELECT generate_series``): ``--loops`` loops, all completed, failed
   or paused; ``--messages-per-loop`` messages each (system, user, an assistant turn
   with two parallel tool calls, their two tool answers, then user/assistant turns),
   all ``completed``; two resolved tool calls per loop (answered, executed, no
   lease); one ``done`` job per loop; 5,000 events. The migration's secondary
   indexes are dropped for the load and recreated afterwards from the exact
   definitions the migration produced, then checked equal to the models'
   metadata; VACUUM ANALYZE runs last. ``--reuse`` skips all this when the
   database is at the migration head, has the expected row counts and its
   indexes match the models.
2. Baseline: the same schema, empty (database ``solidloop_bench_reaper_empty``,
   re-created by the migrations every run).
3. Times ``reap(state)`` (flask_solidloop.maintenance.reaper) in a minimal Flask app
   per database: one warm-up pass each, then ``--passes`` passes alternating big /
   empty. Reports min / median / p95 of ``ReapReport.duration_ms`` and of the
   wall time around the call, the ratio big / empty, and PASS/MISS of the big
   median against the target. Every pass must heal nothing.
4. Runs ``EXPLAIN (ANALYZE, BUFFERS)`` for each reaper query (and the broker's job
   recovery query) on the big database inside a rolled-back transaction (they
   lock rows or update), and prints planning / execution time, buffers and the
   index (or sequential scan) each one uses, plus the query's own median latency
   run plainly from the client. Plans of queries slower than 5 ms are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import psycopg
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from psycopg import sql
from sqlalchemy import Index, create_engine, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.schema import CreateIndex

from flask_solidloop import SolidLoop
from flask_solidloop.database import ensure_database
from flask_solidloop.loops.sql import heals as heal_sql
from flask_solidloop.maintenance.reaper import ReapReport, reap
from flask_solidloop.migrations import VERSION_TABLE, head_revision, upgrade
from flask_solidloop.models import metadata
from flask_solidloop.queue import sql as broker_module
from flask_solidloop.queue.broker import libpq_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_reaper"
EMPTY_SUFFIX = "_empty"
TARGET_MS = 50.0
GRACE = 60  # seconds, for the queries' :grace parameter in EXPLAIN
TOOL_CALLS_PER_LOOP = 2
EVENTS = 5000
SPAN_SECONDS = 180 * 86400  # the history spans six months, the newest loop an hour ago
SLOW_QUERY_MS = 5.0
MODEL_CHECK_SCHEMA = "solidloop_bench_model_check"

TABLES = ("solidloop_loops", "solidloop_messages", "solidloop_tool_calls",
          "solidloop_jobs", "solidloop_events")

# (name, SQL, parameters): the reaper's read queries in the order one pass runs
# them (stalled tools and orphan shells are healed by single UPDATEs now, with
# no read to time on its own).
QUERIES: list[tuple[str, str, dict[str, Any]]] = [
    ("recover_jobs", broker_module.RECOVER, {"max_deliveries": 5, "promote_after": None}),
    ("expired_llm", heal_sql.EXPIRED_LLM, {}),
    ("stalled_tools", heal_sql.HEAL_STALLED_TOOLS, {}),
    ("dropped_tools", heal_sql.DROPPED_TOOLS, {"grace": GRACE}),
    ("stuck_tool_phase", heal_sql.STUCK_TOOL_PHASE, {"grace": GRACE}),
    ("stuck_queued", heal_sql.STUCK_QUEUED, {"grace": GRACE}),
    ("orphan_shells", heal_sql.HEAL_ORPHAN_SHELLS, {}),
]
DRIVER_SQL = {"recover_jobs"}  # psycopg %(name)s parameters, not SQLAlchemy :name


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil(n * pct / 100), at least 1
    return ordered[int(rank) - 1]


def sqlalchemy_url(url: str) -> str:
    """flask-solidloop's session needs psycopg 3: ``postgresql://`` -> ``postgresql+psycopg://``."""
    scheme, rest = url.split("://", 1)
    return ("postgresql+psycopg://" + rest) if "+" not in scheme else url


def with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def connect(url: str) -> psycopg.Connection:
    return psycopg.connect(libpq_url(url), autocommit=True)


# -- schema ----------------------------------------------------------------------


def reset_schema(url: str) -> None:
    """Create the database if needed, drop our tables, re-create them by migration."""
    ensure_database(url)
    with connect(url) as conn:
        tables = [row[0] for row in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename LIKE 'solidloop\\_%'")]
        for table in tables:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(table)))
    upgrade(url)


def index_defs(conn: psycopg.Connection, schema: str | None = None) -> dict[str, str]:
    """index name -> definition (pg_get_indexdef, schema stripped) of our tables."""
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = "
        "coalesce(%s, current_schema()) AND tablename LIKE 'solidloop\\_%%' "
        "AND tablename <> %s", (schema, VERSION_TABLE)).fetchall()
    return {name: re.sub(r" ON (ONLY )?\S+\.", r" ON \1", definition)
            for name, definition in rows}


def model_index_defs(url: str) -> dict[str, str]:
    """The indexes the models' metadata defines, as PostgreSQL spells them.

    Creates the tables in a scratch schema inside a transaction that is rolled back.
    """
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {MODEL_CHECK_SCHEMA}"))
            metadata.create_all(conn.execution_options(
                schema_translate_map={None: MODEL_CHECK_SCHEMA}))
            raw = conn.connection.driver_connection
            defs = index_defs(raw, MODEL_CHECK_SCHEMA)  # type: ignore[arg-type]
            conn.rollback()
    finally:
        engine.dispose()
    return defs


def compare_indexes(live: dict[str, str], model: dict[str, str]) -> list[str]:
    problems = [f"missing: {name}" for name in sorted(set(model) - set(live))]
    problems += [f"not in the models: {name}" for name in sorted(set(live) - set(model))]
    problems += [f"differs: {name}: live {live[name]!r} vs model {model[name]!r}"
                 for name in sorted(set(live) & set(model)) if live[name] != model[name]]
    return problems


def secondary_indexes() -> dict[str, Index]:
    """The models' plain indexes (not the ones backing PK/UNIQUE constraints), by name."""
    return {str(index.name): index
            for table in metadata.tables.values() for index in table.indexes}


# -- data ------------------------------------------------------------------------


def expected_counts(args: argparse.Namespace) -> dict[str, int]:
    return {
        "solidloop_loops": args.loops,
        "solidloop_messages": args.loops * args.messages_per_loop,
        "solidloop_tool_calls": args.loops * TOOL_CALLS_PER_LOOP,
        "solidloop_jobs": args.loops,
        "solidloop_events": EVENTS,
    }


def row_counts(conn: psycopg.Connection) -> dict[str, int]:
    return {table: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
        sql.Identifier(table))).fetchone()[0] for table in TABLES}


def created(loop: str, loops: int) -> str:
    """SQL for the creation time of loop ``loop``: oldest first, newest an hour ago."""
    return (f"(now() - make_interval(secs => 3600 + ({loops} - {loop})::float8 * "
            f"{SPAN_SECONDS} / {loops}))")


def load_statements(loops: int, per_loop: int) -> tuple[list[tuple[str, str]],
                                                       list[tuple[str, str]]]:
    """Two lists of (label, SQL): messages (in id order), and everything else."""
    m = per_loop
    tc = TOOL_CALLS_PER_LOOP
    loops_sql = f"""
INSERT INTO solidloop_loops (id, agent_name, subject_type, subject_id, status, execution_token,
    lease_expires_at, error_message, step_count, started_at, run_started_at, run_step_base,
    finished_at, input_tokens, output_tokens, cost, frozen, observed, state,
    created_at, updated_at)
SELECT i, (ARRAY['support', 'research', 'triage', 'billing'])[1 + i % 4], 'Ticket', i::text,
       s.status, NULL, NULL,
       CASE WHEN s.status = 'failed' THEN 'LLM request failed after 5 attempts: 503' END,
       3, t.ts + interval '1 second', t.ts + interval '1 second', 0,
       CASE WHEN s.status <> 'paused' THEN t.ts + make_interval(secs => {m * 4 + 5}) END,
       4000 + i % 3000, 200 + i % 700, 0.01234567, false, false, '{{}}'::jsonb,
       t.ts, t.ts + make_interval(secs => {m * 4 + 5})
  FROM generate_series(__LO__::bigint, __HI__::bigint) AS g(i)
 CROSS JOIN LATERAL (SELECT CASE WHEN i % 1000 < 5 THEN 'paused'
                                 WHEN i % 1000 < 85 THEN 'failed'
                                 ELSE 'completed' END AS status) AS s
 CROSS JOIN LATERAL (SELECT {created('i', loops)} AS ts) AS t
"""
    # Message (loop l, k = 1..m): 1 system, 2 user, 3 assistant asking for two tool
    # calls, 4-5 the tool answers, then user (odd k) / assistant (even k) turns.
    messages_sql = f"""
INSERT INTO solidloop_messages (id, loop_id, role, content, status, is_hidden, reasoning,
    tool_call_id, finish_reason, usage, cost, metadata, completed_at, created_at, updated_at)
SELECT id, x.l, r.role,
       CASE WHEN x.k = 1 THEN 'You are a support agent. Be brief; use the tools when needed.'
            WHEN x.k = 2 THEN 'Ticket #' || x.l || ': the CSV export fails with a timeout.'
            WHEN x.k = 3 THEN 'Let me look up the account and the export job.'
            WHEN r.role = 'tool' THEN '{{"ok": true, "rows": ' || x.l % 997 || '}}'
            WHEN r.role = 'user' THEN 'Thanks. Can you also check invoice ' || x.l || '?'
            ELSE 'The export timed out on a large attachment; retried, it is done (turn '
                 || x.k || ').' END,
       'completed', false, NULL,
       CASE WHEN x.k BETWEEN 4 AND {3 + tc} THEN (x.l - 1) * {tc} + x.k - 3 END,
       CASE WHEN r.role = 'assistant' THEN CASE WHEN x.k = 3 THEN 'tool_calls' ELSE 'stop' END
       END,
       CASE WHEN r.role = 'assistant' THEN jsonb_build_object(
           'prompt_tokens', 900 + x.k * 150, 'completion_tokens', 40 + x.l % 90) END,
       CASE WHEN r.role = 'assistant' THEN 0.00123456 END,
       '{{}}'::jsonb, r.ts, r.ts, r.ts
  FROM generate_series(__LO__::bigint, __HI__::bigint) AS g(id)
 CROSS JOIN LATERAL (SELECT (id - 1) / {m} + 1 AS l, (id - 1) % {m} + 1 AS k) AS x
 CROSS JOIN LATERAL (
       SELECT CASE WHEN x.k = 1 THEN 'system' WHEN x.k = 2 THEN 'user'
                   WHEN x.k = 3 THEN 'assistant' WHEN x.k <= {3 + tc} THEN 'tool'
                   WHEN x.k % 2 = 0 THEN 'assistant' ELSE 'user' END AS role,
              {created('x.l', loops)} + make_interval(secs => x.k * 4) AS ts) AS r
"""
    tool_calls_sql = f"""
INSERT INTO solidloop_tool_calls (id, loop_id, message_id, position, call_id, name, server_name,
    tool_name, arguments_raw, arguments, is_success, result, error_kind, executed_at,
    lease_token, leased_until, duration_ms, response_message_id, created_at, updated_at)
SELECT id, x.l, (x.l - 1) * {m} + 3, x.p, 'call_' || left(md5(id::text), 24),
       CASE x.p WHEN 0 THEN 'crm__lookup_account' ELSE 'jobs__get_export' END,
       CASE x.p WHEN 0 THEN 'crm' ELSE 'jobs' END,
       CASE x.p WHEN 0 THEN 'lookup_account' ELSE 'get_export' END,
       '{{"id": ' || x.l || '}}', jsonb_build_object('id', x.l),
       id % 50 <> 0,
       CASE WHEN id % 50 <> 0 THEN jsonb_build_object('ok', true, 'rows', x.l % 997)
            ELSE jsonb_build_object('error', 'upstream timeout') END,
       CASE WHEN id % 50 = 0 THEN 'tool_error' END,
       x.ts + interval '2 seconds', NULL, NULL, 120.5 + id % 400,
       (x.l - 1) * {m} + 4 + x.p, x.ts, x.ts + interval '2 seconds'
  FROM generate_series(__LO__::bigint, __HI__::bigint) AS g(id)
 CROSS JOIN LATERAL (SELECT (id - 1) / {tc} + 1 AS l, (id - 1) % {tc} AS p) AS x0
 CROSS JOIN LATERAL (SELECT x0.l, x0.p,
                            {created('x0.l', loops)} + interval '12 seconds' AS ts) AS x
"""
    # One done job per loop: two of three are LLM turns, one a tool call.
    jobs_sql = f"""
INSERT INTO solidloop_jobs (id, queue_name, actor_name, message_id, message, state, eta,
    attempts, lease_token, lease_until, loop_id, last_error, created_at, started_at, finished_at)
SELECT j, x.queue, x.actor, x.uid,
       jsonb_build_object('queue_name', x.queue, 'actor_name', x.actor,
                          'args', CASE WHEN x.tool THEN jsonb_build_array((j - 1) * {tc} + 1,
                                        md5('token' || j)::uuid::text)
                                       ELSE jsonb_build_array(j) END,
                          'kwargs', '{{}}'::jsonb,
                          'options', jsonb_build_object('solidloop_loop_id', j),
                          'message_id', x.uid::text,
                          'message_timestamp', (extract(epoch FROM x.ts) * 1000)::bigint),
       'done', x.ts, 1, md5('lease' || j)::uuid, NULL, j, NULL,
       x.ts, x.ts + interval '1 second', x.ts + interval '6 seconds'
  FROM generate_series(__LO__::bigint, __HI__::bigint) AS g(j)
 CROSS JOIN LATERAL (
       SELECT j % 3 = 0 AS tool,
              CASE WHEN j % 3 = 0 THEN 'solidloop_tool' ELSE 'solidloop_llm' END AS queue,
              CASE WHEN j % 3 = 0 THEN 'solidloop.tool_call' ELSE 'solidloop.llm_turn' END
                  AS actor,
              md5('job' || j)::uuid AS uid,
              {created('j', loops)} + interval '3 seconds' AS ts) AS x
"""
    # A few thousand events on the newest loops (the janitor prunes older ones).
    events_sql = f"""
INSERT INTO solidloop_events (id, loop_id, message_id, tool_call_id, kind, status_code,
    duration_ms, error, payload, created_at, updated_at)
SELECT e, x.l,
       CASE WHEN e % 2 = 1 THEN (x.l - 1) * {m} + 3 END,
       CASE WHEN e % 2 = 0 THEN (x.l - 1) * {tc} + 1 END,
       CASE WHEN e % 2 = 1 THEN 'llm_request' ELSE 'tool_call' END, 200, 850.0 + e % 300, NULL,
       jsonb_build_object('request', jsonb_build_object('model', 'bench-model', 'messages', 3),
                          'response', jsonb_build_object('finish_reason', 'tool_calls')),
       x.ts, x.ts
  FROM generate_series(__LO__::bigint, __HI__::bigint) AS g(e)
 CROSS JOIN LATERAL (SELECT {loops} - ((e - 1) / 2) % {loops} AS l0) AS x0
 CROSS JOIN LATERAL (SELECT x0.l0 AS l, {created('x0.l0', loops)} + interval '4 seconds'
                     AS ts) AS x
"""
    chunk = 1_000_000

    def chunks(label: str, statement: str, total: int) -> list[tuple[str, str]]:
        out = []
        for lo in range(1, total + 1, chunk):
            hi = min(total, lo + chunk - 1)
            out.append((f"{label} {lo:,}-{hi:,}",
                        statement.replace("__LO__", str(lo)).replace("__HI__", str(hi))))
        return out

    messages = chunks("messages", messages_sql, loops * m)
    other = (chunks("loops", loops_sql, loops) + chunks("tool_calls", tool_calls_sql, loops * tc)
             + chunks("jobs", jobs_sql, loops) + chunks("events", events_sql, EVENTS))
    return messages, other


def run_streams(url: str, streams: list[list[tuple[str, str]]], t0: float) -> None:
    """Run each stream of statements on its own connection, streams in parallel."""
    errors: queue.Queue[BaseException] = queue.Queue()

    def worker(statements: list[tuple[str, str]]) -> None:
        try:
            with connect(url) as conn:
                # The data is consistent by construction (messages and tool calls
                # point at each other), so foreign-key triggers are skipped for the
                # load; the constraints themselves stay defined.
                conn.execute("SET session_replication_role = replica")
                conn.execute("SET synchronous_commit = off")
                for label, statement in statements:
                    started = time.perf_counter()
                    conn.execute(statement)
                    log(f"  [{time.perf_counter() - t0:6.1f} s] {label}: "
                        f"{time.perf_counter() - started:.1f} s")
        except BaseException as exc:  # reported by the main thread
            errors.put(exc)

    threads = [threading.Thread(target=worker, args=(stream,)) for stream in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not errors.empty():
        raise errors.get()


def generate(args: argparse.Namespace, model_defs: dict[str, str]) -> float:
    """Rebuild the big database. Returns the seconds it took."""
    t0 = time.perf_counter()
    log(f"generating {args.loops:,} loops x {args.messages_per_loop} messages in {args.url} ...")
    reset_schema(args.url)
    with connect(args.url) as conn:
        migrated = index_defs(conn)
        problems = compare_indexes(migrated, model_defs)
        if problems:
            raise SystemExit("the migration's indexes differ from the models':\n  "
                             + "\n  ".join(problems))
        indexes = secondary_indexes()
        for name in sorted(indexes):
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
        log(f"  dropped {len(indexes)} secondary indexes for the load "
            f"(kept {len(migrated) - len(indexes)} PK/UNIQUE)")

    messages, other = load_statements(args.loops, args.messages_per_loop)
    run_streams(args.url, [messages, other], t0)

    # Re-created from the models' Index objects, the same definitions the
    # migration's op.create_index calls carry; checked against the migration below.
    engine = create_engine(args.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as sa_conn:
            sa_conn.execute(text("SET maintenance_work_mem = '1GB'"))
            for name in sorted(indexes):
                started = time.perf_counter()
                sa_conn.execute(CreateIndex(indexes[name]))
                log(f"  [{time.perf_counter() - t0:6.1f} s] index {name}: "
                    f"{time.perf_counter() - started:.1f} s")
    finally:
        engine.dispose()

    with connect(args.url) as conn:
        problems = compare_indexes(index_defs(conn), migrated)
        if problems:
            raise SystemExit("re-created indexes differ from the migration's:\n  "
                             + "\n  ".join(problems))
        for table in TABLES:
            conn.execute(sql.SQL(
                "SELECT setval(pg_get_serial_sequence({t}, 'id'), "
                "(SELECT coalesce(max(id), 0) + 1 FROM {i}), false)").format(
                    t=sql.Literal(table), i=sql.Identifier(table)))
        started = time.perf_counter()
        conn.execute("VACUUM (ANALYZE)")
        log(f"  [{time.perf_counter() - t0:6.1f} s] VACUUM (ANALYZE): "
            f"{time.perf_counter() - started:.1f} s")
        conn.execute("CHECKPOINT")
    seconds = time.perf_counter() - t0
    log(f"  generated in {seconds:.1f} s")
    return seconds


def reusable(args: argparse.Namespace, model_defs: dict[str, str]) -> str | None:
    """None if the big database can be reused as is, else why not."""
    try:
        with connect(args.url) as conn:
            present = {row[0] for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
            if not {*TABLES, VERSION_TABLE} <= present:
                return "tables missing"
            version = conn.execute(
                sql.SQL("SELECT version_num FROM {}").format(sql.Identifier(VERSION_TABLE))
            ).fetchone()
            if not version or version[0] != head_revision():
                return f"schema at {version[0] if version else None}, not {head_revision()}"
            counts = row_counts(conn)
            if counts != expected_counts(args):
                return f"row counts {counts} differ from {expected_counts(args)}"
            problems = compare_indexes(index_defs(conn), model_defs)
            if problems:
                return "indexes differ from the models: " + "; ".join(problems)
    except psycopg.OperationalError as exc:
        return f"cannot connect: {str(exc).strip()}"
    return None


# -- timing ----------------------------------------------------------------------


def make_app(url: str, name: str) -> Flask:
    """A minimal host app: Flask-SQLAlchemy plus the extension, no agents needed."""
    app = Flask(name)
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy()
    db.init_app(app)
    SolidLoop(app, db=db)
    return app


class Series:
    def __init__(self) -> None:
        self.reported: list[float] = []
        self.wall: list[float] = []
        self.healed = 0

    def run(self, app: Flask) -> ReapReport:
        state = app.extensions["solidloop"]
        with app.app_context():
            started = time.perf_counter()
            report = reap(state)
            wall = (time.perf_counter() - started) * 1000
        if report.healed:
            raise SystemExit(f"the reaper healed something: {report.summary()}")
        self.reported.append(report.duration_ms)
        self.wall.append(wall)
        return report


def time_reaps(big_url: str, empty_url: str, passes: int) -> tuple[Series, Series]:
    big_app, empty_app = make_app(big_url, "reaper-bench"), make_app(empty_url, "reaper-empty")
    big, empty = Series(), Series()
    try:
        Series().run(big_app)  # warm-up: connections, pools, caches
        Series().run(empty_app)
        for _ in range(passes):  # alternate, so drift in the machine hits both alike
            big.run(big_app)
            empty.run(empty_app)
    finally:
        for app in (big_app, empty_app):
            app.extensions["solidloop"].broker.close()
            with app.app_context():
                app.extensions["solidloop"].db.engine.dispose()
    return big, empty


# -- EXPLAIN ---------------------------------------------------------------------


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += walk(child)
    return out


def access_paths(plan: dict[str, Any]) -> list[str]:
    paths = []
    for node in walk(plan):
        kind = node["Node Type"]
        where = node.get("Relation Name")
        if "Index Name" in node:
            path = f"{kind} {node['Index Name']}"
        elif kind in ("Seq Scan", "Bitmap Heap Scan", "Tid Scan"):
            path = f"{kind} on {where}"
        else:
            continue
        if path not in paths:
            paths.append(path)
    return paths


def explain_all(url: str, passes: int) -> list[dict[str, Any]]:
    engine = create_engine(url)
    results = []
    try:
        with engine.connect() as conn:
            for name, statement, params in QUERIES:
                def execute(prefix: str, conn: Connection = conn, statement: str = statement,
                            params: dict[str, Any] = params, name: str = name) -> Any:
                    if name in DRIVER_SQL:
                        return conn.exec_driver_sql(prefix + statement, params).all()
                    return conn.execute(text(prefix + statement), params).all()

                # Everything runs in a transaction that is rolled back: the queries
                # lock rows (FOR UPDATE) or update them.
                plan_json = execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ")[0][0][0]
                conn.rollback()
                plan_text = "\n".join(row[0] for row in execute("EXPLAIN (ANALYZE, BUFFERS) "))
                conn.rollback()
                plain = []
                for _ in range(passes):
                    started = time.perf_counter()
                    execute("")
                    plain.append((time.perf_counter() - started) * 1000)
                    conn.rollback()
                top = plan_json["Plan"]
                results.append({
                    "name": name,
                    "planning": plan_json.get("Planning Time", float("nan")),
                    "execution": plan_json.get("Execution Time", float("nan")),
                    "plain": statistics.median(plain),
                    "rows": top.get("Actual Rows", 0),
                    "hit": top.get("Shared Hit Blocks", 0),
                    "read": top.get("Shared Read Blocks", 0),
                    "paths": access_paths(top),
                    "text": plan_text,
                })
    finally:
        engine.dispose()
    return results


# -- report ----------------------------------------------------------------------


def server_info(url: str) -> str:
    with connect(url) as conn:
        settings = {name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name)))
                    .fetchone()[0]
                    for name in ("server_version", "shared_buffers", "work_mem", "jit",
                                 "effective_cache_size", "random_page_cost")}
    version = settings.pop("server_version").split()[0]
    return f"PostgreSQL {version}, " + ", ".join(f"{k}={v}" for k, v in settings.items())


def sizes(url: str) -> tuple[str, list[tuple[str, int, str, str]]]:
    with connect(url) as conn:
        database = conn.execute(
            "SELECT pg_size_pretty(pg_database_size(current_database()))").fetchone()[0]
        counts = row_counts(conn)
        rows = []
        for table in TABLES:
            table_size, index_size = conn.execute(
                "SELECT pg_size_pretty(pg_table_size(%s::regclass)), "
                "pg_size_pretty(pg_indexes_size(%s::regclass))", (table, table)).fetchone()
            rows.append((table, counts[table], table_size, index_size))
    return database, rows


def status_mix(url: str) -> str:
    with connect(url) as conn:
        loops = conn.execute("SELECT status, count(*) FROM solidloop_loops GROUP BY 1 "
                             "ORDER BY 2 DESC").fetchall()
        roles = conn.execute("SELECT role, count(*) FROM solidloop_messages GROUP BY 1 "
                             "ORDER BY 2 DESC").fetchall()
        jobs = conn.execute("SELECT state, count(*) FROM solidloop_jobs GROUP BY 1 "
                            "ORDER BY 2 DESC").fetchall()

    def fmt_rows(rows: list[tuple[Any, ...]]) -> str:
        return ", ".join(f"{key} {count:,}" for key, count in rows)

    return (f"loops: {fmt_rows(loops)}\n  messages: {fmt_rows(roles)} (all completed)\n"
            f"  jobs: {fmt_rows(jobs)}")


def disk_free(url: str) -> str:
    path = "/"
    try:
        with connect(url) as conn:
            path = conn.execute("SHOW data_directory").fetchone()[0]
        usage = shutil.disk_usage(path)
    except Exception:
        path, usage = "/", shutil.disk_usage("/")
    return f"{usage.free / 1e9:.1f} GB free on the filesystem of {path}"


def machine_load(url: str) -> str:
    """The load average and other active sessions on the server: noise to know about."""
    with connect(url) as conn:
        others = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND state <> 'idle' AND pid <> pg_backend_pid()").fetchone()[0]
    return f"load average {os.getloadavg()[0]:.2f}, {others} other active sessions"


def triple(values: list[float]) -> str:
    return (f"{min(values):8.2f}{statistics.median(values):9.2f}"
            f"{percentile(values, 95):9.2f}")


def report(args: argparse.Namespace, big: Series, empty: Series,
           explains: list[dict[str, Any]], generation: str, load: str) -> bool:
    database, table_rows = sizes(args.url)
    print()
    print(f"server: {server_info(args.url)}; {os.cpu_count()} CPUs")
    print(f"machine during the timing: before: {load}")
    print(f"data: {generation}")
    print(f"  {status_mix(args.url)}")
    print()
    print(f"{'table':<24}{'rows':>14}{'table':>12}{'indexes':>12}")
    for table, count, table_size, index_size in table_rows:
        print(f"{table:<24}{count:>14,}{table_size:>12}{index_size:>12}")
    print(f"database {make_url(args.url).database}: {database}")
    print()

    print(f"reap(state), nothing to heal: 1 warm-up + {args.passes} passes per database, "
          "alternating (ms)")
    print(f"{'':34}{'min':>8}{'median':>9}{'p95':>9}")
    print(f"{'big   ReapReport.duration_ms':<34}{triple(big.reported)}")
    print(f"{'big   wall time around reap()':<34}{triple(big.wall)}")
    print(f"{'empty ReapReport.duration_ms':<34}{triple(empty.reported)}")
    print(f"{'empty wall time around reap()':<34}{triple(empty.wall)}")
    big_median = statistics.median(big.reported)
    ratio = big_median / statistics.median(empty.reported)
    print(f"ratio big / empty (median duration_ms): {ratio:.2f}x")
    print(f"healed: 0 in all {2 * (args.passes + 1)} passes")
    ok = big_median < TARGET_MS
    print(f"target: median < {TARGET_MS:g} ms over {args.loops:,} loops / "
          f"{args.loops * args.messages_per_loop:,} messages: {big_median:.2f} ms "
          f"{'PASS' if ok else 'MISS'}")
    print()

    print(f"EXPLAIN (ANALYZE, BUFFERS) on the big database, :grace = {GRACE} s, rolled back; "
          f"'plain' = median of {args.passes} plain runs from the client (ms)")
    print(f"{'query':<18}{'plan':>8}{'exec':>8}{'plain':>8}{'rows':>6}{'hit':>6}{'read':>6}"
          "  access path")
    for row in explains:
        print(f"{row['name']:<18}{row['planning']:8.3f}{row['execution']:8.3f}"
              f"{row['plain']:8.3f}{row['rows']:6d}{row['hit']:6d}{row['read']:6d}"
              f"  {'; '.join(row['paths'])}")
    seq = [row["name"] for row in explains
           if any(path.startswith("Seq Scan") for path in row["paths"])]
    print(f"sequential scans: {', '.join(seq) if seq else 'none'}")
    slow = [row for row in explains if row["planning"] + row["execution"] > SLOW_QUERY_MS]
    for row in slow:
        print(f"\nSLOW ({row['planning'] + row['execution']:.1f} ms) {row['name']}:")
        print(row["text"])
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--loops", type=int, default=1_000_000, help="loops (1,000,000)")
    parser.add_argument("--messages-per-loop", type=int, default=10,
                        help="messages per loop (10; at least 5)")
    parser.add_argument("--passes", type=int, default=20, help="timed reap passes (20)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the data if the row counts and indexes already match")
    parser.add_argument("--url", default=DEFAULT_URL, help="URL of the bench database")
    args = parser.parse_args(argv)
    if args.messages_per_loop < 3 + TOOL_CALLS_PER_LOOP:
        parser.error(f"--messages-per-loop must be at least {3 + TOOL_CALLS_PER_LOOP}")
    if args.loops < 1 or args.passes < 1:
        parser.error("--loops and --passes must be positive")
    args.url = sqlalchemy_url(args.url)
    empty_url = with_database(args.url, str(make_url(args.url).database) + EMPTY_SUFFIX)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()

    ensure_database(args.url)
    log(disk_free(args.url))
    model_defs = model_index_defs(args.url)
    why = reusable(args, model_defs) if args.reuse else "--reuse not given"
    if why is None:
        generation = "reused (--reuse: counts, schema head and indexes match)"
        log("reusing the existing data")
    else:
        log(f"regenerating: {why}")
        seconds = generate(args, model_defs)
        generation = f"generated in {seconds:.1f} s this run"
    generation += (f"; {len(model_defs)} indexes, identical to the models' metadata "
                   "(and the migration's)")

    log(f"empty baseline: {make_url(empty_url).database}")
    reset_schema(empty_url)

    log(f"timing {args.passes} reap passes per database ...")
    before = machine_load(args.url)
    big, empty = time_reaps(args.url, empty_url, args.passes)
    after = machine_load(args.url)
    log("EXPLAIN ANALYZE ...")
    explains = explain_all(args.url, args.passes)
    ok = report(args, big, empty, explains, generation, f"{before}; after: {after}")
    print(f"\n(total run {time.perf_counter() - t_start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
