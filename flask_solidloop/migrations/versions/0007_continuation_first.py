"""Continuation-first claims: a tier on each job, and the claim index ordered by it.

``tier`` 0 marks the continuations of started loops (their tool calls and
next LLM turns), claimed before tier 1 (new loops' first turns, host jobs);
the claim index becomes (queue_name, tier, eta, id) over queued rows, so the
claim stays an index-ordered scan.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 10:40:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0007'
down_revision: str | Sequence[str] | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_jobs', sa.Column('tier', sa.SmallInteger(), server_default='1',
                                              nullable=False))
    op.drop_index('ix_solidloop_jobs_claim', table_name='solidloop_jobs',
                  postgresql_where=sa.text("state = 'queued'"))
    op.create_index('ix_solidloop_jobs_claim', 'solidloop_jobs',
                    ['queue_name', 'tier', 'eta', 'id'], unique=False,
                    postgresql_where=sa.text("state = 'queued'"))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_jobs_claim', table_name='solidloop_jobs',
                  postgresql_where=sa.text("state = 'queued'"))
    op.create_index('ix_solidloop_jobs_claim', 'solidloop_jobs', ['queue_name', 'eta', 'id'],
                    unique=False, postgresql_where=sa.text("state = 'queued'"))
    op.drop_column('solidloop_jobs', 'tier')
