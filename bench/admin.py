"""Benchmark the admin: server time of its pages over 1,000,000 loops and
10,000,000 messages, and 100 concurrent live observers on one web process.

Run it from the project root with the project's virtualenv::

    python bench/admin.py            # builds the data once (minutes), then times
    python bench/admin.py --reuse    # keep the data when it matches (see bench/reaper.py)
    python bench/admin.py --loops 100000 --observers 20
    python bench/admin.py --reuse --observers 0   # the pages only

Data: bench/reaper.py's generator (set-based SQL, the migration's indexes, VACUUM
ANALYZE), in its own database ``solidloop_bench_admin``: ``--loops`` finished
loops of four agents (completed, failed, paused), ten messages each, two tool
calls each, spread over six months. On top, for the run only, one running loop
with 1,000 messages and 200 tool calls (deleted afterwards so ``--reuse``
still matches).

1. Pages: each requested ``--passes`` times through Flask's test client after
   one warm-up (so the time is the server's: routing, queries and rendering, no
   network), median / p95 in ms against the 300 ms target: the dashboard with
   its charts (24 h and 7 d, after one rollup pass: ``flask solidloop rollup``'s
   function, its backfill and a steady pass timed too), an agent page, the
   unfiltered list, lists filtered by status + agent, by failure class, by
   subject, by JSON containment on state, by text in messages, the second page
   of a filtered list (older, and newer: keyset both ways), and the loop page
   with 1,000 messages. Each list page also counts its filtered loops (exact
   within SOLIDLOOP_ADMIN_COUNT_BUDGET, else the planner's "about N"); that
   count is timed on its own too (loops.listing.count_or_estimate), with
   whether it was exact. The baseline: the dashboard's queries as they were
   before the charts (a GROUP BY of every loop's status, the last hour's and
   day's turns from the messages, the last day's failures from the loops, the
   queues, the dead letters), without the page around them; the dashboard
   with charts (the whole page) is printed as a ratio of it.
2. Observers: a threaded WSGI server in this process serves the admin;
   ``--observers`` clients hold the big loop's live stream open while a writer
   records ``--partials`` partials (``loops.store.record_delta``, which
   NOTIFYs on commit). Reports how long each partial took to reach every
   observer (median / max), and the database connections the web process held
   (sampled from pg_stat_activity: LISTEN connections by application_name, and
   the peak of its pooled ones), against the target of one LISTEN connection.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reaper

from flask_solidloop import SolidLoop
from flask_solidloop.admin import filters
from flask_solidloop.database import ensure_database
from flask_solidloop.loops import listing, stats, store
from flask_solidloop.maintenance.rollup import rollup
from flask_solidloop.streaming import LISTEN_APPLICATION_NAME

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_admin"
TARGET_MS = 300.0
BIG_AGENT = "bench_admin_big"
WEB_APP_NAME = "solidloop-bench-admin-web"
#: A token event's offset and text (admin/live.py's token_html).
TOKEN = re.compile(r'data-o="(\d+)">([^<]*)</span>')


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_app(url: str, stream_seconds: float) -> Flask:
    app = Flask("admin-bench")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
        "connect_args": {"application_name": WEB_APP_NAME}}
    app.config["SOLIDLOOP_ADMIN_STREAM_SECONDS"] = stream_seconds
    app.config["SOLIDLOOP_ADMIN_HEARTBEAT"] = 5.0
    db = SQLAlchemy()
    db.init_app(app)
    solidloop = SolidLoop(app, db=db)
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    return app


def drop_big_loop(conn: psycopg.Connection) -> None:
    """Delete the bench's own loop table by table with FK triggers off: the
    cascade would check solidloop_tool_calls.response_message_id (no index)
    once per deleted message, a scan of 2M rows each time. Nothing else
    references these rows."""
    conn.execute("SET session_replication_role = replica")
    ids = [r[0] for r in conn.execute("SELECT id FROM solidloop_loops WHERE agent_name = %s",
                                      (BIG_AGENT,))]
    for table in ("solidloop_events", "solidloop_tool_calls", "solidloop_messages",
                  "solidloop_mcp_sessions", "solidloop_loops"):
        column = "id" if table == "solidloop_loops" else "loop_id"
        conn.execute(f"DELETE FROM {table} WHERE {column} = ANY(%s)", (ids,))
    conn.execute("SET session_replication_role = origin")


def add_big_loop(conninfo: str, messages: int) -> tuple[int, int]:
    """A running loop with ``messages`` messages (a fifth of them tool answers
    to a call each) and a processing shell; returns (loop id, shell id)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        drop_big_loop(conn)
        loop_id = conn.execute(
            "INSERT INTO solidloop_loops (agent_name, status, execution_token, step_count, "
            "started_at, state) VALUES (%s, 'running', gen_random_uuid(), %s, now(), "
            "'{\"bench\": true}') RETURNING id", (BIG_AGENT, messages // 5)).fetchone()[0]
        conn.execute(
            "INSERT INTO solidloop_messages (loop_id, role, content, status, usage, cost, "
            "metadata) SELECT %s, CASE WHEN i %% 5 = 1 THEN 'user' WHEN i %% 5 IN (2, 4) "
            "THEN 'assistant' ELSE 'tool' END, repeat('text ' || i || ' ', 20), 'completed', "
            "'{\"input_tokens\": 120, \"output_tokens\": 40}', 0.00042, "
            "'{\"metrics\": {\"duration_ms\": 850, \"ttft_ms\": 210}}' "
            "FROM generate_series(1, %s) AS i", (loop_id, messages - 1))
        conn.execute(
            "INSERT INTO solidloop_tool_calls (loop_id, message_id, position, call_id, name, "
            "arguments, is_success, result, executed_at, duration_ms) "
            "SELECT %s, m.id, 0, 'c' || m.id, 'calc__add', '{\"a\": 1, \"b\": 2}', true, "
            "'{\"content\": [{\"type\": \"text\", \"text\": \"3\"}]}', now(), 12 "
            "FROM solidloop_messages m WHERE m.loop_id = %s AND m.role = 'assistant' "
            "AND m.id %% 2 = 0", (loop_id, loop_id))
        shell = conn.execute(
            "INSERT INTO solidloop_messages (loop_id, role, content, status, is_hidden) "
            "VALUES (%s, 'assistant', '', 'processing', true) RETURNING id",
            (loop_id,)).fetchone()[0]
        conn.execute("ANALYZE solidloop_messages")
    return loop_id, shell


def old_dashboard(session: Any) -> None:
    """The dashboard's reads as they were before the charts' rollup (the
    baseline): every loop's status grouped, the last hour's and day's turns
    from the messages (their first id found by the same binary search), the
    last day's failed loops by class, the queues and the dead-letter count."""
    from datetime import timedelta

    from sqlalchemy import func, select, text

    from flask_solidloop.loops import queries
    from flask_solidloop.models import Loop

    now = session.execute(select(func.now())).scalar_one()
    session.execute(select(Loop.status, func.count()).group_by(Loop.status)).all()
    for span in (timedelta(hours=1), timedelta(days=1)):
        first = queries.first_id_since(session, "solidloop_messages", now - span)
        if first is not None:
            session.execute(text(
                "SELECT count(*), coalesce(sum((usage->>'input_tokens')::bigint), 0),"
                " coalesce(sum((usage->>'output_tokens')::bigint), 0), sum(cost)"
                " FROM solidloop_messages WHERE id >= :first AND role = 'assistant'"
                " AND status = 'completed' AND created_at >= :since"),
                {"first": first, "since": now - span}).one()
    first_loop = queries.first_id_since(session, "solidloop_loops", now - timedelta(days=1))
    if first_loop is not None:
        cls = queries.failure_class_sql().label("cls")
        session.execute(select(cls, func.count()).where(
            Loop.id >= first_loop, Loop.status == "failed").group_by(cls)).all()
    session.execute(text(
        "SELECT queue_name, count(*) FILTER (WHERE state = 'queued'),"
        " count(*) FILTER (WHERE state = 'running'), min(created_at) FILTER (WHERE state ="
        " 'queued') FROM solidloop_jobs WHERE state IN ('queued', 'running')"
        " GROUP BY queue_name")).all()
    session.execute(text("SELECT count(*) FROM solidloop_jobs WHERE state = 'dead'")).one()
    session.rollback()


def time_baseline(app: Flask, passes: int) -> dict[str, Any]:
    """:func:`old_dashboard`, ``passes`` times after a warm-up, on the app's session."""
    times = []
    with app.app_context():
        session = app.extensions["sqlalchemy"].session
        for n in range(passes + 1):
            started = time.perf_counter()
            old_dashboard(session)
            if n:
                times.append((time.perf_counter() - started) * 1000)
        session.remove()
    return {"page": "baseline: the dashboard's queries before the charts", "path": "-",
            "median": statistics.median(times), "p95": reaper.percentile(times, 95),
            "bytes": 0}


def time_pages(app: Flask, pages: list[tuple[str, str]], passes: int) -> list[dict[str, Any]]:
    client = app.test_client()
    rows = []
    for label, path in pages:
        response = client.get(path)
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}: "
                             f"{response.get_data(as_text=True)[:500]}")
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200
        rows.append({"page": label, "path": path, "median": statistics.median(times),
                     "p95": reaper.percentile(times, 95), "bytes": len(response.data),
                     **count_time(app, path, passes)})
        log(f"  {label}: median {rows[-1]['median']:.1f} ms")
    return rows


def count_time(app: Flask, path: str, passes: int) -> dict[str, Any]:
    """The list's total alone, as the list page computes it: median ms, and
    whether the count was exact (else the planner's estimate)."""
    from urllib.parse import parse_qsl, urlsplit

    from werkzeug.datastructures import MultiDict

    if not path.startswith("/admin/loops") or "/admin/loops/" in path:
        return {}
    search = filters.parse(MultiDict(parse_qsl(urlsplit(path).query)))
    state = app.extensions["solidloop"]
    session = state.db.session
    times, total = [], None
    scanned = bool(search.text or search.state or search.failure or search.created_from
                   or search.created_to)  # the list then estimates (or knows from its scan)
    for _ in range(passes):
        started = time.perf_counter()
        total = (listing.estimate(session, search) if scanned else listing.count_or_estimate(
            session, search, budget_seconds=state.config.admin_count_budget))
        times.append((time.perf_counter() - started) * 1000)
        session.rollback()
    assert total is not None
    return {"count_ms": statistics.median(times), "count": total.count, "exact": total.exact}


def observers(app: Flask, conninfo: str, loop_id: int, shell: int, count: int,
              partials: int) -> dict[str, Any]:
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    port = server.server_port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Each observer is a browser: the shared stream (admin/static/stream-worker.js),
    # from where the loop's page would start, with a client id of its own.
    url = f"http://127.0.0.1:{port}/admin/stream?loop={loop_id}&client=bench-{{}}"
    received: list[dict[int, float]] = [{} for _ in range(count)]
    ready = threading.Barrier(count + 1)
    stop = threading.Event()

    def observe(i: int) -> None:
        with httpx.Client(timeout=30) as client, \
                client.stream("GET", url.format(i)) as response:
            ready.wait()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    message = json.loads(line[6:])
                    token = TOKEN.search(message["data"]) if message["event"] == "token" else None
                    if token:  # the text's length once this piece is shown
                        end = int(token.group(1)) + len(html.unescape(token.group(2)))
                        received[i].setdefault(end, time.perf_counter())
                if stop.is_set():
                    return

    threads = [threading.Thread(target=observe, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    ready.wait(timeout=60)
    time.sleep(0.5)
    samples: list[tuple[int, int]] = []
    latencies: list[float] = []

    def sample() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE application_name = %s),"
                " count(*) FILTER (WHERE application_name = %s)"
                " FROM pg_stat_activity WHERE datname = current_database()",
                (LISTEN_APPLICATION_NAME, WEB_APP_NAME)).fetchone()
            samples.append((row[0], row[1]))

    engine_url = conninfo
    text = ""
    with psycopg.connect(engine_url, autocommit=False) as writer:
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        engine = create_engine(reaper.sqlalchemy_url(app.config["SQLALCHEMY_DATABASE_URI"]))
        with Session(engine) as session:
            for n in range(partials):
                piece = f"token{n:03d} "
                sent = time.perf_counter()
                store.record_delta(session, shell, piece, len(text))
                text += piece
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not all(
                        len(text) in r for r in received):
                    time.sleep(0.002)
                arrived = [r.get(len(text)) for r in received]
                if None in arrived:
                    raise SystemExit(f"partial {n} did not reach every observer")
                latencies.append((max(arrived) - sent) * 1000)  # type: ignore[type-var]
                sample()
                time.sleep(0.1)
        engine.dispose()
        writer.rollback()
    stop.set()
    server.shutdown()
    return {"observers": count, "partials": partials,
            "median_ms": statistics.median(latencies), "max_ms": max(latencies),
            "listen_connections": max(s[0] for s in samples),
            "pooled_connections_peak": max(s[1] for s in samples)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--loops", type=int, default=1_000_000)
    parser.add_argument("--messages-per-loop", type=int, default=10)
    parser.add_argument("--big-loop-messages", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--observers", type=int, default=100, help="0 skips the observers")
    parser.add_argument("--partials", type=int, default=20)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--url", default=DEFAULT_URL)
    args = parser.parse_args(argv)
    args.url = reaper.sqlalchemy_url(args.url)
    conninfo = reaper.libpq_url(args.url)
    ensure_database(args.url)
    try:  # a run that was interrupted may have left its big loop behind
        with psycopg.connect(conninfo, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('solidloop_loops')").fetchone()[0]:
                drop_big_loop(conn)
    except psycopg.Error:
        pass
    model_defs = reaper.model_index_defs(args.url)
    why = reaper.reusable(args, model_defs) if args.reuse else "--reuse not given"
    if why is None:
        generation = "reused"
        log("reusing the existing data")
    else:
        log(f"regenerating: {why}")
        generation = f"generated in {reaper.generate(args, model_defs):.1f} s"
    loop_id, shell = add_big_loop(conninfo, args.big_loop_messages)
    try:
        app = make_app(args.url, stream_seconds=60)
        with psycopg.connect(conninfo) as conn:
            subject = conn.execute("SELECT subject_type, subject_id FROM solidloop_loops "
                                   "WHERE subject_id IS NOT NULL LIMIT 1").fetchone()
            page2 = conn.execute("SELECT id FROM solidloop_loops WHERE status = 'failed' "
                                 "AND agent_name = 'support' ORDER BY id DESC OFFSET 50 "
                                 "LIMIT 1").fetchone()
            page3 = conn.execute("SELECT id FROM solidloop_loops WHERE status = 'failed' "
                                 "AND agent_name = 'support' ORDER BY id DESC OFFSET 100 "
                                 "LIMIT 1").fetchone()
        with app.app_context():
            state = app.extensions["solidloop"]
            first_kind = ("catch-up (reused data, rolled up before)"
                          if stats.rolled_to(state.db.session) else "7-day backfill")
            state.db.session.rollback()
            started = time.perf_counter()
            backfill = rollup(state)
            backfill_s = time.perf_counter() - started
            with psycopg.connect(conninfo, autocommit=True) as conn:  # a minute later
                conn.execute("UPDATE solidloop_rollup_marks SET rolled_to = rolled_to"
                             " - interval '1 minute'")
            started = time.perf_counter()
            rollup(state)
            steady_ms = (time.perf_counter() - started) * 1000
            state.db.session.remove()
        log(f"rollup: backfill {backfill_s:.1f} s ({backfill.minute_rows} minute rows), "
            f"a steady pass {steady_ms:.0f} ms")
        pages = [
            ("dashboard with charts (24h)", "/admin/"),
            ("dashboard with charts (7d)", "/admin/?range=7d"),
            ("agent page with charts (24h)", "/admin/agents/support"),
            ("list, unfiltered", "/admin/loops"),
            ("list, status=failed & agent", "/admin/loops?status=failed&agent=support"),
            ("list, failed: page 2 (keyset)",
             f"/admin/loops?status=failed&agent=support&before={page2[0] if page2 else 0}"),
            ("list, failed: newer than page 3 (keyset)",
             f"/admin/loops?status=failed&agent=support&after={page3[0] if page3 else 0}"),
            ("list, failure=infra:http", "/admin/loops?failure=infra%3Ahttp"),
            ("list, failure=agent", "/admin/loops?failure=agent"),
            ("list, subject", f"/admin/loops?subject_type={subject[0]}&subject_id={subject[1]}"
             if subject else "/admin/loops?subject_type=User&subject_id=1"),
            ("list, state @> (rare: 1 match)", "/admin/loops?state=%7B%22bench%22%3Atrue%7D"),
            ("list, text in messages (common)", "/admin/loops?q=weather"),
            ("list, text in messages (rare)", "/admin/loops?q=zz-no-such-text"),
            ("loop page, 1,000 messages", f"/admin/loops/{loop_id}"),
        ]
        log(f"timing {len(pages)} pages x {args.passes} ...")
        with app.app_context():
            rows = time_pages(app, pages, args.passes)
        baseline = time_baseline(app, args.passes)
        live = None
        if args.observers:
            log(f"{args.observers} observers ...")
            live = observers(app, conninfo, loop_id, shell, args.observers, args.partials)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            drop_big_loop(conn)
    print(f"\nadmin bench: {args.loops:,} loops, {args.loops * args.messages_per_loop:,} "
          f"messages ({generation}); {reaper.server_info(args.url)}")
    print(f"\nrollup: first pass ({first_kind}) {backfill_s:.1f} s, "
          f"{backfill.minute_rows} minute rows; a steady pass {steady_ms:.0f} ms")
    print(f"\n| page | median ms | p95 ms | KB | count ms | total | target {TARGET_MS:.0f} ms |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| {baseline['page']} | {baseline['median']:.1f} | {baseline['p95']:.1f} "
          "| - | - | - | - |")
    for row in rows:
        verdict = "PASS" if row["median"] < TARGET_MS else "MISS"
        count = (f"{row['count_ms']:.1f} | {'' if row['exact'] else 'about '}{row['count']:,}"
                 if "count_ms" in row else "- | -")
        print(f"| {row['page']} | {row['median']:.1f} | {row['p95']:.1f} | "
              f"{row['bytes'] / 1024:.0f} | {count} | {verdict} |")
    charts = rows[0]
    print(f"\ndashboard with charts: median {charts['median']:.1f} ms, p95 {charts['p95']:.1f}"
          f" ms; {charts['median'] / baseline['median']:.2f}x the baseline's median "
          f"({baseline['median']:.1f} ms)")
    ok = all(r["median"] < TARGET_MS for r in rows)
    if live is not None:
        print("\n| live observers | partials | fan-out median ms | max ms | LISTEN connections |"
              " web pool connections (peak) |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(f"| {live['observers']} | {live['partials']} | {live['median_ms']:.1f} | "
              f"{live['max_ms']:.1f} | {live['listen_connections']} | "
              f"{live['pooled_connections_peak']} |")
        ok = ok and live["listen_connections"] == 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
