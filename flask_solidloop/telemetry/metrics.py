"""Prometheus instruments: their definitions, and one small function per hook.

This module owns every counter and histogram the package writes (the table in
docs/guides/observability.md lists them) and the switch that turns them on.
Off (the default), every hook returns at its first line: the turn path pays
a call and a test. :func:`enable` turns them on for this process, in
prometheus_client's multiprocess mode (each process writes memory-mapped
files into one directory, which one server per host reads: see
runtime/metrics.py); prometheus_client is imported there and only there,
after the directory is set, because it picks its value class from the
environment when it is imported.

Labels are bounded by configuration, never by traffic: agent, model, tool,
queue, outcome and error class; never a loop, call or job id.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

#: The prefix of every metric name of ours.
PREFIX = "solidloop_"
#: The tool label of a call no server offers (a name the model made up).
UNKNOWN_TOOL = "(unknown)"

#: Seconds: an LLM request (its retries and stream included).
LLM_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Seconds: the first streamed token.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
#: Seconds: one tool run.
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0)

#: The token kinds of ``solidloop_llm_tokens_total`` and the usage field of each.
TOKEN_KINDS = (("input", "input_tokens"), ("output", "output_tokens"),
               ("reasoning", "reasoning_tokens"), ("cached_input", "cached_input_tokens"))

_on = False
_lock = threading.Lock()
_directory: str | None = None
_m: Any = None  # the instruments (a _Instruments) while on


def enabled() -> bool:
    """Whether this process records metrics."""
    return _on


def directory() -> str | None:
    """The multiprocess directory this process writes to (None while off)."""
    return _directory


class _Instruments:
    """Every instrument, created once per :func:`enable`."""

    def __init__(self, prom: Any, registry: Any) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Any:
            return prom.Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, labels: tuple[str, ...],
                      buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(PREFIX + name, doc, labels, buckets=buckets,
                                  registry=registry)

        self.llm_turns = counter("llm_turns", "LLM turns that ended, by outcome.",
                                 ("agent", "model", "outcome"))
        self.llm_errors = counter("llm_errors", "LLM turns that ended in an error, by class.",
                                  ("agent", "model", "error"))
        self.llm_tokens = counter("llm_tokens", "Tokens of answered LLM turns, by kind.",
                                  ("agent", "model", "kind"))
        self.llm_cost = counter("llm_cost_usd", "Cost of answered LLM turns (SOLIDLOOP_PRICES).",
                                ("agent", "model"))
        self.llm_unpriced = counter("llm_unpriced_turns",
                                    "Answered LLM turns with no price or no usage.",
                                    ("agent", "model"))
        self.llm_seconds = histogram("llm_request_seconds",
                                     "LLM request latency, retries and stream included.",
                                     ("agent", "model"), LLM_BUCKETS)
        self.llm_ttft = histogram("llm_time_to_first_token_seconds",
                                  "Time to the first streamed token.",
                                  ("agent", "model"), TTFT_BUCKETS)
        self.tool_calls = counter("tool_calls", "Tool runs, by tool and outcome.",
                                  ("agent", "tool", "outcome"))
        self.tool_seconds = histogram("tool_call_seconds", "Tool run latency.",
                                      ("tool", "outcome"), TOOL_BUCKETS)
        self.steps = counter("steps", "Turn jobs run: delivered by the queue, or inline.",
                             ("kind", "mode"))
        self.lease_losses = counter("lease_losses", "Leases this worker found gone.",
                                    ("kind", "reason"))
        self.takeovers = counter("lease_takeovers", "Expired leases the reaper took over.",
                                 ("kind",))
        self.reaper_heals = counter("reaper_heals", "Repairs of the reaper, by case.",
                                    ("case",))
        self.reaper_passes = counter("reaper_passes", "Reaper passes run.", ())
        self.rate_limit_deferrals = counter(
            "rate_limit_deferrals", "Turns and tool calls deferred for rate-limit capacity.",
            ("kind",))
        self.loops_ended = counter("loops_ended", "Loops that completed, failed or paused.",
                                   ("status", "failure_class"))


def enable(path: str) -> None:
    """Record metrics in this process, into the multiprocess directory ``path``
    (created if missing). Idempotent for one path; a new path starts afresh
    (the tests use one directory each)."""
    global _on, _m, _directory
    with _lock:
        if _on and _directory == path:
            return
        os.makedirs(path, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        import prometheus_client as prom
        from prometheus_client import values

        if _directory is not None or not getattr(values.ValueClass, "_multiprocess", False):
            # Imported before the directory was set (or set to another one): a
            # value class of its own, writing to files under ``path``.
            values.ValueClass = values.MultiProcessValue()
        # A registry of ours: the host's default registry is left alone (the
        # server reads the directory, not a registry).
        _m = _Instruments(prom, prom.CollectorRegistry(auto_describe=False))
        _directory = path
        _on = True


def disable() -> None:
    """Stop recording (the hooks return at once again)."""
    global _on, _m
    with _lock:
        _on, _m = False, None


# -- the hooks: each returns at its first line while off ---------------------------------


def llm_turn(agent: str | None, model: str | None, outcome: str, *, usage: Any = None,
             cost: Decimal | None = None, timing: Mapping[str, Any] | None = None,
             error: str | None = None) -> None:
    """An LLM turn ended: ``outcome`` is ``ok`` (its answer committed),
    ``failed``, ``deferred`` (a provider outage or a rate limit: queued again),
    ``paused`` (a limit) or ``aborted``. An answered turn brings its ``usage``
    (llm.types.Usage), ``cost`` and ``timing`` (the turn's metrics:
    ``duration_ms``, ``ttft_ms``); a failed one its ``error`` class."""
    if not _on:
        return
    m, agent, model = _m, agent or "", model or ""
    m.llm_turns.labels(agent, model, outcome).inc()
    if error is not None:
        m.llm_errors.labels(agent, model, error).inc()
    if usage is not None:
        for kind, field in TOKEN_KINDS:
            count = getattr(usage, field, 0) or 0
            if count:
                m.llm_tokens.labels(agent, model, kind).inc(count)
    if outcome == "ok":
        if cost is None or usage is None:
            m.llm_unpriced.labels(agent, model).inc()
        else:
            m.llm_cost.labels(agent, model).inc(float(cost))
    if timing:
        duration = timing.get("duration_ms")
        if duration is not None:
            m.llm_seconds.labels(agent, model).observe(duration / 1000)
        ttft = timing.get("ttft_ms")
        if ttft is not None:
            m.llm_ttft.labels(agent, model).observe(ttft / 1000)


def tool_call(agent: str | None, tool: str | None, outcome: str, duration_ms: float) -> None:
    """A tool ran: ``outcome`` is ``ok``, ``error`` or the result's error kind
    (``timeout``, ``attempts``)."""
    if not _on:
        return
    tool = tool or UNKNOWN_TOOL
    _m.tool_calls.labels(agent or "", tool, outcome).inc()
    _m.tool_seconds.labels(tool, outcome).observe(duration_ms / 1000)


def step(kind: str, inline: bool) -> None:
    """A turn job started: delivered by the queue, or continued inline."""
    if not _on:
        return
    _m.steps.labels(kind, "inline" if inline else "delivered").inc()


def lease_lost(kind: str, reason: str) -> None:
    """This process found a lease gone (``kind``: ``loop``, an LLM turn's, or ``tool``;
    ``reason``: ``taken_over`` or ``renewal_failed``)."""
    if not _on:
        return
    _m.lease_losses.labels(kind, reason).inc()


#: The reaper's cases that take over a lease another worker held.
TAKEOVER_CASES = {"expired_llm": "loop", "stalled_tools": "tool", "expired_jobs": "job"}


def reaper_pass(counts: Mapping[str, int]) -> None:
    """A reaper pass ended, healing ``counts`` (case -> rows)."""
    if not _on:
        return
    _m.reaper_passes.inc()
    for case, count in counts.items():
        if count:
            _m.reaper_heals.labels(case).inc(count)
            kind = TAKEOVER_CASES.get(case)
            if kind is not None:
                _m.takeovers.labels(kind).inc(count)


def rate_limit_deferral(kind: str) -> None:
    """A turn (``llm``) or a tool call (``tool``) went back to the queue, due
    when its rate-limit key has capacity."""
    if not _on:
        return
    _m.rate_limit_deferrals.labels(kind).inc()


def loop_ended(status: str, failure_class: str = "") -> None:
    """A loop completed, failed (with its class) or paused."""
    if not _on:
        return
    _m.loops_ended.labels(status, failure_class).inc()


def mark_process_dead(pid: int | None = None) -> None:
    """At a worker process's exit: its live gauges stop counting."""
    if not _on or _directory is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid or os.getpid(), _directory)
