"""The MCP server blueprint's API and its janitor retention (no server process)."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import func, select, text

from flask_solidloop import CallContext, ConfigurationError, Toolset
from flask_solidloop.errors import AgentDefinitionError
from flask_solidloop.maintenance.janitor import prune
from flask_solidloop.mcp_server import ExposedAgent
from flask_solidloop.mcp_server import store as inbound
from flask_solidloop.mcp_server.agents import agent_toolset
from flask_solidloop.models import Event, Loop, McpInboundSession
from flask_solidloop.state import get_state

from ..support.support_app import Assistant, calc, solidloop


def test_auth_is_required_at_creation_time():
    with pytest.raises(ConfigurationError, match="mcp_blueprint needs auth="):
        solidloop.mcp_blueprint(calc)
    with pytest.raises(ConfigurationError, match="needs at least one Toolset"):
        solidloop.mcp_blueprint(auth=lambda t, r: "x")
    with pytest.raises(ConfigurationError, match="takes Toolset objects positionally"):
        solidloop.mcp_blueprint("calc", auth=lambda t, r: "x")
    with pytest.raises(AgentDefinitionError, match="takes Agent subclasses"):
        solidloop.mcp_blueprint(calc, auth=lambda t, r: "x", agents=[object])
    with pytest.raises(ConfigurationError, match="must be a list of strings"):
        solidloop.mcp_blueprint(calc, auth=lambda t, r: "x", allowed_hosts="example.com")


@pytest.mark.parametrize("options, named", [
    ({"arguments": ["ticket_id"]}, "must be a dict of argument name -> JSON Schema"),
    ({"arguments": {"message": {"type": "string"}}}, "'message' is the start tool's own"),
    ({"arguments": {"ticket id": {"type": "integer"}}}, "argument names match"),
    ({"arguments": {"ticket_id": "integer"}}, "must be a JSON Schema dict"),
    ({"arguments": {"ticket_id": {"type": "int"}}}, "is not valid JSON Schema: 'int' is not"),
    ({"arguments": {"a": {}}, "required": "a"}, "must be a list of argument names"),
    ({"arguments": {"a": {}}, "required": ["b"]}, "names ['b'] that arguments= does not"),
    ({"on_start": "start_ticket"}, "must be a callable on_start(principal, arguments)"),
])
def test_an_exposed_agents_start_options_are_checked_when_declared(options, named):
    with pytest.raises(ConfigurationError) as caught:
        ExposedAgent(Assistant, **options)
    assert named in str(caught.value)


def test_an_exposed_agent_must_wrap_a_registered_agent():
    with pytest.raises(AgentDefinitionError, match="or ExposedAgent"):
        solidloop.mcp_blueprint(auth=lambda t, r: "x", agents=[ExposedAgent(object)])


@pytest.mark.parametrize("chosen, named", [
    ({"subject": ("Ticket", "1"), "colour": "red"},
     "on_start=['colour', 'subject'] is invalid: must return None or a dict"),
    (["Ticket", "1"], "on_start='list' is invalid: must return None or a dict"),
    ({"state": "secret-value"}, "on_start='str' is invalid: 'state' must be a dict"),
    ({"state": {"mcp_principal": "someone-else"}}, "is set by the blueprint"),
])
def test_an_on_start_that_returns_the_wrong_shape_starts_nothing_and_says_why(
        app, session, chosen, named):
    exposed = ExposedAgent(Assistant, on_start=lambda principal, arguments: chosen)
    tools = agent_toolset("t", [exposed], label_of=str)
    result = tools.call("start_assistant", {"message": "hi"}, CallContext(principal="p"))
    assert result.is_error and named in result.text(), result.text()
    assert "secret-value" not in result.text()  # the client reads it: keys, never values
    assert session.query(Loop).count() == 0


def test_an_on_start_that_returns_none_keeps_the_defaults(app, session):
    seen = []
    exposed = ExposedAgent(Assistant, on_start=lambda principal, arguments:
                           seen.append((principal, arguments)))
    tools = agent_toolset("t", [exposed], label_of=str)
    result = tools.call("start_assistant", {"message": "hi"}, CallContext(principal="p"))
    assert not result.is_error, result.text()
    loop = session.get(Loop, result.structured_content["loop_id"])
    assert (loop.subject_type, loop.subject_id, loop.state) == (
        "mcp_principal", "p", {"mcp_principal": "p"})
    assert seen == [("p", {"message": "hi"})]


def test_tool_names_must_be_unique_across_a_blueprint():
    other = Toolset("other")
    other.add_tool(lambda a, b: a, name="add")
    with pytest.raises(ConfigurationError, match="'add' is offered by both 'calc' and 'other'"):
        solidloop.mcp_blueprint(calc, other, auth=lambda t, r: "x")


def test_only_the_toolsets_passed_are_exposed():
    blueprint = solidloop.mcp_blueprint(calc, auth=lambda t, r: "x", name="only_calc")
    assert sorted(blueprint.mcp_endpoint.spec.tools) == ["add", "explode", "lookup"]


def test_janitor_prunes_inbound_sessions_by_creation_age_with_their_events(app, session):
    state = get_state()
    for sid in ("old-live", "old-ended", "young"):
        inbound.create_session(session, session_id=sid, server_name="s",
                               principal_label="p", protocol_version="2025-11-25",
                               client_info={})
    inbound.record_events(session, [
        {"payload": {"session_id": sid, "method": method}, "status_code": 200,
         "duration_ms": 1.0, "error": None}
        for sid, method in (("old-live", "ping"), ("old-ended", "ping"), ("young", "ping"),
                            (None, "tools/list"))], body_limit=1000)
    inbound.terminate_session(session, session_id="old-ended", server_name="s",
                              principal_label="p")
    session.execute(text("UPDATE solidloop_mcp_inbound_sessions SET created_at = now() - "
                         "interval '2 hours', last_seen_at = now() WHERE id LIKE 'old-%'"))
    session.commit()

    assert prune(state).inbound_sessions == 0  # two hours old: inside the default day
    state.config = dataclasses.replace(state.config, mcp_inbound_session_retention=3600,
                                       janitor_batch_size=1)
    report = prune(state)
    assert report.inbound_sessions == 2
    assert session.scalars(select(McpInboundSession.id)).all() == ["young"]
    kept = session.scalars(select(Event.payload["session_id"].astext)
                           .where(Event.kind == "mcp_inbound")).all()
    assert sorted(kept, key=str) == sorted(["young", None], key=str)
    assert session.scalar(select(func.count()).select_from(Event)) == 2
