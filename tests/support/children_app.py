"""The test app's child agents (docs/guides/conversations.md, "Child agents"):
a lead that delegates to researchers, and chains for the depth cap and the
cycle check. Registered on support_app's ``solidloop`` when it is imported."""

from __future__ import annotations

from flask_solidloop import Agent, Toolset

from .support_app import calc, llm_settings, slow_tools, solidloop


@solidloop.agent("researcher")
class Researcher(Agent):
    """Research one topic and report the findings in a paragraph."""

    system_prompt = "You research."
    mcps = [{"name": "calc", "toolset": calc}, {"name": "slow", "toolset": slow_tools}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("lead")
class Lead(Agent):
    """Plans work and hands research to its researchers."""

    system_prompt = "You lead."
    mcps = [{"name": "research", "agent": Researcher},
            {"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("lead_sequential")
class SequentialLead(Lead):
    sequential_tool_calls = True


@solidloop.agent("lead_by_name")
class LeadByName(Lead):
    mcps = [{"name": "ask", "agent": "researcher", "description": "Ask a researcher."}]


delegation = Toolset("delegation")


@delegation.agent_tool(Researcher)
def consult(message: str) -> str:
    """Consult a researcher about one topic."""
    raise AssertionError("an agent tool is never run")


@solidloop.agent("lead_toolset")
class ToolsetLead(Lead):
    mcps = [{"name": "delegation", "toolset": delegation}]


#: chain0 delegates to chain1, ..., chain6 (a chain past the default depth cap).
CHAIN_LENGTH = 7
for _n in range(CHAIN_LENGTH):
    solidloop.agent(f"chain{_n}")(type(f"Chain{_n}", (Agent,), {
        "__doc__": f"Link {_n} of a chain of agents.",
        "system_prompt": f"You are link {_n}.",
        "mcps": [{"name": "delegate", "agent": f"chain{_n + 1}"}]
        if _n + 1 < CHAIN_LENGTH else [],
        "llm": lambda self: llm_settings()}))


@solidloop.agent("ping")
class Ping(Agent):
    """Delegates to pong, which delegates back: a cycle."""

    system_prompt = "You ping."
    mcps = [{"name": "pong", "agent": "pong"}]

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("pong")
class Pong(Ping):
    """Delegates back to ping."""

    mcps = [{"name": "ping", "agent": "ping"}]


@solidloop.agent("profiling_lead")
class ProfilingLead(Agent):
    """Hands profiles to the profiler, a child agent with structured output."""

    system_prompt = "You lead."
    mcps = [{"name": "profile", "agent": "profiler"}]

    def llm(self) -> dict:
        return llm_settings()
