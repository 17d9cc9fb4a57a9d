"""The middleware Builder and stack composition."""

from __future__ import annotations

import pytest

from flask_solidloop import Builder, UnknownMiddlewareError
from flask_solidloop.pipeline.llm_stack import (
    DEFAULT_LLM_STACK,
    AgentInitialization,
    ErrorHandling,
    NetworkCalling,
    ResponseParsing,
)
from flask_solidloop.pipeline.tool_stack import DEFAULT_TOOL_STACK, ResponseCreation, ToolExecution


def tracer(label):
    class Trace:
        def __init__(self, next_step):
            self.next_step = next_step

        def __call__(self, ctx):
            ctx.append(label)
            return self.next_step(ctx)

    Trace.__qualname__ = f"Trace{label}"
    return Trace


A, B, C, D = (tracer(x) for x in "ABCD")


def test_default_stacks_split_like_the_seed():
    assert (ErrorHandling, AgentInitialization, NetworkCalling,
                                 ResponseParsing) == DEFAULT_LLM_STACK
    assert (ToolExecution, ResponseCreation) == DEFAULT_TOOL_STACK


def test_edits_and_order():
    builder = Builder([A, C])
    builder.insert_before(C, B).insert_after(C, D)
    calls = []
    builder.build()(calls)
    assert calls == ["A", "B", "C", "D"]
    builder.replace(B, tracer("X")).delete(D)
    calls = []
    builder.build()(calls)
    assert calls == ["A", "X", "C"]


@pytest.mark.parametrize("method", ["insert_before", "insert_after", "replace"])
def test_positional_edits_raise_on_unknown_target(method):
    builder = Builder([A])
    message = "TraceB is not in this stack; present: TraceA"
    with pytest.raises(UnknownMiddlewareError, match=message):
        getattr(builder, method)(B, C)


def test_delete_is_lenient():
    builder = Builder([A])
    builder.delete(B)
    assert builder.middlewares == [A]
