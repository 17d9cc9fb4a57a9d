"""What one deployment carries: the scale benchmarks, run one after another.

Run it from the project root with the project's virtualenv::

    python bench/scale.py                      # every part, about 40 minutes
    python bench/scale.py --quick              # every part's quick form
    python bench/scale.py --only inflight,unwatched
    python bench/scale.py --report scale.md    # also write the tables to a file

Each part is a script of its own (its docstring says what it runs and how it
measures), run here in a process of its own, each on a PostgreSQL cluster it
initdbs for itself (but ``growth``), so no part disturbs the next:

* ``inflight`` (bench/scale_inflight.py): one worker process with 1,000
  concurrent streaming loops, async LLM I/O against thread mode;
* ``unwatched`` (bench/scale_unwatched.py): 500 streaming loops nobody
  watches against partial text off; 50 of them followed by SSE clients;
* ``pgbouncer`` (bench/scale_pgbouncer.py): 8 worker processes behind
  PgBouncer in transaction mode against the same fleet direct;
* ``idle`` (bench/scale_idle.py): 4 and 32 idle worker processes, against the
  commit before the fleet's change (e4c78a4);
* ``growth`` (bench/growth.py): table and index bytes per turn, and what
  loop retention reclaims (on the machine's server, database
  ``solidloop_bench_growth``);
* ``turns`` (bench/turns.py): PostgreSQL CPU and WAL per turn against DBOS
  (``--against REV`` adds a build of REV beside them).

The report is each part's own tables, in that order.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (name, script, arguments of the full run, arguments of the quick run)
PARTS: list[tuple[str, str, list[str], list[str]]] = [
    ("inflight", "scale_inflight.py", [], ["--quick"]),
    ("unwatched", "scale_unwatched.py", [], ["--quick"]),
    ("pgbouncer", "scale_pgbouncer.py", [], ["--quick"]),
    ("idle", "scale_idle.py", ["--against", "e4c78a4"], ["--against", "e4c78a4", "--quick"]),
    ("growth", "growth.py", [], ["--loops", "40"]),
    ("turns", "turns.py", ["--cluster-port", "5446"], ["--reps", "1", "--cluster-port", "5446"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each part's quick form")
    parser.add_argument("--only", help="comma-separated parts: "
                        + ",".join(name for name, *_ in PARTS))
    parser.add_argument("--against", help="bench/turns.py: also a build of this git revision")
    parser.add_argument("--report", type=Path, help="write the report to this file too")
    args = parser.parse_args(argv)
    wanted = [name for name, *_ in PARTS] if not args.only else args.only.split(",")
    unknown = set(wanted) - {name for name, *_ in PARTS}
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; pick from "
                     + ", ".join(name for name, *_ in PARTS))
    report: list[str] = []
    failed: list[str] = []
    for name, script, full, quick in PARTS:
        if name not in wanted:
            continue
        extra = list(quick if args.quick else full)
        if name == "turns" and args.against:
            extra += ["--against", args.against]
        cmd = [sys.executable, str(ROOT / "bench" / script), *extra]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        print(done.stdout, flush=True)
        took = time.monotonic() - started
        report.append(f"## {name} (`bench/{script} {' '.join(extra)}`, {took:.0f} s)\n\n"
                      + done.stdout.strip() + "\n")
        if done.returncode != 0:
            failed.append(name)
    if args.report:
        args.report.write_text("# bench/scale.py\n\n" + "\n".join(report))
    if failed:
        print(f"parts that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
