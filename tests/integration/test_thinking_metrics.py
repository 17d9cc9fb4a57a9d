"""Issue 16: thinking time and the output-token count of streamed turns, for every
reasoning shape the dialects capture, against the strict emulator."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Message

from ..support.support_app import solidloop

SHAPES = [("openai", {"reasoning_content": "Let me think about it."}),
          ("openai", {"content_prefix": "<think>Let me think about it.</think>"}),
          ("anthropic", {"reasoning_content": "Let me think about it."}),
          ("gemini", {"reasoning_content": "Let me think about it."})]


def make_agent(name: str, dialect: str, base_url: str) -> type[Agent]:
    class ThinkingAgent(Agent):
        system_prompt = "You think first."
        streaming = True
        llm = {"dialect": dialect, "base_url": base_url, "model": "test-model",
               "api_key_env": "SOLIDLOOP_TEST_API_KEY", "read_timeout": 10}

    return solidloop.agent(name)(ThinkingAgent)


def answer(session) -> Message:
    return session.scalars(select(Message).where(Message.role == "assistant",
                                                 Message.status == "completed")).one()


@pytest.mark.parametrize(("dialect", "shape"), SHAPES,
                         ids=["reasoning_content", "think_tag", "anthropic", "gemini"])
def test_thinking_ms_for_every_reasoning_shape(app, session, llm, drain, dialect, shape):
    agent = make_agent(f"thinking_{dialect}_{len(shape)}_{id(shape)}", dialect, llm.base_url)
    reply = {"content": shape.get("content_prefix", "") + "The answer is 4."}
    if "reasoning_content" in shape:
        reply["reasoning_content"] = shape["reasoning_content"]
    llm.script("two and two", reply)
    agent.start(message="two and two?")
    drain()
    message = answer(session)
    assert message.reasoning and "think about it" in message.reasoning
    metrics = message.meta["metrics"]
    assert metrics["thinking_ms"] >= 0 and metrics["ttft_ms"] >= 0
    assert metrics["output_tokens"] > 0 and "output_tokens_estimated" not in metrics


def test_no_thinking_ms_without_reasoning(app, session, llm, drain):
    agent = make_agent("thinking_none", "openai", llm.base_url)
    llm.script("hello", {"content": "Hi."})
    agent.start(message="hello")
    drain()
    assert "thinking_ms" not in answer(session).meta["metrics"]


def test_output_tokens_are_estimated_and_labelled_without_usage(app, session, llm, drain):
    agent = make_agent("thinking_no_usage", "openai", llm.base_url)
    llm.fault_next("no_usage")
    llm.script("count", {"content": "x" * 40})
    agent.start(message="count")
    drain()
    metrics = answer(session).meta["metrics"]
    assert metrics["output_tokens"] == 10 and metrics["output_tokens_estimated"] is True
    assert metrics["output_tokens_per_s"] > 0


def test_status_shows_thinking_time_and_estimated_tokens(app, session, llm, drain):
    agent = make_agent("thinking_status", "openai", llm.base_url)
    llm.fault_next("no_usage")
    llm.script("status", {"content": "x" * 40, "reasoning_content": "hmm"})
    loop = agent.start(message="status")
    drain()
    output = app.test_cli_runner().invoke(args=["solidloop", "status", str(loop.id)]).output
    assert "timing: first token" in output and "thinking" in output
    assert "output tokens (estimate: the server sent no usage)" in output


def test_a_turn_still_streaming_shows_its_tokens_so_far():
    from flask_solidloop.render import format_message

    shell = Message(role="assistant", status="processing", is_hidden=True, content="x" * 40,
                    meta={})
    assert "streaming: ~10 output tokens so far (estimate" in format_message(shell, {})
