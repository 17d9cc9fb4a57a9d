"""OAuth tokens our agents hold for remote MCP servers (``mcps`` entries with ``auth=``)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, Timestamps


class McpOAuthToken(Timestamps, Base):
    """One token set per (MCP server, subject), shared by every worker process.

    ``resource`` is the server's canonical URL (the RFC 8707 resource the token is
    for); ``subject`` is the key the host chose for whose token it is ("default"
    unless the entry names one). The access and refresh tokens are stored only
    encrypted under SOLIDLOOP_OAUTH_KEY (``*_encrypted``, Fernet tokens). A
    worker refreshes under ``SELECT ... FOR UPDATE`` on this row, so one refresh
    happens at a time (flask_solidloop/mcp/oauth.py).
    """

    __tablename__ = "solidloop_mcp_oauth_tokens"
    __table_args__ = (
        UniqueConstraint("resource", "subject", name="uq_solidloop_mcp_oauth_tokens_resource"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    resource: Mapped[str] = mapped_column(Text, nullable=False)
    subject: Mapped[str] = mapped_column(String(200), nullable=False)
    server_name: Mapped[str] = mapped_column(String(200), nullable=False)
    issuer: Mapped[str | None] = mapped_column(Text, nullable=True)
    token_endpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    client_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    access_token_encrypted: Mapped[str | None] = mapped_column(Text, nullable=True)
    refresh_token_encrypted: Mapped[str | None] = mapped_column(Text, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    scope: Mapped[str | None] = mapped_column(Text, nullable=True)
