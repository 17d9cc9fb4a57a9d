"""Lease holders on loops and tool calls; metadata on tool calls.

``lease_holder`` names the worker process (``host:pid``) that holds a running
LLM turn's or tool call's lease, so ``status`` (and the admin) can say who
holds what. ``solidloop_tool_calls.metadata`` records facts about a call
(for example that text headed for the database had to be made storable).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:40:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops', sa.Column('lease_holder', sa.String(length=200), nullable=True))
    op.add_column('solidloop_tool_calls', sa.Column('lease_holder', sa.String(length=200), nullable=True))
    op.add_column('solidloop_tool_calls', sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_tool_calls', 'metadata')
    op.drop_column('solidloop_tool_calls', 'lease_holder')
    op.drop_column('solidloop_loops', 'lease_holder')
