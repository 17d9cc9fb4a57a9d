"""Official MCP clients against the blueprint under ``gunicorn -w 4 -k gthread``.

20 concurrent ``mcp`` SDK clients per protocol mode (``legacy``, ``2026-07-28``,
``auto``), each with a principal of its own, list and call tools; each gets its
own answer, and the calls spread over the worker processes (handshake-era
sessions live in PostgreSQL, so any process serves any request of a session).
"""

from __future__ import annotations

import asyncio

import httpx2
import psycopg
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from flask_solidloop.urls import libpq_url

from ..support.mcp_gunicorn import eventually

CLIENTS = 20


async def _one_client(url: str, mode: str, who: str) -> dict:
    headers = {"Authorization": f"Bearer token-{who}"}
    # A connection per request: gunicorn's workers take each one as it comes,
    # so one session's requests land on different processes (what a session
    # kept in PostgreSQL is for), not all on the process that accepted a
    # kept-alive connection.
    fresh = httpx2.Limits(max_keepalive_connections=0)
    async with httpx2.AsyncClient(headers=headers, timeout=30, limits=fresh) as http, \
            Client(streamable_http_client(url, http_client=http), mode=mode) as client:
        listed = await client.list_tools()
        echoed = await client.call_tool("echo", {"text": f"hello {who}"})
        me = await client.call_tool("whoami", {},
                                    meta={"solidloop/idempotencyKey": f"key-{who}"})
        added = await client.call_tool("add", {"a": len(who), "b": 1000})
        return {"tools": sorted(t.name for t in listed.tools),
                "echo": echoed.content[0].text, "me": me.structured_content,
                "added": added.content[0].text}


async def _many(url: str, mode: str) -> list[dict]:
    return await asyncio.gather(*(_one_client(url, mode, f"{mode}-{n}")
                                  for n in range(CLIENTS)))


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28", "auto"])
def test_twenty_concurrent_sdk_clients_each_get_their_own_result(mcp_gunicorn, database_url,
                                                                  mode):
    results = asyncio.run(_many(f"{mcp_gunicorn}/mcp/calc", mode))
    pids = set()
    for n, result in enumerate(results):
        who = f"{mode}-{n}"
        assert result["tools"] == ["add", "echo", "explode", "lookup", "nap", "remember", "whoami"]
        text, _, pid = result["echo"].rpartition(" from ")
        assert text == f"hello {who}"
        pids.add(pid)
        assert result["me"]["principal"] == who
        assert result["me"]["idempotency_key"] == f"key-{who}"
        assert result["me"]["agent"] is False and result["me"]["loop"] is False
        assert result["added"] == str(len(who) + 1000)
        pids.add(str(result["me"]["pid"]))
    assert len(pids) > 1, "all calls landed on one worker process"
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        sessions = conn.execute(
            "SELECT principal_label, protocol_version, client_info->>'name', terminated_at "
            "FROM solidloop_mcp_inbound_sessions WHERE principal_label LIKE %s",
            (f"{mode}-%",)).fetchall()
        events = eventually(lambda: conn.execute(
            "SELECT count(*) FROM solidloop_events WHERE kind = 'mcp_inbound' "
            "AND payload->>'principal' LIKE %s AND payload->>'tool' = 'echo'",
            (f"{mode}-%",)).fetchone()[0], lambda n: n >= CLIENTS)
    assert events == CLIENTS
    if mode == "2026-07-28":
        assert sessions == []  # stateless: no session rows
    elif mode == "legacy":
        assert len(sessions) == CLIENTS
        assert {row[1] for row in sessions} == {"2025-11-25"}
        assert all(row[3] is not None for row in sessions)  # the SDK sent DELETE
