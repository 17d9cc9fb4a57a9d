"""A loop's view of one remote MCP server: the tool snapshot and the session."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, ForeignKey, String, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, Timestamps


class McpSession(Timestamps, Base):
    """What a loop saw of one ``url=``/``command=``/``transport=`` server.

    ``tools`` is the loop's snapshot: the tool list taken at the loop's first
    turn, advertised to the model on every later turn without asking the
    server again. ``session_state`` is what the transport exported to resume
    its session (protocol version, session id), so another worker process can
    continue it.
    """

    __tablename__ = "solidloop_mcp_sessions"
    __table_args__ = (
        UniqueConstraint("loop_id", "server_name", name="uq_solidloop_mcp_sessions_loop_server"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loop_id: Mapped[int] = mapped_column(
        ForeignKey("solidloop_loops.id", ondelete="CASCADE"), nullable=False
    )
    server_name: Mapped[str] = mapped_column(String(200), nullable=False)
    tools: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False)
    session_state: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, server_default=text("'{}'::jsonb")
    )
