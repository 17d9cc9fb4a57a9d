"""Count the SQL statements PostgreSQL receives per LLM turn.

Run it from the project root with the project's virtualenv::

    python bench/statements.py                   # both modes, 20 loops x 5 LLM turns
    python bench/statements.py --loops 50 --mode worker

Method (the one the redesign issue asks for): a dedicated database,
``solidloop_bench_statements``, gets ``ALTER DATABASE ... SET log_statement =
'all'``, so every statement any connection to it sends (sessions, the broker's
consumers, the lease renewer) is written to the server log with the database
name in its prefix. The script remembers the log's size, runs the workload,
waits a moment for the log to flush, and counts the new lines of that database
that log a statement (``statement:`` for simple queries, ``execute`` for
extended-protocol ones). It prints the total, the count per LLM turn and the
most frequent statement shapes.

The workload: ``--loops`` loops of the test suite's ``Assistant`` agent, each
``--turns`` LLM turns with one in-process tool call (``add``) between two
turns, against the LLM emulator (instant answers, not streaming). Two modes:

* ``drain``: the in-process drain runs every job (deterministic: the same
  counts on every run, no idle polling);
* ``worker``: one real ``dramatiq`` worker process with one thread, so the
  broker's claims, acks and wake-ups and the renewer are counted too. Idle
  polling adds a few statements per second of wall time, so compare runs of
  the same size.

The server log is found with ``--log`` (default: Debian's
``/var/log/postgresql/postgresql-15-main.log``; its prefix must contain ``%d``,
as Debian's default ``%m [%p] %q%u@%d`` does).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATABASE = "solidloop_bench_statements"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
DEFAULT_LOG = "/var/log/postgresql/postgresql-15-main.log"
STATEMENT = re.compile(r"@(?P<db>\S+) LOG:  (?:statement|execute [^:]*): (?P<sql>.*)")


def prepare_database() -> None:
    import psycopg

    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    ensure_database(URL)
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DATABASE}",
                         autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {DATABASE} SET log_statement = 'all'")
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    upgrade(URL)


def shape(sql: str) -> str:
    """A statement reduced to its verb and first table, for the breakdown."""
    words = sql.replace(",", " ").strip().split()
    if not words:
        return "?"
    verb = words[0].upper()
    table = next((w for w in words if w.startswith("solidloop_")), "")
    return f"{verb} {table}".strip()


def statements_since(log: Path, offset: int) -> list[str]:
    """The statements of our database logged after ``offset``, continuation
    lines (a multi-line statement) joined to their first line."""
    found: list[str] = []
    in_ours = False
    with log.open("rb") as handle:
        handle.seek(offset)
        for raw in handle:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            match = STATEMENT.search(line)
            if match:
                in_ours = match.group("db") == DATABASE
                if in_ours:
                    found.append(match.group("sql"))
            elif line.startswith(("\t", " ")) and in_ours and found:
                found[-1] += " " + line.strip()
            else:
                in_ours = False
    return found


def scripted_llm(turns: int):
    from flask_solidloop.testing import LLMEmulator

    emulator = LLMEmulator().start()

    def reply(request: dict) -> dict:
        done = sum(1 for m in request["messages"] if m.get("role") == "tool")
        if done + 1 >= turns:
            return {"content": "done"}
        return {"content": "", "tool_calls": [{"name": "add", "arguments": {"a": done, "b": 1}}]}

    emulator.script(lambda request: True, reply)
    return emulator


def run_workload(mode: str, loops: int, turns: int, timeout: float) -> tuple[int, float]:
    """Start the loops, run them to completion; return (LLM turns, seconds)."""
    from sqlalchemy import func, select

    from flask_solidloop.models import Loop
    from tests.support import support_app

    app = support_app.create_app()
    with app.app_context():
        session = support_app.db.session
        ids = [support_app.Assistant.start(message=f"loop {n}").id for n in range(loops)]
        started = time.monotonic()
        worker = None
        if mode == "drain":
            from flask_solidloop.testing import drain

            drain(app, max_jobs=loops * turns * 3, timeout=timeout)
        else:
            env = dict(os.environ, FLASK_APP="tests.support.support_app:create_app()",
                       PYTHONPATH=str(ROOT))
            worker = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                 "--processes", "1", "--threads", "1"], env=env, cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                session.rollback()
                open_ = session.scalar(select(func.count()).select_from(Loop).where(
                    Loop.id.in_(ids), Loop.status.not_in(("completed", "failed"))))
                if not open_:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{open_} loops did not finish in {timeout}s")
                time.sleep(0.05)
            elapsed = time.monotonic() - started
        finally:
            if worker is not None:
                worker.terminate()
                worker.wait(30)
        steps = session.scalar(select(func.sum(Loop.step_count)).where(Loop.id.in_(ids)))
        failed = session.scalar(select(func.count()).select_from(Loop).where(
            Loop.id.in_(ids), Loop.status != "completed"))
        if failed:
            raise SystemExit(f"{failed} loops did not complete")
        session.remove()
    return int(steps or 0), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--turns", type=int, default=5, help="LLM turns per loop")
    parser.add_argument("--mode", choices=("drain", "worker", "both"), default="both")
    parser.add_argument("--log", default=DEFAULT_LOG)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--dump", default=None, metavar="FILE",
                        help="write every statement, in order, to FILE (one mode only)")
    args = parser.parse_args()

    log = Path(args.log)
    if not log.exists():
        raise SystemExit(f"no PostgreSQL server log at {log}; pass --log PATH")
    os.environ["SOLIDLOOP_TEST_DATABASE_URL"] = URL
    os.environ["SOLIDLOOP_TEST_API_KEY"] = "sk-bench"
    emulator = scripted_llm(args.turns)
    os.environ["SOLIDLOOP_TEST_LLM_URL"] = emulator.base_url
    modes = ("drain", "worker") if args.mode == "both" else (args.mode,)
    try:
        for mode in modes:
            prepare_database()
            time.sleep(0.5)
            offset = log.stat().st_size
            turns, elapsed = run_workload(mode, args.loops, args.turns, args.timeout)
            time.sleep(1.0)  # let the server flush its log
            found = statements_since(log, offset)
            counts = collections.Counter(shape(sql) for sql in found)
            total = len(found)
            print(f"\n[{mode}] {args.loops} loops, {turns} LLM turns, "
                  f"{turns - args.loops} tool calls, {elapsed:.1f} s")
            print(f"  statements: {total}   per LLM turn: {total / turns:.1f}")
            for name, n in counts.most_common(args.top):
                print(f"    {n / turns:6.2f}/turn  {n:6d}  {name}")
            if args.dump:
                Path(args.dump).write_text("\n".join(found) + "\n")
                print(f"  every statement, in order: {args.dump}")
    finally:
        emulator.stop()


if __name__ == "__main__":
    main()
