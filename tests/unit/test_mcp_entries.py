"""The ``stateless=`` and ``concurrent=`` keys of an ``mcps`` entry: checked at
validation with one-line errors, and passed to the stdio transport."""

from __future__ import annotations

import pytest

from flask_solidloop.errors import AgentDefinitionError
from flask_solidloop.mcp.registry import TransportServer, make_server, validate_entry


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "web", "url": "http://127.0.0.1:9/mcp", "stateless": True},
     "mcps entry 'web': stateless= applies to command= (stdio) entries only; remove it"),
    ({"name": "fs", "command": ["srv"], "stateless": "yes"},
     "mcps entry 'fs': stateless= must be True or False, got 'yes'"),
    ({"name": "fs", "command": ["srv"], "concurrent": 0},
     "mcps entry 'fs': concurrent= must be True or False, got 0"),
])
def test_bad_flags_are_one_line_errors(entry, message):
    with pytest.raises(AgentDefinitionError) as caught:
        validate_entry(entry, "a")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_flags_reach_the_stdio_transport():
    assert validate_entry({"name": "fs", "command": ["srv"], "stateless": True,
                           "concurrent": False}, "a") == "command"
    server = make_server({"name": "fs", "command": ["srv"], "stateless": True,
                          "concurrent": False})
    assert isinstance(server, TransportServer)
    transport = server.transport
    assert (transport.stateless, transport.concurrent) == (True, False)  # type: ignore[attr-defined]
    default = make_server({"name": "fs", "command": ["srv"]}).transport  # type: ignore[attr-defined]
    assert (default.stateless, default.concurrent) == (False, True)
