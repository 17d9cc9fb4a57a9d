"""The provider layer end to end against the emulator: retries, faults, bad input,
reasoning round trips, usage, cost and the wire log."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Event, Loop, Message, ToolCall
from flask_solidloop.testing import drain as run

from ..support.rows import loop_of as finished
from ..support.support_app import calc, create_app, solidloop


def agent_for(name, emulator, *, dialect="openai", streaming=False, **extra):
    class ProviderAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]

    ProviderAgent.llm = {"dialect": dialect, "base_url": emulator.base_url, "model": "test-model",
                         "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 5}
    ProviderAgent.streaming = streaming
    for key, value in extra.items():
        setattr(ProviderAgent, key, value)
    return solidloop.agent(name)(ProviderAgent)


def attempts(session):
    event = session.scalars(select(Event).where(Event.kind == "llm_request")
                            .order_by(Event.id.desc())).first()
    return event.payload["attempts"]


# -- retries ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["seconds", "http-date", "ms"])
def test_retry_after_in_every_form_is_honoured(app, session, llm, form):
    from datetime import UTC, datetime, timedelta

    agent = agent_for(f"retry_{form.replace('-', '_')}", llm)
    options = {"seconds": {"retry_after": 0.2},
               "http-date": {"retry_after": datetime.now(UTC) + timedelta(seconds=1)},
               "ms": {"retry_after_ms": 150}}[form]
    llm.fault_next("status", status=429, **options)
    llm.script("hi", {"content": "hello"})
    loop = agent.start(message="hi")
    run(app)
    assert finished(session, loop.id).status == "completed"
    first = attempts(session)[0]
    assert first["status"] == 429
    expected = {"seconds": 0.2, "http-date": 1.0, "ms": 0.15}[form]
    # the server's wait is a floor; full jitter adds up to the backoff (0.05 s in tests)
    slack = 1.0 if form == "http-date" else 0.01
    assert expected - slack <= first["retry_in_s"] <= expected + 0.05 + slack


def test_gemini_retry_info_is_honoured_and_capped(app, session, llm):
    agent = agent_for("retry_gemini", llm, dialect="gemini")
    llm.fault_next("retry_info", retry_delay="37s")
    llm.script("hi", {"content": "hello"})
    loop = agent.start(message="hi")
    run(app)
    assert finished(session, loop.id).status == "completed"
    # the server asked for 37 s; SOLIDLOOP_LLM_RETRY_MAX_DELAY (0.5 in tests) caps it,
    # and a capped wait leaves no room for jitter
    assert attempts(session)[0]["retry_in_s"] == 0.5


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_deterministic_statuses_are_never_retried(app, session, llm, status):
    agent = agent_for(f"never_{status}", llm)
    llm.fault_next("status", status=status)
    loop = agent.start(message="hi")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed" and f"HTTP {status}" in row.error_message
    assert len(attempts(session)) == 1


def test_a_read_timeout_is_not_retried(app, session, llm):
    agent = agent_for("read_timeout", llm)
    agent.llm = {**agent.llm, "read_timeout": 0.5}
    llm.fault_next("slow_prefill", seconds=1.5)
    loop = agent.start(message="slow")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed" and "ReadTimeout" in row.error_message
    assert "not retried" in row.error_message
    assert len(attempts(session)) == 1


def test_a_connection_that_never_opened_is_retried_then_deferred(app, session, llm):
    import socket

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    agent = agent_for("refused", llm)
    agent.llm = {**agent.llm, "base_url": f"http://127.0.0.1:{dead_port}"}
    loop = agent.start(message="anyone?")
    run(app)
    session.expire_all()
    row = session.get(Loop, loop.id)
    # Past its retries, an unreachable provider defers the turn rather than fail
    # the loop (tests/integration/test_provider_outages.py has the rest).
    assert row.status == "queued" and "cannot connect" in row.provider_wait_error
    assert [a.get("error", "").startswith("connect failed") for a in attempts(session)] == \
        [True, True, True]  # the first attempt and SOLIDLOOP_LLM_RETRIES=2 more


def test_streaming_read_timeout_counts_silence_not_total_time(app, session, llm):
    agent = agent_for("slow_but_alive", llm, streaming=True)
    # Gaps of 0.4 s under a 1.5 s read timeout (room for a loaded machine), and
    # a total well above it: 12 pieces of 8 characters.
    agent.llm = {**agent.llm, "read_timeout": 1.5}
    llm.fault_next("slow_stream", seconds=0.4)
    answer = "a long answer that arrives in many small pieces, " * 2
    llm.script("steady", {"content": answer})
    loop = agent.start(message="steady")
    began = time.monotonic()
    run(app)
    assert time.monotonic() - began > 1.5  # the premise: longer than the timeout in all
    assert finished(session, loop.id).status == "completed"
    reply = session.scalars(select(Message).where(
        Message.loop_id == loop.id, Message.role == "assistant",
        Message.is_hidden.is_(False))).one()
    assert reply.content == answer


def test_a_stream_that_broke_before_any_content_is_retried(app, session, llm):
    agent = agent_for("broke_early", llm, streaming=True)
    llm.fault_next("disconnect_mid_stream", after=0)
    llm.script("early", {"content": "second time lucky"})
    loop = agent.start(message="early")
    run(app)
    assert finished(session, loop.id).status == "completed"
    assert len(attempts(session)) == 2


def test_a_stream_that_broke_after_content_is_not_retried_at_once_but_deferred(
        app, session, llm):
    """Content was handed over, so the attempt is never repeated inside the turn
    (a second generation would be glued onto the first); the broken connection
    is an outage for the loop (a provider restart): the turn is deferred whole."""
    agent = agent_for("broke_late", llm, streaming=True)
    llm.fault_next("disconnect_mid_stream", after=3)
    llm.script("late", {"content": "this answer will be cut off in the middle somewhere"})
    loop = agent.start(message="late")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "queued" and row.provider_wait_attempts == 1
    assert row.provider_wait_error.startswith("ProviderConnectionLostError: the stream from ")
    assert len(attempts(session)) == 1
    shells = list(session.scalars(select(Message).where(Message.role == "assistant")))
    assert [(s.status, s.is_hidden) for s in shells] == [("failed", True)]


@pytest.mark.parametrize("dialect", ["openai", "openai_responses", "anthropic", "gemini"])
def test_an_error_event_mid_stream_before_content_is_retried(app, session, llm, dialect):
    agent = agent_for(f"overloaded_{dialect}", llm, dialect=dialect, streaming=True)
    llm.fault_next("error_mid_stream", after=0)
    llm.script("busy", {"content": "ok now"})
    loop = agent.start(message="busy")
    run(app)
    assert finished(session, loop.id).status == "completed"


def test_pause_during_a_backoff_wait_cuts_the_wait_short(app, session, llm):
    import threading

    agent = agent_for("patient", llm)
    llm.fault_next("status", status=503, retry_after=30)
    other = create_app(SOLIDLOOP_LLM_RETRY_MAX_DELAY=60)
    loop_id = agent.start(message="wait").id
    paused_at = {}

    def pause_soon():
        time.sleep(0.5)
        with other.app_context():
            agent(loop_id).pause()
        paused_at["t"] = time.monotonic()

    threading.Thread(target=pause_soon).start()
    with other.app_context():
        run(other)
    ended = time.monotonic()
    other.extensions["solidloop"].broker.close()
    # The wait was 30 s (Retry-After): the pause cut it short (the client polls
    # for it every 0.5 s; a third of the wait is a bound no loaded machine
    # reaches) and the retry was never sent.
    assert ended - paused_at["t"] < 10
    assert len(llm.requests) == 1
    assert finished(session, loop_id).status == "paused"


# -- bad input -------------------------------------------------------------------------


def test_a_malformed_json_body_fails_with_a_readable_error(app, session, llm):
    agent = agent_for("malformed", llm)
    llm.fault_next("malformed_chunk")
    llm.script("garbled", {"content": "never parsed"})
    loop = agent.start(message="garbled")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed"
    assert row.error_message.startswith("ProviderResponseError") and "not JSON" in row.error_message


def test_an_unknown_finish_reason_fails_with_a_readable_error(app, session, llm):
    agent = agent_for("weird_finish", llm)
    llm.script("weird", {"content": "?", "finish_reason": "galaxy_brain"})
    loop = agent.start(message="weird")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed" and "galaxy_brain" in row.error_message


def test_a_gemini_blocked_prompt_fails_with_the_reason(app, session, llm):
    agent = agent_for("blocked", llm, dialect="gemini")
    llm.fault_next("status", status=200,
                   body={"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {}})
    loop = agent.start(message="something unsafe")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed" and "SAFETY" in row.error_message


# -- reasoning, usage, cost, wire log --------------------------------------------------------


def test_anthropic_thinking_blocks_go_back_unchanged(app, session, llm):
    agent = agent_for("thinker", llm, dialect="anthropic", streaming=True)
    llm.script("think", {"reasoning_content": "Let me add 2 and 3 carefully.",
                         "content": "Adding.",
                         "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]})
    llm.script("5", {"content": "5."})
    loop = agent.start(message="think then add")
    run(app)
    assert finished(session, loop.id).status == "completed"
    first_turn = session.scalars(select(Message).where(Message.role == "assistant")
                                 .order_by(Message.id)).first()
    stored = first_turn.meta["anthropic_blocks"]
    assert stored[0]["type"] == "thinking" and stored[0]["signature"].startswith("sig-")
    sent_back = llm.requests[-1].json["messages"][1]["content"]
    import json

    assert json.dumps(sent_back) == json.dumps(stored)
    assert first_turn.reasoning == "Let me add 2 and 3 carefully."
    final = session.scalars(select(Message).where(Message.role == "assistant")
                            .order_by(Message.id.desc())).first()
    assert final.meta["reasoning_carried"]["messages"] == 1
    assert final.meta["reasoning_carried"]["chars"] == len("Let me add 2 and 3 carefully.")


def test_cost_is_recorded_per_message_and_totalled_per_loop(app, session, llm):
    other = create_app(SOLIDLOOP_PRICES={"test-model": {"input": 2, "cached_input": 1,
                                                        "output": 10}})
    agent = agent_for("priced", llm)
    llm.script("add 2", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}],
                         "usage": {"prompt_tokens": 1000, "completion_tokens": 100}})
    llm.script("4", {"content": "4", "usage": {"prompt_tokens": 2000, "completion_tokens": 10}})
    with other.app_context():
        loop_id = agent.start(message="add 2 and 2").id
        run(other)
    other.extensions["solidloop"].broker.close()
    row = finished(session, loop_id)
    turns = list(session.scalars(select(Message).where(Message.role == "assistant")
                                 .order_by(Message.id)))
    assert [t.cost for t in turns] == [Decimal("0.003"), Decimal("0.0041")]
    assert row.cost == Decimal("0.0071")
    assert (row.input_tokens, row.output_tokens) == (3000, 110)


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "gemini"])
def test_no_key_reaches_the_database_in_any_dialect(app, session, llm, dialect):
    agent = agent_for(f"secret_{dialect}", llm, dialect=dialect, streaming=True)
    llm.script("secret", {"content": "ok"})
    agent.start(message="secret")
    run(app)
    dump = session.connection().exec_driver_sql(
        "SELECT coalesce(string_agg(e::text || coalesce(a::text, ''), ''), '') "
        "FROM solidloop_events e LEFT JOIN solidloop_llm_answers a ON a.event_id = e.id"
    ).scalar_one()
    assert "sk-test-secret-123" not in dump and "[redacted]" in dump


def test_invalid_tool_call_json_from_the_model_is_a_tool_error(app, session, llm):
    agent = agent_for("bad_args_stream", llm, streaming=True)
    llm.script("bad", {"tool_calls": [{"name": "add", "arguments": "{\"a\": 1, \"b\":"}]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "sorry"})
    loop = agent.start(message="bad args")
    run(app)
    assert finished(session, loop.id).status == "completed"
    call = session.scalars(select(ToolCall)).one()
    assert call.is_success is False
    assert "not a JSON object" in call.result["content"][0]["text"]


@pytest.mark.parametrize("max_hz", [20.0, 0.0], ids=["deltas", "deltas-off"])
def test_streamed_partials_reach_watchers_but_never_the_history(app, session, llm,
                                                                  database_url, max_hz):
    # Text deltas on, the text so far is in the loop's stream and the shell stays
    # empty until the turn commits; off, the text so far is on the hidden shell.
    # Either way no visible message ever holds a partial.
    import threading

    import psycopg

    from flask_solidloop.queue.broker import libpq_url

    other = create_app(SOLIDLOOP_STREAM_UPDATE_INTERVAL=0.05, SOLIDLOOP_STREAM_MAX_HZ=max_hz)
    agent = agent_for("watched", llm, streaming=True)
    llm.fault_next("slow_stream", seconds=0.05)
    text = "one two three four five six seven eight nine ten " * 3
    llm.script("watch", {"content": text})
    seen: list[tuple[str, bool, str, str]] = []
    done = threading.Event()

    def watch():
        with psycopg.connect(libpq_url(database_url), autocommit=True) as pg:
            while not done.is_set():
                seen.extend(pg.execute(
                    "SELECT m.status, m.is_hidden, coalesce(m.content, ''), "
                    "coalesce((SELECT string_agg(e.text, '' ORDER BY e.id) "
                    "FROM solidloop_stream_events e WHERE e.message_id = m.id "
                    "AND e.kind = 'text_delta'), '') "
                    "FROM solidloop_messages m WHERE m.role = 'assistant'").fetchall())
                time.sleep(0.02)

    with other.app_context():
        loop_id = agent.start(message="watch me stream").id
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            run(other)
        finally:
            done.set()
            watcher.join()
    other.extensions["solidloop"].broker.close()
    unfinished = [(content, streamed) for status, hidden, content, streamed in seen
                  if status == "processing"]
    assert all(hidden for status, hidden, _, _ in seen if status == "processing")
    if max_hz:
        partials = [streamed for content, streamed in unfinished if streamed]
        assert all(content == "" for content, _ in unfinished)
    else:
        partials = [content for content, streamed in unfinished if content]
        assert all(streamed == "" for _, streamed in unfinished)
    assert partials, "no partial text was written while streaming"
    assert all(text.startswith(p) for p in partials)
    assert finished(session, loop_id).status == "completed"


def test_a_stream_without_usage_still_completes(app, session, llm):
    agent = agent_for("no_usage", llm, streaming=True)
    llm.fault_next("no_usage")
    llm.script("quiet", {"content": "no numbers here"})
    loop = agent.start(message="quiet")
    run(app)
    assert finished(session, loop.id).status == "completed"
    turn = session.scalars(select(Message).where(Message.role == "assistant")).one()
    assert turn.usage is None and turn.cost is None


def test_a_key_with_a_trailing_newline_is_cleaned_and_never_leaks(app, session, llm,
                                                                   monkeypatch):
    monkeypatch.setenv("SOLIDLOOP_TEST_API_KEY", "sk-live-SECRET123\n")
    agent = agent_for("newline_key", llm)
    llm.script("newline", {"content": "fine"})
    loop = agent.start(message="newline")
    run(app)
    assert finished(session, loop.id).status == "completed"
    assert llm.requests[-1].headers["authorization"] == "Bearer sk-live-SECRET123"
    monkeypatch.setenv("SOLIDLOOP_TEST_API_KEY", "sk-live-SE\x01CRET123")
    loop = agent.start(message="newline")
    run(app)
    row = finished(session, loop.id)
    assert row.status == "failed" and "control characters" in row.error_message
    dump = session.connection().exec_driver_sql(
        "SELECT coalesce(string_agg(t::text, ''), '') FROM (SELECT error_message FROM "
        "solidloop_loops UNION ALL SELECT payload::text FROM solidloop_events "
        "UNION ALL SELECT answer::text FROM solidloop_llm_answers) t").scalar_one()
    assert "SECRET123" not in dump


def test_pausing_a_streaming_turn_closes_the_stream(app, session, llm):
    import threading

    agent = agent_for("long_stream", llm, streaming=True)
    llm.fault_next("slow_stream", seconds=0.3)
    llm.script("long", {"content": " ".join(["word"] * 200)})  # ~60 s at this pace
    other = create_app()
    loop_id = agent.start(message="long story").id

    def pause_soon():
        time.sleep(1.0)
        with other.app_context():
            agent(loop_id).pause()

    threading.Thread(target=pause_soon).start()
    started = time.monotonic()
    with other.app_context():
        run(other)
    other.extensions["solidloop"].broker.close()
    assert time.monotonic() - started < 5
    assert finished(session, loop_id).status == "paused"
