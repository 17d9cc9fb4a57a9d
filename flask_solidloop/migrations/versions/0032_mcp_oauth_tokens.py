"""OAuth tokens for remote MCP servers (docs/decisions/0040-mcp-client-oauth.md).

``solidloop_mcp_oauth_tokens`` holds one token set per (resource, subject):
the MCP server's canonical URL and the key the host chose for whose token it
is. The access and refresh tokens are stored encrypted (Fernet, under
SOLIDLOOP_OAUTH_KEY), never in clear; the token endpoint, issuer and client id
beside them let any worker refresh without discovering again.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-03 19:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0032'
down_revision: str | Sequence[str] | None = '0031'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'solidloop_mcp_oauth_tokens',
        sa.Column('id', sa.BigInteger(), nullable=False),
        sa.Column('resource', sa.Text(), nullable=False),
        sa.Column('subject', sa.String(length=200), nullable=False),
        sa.Column('server_name', sa.String(length=200), nullable=False),
        sa.Column('issuer', sa.Text(), nullable=True),
        sa.Column('token_endpoint', sa.Text(), nullable=True),
        sa.Column('client_id', sa.Text(), nullable=True),
        sa.Column('access_token_encrypted', sa.Text(), nullable=True),
        sa.Column('refresh_token_encrypted', sa.Text(), nullable=True),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('scope', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_solidloop_mcp_oauth_tokens')),
        sa.UniqueConstraint('resource', 'subject', name='uq_solidloop_mcp_oauth_tokens_resource'),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('solidloop_mcp_oauth_tokens')
