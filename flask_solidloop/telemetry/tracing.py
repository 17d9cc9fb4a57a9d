"""OpenTelemetry spans of loops, turns, tool calls and jobs (GenAI semantic conventions).

We depend on ``opentelemetry-api`` only: with no SDK installed as the global
tracer provider every helper here returns at its first check, and a loop
stores no trace context (docs/decisions/0033-tracing.md).

One loop run is one trace although its turns run as separate jobs on any
worker: :func:`new_run` mints the run's ``invoke_agent`` span context when the
loop starts (a child of the caller's current span, a traced Flask request
say) and the loop stores it (``solidloop_loops.trace``); each job carries its
``traceparent`` (:func:`carried`, queue/dispatch.py) and each turn's span is a
child of it. The ``invoke_agent`` span itself is emitted when the run ends
(:func:`end_run`), with the ids minted at the start and the start time on
record: no process lives as long as a run, so none could hold the span open.
A worker killed mid-turn never ends its span; the reaper that takes the turn
over emits one for the lapsed attempt, marked as an error
(:func:`lapsed_attempt`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from .._version import __version__

__all__ = [
    "CHAT", "EXECUTE_TOOL", "INVOKE_AGENT", "SpanKind", "after_turn", "capture_content",
    "carried", "carrying", "child", "configure", "content", "current_traceparent", "enabled",
    "end_job", "end_run", "end_span", "lapsed_attempt", "new_run", "note_error",
    "parse_traceparent", "span", "start_job", "start_span", "trace_id_of", "use",
]

INVOKE_AGENT = "invoke_agent"
CHAT = "chat"
EXECUTE_TOOL = "execute_tool"
#: ``error.type`` of an attempt whose worker stopped renewing its lease.
LEASE_LAPSED = "solidloop.lease_lapsed"

_SCOPE = "flask_solidloop"
_state: dict[str, Any] = {"provider": None, "tracer": None, "capture": False}
#: The run context the jobs enqueued here carry (set around a turn, a start).
_carried: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "solidloop_traceparent", default=None)
#: Ids the next span gets (the run's root, emitted at its end with the ids
#: minted at its start).
_preset: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "solidloop_preset_ids", default=None)
#: The turn span current in this context (:func:`use` with ``turn``), and what
#: waits for each turn span's end (:func:`after_turn`), by the span's id.
_turn: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "solidloop_turn_span", default=None)
_after: dict[int, list[Callable[[], object]]] = {}


def configure(*, capture: bool) -> None:
    """Record SOLIDLOOP_OTEL_CAPTURE_CONTENT (extension.init_app)."""
    _state["capture"] = bool(capture)


def capture_content() -> bool:
    """Whether message content goes onto spans (off unless configured)."""
    return bool(_state["capture"])


class _PresetIds:
    """The SDK tracer's id generator, giving a preset pair once when one is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        preset = _preset.get()
        return preset[1] if preset is not None else int(self.inner.generate_span_id())

    def generate_trace_id(self) -> int:
        preset = _preset.get()
        return preset[0] if preset is not None else int(self.inner.generate_trace_id())

    def __getattr__(self, name: str) -> Any:
        # Anything else the SDK asks (is_trace_id_random, ...): the generator's
        # own answer (our preset ids are drawn at random too, new_run).
        return getattr(self.inner, name)


#: The API's global provider, and whether the environment names one
#: (OTEL_PYTHON_TRACER_PROVIDER, which the API loads on first use).
_UNSET = object()
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def _tracer() -> Any:
    """Our tracer when an SDK is the global provider; None otherwise. The
    path with nothing installed reads one module attribute (the API's own
    getter looks the environment up on every call); should that attribute
    go, the public getter answers instead."""
    if getattr(trace, "_TRACER_PROVIDER", _UNSET) is None and not _PROVIDER_FROM_ENV:
        return None
    provider = trace.get_tracer_provider()
    if provider is _state["provider"]:
        return _state["tracer"]
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    tracer: Any = provider.get_tracer(_SCOPE, __version__)
    # The OpenTelemetry SDK's tracer draws its ids from ``id_generator``: wrapped,
    # the run's root gets the ids its children already name as their parent.
    inner = getattr(tracer, "id_generator", None)
    if inner is not None and not isinstance(inner, _PresetIds):
        tracer.id_generator = _PresetIds(inner)
    _state["provider"], _state["tracer"] = provider, tracer
    return tracer


def enabled() -> bool:
    """Whether spans are recorded (an SDK tracer provider is installed)."""
    return _tracer() is not None


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The span context a W3C ``traceparent`` names; None when absent or malformed."""
    if not value:
        return None
    parts = value.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        context = SpanContext(int(parts[1], 16), int(parts[2], 16), is_remote=True,
                              trace_flags=TraceFlags(int(parts[3], 16) & 0xFF))
    except ValueError:
        return None
    return context if context.is_valid else None


def _format(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def trace_id_of(run: Mapping[str, Any] | None) -> str | None:
    """The trace id (32 hex digits) of a loop's stored run context."""
    context = parse_traceparent((run or {}).get("traceparent"))
    return f"{context.trace_id:032x}" if context is not None else None


def _parent(traceparent: str | None) -> otel_context.Context:
    """A context whose current span is the remote one ``traceparent`` names
    (an empty context without one: never the job thread's own)."""
    remote = parse_traceparent(traceparent)
    empty = otel_context.Context()
    return trace.set_span_in_context(NonRecordingSpan(remote), empty) \
        if remote is not None else empty


def new_run(previous: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A new run's context, to store with the loop: its ``invoke_agent`` span's
    ``traceparent`` (a child of the current span, if any, else a new trace),
    the parent's, the start time, and the previous run's span (a resumed run
    links to it). None when tracing is off."""
    if _tracer() is None:
        return None
    current = trace.get_current_span().get_span_context()
    if current.is_valid:
        trace_id, flags = current.trace_id, current.trace_flags
        parent: str | None = _format(current)
    else:
        trace_id, flags, parent = random.getrandbits(128) or 1, TraceFlags(1), None
    context = SpanContext(trace_id, random.getrandbits(64) or 1, is_remote=True,
                          trace_flags=flags)
    run = {"traceparent": _format(context), "parent": parent, "start_ns": time.time_ns()}
    if previous and previous.get("traceparent"):
        run["previous"] = previous["traceparent"]
    return run


def carried() -> str | None:
    """The ``traceparent`` a job enqueued now carries (queue/dispatch.py)."""
    return _carried.get()


@contextlib.contextmanager
def carrying(traceparent: str | None) -> Iterator[None]:
    """Jobs enqueued inside carry ``traceparent`` (a loop's run context)."""
    if traceparent is None:
        yield
        return
    token = _carried.set(traceparent)
    try:
        yield
    finally:
        _carried.reset(token)


def start_span(name: str, traceparent: str | None, *, kind: SpanKind = SpanKind.INTERNAL,
               start_ns: int | None = None,
               attributes: Mapping[str, Any] | None = None) -> Span | None:
    """A span under the run context ``traceparent`` (or the current span when
    None), started at ``start_ns`` (now by default); the caller ends it
    (:func:`end_span`). None when off."""
    tracer = _tracer()
    if tracer is None:
        return None
    parent = _parent(traceparent) if traceparent else None
    return tracer.start_span(name, context=parent, kind=kind,  # type: ignore[no-any-return]
                             start_time=start_ns or None, attributes=_clean(attributes))


def child(parent: Span | None, name: str, *, start_ns: int,
          attributes: Mapping[str, Any] | None = None) -> None:
    """A finished internal child of ``parent``, from ``start_ns`` to now (a claim
    that ran before its turn's span could be named)."""
    tracer = _tracer()
    if tracer is None or parent is None:
        return
    tracer.start_span(name, context=trace.set_span_in_context(parent, otel_context.Context()),
                      start_time=start_ns or None, attributes=_clean(attributes)).end()


def note_error(error: BaseException | str) -> None:
    """Mark the current span (a turn's) with an error it handled itself."""
    if _tracer() is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        _mark_error(current, error)


def end_span(span: Span | None, *, attributes: Mapping[str, Any] | None = None,
             error: BaseException | str | None = None) -> None:
    """Set ``attributes`` on ``span`` and end it, marked as an error with
    ``error.type`` when ``error`` is given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        _mark_error(span, error)
    span.end()
    for run in _after.pop(id(span), ()):
        run()


def after_turn(run: Callable[[], object]) -> None:
    """Run ``run`` once the current turn's span has ended (a run's root, which
    must end after the turn that ended the run), or now outside a turn."""
    current = _turn.get()
    if current is None:
        run()
    else:
        _after.setdefault(id(current), []).append(run)


def _mark_error(span: Span, error: BaseException | str) -> None:
    kind = error if isinstance(error, str) else type(error).__qualname__
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, str(error)[:500]))


@contextlib.contextmanager
def use(span: Span | None, *, turn: bool = False) -> Iterator[None]:
    """``span`` is the current span inside (children attach to it); ``turn``:
    it is a turn's (:func:`after_turn` waits for its end)."""
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    turn_token = _turn.set(span) if turn else None
    try:
        yield
    finally:
        if turn_token is not None:
            _turn.reset(turn_token)
        otel_context.detach(token)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span | None]:
    """An internal span under the current span (the claim, the commit); an
    exception that escapes marks it as an error."""
    tracer = _tracer()
    if tracer is None or not trace.get_current_span().get_span_context().is_valid:
        yield None
        return
    with tracer.start_as_current_span(name, attributes=_clean(attributes),
                                      record_exception=False,
                                      set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            _mark_error(current, exc)
            raise


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span (a traced request's, a job's);
    None when there is none or tracing is off."""
    if _tracer() is None:
        return None
    current = trace.get_current_span().get_span_context()
    return _format(current) if current.is_valid else None


def start_job(name: str, traceparent: str | None, *,
              attributes: Mapping[str, Any] | None = None) -> Any:
    """A ``CONSUMER`` span for one host job, under the context it carried,
    current until :func:`end_job` (jobs it enqueues carry it on); None when off."""
    tracer = _tracer()
    if tracer is None:
        return None
    current = tracer.start_span(name, context=_parent(traceparent), kind=SpanKind.CONSUMER,
                                attributes=_clean(attributes))
    token = otel_context.attach(trace.set_span_in_context(current))
    return current, token


def end_job(job: Any, error: BaseException | None) -> None:
    """End a job's span (:func:`start_job`), an error when ``error``."""
    if job is None:
        return
    current, token = job
    try:
        otel_context.detach(token)
    finally:
        if error is not None:
            _mark_error(current, error)
        current.end()


def end_run(run: Mapping[str, Any] | None, *, agent: str, attributes: Mapping[str, Any],
            error: str | None = None, end_ns: int | None = None) -> bool:
    """Emit a run's ``invoke_agent`` span now that it ended, with the ids and
    start time :func:`new_run` recorded; False when off, or when the run has
    no context, or the tracer cannot take preset ids (not the SDK's)."""
    tracer = _tracer()
    context = parse_traceparent((run or {}).get("traceparent"))
    if tracer is None or context is None or run is None:
        return False
    links = []
    previous = parse_traceparent(run.get("previous"))
    if previous is not None:
        links.append(Link(previous, {"solidloop.link": "previous_run"}))
    token = _preset.set((context.trace_id, context.span_id))
    try:
        root = tracer.start_span(f"{INVOKE_AGENT} {agent}", context=_parent(run.get("parent")),
                                 kind=SpanKind.INTERNAL, links=links,
                                 start_time=int(run.get("start_ns") or time.time_ns()),
                                 attributes=_clean({"gen_ai.operation.name": INVOKE_AGENT,
                                                    "gen_ai.agent.name": agent,
                                                    **attributes}))
    finally:
        _preset.reset(token)
    if error is not None:
        _mark_error(root, error)
    root.end(end_time=end_ns)
    return root.get_span_context().span_id == context.span_id  # type: ignore[no-any-return]


def lapsed_attempt(traceparent: str | None, name: str, *, start_ns: int | None,
                   end_ns: int | None, attributes: Mapping[str, Any]) -> None:
    """Emit, for a worker that died holding a turn's lease, the span it never
    ended: from the attempt's start on record to its lease's lapse, marked as
    an error (``error.type`` = solidloop.lease_lapsed)."""
    tracer = _tracer()
    if tracer is None or parse_traceparent(traceparent) is None:
        return
    lapsed = tracer.start_span(name, context=_parent(traceparent), kind=SpanKind.CLIENT,
                               start_time=start_ns, attributes=_clean(attributes))
    _mark_error(lapsed, LEASE_LAPSED)
    lapsed.end(end_time=end_ns)


def content(value: Any) -> str | None:
    """Message content as a span attribute: JSON text when capture is on
    (SOLIDLOOP_OTEL_CAPTURE_CONTENT), None otherwise. The caller redacts
    first, as the wire log does."""
    if not _state["capture"] or value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, default=str,
                                                            ensure_ascii=False)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes OpenTelemetry accepts: no None, sequences as tuples."""
    if not attributes:
        return {}
    return {key: tuple(value) if isinstance(value, list) else value
            for key, value in attributes.items() if value is not None}
