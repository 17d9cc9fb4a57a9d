"""A process of the refresh race (tests/integration/test_mcp_oauth.py): configure the
token store, wait for the others, ask for the access token, report it.

Kept apart from the test module so a spawned process imports only this and
flask_solidloop.mcp.oauth (not the support app)."""

from __future__ import annotations

from typing import Any

from flask_solidloop.mcp import oauth


def refresh_in_a_process(database_url: str, key: str, entry: oauth.OAuthEntry,
                         barrier: Any, results: Any) -> None:
    oauth._engines.clear()  # a forked child opens its own connections
    oauth.configure(database_url=database_url, keys=(key,), refresh_margin=60)
    barrier.wait(timeout=120)
    try:
        results.put(oauth.access_token(entry))
    except Exception as exc:  # the test reads it
        results.put(f"error: {type(exc).__name__}: {exc}")
