"""Shared rate limits: 200 loops against a provider enforcing 120 RPM and 40,000 TPM,
with the limiter on and off, in one run; and how long another provider's loops wait.

Run it from the project root with the project's virtualenv::

    python bench/rate_limits.py                  # 200 loops x 2 LLM turns, both runs, ~8 min
    python bench/rate_limits.py --loops 40       # a smoke run
    python bench/rate_limits.py --max-tokens 1024   # a more generous output cap
    python bench/rate_limits.py --runs on        # the limiter's run alone

The workload, the same in both runs, each on a fresh database
(``solidloop_bench_rates_on`` / ``_off``) with fresh emulators and workers:

* two LLM emulators (real HTTP on 127.0.0.1, in this process): the **limited**
  one enforcing ``rpm=120, tpm=40000`` (token buckets refilled continuously, a
  minute's worth may burst at start; 429 + Retry-After + OpenAI's headers), and
  the **other**, unlimited one;
* ``dramatiq flask_solidloop.worker --processes 4 --threads 4`` on
  bench/rate_limits_app.py (16 worker threads);
* ``--loops`` loops of the limited agent, started at once (``Agent.start_many``),
  each ``--turns`` LLM turns with one in-process tool call (``lookup``) between
  two turns. The limited provider answers after ``--latency`` (0.2 s). Sizes,
  as the emulator counts them (4 characters a token): the system prompt about
  140 tokens, a turn that calls the tool answers about 150 tokens of text, the
  last turn about 180; so a 2-turn loop's requests cost about 300 and 440
  tokens, about 370 on average, and 120 requests a minute would be about
  45,000 tokens: **TPM is the binding limit** (at 120 RPM, 200 x 2 requests
  take 2.3 min after the first minute's burst; at 40,000 TPM their real
  usage takes 2.7 min). That is also why the run lasts about 3.5 minutes,
  not the 3.3 minutes of 400 requests at 120 RPM from an empty bucket: two
  runs fit in about 8 minutes. The agent's ``max_tokens`` is
  ``--max-tokens`` (256: a cap about 1.4x its longest answer, as a tuned
  deployment sets it; SOLIDLOOP_DEFAULT_OUTPUT_ESTIMATE, 1024, applies only
  to requests without one). The limiter reserves each request's estimate,
  the payload's bytes / 4 + ``max_tokens``: about 570 tokens here, 1.5x
  the real usage;
* the **other** agent (3 LLM turns, 2 tool calls, answers after 0.4 s, on
  the unlimited emulator): 4 loops alone first (the baseline, once the
  workers are warm), then 4 loops started ``--other-after`` (20 s) after the
  limited loops, while their backlog waits.

Run **on** sets ``SOLIDLOOP_RATE_LIMITS = {"<origin> bench-limited": {"rpm": 120,
"tpm": 40000}}``; run **off** sets none, so a 429 is retried in the worker
thread as before (SOLIDLOOP_LLM_RETRY_*: the defaults, 2 retries, the
server's Retry-After as a floor plus jitter), then the turn is deferred as
for a provider outage (5 s, doubling to 60 s).

What it reports, per run, side by side with the ratio on / off:

* 429s from the limited emulator (``rate_limit_stats()``): all, and after the
  first 10 s of the run (the bursts and the clocks' start settle there);
* in-thread retries of a 429: attempts with status 429 and a ``retry_in_s``
  in the ``llm_request`` events' ``payload.attempts`` (the wire log keeps
  every attempt of a turn, a turn deferred after its retries included), the
  longest one such sleep and the longest total of one turn's sleeps;
* the longest a worker thread slept waiting for capacity. Run on: a turn
  sleeps inline only when its slot is at most SOLIDLOOP_RATE_LIMIT_INLINE_WAIT
  (0.5 s) away (``_capacity_now``, by construction), else it is deferred; its
  only other sleeps are 429 retries, which the wire log shows: the bound is
  0.5 s + the longest total of one turn's 429 retry sleeps. Run off: that
  longest total (no inline wait without a limiter);
* deferrals: run on, ``sum(solidloop_loops.capacity_deferrals)`` (and the
  key's ``solidloop_rate_buckets`` row, deferrals and provider refusals);
  both runs, turns deferred after their retries (an ``llm_request`` event
  whose final status is 429);
* achieved tokens per minute (the usage the emulator settled) over the steady
  part: from 10 s after the loops started to the last limited answer; and
  the requests per minute over the same window;
* the mean estimate the limiter reserves per request (flask_solidloop's own
  ``llm.estimate`` on each request the emulator received) against the mean
  real usage, which says how much capacity an over-estimate holds;
* the other agent's loop time (created to finished, the database's clock)
  p50 / max, with the backlog and alone, and the limited loops still
  unfinished when they started;
* the wall time of the limited loops (first created to last finished).

Targets (issue 28), for run on: no 429 after the first 10 s; achieved tokens
per minute >= 90% of the limit; no worker thread sleeps more than 1 s waiting
for capacity; the other agent's loops p50 and max within 1.5x of alone.
Printed with PASS/MISS. Figures are noisy on a shared 2-core machine.

``SOLIDLOOP_BENCH_WORKER_LOG=<file>`` keeps the workers' log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from turns import PG, fresh_database, percentile  # noqa: E402

RPM, TPM = 120, 40_000
PROCESSES, THREADS = 4, 4
OTHER_LOOPS = 4
OTHER_TURNS = 3
OTHER_LATENCY = 0.4
#: 429s before this many seconds into the run are not held against the limiter.
SETTLE_S = 10.0
#: Target: the other agent's loops within this factor of their time alone.
OTHER_FACTOR = 1.5
#: The tokens-per-minute series is printed by windows of this many seconds.
SERIES_S = 30.0


def filler(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of text (4 characters each, as the emulator counts)."""
    words = ("the order shipped on time and the parcel is on its way; "
             "your record shows no open refund and nothing else to do. ")
    text = (f"Ticket {seed}: " + words * (tokens * 4 // len(words) + 1))
    return text[:tokens * 4]


class LimitedScript:
    """The limited agent's loops: ``turns`` LLM turns, a lookup between two of them."""

    def __init__(self, turns: int, latency: float) -> None:
        self.turns = turns
        self.latency = latency

    def reply(self, request: dict) -> dict:
        time.sleep(self.latency)
        messages = request["messages"]
        done = sum(1 for m in messages if m.get("role") == "tool")
        if done + 1 >= self.turns:
            return {"content": filler(180, done)}
        return {"content": filler(150, done),
                "tool_calls": [{"name": "lookup", "arguments": {"n": done}}]}


class OtherScript:
    def reply(self, request: dict) -> dict:
        time.sleep(OTHER_LATENCY)
        done = sum(1 for m in request["messages"] if m.get("role") == "tool")
        if done + 1 >= OTHER_TURNS:
            return {"content": "done"}
        return {"content": "", "tool_calls": [{"name": "lookup", "arguments": {"n": done}}]}


@dataclass
class Result:
    name: str
    limiter: bool
    wall: float = 0.0
    answered: int = 0
    count_429: int = 0
    count_429_late: int = 0
    retries: int = 0
    retry_max: float = 0.0
    retry_turn_max: float = 0.0
    outage_deferrals: int = 0
    capacity_deferrals: int = 0
    buckets: list[tuple] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    tpm: float = 0.0
    rpm: float = 0.0
    estimate: float = 0.0
    real: float = 0.0
    waiting: int = 0
    other: list[float] = field(default_factory=list)
    alone: list[float] = field(default_factory=list)
    failed: int = 0
    #: Each limited loop's end, seconds after the first one was created.
    completion: list[float] = field(default_factory=list)
    #: Tokens per minute in each 30 s of the run (the usage settled then).
    series: list[float] = field(default_factory=list)

    @property
    def sleep_bound(self) -> float:
        """The longest a thread slept for capacity: the inline wait (run on, by
        construction) plus the longest total of one turn's 429 retry sleeps."""
        inline = inline_wait() if self.limiter else 0.0
        return inline + self.retry_turn_max


def inline_wait() -> float:
    from flask_solidloop.config import Config

    return float(Config.from_mapping({}).rate_limit_inline_wait)


# -- running ---------------------------------------------------------------------------------


def start_workers(env: dict[str, str]) -> subprocess.Popen:
    log_path = os.environ.get("SOLIDLOOP_BENCH_WORKER_LOG")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
             "--processes", str(PROCESSES), "--threads", str(THREADS)],
            cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
    finally:
        if log_path:
            log.close()


def stop_workers(workers: subprocess.Popen) -> None:
    try:
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(workers.pid, signal.SIGKILL)
        workers.wait(10)


def wait_for(ids: list[int], database: str, workers: subprocess.Popen,
             timeout: float = 1800.0) -> None:
    """Until every loop of ``ids`` has ended (one count every 0.2 s)."""
    deadline = time.monotonic() + timeout
    with connect(database) as conn:
        while conn.execute(
                "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) "
                "AND status NOT IN ('completed', 'failed', 'paused')", (ids,)).fetchone()[0]:
            if workers.poll() is not None:
                raise SystemExit("the workers exited (SOLIDLOOP_BENCH_WORKER_LOG=<file> "
                                 "keeps their log)")
            if time.monotonic() > deadline:
                raise SystemExit(f"loops not finished after {timeout:.0f} s")
            time.sleep(0.2)


def connect(database: str):
    """An autocommit connection to ``database``; the server is shared with other
    engineers' test runs, so "too many clients" is waited out (up to 60 s)."""
    import psycopg

    deadline = time.monotonic() + 60
    while True:
        try:
            return psycopg.connect(f"{PG}/{database}", autocommit=True)
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def query(database: str, text: str, params: tuple = ()) -> list[tuple]:
    with connect(database) as conn:
        return conn.execute(text, params).fetchall()


def loop_times(database: str, ids: list[int]) -> list[float]:
    return [float(s) for (s,) in query(
        database, "SELECT extract(epoch FROM finished_at - created_at) FROM solidloop_loops "
        "WHERE id = ANY(%s)", (ids,))]


def run(args: argparse.Namespace, limiter: bool) -> Result:
    from flask_solidloop.llm.estimate import estimate
    from flask_solidloop.migrations import upgrade
    from flask_solidloop.testing.llm_emulator import LLMEmulator

    name = "on" if limiter else "off"
    database = f"solidloop_bench_rates_{name}"
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
    fresh_database(database)
    upgrade(url)
    result = Result(name, limiter)
    with LLMEmulator(rate_limits={"rpm": RPM, "tpm": TPM}) as limited, \
            LLMEmulator() as other:
        limited.script(lambda _request: True, LimitedScript(args.turns, args.latency).reply)
        other.script(lambda _request: True, OtherScript().reply)
        import rate_limits_app as app_module

        from flask_solidloop.limits.rates import origin_of

        key = f"{origin_of(limited.base_url)} {app_module.LIMITED_MODEL}"
        env = {"SOLIDLOOP_BENCH_DATABASE_URL": url,
               "SOLIDLOOP_BENCH_LLM_URL": limited.base_url,
               "SOLIDLOOP_BENCH_OTHER_URL": other.base_url,
               "SOLIDLOOP_BENCH_API_KEY": "bench",
               "SOLIDLOOP_BENCH_MAX_TOKENS": str(args.max_tokens),
               "SOLIDLOOP_BENCH_RATE_LIMITS": json.dumps(
                   {key: {"rpm": RPM, "tpm": TPM}} if limiter else {}),
               "FLASK_APP": "rate_limits_app:create_app()"}
        os.environ.update(env)
        workers = start_workers(dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(BENCH), str(ROOT)])))
        try:
            app = app_module.create_app()
            with app.app_context():
                session = app_module.db.session
                warm = app_module.Other.start_many(
                    [f"warm {n}" for n in range(PROCESSES * THREADS)])
                wait_for(warm, database, workers, timeout=120)
                ids = app_module.Other.start_many([f"alone {n}" for n in range(OTHER_LOOPS)])
                wait_for(ids, database, workers)
                result.alone = loop_times(database, ids)
                print(f"  [{name}] the other agent alone: "
                      f"{', '.join(f'{t:.2f}' for t in sorted(result.alone))} s", flush=True)

                t0 = time.monotonic()
                limited_ids = app_module.Limited.start_many(
                    [f"task {n}" for n in range(args.loops)])
                time.sleep(max(0.0, t0 + args.other_after - time.monotonic()))
                (result.waiting,), = query(
                    database, "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) "
                    "AND status NOT IN ('completed', 'failed', 'paused')", (limited_ids,))
                other_ids = app_module.Other.start_many(
                    [f"busy {n}" for n in range(OTHER_LOOPS)])
                wait_for(other_ids, database, workers)
                result.other = loop_times(database, other_ids)
                print(f"  [{name}] the other agent with {result.waiting} limited loops "
                      f"waiting: {', '.join(f'{t:.2f}' for t in sorted(result.other))} s",
                      flush=True)
                progress = threading.Event()
                reporter = threading.Thread(target=report_progress, daemon=True,
                                            args=(name, database, limited_ids, t0, progress))
                reporter.start()
                try:
                    wait_for(limited_ids, database, workers)
                finally:
                    progress.set()
                session.remove()
        finally:
            stop_workers(workers)
        stats = limited.rate_limit_stats()
        bodies = [r.json for r in limited.requests if isinstance(r.json, dict)]

    (result.wall, result.failed), = query(
        database, "SELECT extract(epoch FROM max(finished_at) - min(created_at)), "
        "count(*) FILTER (WHERE status <> 'completed') FROM solidloop_loops "
        "WHERE id = ANY(%s)", (limited_ids,))
    result.wall = float(result.wall)
    result.completion = [float(s) for (s,) in query(
        database, "SELECT extract(epoch FROM finished_at - min(created_at) OVER ()) "
        "FROM solidloop_loops WHERE id = ANY(%s)", (limited_ids,))]
    result.count_429 = stats.count_429
    result.count_429_late = stats.count_429_since(t0 + SETTLE_S)
    answered = [at for at, status in stats.requests if status < 400]
    result.answered = len(answered)
    end = max(at for at, _ in stats.tokens)
    result.window = (SETTLE_S, end - t0)
    result.tpm = stats.tokens_per_minute(t0 + SETTLE_S, end + 1e-6)
    minutes = (end - t0 - SETTLE_S) / 60
    result.rpm = sum(1 for at in answered if t0 + SETTLE_S <= at <= end) / minutes
    result.series = [stats.tokens_per_minute(t0 + start, min(t0 + start + SERIES_S, end + 1e-6))
                     for start in range(0, int(end - t0) + 1, int(SERIES_S))]
    result.real = statistics.mean(tokens for _, tokens in stats.tokens)
    result.estimate = statistics.mean(estimate(body, default_output=1024).tokens
                                      for body in bodies)
    attempts = ("FROM solidloop_events e CROSS JOIN LATERAL jsonb_array_elements("
                "coalesce(e.payload->'attempts', '[]'::jsonb)) a "
                "WHERE e.kind = 'llm_request' AND e.loop_id = ANY(%s)")
    (retries, retry_max), = query(
        database, "SELECT count(*) FILTER (WHERE a->>'status' = '429' AND a ? 'retry_in_s'), "
        f"coalesce(max((a->>'retry_in_s')::float8), 0) {attempts}", (limited_ids,))
    (turn_max,), = query(
        database, "SELECT coalesce(max(s), 0) FROM (SELECT e.id, "
        f"sum((a->>'retry_in_s')::float8) AS s {attempts} GROUP BY e.id) t", (limited_ids,))
    result.retries, result.retry_max, result.retry_turn_max = \
        int(retries), float(retry_max), float(turn_max)
    (result.outage_deferrals,), = query(
        database, "SELECT count(*) FROM solidloop_events WHERE kind = 'llm_request' "
        "AND status_code = 429 AND loop_id = ANY(%s)", (limited_ids,))
    (deferrals,), = query(database, "SELECT coalesce(sum(capacity_deferrals), 0) FROM "
                          "solidloop_loops WHERE id = ANY(%s)", (limited_ids,))
    result.capacity_deferrals = int(deferrals)
    result.buckets = query(database, "SELECT key, dimension, deferrals, refusals FROM "
                           "solidloop_rate_buckets ORDER BY key, dimension")
    print(f"  [{name}] {args.loops} limited loops in {result.wall:.1f} s", flush=True)
    return result


def report_progress(name: str, database: str, ids: list[int], t0: float,
                    stop: threading.Event) -> None:
    while not stop.wait(30):
        try:
            (left,), = query(database, "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) "
                             "AND status NOT IN ('completed', 'failed', 'paused')", (ids,))
        except Exception:
            return
        print(f"  [{name}] {time.monotonic() - t0:.0f} s: {left} limited loops left",
              flush=True)


# -- report ------------------------------------------------------------------------------------


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report(args: argparse.Namespace, on: Result, off: Result) -> list[tuple[str, bool]]:
    print(f"\n{args.loops} loops x {args.turns} LLM turns (a lookup tool call between two), "
          f"limited provider {RPM} RPM / {TPM:,} TPM, answers after {args.latency:g} s; "
          f"max_tokens {args.max_tokens}; {PROCESSES} worker processes x {THREADS} threads; "
          f"the other agent: {OTHER_LOOPS} loops of {OTHER_TURNS} turns, answers after "
          f"{OTHER_LATENCY:g} s, started {args.other_after:g} s in")
    rows: list[tuple[str, str, str, str]] = []

    def row(label: str, a: float | str, b: float | str, fmt: str = "{:.1f}",
            show_ratio: bool = True) -> None:
        texts = [v if isinstance(v, str) else fmt.format(v) for v in (a, b)]
        r = ratio(a, b) if show_ratio and not isinstance(a, str) and not isinstance(b, str) \
            else ""
        rows.append((label, texts[0], texts[1], r))

    row("wall time of the limited loops, s", on.wall, off.wall)
    row("limited loop completion p50, s", percentile(on.completion, .5),
        percentile(off.completion, .5))
    row("LLM requests answered", on.answered, off.answered, "{:.0f}")
    row("429s, all", on.count_429, off.count_429, "{:.0f}")
    row(f"429s after the first {SETTLE_S:g} s", on.count_429_late, off.count_429_late, "{:.0f}")
    row("in-thread 429 retries (slept)", on.retries, off.retries, "{:.0f}")
    row("longest 429 retry sleep, s", on.retry_max, off.retry_max, "{:.2f}")
    row("longest sleeps of one turn, s", on.retry_turn_max, off.retry_turn_max, "{:.2f}")
    row("longest thread sleep for capacity, s", f"<= {on.sleep_bound:.2f}",
        f"{off.sleep_bound:.2f}")
    row("turns deferred for capacity", on.capacity_deferrals, off.capacity_deferrals, "{:.0f}")
    row("turns deferred after 429 retries", on.outage_deferrals, off.outage_deferrals,
        "{:.0f}")
    row(f"tokens/min, {SETTLE_S:g} s to last answer", on.tpm, off.tpm, "{:,.0f}")
    row("  as % of the TPM limit", 100 * on.tpm / TPM, 100 * off.tpm / TPM, "{:.1f}%")
    row("requests/min, same window", on.rpm, off.rpm, "{:.1f}")
    row("  window, s", f"{on.window[0]:.0f}-{on.window[1]:.0f}",
        f"{off.window[0]:.0f}-{off.window[1]:.0f}")
    row("mean estimate / request sent", on.estimate, off.estimate, "{:.0f}")
    row("mean real usage / request", on.real, off.real, "{:.0f}")
    row("limited loops waiting at other's start", on.waiting, off.waiting, "{:.0f}")
    row("other agent alone p50 / max, s",
        f"{percentile(on.alone, .5):.2f} / {max(on.alone):.2f}",
        f"{percentile(off.alone, .5):.2f} / {max(off.alone):.2f}")
    row("other agent, backlog waiting p50, s", percentile(on.other, .5),
        percentile(off.other, .5), "{:.2f}")
    row("other agent, backlog waiting max, s", max(on.other), max(off.other), "{:.2f}")
    row("  p50 / alone p50", percentile(on.other, .5) / percentile(on.alone, .5),
        percentile(off.other, .5) / percentile(off.alone, .5), "{:.2f}x")
    row("  max / alone max", max(on.other) / max(on.alone),
        max(off.other) / max(off.alone), "{:.2f}x")
    row("limited loops not completed", on.failed, off.failed, "{:.0f}", show_ratio=False)
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':{width}}{'limiter on':>16}{'limiter off':>16}{'on ÷ off':>10}")
    for label, a, b, r in rows:
        print(f"{label:{width}}{a:>16}{b:>16}{r:>10}")
    for key, dimension, deferrals, refusals in on.buckets:
        print(f"  run on: bucket {key} [{dimension}]: {deferrals} deferrals, "
              f"{refusals} refusals")
    for result in (on, off):
        print(f"  run {result.name}: tokens/min by {SERIES_S:g} s from the start: "
              + " ".join(f"{v / 1000:.1f}k" for v in result.series))
    targets = [
        (f"limiter on: no 429 after the first {SETTLE_S:g} s", on.count_429_late == 0),
        ("limiter on: tokens/min >= 90% of the limit", on.tpm >= 0.9 * TPM),
        ("limiter on: no thread sleeps > 1 s for capacity", on.sleep_bound <= 1.0),
        (f"limiter on: other agent p50 and max within {OTHER_FACTOR:g}x of alone",
         percentile(on.other, .5) <= OTHER_FACTOR * percentile(on.alone, .5)
         and max(on.other) <= OTHER_FACTOR * max(on.alone)),
    ]
    print()
    for label, ok in targets:
        print(f"{'PASS' if ok else 'MISS'}  {label}")
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--turns", type=int, default=2, help="LLM turns per limited loop (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="the limited agent's max_tokens")
    parser.add_argument("--latency", type=float, default=0.2,
                        help="seconds the limited provider takes to answer")
    parser.add_argument("--other-after", type=float, default=20.0,
                        help="seconds after the limited loops start the other agent's")
    parser.add_argument("--runs", default="on,off",
                        help="which runs: on,off (the default), on or off")
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be >= 2 (a tool call between two LLM turns)")
    runs = [name.strip() for name in args.runs.split(",")]
    if not runs or set(runs) - {"on", "off"}:
        parser.error("--runs takes on, off or on,off")
    started = time.monotonic()
    results = {}
    for name in runs:
        print(f"run {name}: the limiter {name}", flush=True)
        results[name] = run(args, name == "on")
    if len(results) == 2:
        report(args, results["on"], results["off"])
    else:
        only = next(iter(results.values()))
        report(args, only, only)
        print("(one run only: both columns are that run, and the targets are "
              f"{'its' if only.limiter else 'not meaningful'})")
    print(f"\n(the bench took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
