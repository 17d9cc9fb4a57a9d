"""The worker registry: solidloop_workers, one heartbeat row per worker process.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0006'
down_revision: str | Sequence[str] | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('solidloop_workers',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('identity', sa.String(length=200), nullable=False),
    sa.Column('host', sa.String(length=200), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('queues', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('threads', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_solidloop_workers')),
    sa.UniqueConstraint('identity', name=op.f('uq_solidloop_workers_identity'))
    )
    op.create_index('ix_solidloop_workers_last_seen_at', 'solidloop_workers', ['last_seen_at'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_workers_last_seen_at', table_name='solidloop_workers')
    op.drop_table('solidloop_workers')
