"""Sessions of outside MCP clients with an MCP server blueprint (handshake era)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Index, String, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class McpInboundSession(Base):
    """One ``initialize`` by an outside client: the ``Mcp-Session-Id`` it was given.

    Kept in PostgreSQL, not in a process, so any request of the session may
    land on any process of a multi-process deployment. ``principal_label`` is
    what ``auth`` returned, as a label (never the token); a request carrying
    this id for another principal is answered 404, as an unknown id is.
    """

    __tablename__ = "solidloop_mcp_inbound_sessions"
    __table_args__ = (Index("ix_solidloop_mcp_inbound_sessions_created_at", "created_at"),)

    #: The ``Mcp-Session-Id``: 32 random bytes, URL-safe base64.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: The blueprint that created it; a session is valid only there.
    server_name: Mapped[str] = mapped_column(String(200), nullable=False)
    principal_label: Mapped[str] = mapped_column(String(200), nullable=False)
    protocol_version: Mapped[str] = mapped_column(String(20), nullable=False)
    client_info: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, server_default=text("'{}'::jsonb")
    )
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    last_seen_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    terminated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
