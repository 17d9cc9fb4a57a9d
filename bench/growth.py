"""How the database grows per LLM turn, and what a loop retention pass gives back.

Run it from the project root with the project's virtualenv::

    python bench/growth.py                       # 200 loops x 10 LLM turns, ~1 min
    python bench/growth.py --loops 100 --turns 3
    python bench/growth.py --archive             # with an on_loop_archive hook (JSON copy)

The workload: ``--loops`` loops of bench/turns_app.py's agent, each
``--turns`` LLM turns with one in-process tool call (``noop``) between two
turns, run to completion by the real engine (the in-process drain runs every
job: claims, turns, tool calls, the wire log, the stream events' triggers)
against the LLM emulator (instant, non-streaming answers: a streaming agent
adds its ``text_delta`` stream events on top).

Then, in a database of its own (``--url``, default
``solidloop_bench_growth``, dropped and migrated at the start):

1. ``VACUUM FULL ANALYZE``, and each ``solidloop_*`` table's rows, heap
   (``pg_relation_size``), TOAST and free-space map and the like
   (``pg_total_relation_size`` less heap and indexes), indexes
   (``pg_indexes_size``), total, and total per LLM turn;
2. ``--old-fraction`` of the loops (by id) made to have ended a day ago, and
   one loop retention pass (``purge_loops``, SOLIDLOOP_LOOP_RETENTION of an
   hour, the default batch size) timed: loops deleted, loops/s;
3. the total size right after the pass (``DELETE`` leaves dead tuples), after
   ``VACUUM`` (space reusable by new rows, files as large) and after ``VACUUM
   FULL`` (files rewritten): what the pass reclaimed, per deleted turn.

``--archive`` registers an ``on_loop_archive`` hook that serializes each loop
(``ArchivedLoop.to_dict()`` to JSON, discarded) and prints the copy's bytes
per loop. Sizes are PostgreSQL 15's on this machine's default settings;
timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_growth"

#: Each solidloop_* table's sizes, bytes.
SIZES = """
SELECT c.relname, c.reltuples::bigint,
       pg_relation_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND n.nspname = 'public' AND c.relname LIKE 'solidloop\\_%'
ORDER BY pg_total_relation_size(c.oid) DESC, c.relname
"""


def libpq(url: str) -> str:
    from flask_solidloop.urls import libpq_url

    return libpq_url(url)


def prepare_database(url: str) -> None:
    import psycopg

    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    ensure_database(url)
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    upgrade(url)


def scripted_llm(turns: int) -> Any:
    from flask_solidloop.testing import LLMEmulator

    emulator = LLMEmulator().start()

    def reply(request: dict) -> dict:
        done = sum(1 for m in request["messages"] if m.get("role") == "tool")
        if done + 1 >= turns:
            return {"content": f"Done after {turns} turns: every noop answered."}
        return {"content": "", "tool_calls": [{"name": "noop", "arguments": {"n": done}}]}

    emulator.script(lambda request: True, reply)
    return emulator


def sizes(url: str) -> list[tuple[str, int, int, int, int]]:
    """(table, rows, heap, indexes, total) of every solidloop_* table."""
    import psycopg

    with psycopg.connect(libpq(url), autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(SIZES).fetchall()]  # type: ignore[misc]


def vacuum(url: str, full: bool) -> None:
    import psycopg

    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("VACUUM FULL ANALYZE" if full else "VACUUM ANALYZE")


def total(rows: list[tuple[str, int, int, int, int]]) -> int:
    return sum(row[4] for row in rows)


def kb(value: float) -> str:
    return f"{value / 1024:,.1f}"


def print_sizes(rows: list[tuple[str, int, int, int, int]], turns: int) -> None:
    print("| table | rows | heap KB | TOAST+other KB | indexes KB | total KB | bytes/turn |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, tuples, heap, indexes, whole in rows:
        if whole <= 0:
            continue
        print(f"| {name} | {max(tuples, 0):,} | {kb(heap)} | {kb(whole - heap - indexes)} | "
              f"{kb(indexes)} | {kb(whole)} | {whole / turns:,.0f} |")
    all_ = total(rows)
    print(f"| **all** | | {kb(sum(r[2] for r in rows))} | "
          f"{kb(sum(r[4] - r[2] - r[3] for r in rows))} | {kb(sum(r[3] for r in rows))} | "
          f"{kb(all_)} | **{all_ / turns:,.0f}** |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--turns", type=int, default=10, help="LLM turns per loop (>= 1)")
    parser.add_argument("--old-fraction", type=float, default=0.5,
                        help="share of the loops the retention pass deletes")
    parser.add_argument("--archive", action="store_true",
                        help="run the pass with an on_loop_archive hook (a JSON copy)")
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.loops < 1 or args.turns < 1 or not 0 < args.old_fraction <= 1:
        parser.error("--loops and --turns must be >= 1, --old-fraction in (0, 1]")

    import psycopg

    prepare_database(args.url)
    emulator = scripted_llm(args.turns)
    os.environ["SOLIDLOOP_BENCH_DATABASE_URL"] = args.url
    os.environ["SOLIDLOOP_BENCH_LLM_URL"] = emulator.base_url
    os.environ.setdefault("SOLIDLOOP_BENCH_API_KEY", "sk-bench")
    import dataclasses

    import turns_app

    from flask_solidloop.maintenance.janitor import purge_loops
    from flask_solidloop.state import get_state
    from flask_solidloop.testing import drain

    app = turns_app.create_app()
    copied: list[int] = []
    if args.archive:
        @turns_app.solidloop.on_loop_archive
        def copy(archived: Any, session: Any) -> None:
            copied.append(len(json.dumps(archived.to_dict())))

    with app.app_context():
        started = time.monotonic()
        turns_app.Turns.start_many([f"loop {n}" for n in range(args.loops)])
        ran = drain(app, max_jobs=args.loops * args.turns * 4, timeout=args.timeout)
        with psycopg.connect(libpq(args.url), autocommit=True) as conn:
            statuses = dict(conn.execute(
                "SELECT status, count(*) FROM solidloop_loops GROUP BY status").fetchall())
            llm_turns = conn.execute(
                "SELECT count(*) FROM solidloop_messages WHERE role = 'assistant' "
                "AND status = 'completed'").fetchone()[0]
        if statuses != {"completed": args.loops}:
            print(f"loops did not all complete: {statuses}", file=sys.stderr)
            return 1
        print(f"{args.loops} loops x {args.turns} LLM turns ({llm_turns} turns, "
              f"{args.loops * (args.turns - 1)} tool calls) run by the real engine in "
              f"{time.monotonic() - started:.1f} s ({ran} jobs)\n")

        vacuum(args.url, full=True)
        before = sizes(args.url)
        print("After the run (VACUUM FULL ANALYZE):\n")
        print_sizes(before, llm_turns)

        old = max(1, round(args.loops * args.old_fraction))
        with psycopg.connect(libpq(args.url), autocommit=True) as conn:
            conn.execute("UPDATE solidloop_loops SET finished_at = finished_at - interval "
                         "'1 day' WHERE id IN (SELECT id FROM solidloop_loops ORDER BY id "
                         "LIMIT %s)", (old,))
        vacuum(args.url, full=True)
        baseline = total(sizes(args.url))
        state = get_state(app)
        state.config = dataclasses.replace(state.config, loop_retention=3600)
        started = time.perf_counter()
        purge = purge_loops(state)
        elapsed = time.perf_counter() - started
        state.db.session.remove()
        deleted_turns = round(llm_turns * purge.deleted / args.loops)
        after_delete = total(sizes(args.url))
        vacuum(args.url, full=False)
        after_vacuum = total(sizes(args.url))
        vacuum(args.url, full=True)
        after_full = total(sizes(args.url))
    emulator.stop()

    print(f"\nOne loop retention pass (batches of "
          f"{state.config.loop_purge_batch_size}{', with an archive hook' if copied else ''}): "
          f"{purge.deleted} of {args.loops} loops ({deleted_turns} turns) deleted in "
          f"{elapsed * 1000:.0f} ms ({purge.deleted / elapsed:,.0f} loops/s, "
          f"{deleted_turns / elapsed:,.0f} turns/s)")
    if copied:
        print(f"Archive copy (JSON): {sum(copied) / len(copied):,.0f} bytes per loop, "
              f"{sum(copied) / max(deleted_turns, 1):,.0f} per turn")
    print()
    print("| | total KB | reclaimed KB | reclaimed bytes per deleted turn |")
    print("|---|---:|---:|---:|")
    print(f"| before the pass (VACUUM FULL) | {kb(baseline)} | | |")
    for label, value in (("right after the pass", after_delete),
                         ("after VACUUM", after_vacuum),
                         ("after VACUUM FULL", after_full)):
        print(f"| {label} | {kb(value)} | {kb(baseline - value)} | "
              f"{(baseline - value) / max(deleted_turns, 1):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
