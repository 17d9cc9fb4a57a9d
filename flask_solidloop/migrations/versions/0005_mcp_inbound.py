"""Inbound MCP: solidloop_mcp_inbound_sessions, the sessions outside MCP clients
hold with an MCP server blueprint (handshake era).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0005'
down_revision: str | Sequence[str] | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('solidloop_mcp_inbound_sessions',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('server_name', sa.String(length=200), nullable=False),
    sa.Column('principal_label', sa.String(length=200), nullable=False),
    sa.Column('protocol_version', sa.String(length=20), nullable=False),
    sa.Column('client_info', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('terminated_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_solidloop_mcp_inbound_sessions'))
    )
    op.create_index('ix_solidloop_mcp_inbound_sessions_created_at', 'solidloop_mcp_inbound_sessions', ['created_at'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_mcp_inbound_sessions_created_at', table_name='solidloop_mcp_inbound_sessions')
    op.drop_table('solidloop_mcp_inbound_sessions')
