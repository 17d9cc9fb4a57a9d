"""Async LLM I/O's two decisions made before any turn: which stacks may hand
their request to the I/O loop (the steps before NetworkCalling are the
built-in ones), and how big a worker process's per-origin pool is."""

from __future__ import annotations

from types import SimpleNamespace

from flask_solidloop.config import Config
from flask_solidloop.pipeline.llm_stack import (
    DEFAULT_LLM_STACK,
    AgentInitialization,
    ErrorHandling,
    NetworkCalling,
    ResponseParsing,
)
from flask_solidloop.pipeline.plan import StackPlan
from flask_solidloop.pipeline.tool_stack import DEFAULT_TOOL_STACK
from flask_solidloop.runtime.llm_io import pool_limits_for


class Wrapping:
    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        return self.next_step(ctx)


def test_only_stacks_with_nothing_around_the_network_call_hand_off():
    assert StackPlan.of(DEFAULT_LLM_STACK, DEFAULT_TOOL_STACK).hands_off
    after = (ErrorHandling, AgentInitialization, NetworkCalling, Wrapping, ResponseParsing)
    assert StackPlan.of(after, DEFAULT_TOOL_STACK).hands_off
    for before in [(Wrapping, ErrorHandling, AgentInitialization, NetworkCalling, ResponseParsing),
                   (ErrorHandling, Wrapping, AgentInitialization, NetworkCalling, ResponseParsing),
                   (ErrorHandling, AgentInitialization, Wrapping, NetworkCalling, ResponseParsing),
                   (AgentInitialization, NetworkCalling, ResponseParsing)]:
        assert not StackPlan.of(before, DEFAULT_TOOL_STACK).hands_off, before


def state(**config):
    return SimpleNamespace(config=Config.from_mapping({"SOLIDLOOP_LLM_IO": "threads", **config}))


def test_the_pool_is_the_process_concurrency_at_least_100():
    assert pool_limits_for(state(), 8).max_connections == 100
    assert pool_limits_for(state(), 256).max_connections == 256
    assert pool_limits_for(state(SOLIDLOOP_LLM_IO="async"), 16).max_connections == 1000
    assert pool_limits_for(state(SOLIDLOOP_LLM_IO="async", SOLIDLOOP_LLM_IO_MAX_INFLIGHT=50),
                           16).max_connections == 100
    assert pool_limits_for(state(SOLIDLOOP_LLM_MAX_CONNECTIONS=12), 256).max_connections == 12
    limits = pool_limits_for(state(), 300)
    assert limits.httpx_limits().max_keepalive_connections == 300
