"""Middleware hooks (global and per agent) applied to a real loop run."""

from __future__ import annotations

from flask_solidloop.pipeline.llm_stack import AgentInitialization


def test_global_and_agent_hooks_apply_in_order(app, session, llm, drain):
    emulator_url = llm.base_url
    from flask_solidloop import Agent

    from ..support.support_app import solidloop

    seen = []

    class Audit:
        def __init__(self, next_step):
            self.next_step = next_step

        def __call__(self, ctx):
            seen.append(("audit", type(ctx).__name__))
            return self.next_step(ctx)

    class AgentLevel:
        def __init__(self, next_step):
            self.next_step = next_step

        def __call__(self, ctx):
            seen.append(("agent", type(ctx).__name__))
            return self.next_step(ctx)

    hook = solidloop.configure_llm_middlewares(
        lambda b: b.insert_after(AgentInitialization, Audit))
    try:
        class Hooked(Agent):
            llm = {"base_url": emulator_url, "model": "m"}

            def configure_llm_middlewares(self, builder):
                builder.insert_before(Audit, AgentLevel)

        solidloop.agent("hooked")(Hooked)
        llm.script("hook", {"content": "ok"})
        Hooked.start(message="hook")
        drain()
    finally:
        solidloop.llm_middleware_hooks.remove(hook)
    assert seen == [("agent", "LlmContext"), ("audit", "LlmContext")]


def test_a_hook_that_raises_fails_the_loop_before_any_claim(app, session, llm, drain):
    # A broken stack definition does not heal by retrying: the loop fails at
    # once, saying why, and no turn was claimed or requested.
    from flask_solidloop import Agent
    from flask_solidloop.models import Loop, Message

    from ..support.support_app import solidloop

    emulator_url = llm.base_url

    class Broken(Agent):
        llm = {"base_url": emulator_url, "model": "m"}

        def configure_llm_middlewares(self, builder):
            raise RuntimeError("no such middleware: Audit")

    solidloop.agent("broken_stack")(Broken)
    loop = Broken.start(message="hi")
    drain()
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "failed", row.status
    assert "no such middleware: Audit" in row.error_message
    assert row.step_count == 0 and llm.requests == []
    assert session.query(Message).filter_by(loop_id=loop.id, role="assistant").count() == 0
