"""Bulk admin actions run as jobs (docs/decisions/0046-bulk-actions-as-jobs.md).

``solidloop_bulk_actions`` holds one row per confirmed bulk action: what it
does (``action``, ``options``), the set it acts on, frozen at confirmation
(``search`` and ``max_id``, or the operator's selected ``loop_ids``), the
confirmation form's ``token`` (unique: a second POST of the same form finds
the first row and acts on nothing more), its progress (``total``, ``done``,
``skipped``) and the walk's ``cursor`` (every loop id at or above it has been
acted on), who asked, when, and the error that ended it, if one did.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-04 03:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0033'
down_revision: str | Sequence[str] | None = '0032'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'solidloop_bulk_actions',
        sa.Column('id', sa.BigInteger(), nullable=False),
        sa.Column('token', sa.String(length=64), nullable=False),
        sa.Column('action', sa.String(length=32), nullable=False),
        sa.Column('options', postgresql.JSONB(astext_type=sa.Text()), nullable=False,
                  server_default=sa.text("'{}'::jsonb")),
        sa.Column('search', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('max_id', sa.BigInteger(), nullable=True),
        sa.Column('loop_ids', postgresql.ARRAY(sa.BigInteger()), nullable=True),
        sa.Column('status', sa.String(length=16), server_default='queued', nullable=False),
        sa.Column('total', sa.Integer(), server_default='0', nullable=False),
        sa.Column('done', sa.Integer(), server_default='0', nullable=False),
        sa.Column('skipped', sa.Integer(), server_default='0', nullable=False),
        sa.Column('cursor', sa.BigInteger(), nullable=False),
        sa.Column('requested_by', sa.Text(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_solidloop_bulk_actions')),
        sa.UniqueConstraint('token', name='uq_solidloop_bulk_actions_token'),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('solidloop_bulk_actions')
