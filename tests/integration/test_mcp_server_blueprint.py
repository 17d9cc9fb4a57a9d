"""The MCP server blueprint's API and its janitor retention (no server process)."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import func, select, text

from flask_solidloop import ConfigurationError, Toolset
from flask_solidloop.errors import AgentDefinitionError
from flask_solidloop.maintenance.janitor import prune
from flask_solidloop.mcp_server import store as inbound
from flask_solidloop.models import Event, McpInboundSession
from flask_solidloop.state import get_state

from ..support.support_app import calc, solidloop


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
