"""Tracing in one process (docs/decisions/0033-tracing.md): a loop started in a
traced Flask request joins its trace, a resumed run links to the last, host
jobs run in spans under the context they were enqueued in, a failed turn and
run are errors, and with no SDK nothing is stored or carried.

The OpenTelemetry SDK records in memory here; the workers' side, over
OTLP/HTTP, is tests/acceptance/test_tracing_workers.py.
"""

from __future__ import annotations

import json

import pytest
from flask import g, request
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from sqlalchemy import select

from flask_solidloop.models import Job, Loop
from flask_solidloop.telemetry import tracing

from ..support.otel import spans_in_memory
from ..support.support_app import Assistant

REQUEST_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    """The SDK as the process's tracer provider, exporting to memory."""
    with spans_in_memory() as exporter:
        yield exporter


def hexid(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def named(exporter, prefix: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def test_a_loop_started_in_a_traced_request_joins_its_trace(app, session, llm, drain, spans):
    # What a host's Flask instrumentation does: a server span per request, a
    # child of the caller's traceparent header, current while the view runs.
    tracer = trace.get_tracer("host")

    @app.before_request
    def open_span():
        parent = TraceContextTextMapPropagator().extract(
            {key.lower(): value for key, value in request.headers.items()})
        g.span = tracer.start_span(f"POST {request.path}", context=parent,
                                   kind=SpanKind.SERVER)
        g.token = otel_context.attach(trace.set_span_in_context(g.span))

    @app.teardown_request
    def close_span(_exc):
        otel_context.detach(g.token)
        g.span.end()

    @app.post("/start")
    def start_view():
        loop = Assistant.start(message="hello")
        return {"loop": loop.id}

    llm.script("hello", {"content": "hi"})
    reply = app.test_client().post(
        "/start", headers={"traceparent": f"00-{REQUEST_TRACE}-{CALLER_SPAN}-01"})
    loop_id = reply.json["loop"]
    (server,) = named(spans, "POST /start")
    server_id = hexid(server.context.span_id, 16)
    run = session.get(Loop, loop_id).trace
    assert run["traceparent"].split("-")[1] == REQUEST_TRACE
    assert run["parent"] == f"00-{REQUEST_TRACE}-{server_id}-01"
    # The first job carries the run's context.
    (job,) = session.scalars(select(Job).where(Job.loop_id == loop_id))
    assert job.message["options"]["traceparent"] == run["traceparent"]
    session.rollback()

    assert drain() == 1
    (root,) = named(spans, "invoke_agent assistant")
    (chat,) = named(spans, "chat test-model")
    assert hexid(root.context.trace_id, 32) == hexid(chat.context.trace_id, 32) == REQUEST_TRACE
    assert root.parent.span_id == server.context.span_id
    assert chat.parent.span_id == root.context.span_id
    assert hexid(root.context.span_id, 16) == run["traceparent"].split("-")[2]
    assert root.attributes["solidloop.outcome"] == "completed"
    assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    assert chat.attributes["solidloop.delivery"] == "delivered"


def test_a_resumed_run_is_a_new_span_linked_to_the_last(app, session, llm, drain, spans):
    llm.script("first", {"content": "one"})
    llm.script("again", {"content": "two"})
    loop = Assistant.start(message="first")
    drain()
    first = session.get(Loop, loop.id).trace["traceparent"]
    session.rollback()
    assert Assistant(session.get(Loop, loop.id)).resume(message="again")
    session.expire_all()
    second = session.get(Loop, loop.id).trace
    session.rollback()
    assert second["previous"] == first and second["traceparent"] != first
    drain()
    roots = named(spans, "invoke_agent assistant")
    assert len(roots) == 2
    old, new = roots
    assert [hexid(link.context.span_id, 16) for link in new.links] == [first.split("-")[2]]
    assert new.context.trace_id != old.context.trace_id


def test_a_failed_turn_and_its_run_are_errors(app, session, llm, drain, spans):
    llm.fail_next(400, body={"error": {"message": "bad request", "type": "invalid"}})
    loop = Assistant.start(message="fail please")
    drain()
    assert session.get(Loop, loop.id).status == "failed"
    (chat,) = named(spans, "chat ")
    (root,) = named(spans, "invoke_agent ")
    assert chat.status.status_code is StatusCode.ERROR
    assert chat.attributes["error.type"] == "ProviderHTTPError"
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["solidloop.outcome"] == "failed"


def test_host_jobs_run_in_spans_under_the_context_they_were_enqueued_in(japp, spans):
    from ..support import jobs_app
    from .test_jobs import drain as drain_jobs

    tracer = trace.get_tracer("host")
    with tracer.start_as_current_span("enqueuing") as caller:
        jobs_app.default.enqueue(jobs_app.record, "traced", 1)
        jobs_app.process_order.send(7)
    assert drain_jobs(japp) == 2
    jobs = named(spans, "process ")
    assert sorted(s.name for s in jobs) == ["process process_order",
                                            "process tests.support.jobs_app:record"]
    for span in jobs:
        assert span.kind is SpanKind.CONSUMER
        assert span.parent.span_id == caller.context.span_id
        assert span.context.trace_id == caller.context.trace_id
        assert span.attributes["messaging.destination.name"] in ("default", "host_jobs")


def test_with_no_sdk_nothing_is_stored_or_carried(app, session, llm, drain):
    assert not tracing.enabled()
    llm.script("hello", {"content": "hi"})
    loop = Assistant.start(message="hello")
    (job,) = session.scalars(select(Job).where(Job.loop_id == loop.id))
    assert "traceparent" not in job.message["options"]
    assert session.get(Loop, loop.id).trace is None
    session.rollback()
    assert drain() == 1
    assert session.get(Loop, loop.id).status == "completed"
    assert json.dumps(session.get(Loop, loop.id).trace) == "null"


def test_loops_started_together_each_get_a_run_their_jobs_carry(app, session, llm, drain,
                                                                  spans):
    llm.script("many", {"content": "ok"})
    ids = list(Assistant.start_many(["many 1", "many 2"]))
    runs = {loop_id: session.get(Loop, loop_id).trace for loop_id in ids}
    assert len({run["traceparent"] for run in runs.values()}) == 2
    carried = {job.loop_id: job.message["options"]["traceparent"]
               for job in session.scalars(select(Job))}
    assert carried == {loop_id: run["traceparent"] for loop_id, run in runs.items()}
    session.rollback()
    assert drain() == 2
    roots = named(spans, "invoke_agent assistant")
    assert sorted(hexid(root.context.span_id, 16) for root in roots) == \
        sorted(run["traceparent"].split("-")[2] for run in runs.values())


def test_a_lapsed_llm_turn_is_reported_by_its_takeover(app, session, llm, drain, spans):
    from datetime import timedelta

    from sqlalchemy import func, update

    from flask_solidloop.loops import store
    from flask_solidloop.state import get_state

    from .loop_states import running_loop

    loop_id, _ = running_loop(session)
    run = session.get(Loop, loop_id).trace
    # Its worker died: the lease lapsed a moment ago, held by a process gone.
    session.execute(update(Loop).where(Loop.id == loop_id).values(
        lease_holder="gone:4242", updated_at=func.now() - timedelta(seconds=5),
        lease_expires_at=func.now() - timedelta(seconds=1)))
    session.commit()
    assert store.heal_expired_llm(get_state(app), session) == [loop_id]
    (lapsed,) = named(spans, "chat test-model")
    (takeover,) = named(spans, "solidloop.takeover")
    root_id = run["traceparent"].split("-")[2]
    for span in (lapsed, takeover):
        assert hexid(span.parent.span_id, 16) == root_id
        assert hexid(span.context.trace_id, 32) == run["traceparent"].split("-")[1]
    assert lapsed.status.status_code is StatusCode.ERROR
    assert lapsed.attributes["error.type"] == "solidloop.lease_lapsed"
    assert lapsed.attributes["solidloop.lease_holder"] == "gone:4242"
    assert lapsed.end_time - lapsed.start_time >= 3_000_000_000  # claim to lapse, from rows
    assert takeover.attributes["solidloop.lapsed_holder"] == "gone:4242"
    # The turn runs again, in the same trace, and the run ends there.
    llm.script("hello there", {"content": "back"})
    assert drain() == 1
    (chat,) = [s for s in named(spans, "chat test-model") if s is not lapsed]
    (root,) = named(spans, "invoke_agent assistant")
    assert chat.parent.span_id == root.context.span_id
    assert hexid(root.context.span_id, 16) == root_id
