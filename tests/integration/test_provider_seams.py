"""Issue 27's provider seams, against the strict emulator over real HTTP: Gemini's
``url_model``, the token rate of a streamed answer that is only a tool call, a
refusal shown where the answer would be, and a stream cut short the way
llama-cpp-python cuts it naming the likely cause."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Loop, Message

from ..support.support_app import calc, solidloop


def make_agent(name: str, base_url: str, *, dialect: str = "openai", streaming: bool = True,
               **extra_llm: object) -> type[Agent]:
    settings = {"dialect": dialect, "base_url": base_url, "model": "test-model",
                "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10, **extra_llm}

    class SeamAgent(Agent):
        system_prompt = "You add numbers."
        mcps = [{"name": "calc", "toolset": calc}]
        llm = settings

    SeamAgent.streaming = streaming
    return solidloop.agent(name)(SeamAgent)


def answers(session, loop_id: int) -> list[Message]:
    session.expire_all()
    return list(session.scalars(select(Message).where(
        Message.loop_id == loop_id, Message.role == "assistant",
        Message.status == "completed").order_by(Message.id)))


def status_of(app, loop_id: int) -> str:
    result = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop_id)])
    assert result.exit_code == 0, result.output
    return result.output


# ------------------------------------------------------------------ url_model


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "stream"])
def test_gemini_url_model_names_the_model_in_the_url(app, session, llm, drain, streaming):
    agent = make_agent(f"gemini_url_model_{streaming}", llm.base_url, dialect="gemini",
                       streaming=streaming, model="support-bot-priced",
                       url_model="gemini-2.5-flash-001")
    llm.script("hello", {"content": "Hi."})
    loop = agent.start(message="hello")
    drain()
    method = "streamGenerateContent" if streaming else "generateContent"
    assert llm.requests[-1].path == f"/v1beta/models/gemini-2.5-flash-001:{method}"
    (answer,) = answers(session, loop.id)
    # The agent's model stays the name recorded (and priced) on the message.
    assert answer.meta["model"] == "support-bot-priced"


# ------------------------------------------------------- a tool-call-only rate


def test_a_streamed_tool_call_answer_reports_a_rate_over_the_whole_turn(
        app, session, llm, drain):
    agent = make_agent("rate_tool_only", llm.base_url)
    # Silence before the first byte, then the call in a burst: no text ever
    # streams, so there is no time to first token to measure the rate from.
    llm.fault_next("slow_prefill", seconds=0.3)
    llm.script("add 2 and 3", {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}],
                               "usage": {"prompt_tokens": 20, "completion_tokens": 40}})
    llm.script("5", {"content": "The sum is 5."})
    loop = agent.start(message="Please add 2 and 3")
    drain()
    call_turn = answers(session, loop.id)[0]
    metrics = call_turn.meta["metrics"]
    assert "ttft_ms" not in metrics
    assert metrics["output_tokens"] == 40
    assert metrics["output_tokens_per_s_whole_turn"] is True
    # Counted over the attempt's duration: rate x duration gives the tokens back.
    seconds = metrics["duration_ms"] / 1000
    assert metrics["output_tokens_per_s"] == pytest.approx(40 / seconds, rel=0.01)
    assert metrics["output_tokens_per_s"] < 40 / 0.3  # the prefill is in the window
    block = status_of(app, loop.id).split(f"[{call_turn.id}] assistant")[1].split("\n[")[0]
    assert f"{metrics['output_tokens_per_s']} tokens/s over the whole turn" in block
    assert "first token" not in block


def test_a_streamed_text_answer_is_timed_from_its_first_token(app, session, llm, drain):
    agent = make_agent("rate_text", llm.base_url)
    llm.fault_next("slow_stream", seconds=0.1)
    llm.script("hello", {"content": "Hello there, how are you today?",
                         "usage": {"prompt_tokens": 5, "completion_tokens": 8}})
    loop = agent.start(message="hello")
    drain()
    metrics = answers(session, loop.id)[0].meta["metrics"]
    assert "output_tokens_per_s_whole_turn" not in metrics
    window = (metrics["duration_ms"] - metrics["ttft_ms"]) / 1000
    assert metrics["output_tokens_per_s"] == pytest.approx(8 / window, rel=0.02)
    assert "tokens/s over the whole turn" not in status_of(app, loop.id)


# ------------------------------------------------------------------ refusals


# The refusal as the message's content, flagged, in every dialect that has one:
# test_provider_fidelity.py::test_a_refusal_is_the_turns_outcome_and_status_shows_it.


def test_the_admin_flags_a_refusal_beside_its_text(app, session, llm, drain):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    agent = make_agent("refusal_admin", llm.base_url)
    llm.script("forbidden", {"refusal": "No, I won't."})
    loop = agent.start(message="something forbidden")
    drain()
    page = app.test_client().get(f"/admin/loops/{loop.id}").get_data(as_text=True)
    article = page.split(f'data-message="{answers(session, loop.id)[0].id}"')[1]
    article = article.split("</article>")[0]
    assert "refusal: the model declined" in article
    assert "No, I won&#39;t." in article


# ------------------------------------------------- a stream cut short by llama


def test_a_stream_ended_by_done_without_finish_reason_names_the_likely_cause(
        app, session, llm, drain):
    agent = make_agent("interrupted", llm.base_url)
    llm.fault_next("interrupted_stream", after=3)
    llm.script("hello", {"content": "one two three four five six seven eight nine ten"})
    loop = agent.start(message="hello")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed"
    assert "ProviderResponseError: the stream ended with [DONE] before its final chunk" \
        in row.error_message
    assert "--interrupt_requests False" in row.error_message
    # The truncated text was never taken for an answer.
    assert answers(session, loop.id) == []
