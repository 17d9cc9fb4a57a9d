"""The only writer of the MCP server's own rows: the sessions outside MCP
clients hold (``solidloop_mcp_inbound_sessions``) and the inbound wire log (one
``solidloop_events`` row of kind ``mcp_inbound``, with no loop, per request).

Each function runs in its own short transaction on the request's session and
commits it: it rolls back whatever a tool left uncommitted first, so a request
never commits a tool's half-done writes by accident. Wire-log rows and
last-seen stamps are diagnostics: they commit without waiting for the WAL
flush (a crash may lose the last few milliseconds of them, never a session's
existence), so an inbound request pays no fsync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

from .._typing import SessionLike
from ..loops import storable
from ..loops.store.wirelog import event_payload
from ..models import Event, McpInboundSession

#: The ``kind`` of an inbound MCP request's event row.
INBOUND_EVENT_KIND = "mcp_inbound"
#: ``last_seen_at`` is refreshed at most this often (seconds), so a busy session
#: costs one read per request, not a write.
INBOUND_TOUCH_EVERY = 30.0

_ASYNC_COMMIT = text("SET LOCAL synchronous_commit = off")
_FIND = text("""
SELECT protocol_version, last_seen_at < now() - make_interval(secs => :every) AS stale
FROM solidloop_mcp_inbound_sessions
WHERE id = :id AND server_name = :server AND principal_label = :principal
  AND terminated_at IS NULL
""")
_TOUCH = text("UPDATE solidloop_mcp_inbound_sessions SET last_seen_at = now() WHERE id = :id")
_TERMINATE = text("""
UPDATE solidloop_mcp_inbound_sessions SET terminated_at = now(), last_seen_at = now()
WHERE id = :id AND server_name = :server AND principal_label = :principal
  AND terminated_at IS NULL
""")


def create_session(session: SessionLike, *, session_id: str, server_name: str,
                   principal_label: str, protocol_version: str,
                   client_info: dict[str, Any]) -> None:
    """Record a new handshake-era session (an ``initialize`` that succeeded)."""
    session.rollback()
    session.add(McpInboundSession(
        id=session_id, server_name=server_name, principal_label=principal_label[:200],
        protocol_version=protocol_version, client_info=storable.json_value(client_info)[0],
    ))
    session.commit()


def touch_session(session: SessionLike, *, session_id: str, server_name: str,
                  principal_label: str) -> str | None:
    """Find a live session of this principal on this server (refreshing its
    ``last_seen_at`` when it is older than :data:`INBOUND_TOUCH_EVERY`); return
    its negotiated protocol version, or None (unknown, terminated, another
    server's or another principal's: the caller answers all four alike, 404)."""
    session.rollback()
    row = session.execute(_FIND, {
        "id": session_id, "server": server_name, "principal": principal_label[:200],
        "every": INBOUND_TOUCH_EVERY,
    }).first()
    if row is not None and row.stale:
        session.execute(_ASYNC_COMMIT)
        session.execute(_TOUCH, {"id": session_id})
        session.commit()
    else:
        session.rollback()
    return row.protocol_version if row is not None else None


def terminate_session(session: SessionLike, *, session_id: str, server_name: str,
                      principal_label: str) -> bool:
    """End a session (the client's DELETE); False when there was no live one."""
    session.rollback()
    ended = session.execute(_TERMINATE, {
        "id": session_id, "server": server_name, "principal": principal_label[:200],
    }).rowcount  # type: ignore[attr-defined]
    session.commit()
    return bool(ended)


def record_events(session: SessionLike, events: Sequence[dict[str, Any]], *,
                  body_limit: int) -> None:
    """Inbound requests' wire-log rows, in one transaction (the blueprint's
    background writer batches them). Each dict holds ``payload`` (redacted by
    the blueprint: tokens and secret headers stripped), ``status_code``,
    ``duration_ms`` and ``error``; bodies are cut to ``body_limit`` characters
    here, as for every other event."""
    session.rollback()
    session.execute(_ASYNC_COMMIT)
    session.add_all([Event(
        loop_id=None, kind=INBOUND_EVENT_KIND, status_code=event["status_code"],
        duration_ms=event["duration_ms"],
        error=storable.text(event["error"][:storable.MAX_ERROR_TEXT]
                            if event.get("error") else None)[0],
        payload=event_payload(event["payload"], body_limit),
    ) for event in events])
    session.commit()
