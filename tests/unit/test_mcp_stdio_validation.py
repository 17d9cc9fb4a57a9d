"""StdioTransport argument validation: nothing is spawned.

The transport against real child processes is tests/integration/test_mcp_stdio_transport.py.
"""

from __future__ import annotations

import pytest

from flask_solidloop.mcp.stdio_transport import StdioTransport


def test_constructor_validation():
    with pytest.raises(ValueError):
        StdioTransport([])
    with pytest.raises(ValueError):
        StdioTransport("   ")
    with pytest.raises(ValueError):
        StdioTransport(["server"], timeout=0)
    with pytest.raises(ValueError):
        StdioTransport(["server"], env={"A": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        StdioTransport(["server"]).call_tool("x", {}, meta={"progressToken": [1]})
