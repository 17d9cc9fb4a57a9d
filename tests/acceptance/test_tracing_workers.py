"""One OpenTelemetry trace per loop run, across real worker processes, a
SIGKILL and a takeover (docs/decisions/0033-tracing.md).

The workers run the OpenTelemetry SDK with an OTLP/HTTP exporter pointed at a
real receiver on 127.0.0.1 (tests/support/otlp_receiver.py) that decodes the
protobuf; the test process starts the loops with the SDK installed too (an
in-memory one), so each loop stores its run's trace context. Each worker
exports every span as it ends, so a killed worker loses only the spans it
never ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import error_attributes

from flask_solidloop.models import Loop

from ..support.otel import OTLP_ENDPOINT_ENV, spans_in_memory
from ..support.otlp_receiver import Receiver
from ..support.support_app import Assistant, SlowAgent
from .test_e2e_workers import kill_group, spawn_workers
from .test_liveness import holder_group, poll, running_calls

pytestmark = pytest.mark.e2e

TTL = 4.0
WORKER_CMD = [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "1",
              "--threads", "2"]
SECRET = "sk-test-secret-123"  # the emulator's key (tests/conftest.py's llm fixture)

#: What every chat span carries, by the conventions' own names.
CHAT_ATTRIBUTES = (gen_ai.GEN_AI_OPERATION_NAME, gen_ai.GEN_AI_PROVIDER_NAME,
                   gen_ai.GEN_AI_REQUEST_MODEL, gen_ai.GEN_AI_RESPONSE_MODEL,
                   gen_ai.GEN_AI_RESPONSE_ID, gen_ai.GEN_AI_RESPONSE_FINISH_REASONS,
                   gen_ai.GEN_AI_USAGE_INPUT_TOKENS, gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS,
                   gen_ai.GEN_AI_CONVERSATION_ID)
TOOL_ATTRIBUTES = (gen_ai.GEN_AI_OPERATION_NAME, gen_ai.GEN_AI_TOOL_NAME,
                   gen_ai.GEN_AI_TOOL_CALL_ID, gen_ai.GEN_AI_CONVERSATION_ID)
CONTENT = (gen_ai.GEN_AI_INPUT_MESSAGES, gen_ai.GEN_AI_OUTPUT_MESSAGES,
           gen_ai.GEN_AI_TOOL_CALL_ARGUMENTS, gen_ai.GEN_AI_TOOL_CALL_RESULT)


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def traced_here():
    """The SDK in the test process (the loops start here), in memory."""
    with spans_in_memory() as exporter:
        yield exporter


@pytest.fixture
def fleets(monkeypatch, tmp_path, receiver):
    """Named worker fleets exporting to ``receiver``; all stopped at the end."""
    started: dict[str, object] = {}

    def start(name: str, **config: object) -> object:
        monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({
            "SOLIDLOOP_LIVENESS_TTL": TTL, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
            "SOLIDLOOP_LEASE_MARGIN": 1, **config}))
        monkeypatch.setenv(OTLP_ENDPOINT_ENV, receiver.endpoint)
        started[name] = spawn_workers(WORKER_CMD, log=tmp_path / f"{name}.log")
        return started[name]

    yield start
    for proc in started.values():
        kill_group(proc)  # type: ignore[arg-type]


def tool_results(body: dict) -> int:
    return sum(1 for m in body["messages"] if m["role"] == "tool")


def three_turns(llm, *, slow_second: float) -> None:
    """Turn 1 asks for a short sleep, turn 2 (after its result) for a long one,
    turn 3 (after both) answers."""
    llm.script(lambda body: tool_results(body) == 0, {"content": "first", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": 0.1}}]})
    llm.script(lambda body: tool_results(body) == 1, {"content": "second", "tool_calls": [
        {"name": "slow", "arguments": {"seconds": slow_second}}]})
    llm.script(lambda body: tool_results(body) == 2, {"content": "all slept"})


def run_of(session, loop_id: int) -> dict:
    session.expire_all()
    run = session.get(Loop, loop_id).trace
    session.rollback()
    assert run and run["traceparent"], "the loop stored no trace context"
    return run


def test_a_killed_and_taken_over_loop_arrives_as_one_trace(
        app, session, llm, fleets, receiver, traced_here, effects):
    three_turns(llm, slow_second=6.0)
    fleets("first"), fleets("second")
    loop = SlowAgent.start(message="trace please")
    _, trace_id, root_id, _ = run_of(session, loop.id)["traceparent"].split("-")

    # Kill the worker running the second tool call, mid-body.
    def second_call():
        calls = [c for c in running_calls(session, loop.id)
                 if c.arguments == {"seconds": 6.0}]
        return calls[0] if calls else None

    call = poll(session, second_call, what="the second tool call to start")
    holder = call.lease_holder
    poll(session, lambda: effects(call.idempotency_key), what="its body to start")
    os.killpg(holder_group(holder), signal.SIGKILL)
    poll(session, lambda: session.get(Loop, loop.id).status == "completed", timeout=120,
         what="the loop to complete after the kill")

    spans = receiver.wait_for(
        lambda: (lambda found: found if any(s.name.startswith("invoke_agent")
                                            for s in found) else None)(
            receiver.of_trace(trace_id)),
        what="the run's invoke_agent span")
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)

    # One root: the run's invoke_agent span, with the ids the loop stored.
    (root,) = by_name["invoke_agent liveness"]
    assert (root.span_id, root.parent_span_id) == (root_id, "")
    assert root.status != "error"
    assert root.attributes[gen_ai.GEN_AI_OPERATION_NAME] == "invoke_agent"
    assert root.attributes[gen_ai.GEN_AI_CONVERSATION_ID] == str(loop.id)
    assert root.attributes["solidloop.outcome"] == "completed"
    assert root.start_ns <= min(s.start_ns for s in spans)
    assert root.end_ns >= max(s.end_ns for s in spans if s is not root)

    # Three chat turns and the two tool calls that answered, each under the root.
    chats = [s for s in by_name["chat test-model"] if s.status != "error"]
    assert len(chats) == 3
    tools = by_name["execute_tool slow"]
    answered = [s for s in tools if s.status != "error"]
    assert len(answered) == 2
    for span in chats + tools:
        assert span.parent_span_id == root.span_id, span
    for span in chats:
        for name in CHAT_ATTRIBUTES:
            assert span.attributes.get(name) not in (None, "", []), (span, name)
        assert span.attributes[gen_ai.GEN_AI_OPERATION_NAME] == "chat"
        assert span.attributes[gen_ai.GEN_AI_PROVIDER_NAME] == "openai"
        assert span.attributes[gen_ai.GEN_AI_REQUEST_MODEL] == "test-model"
        assert span.attributes[gen_ai.GEN_AI_CONVERSATION_ID] == str(loop.id)
        assert span.kind == "client"
    for span in answered:
        for name in TOOL_ATTRIBUTES:
            assert span.attributes.get(name) not in (None, ""), (span, name)
        assert span.attributes[gen_ai.GEN_AI_TOOL_NAME] == "slow"
    assert {s.attributes["solidloop.tool_call.id"] for s in answered} == \
        {s.attributes["solidloop.tool_call.id"] for s in tools}
    # Each turn's claim and commit, inside it.
    turn_ids = {s.span_id for s in chats + answered}
    assert {s.parent_span_id for s in by_name["solidloop.claim"]} >= turn_ids
    assert {s.parent_span_id for s in by_name["solidloop.commit"]} >= turn_ids

    # The killed attempt: its span, from our rows, an error; the takeover's beside it.
    killed_pid = int(holder.rsplit(":", 1)[1])
    (lapsed,) = [s for s in tools if s.status == "error"]
    assert lapsed.attributes[error_attributes.ERROR_TYPE] == "solidloop.lease_lapsed"
    assert lapsed.attributes["solidloop.lease_holder"] == holder
    assert lapsed.attributes["solidloop.tool_call.id"] == call.id
    assert lapsed.resource["process.pid"] != killed_pid  # the reaper's process sent it
    assert lapsed.start_ns < lapsed.end_ns
    (takeover,) = by_name["solidloop.takeover"]
    assert takeover.parent_span_id == root.span_id
    assert takeover.attributes["solidloop.lapsed_holder"] == holder
    assert takeover.start_ns >= lapsed.end_ns
    # The call ran again after the takeover, in the same trace.
    rerun = [s for s in answered if s.attributes["solidloop.tool_call.id"] == call.id]
    assert len(rerun) == 1 and rerun[0].start_ns >= takeover.start_ns
    assert rerun[0].resource["process.pid"] != killed_pid
    # The killed worker's ended spans arrived before it died (its first turns).
    assert any(s.resource["process.pid"] == killed_pid for s in spans)

    # No content by default.
    for span in spans:
        assert not set(CONTENT) & set(span.attributes), span


def test_content_is_captured_redacted_only_when_turned_on(
        app, session, llm, fleets, receiver, traced_here):
    llm.script(lambda body: tool_results(body) == 0, {"content": "looking", "tool_calls": [
        {"name": "lookup", "arguments": {"key": f"the key {SECRET}"}}]})
    llm.script(lambda body: tool_results(body) == 1, {"content": f"done with {SECRET}"})
    fleets("content", SOLIDLOOP_OTEL_CAPTURE_CONTENT=True)
    loop = Assistant.start(message=f"look up {SECRET} please")
    trace_id = run_of(session, loop.id)["traceparent"].split("-")[1]
    poll(session, lambda: session.get(Loop, loop.id).status == "completed",
         what="the loop to complete")
    spans = receiver.wait_for(
        lambda: (lambda found: found if any(s.name.startswith("invoke_agent")
                                            for s in found) else None)(
            receiver.of_trace(trace_id)),
        what="the run's invoke_agent span")
    chats = [s for s in spans if s.name.startswith("chat ")]
    (tool,) = [s for s in spans if s.name == "execute_tool lookup"]
    assert len(chats) == 2
    captured = [s.attributes[name] for s in chats
                for name in (gen_ai.GEN_AI_INPUT_MESSAGES, gen_ai.GEN_AI_OUTPUT_MESSAGES)]
    captured += [tool.attributes[gen_ai.GEN_AI_TOOL_CALL_ARGUMENTS],
                 tool.attributes[gen_ai.GEN_AI_TOOL_CALL_RESULT]]
    for text in captured:
        assert SECRET not in text
    # The content is there, the key replaced where it was.
    first_input = json.loads(chats[0].attributes[gen_ai.GEN_AI_INPUT_MESSAGES])
    assert first_input[-1]["parts"][0]["content"] == "look up [redacted] please"
    assert json.loads(tool.attributes[gen_ai.GEN_AI_TOOL_CALL_ARGUMENTS]) == \
        {"key": "the key [redacted]"}
    assert "[redacted]" in tool.attributes[gen_ai.GEN_AI_TOOL_CALL_RESULT]
    last_output = json.loads(chats[-1].attributes[gen_ai.GEN_AI_OUTPUT_MESSAGES])
    assert last_output[0]["parts"][0]["content"] == "done with [redacted]"
