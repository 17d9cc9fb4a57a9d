"""Host jobs: solidloop_host_jobs (RQ-style job records), solidloop_results (the
dramatiq Results backend), solidloop_periodic (one job per period), and an
index that finds an RQ-style job's deliveries in solidloop_jobs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-14 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0004'
down_revision: str | Sequence[str] | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('solidloop_host_jobs',
    sa.Column('id', sa.String(length=200), nullable=False),
    sa.Column('message_id', sa.Uuid(), nullable=False),
    sa.Column('queue_name', sa.String(length=200), nullable=False),
    sa.Column('func_name', sa.Text(), nullable=False),
    sa.Column('description', sa.Text(), nullable=True),
    sa.Column('status', sa.String(length=10), nullable=False),
    sa.Column('meta', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('exc_info', sa.Text(), nullable=True),
    sa.Column('result_ttl', sa.Integer(), nullable=True),
    sa.Column('failure_ttl', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('queued','scheduled','finished','failed','canceled')", name=op.f('ck_solidloop_host_jobs_status_valid')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_solidloop_host_jobs'))
    )
    op.create_index('ix_solidloop_host_jobs_expires_at', 'solidloop_host_jobs', ['expires_at'], unique=False, postgresql_where=sa.text('expires_at IS NOT NULL'))
    op.create_index('ix_solidloop_host_jobs_queue_status', 'solidloop_host_jobs', ['queue_name', 'status'], unique=False)
    op.create_table('solidloop_results',
    sa.Column('key', sa.String(length=300), nullable=False),
    sa.Column('value', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_solidloop_results'))
    )
    op.create_index('ix_solidloop_results_expires_at', 'solidloop_results', ['expires_at'], unique=False)
    op.create_table('solidloop_periodic',
    sa.Column('name', sa.String(length=300), nullable=False),
    sa.Column('last_period', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_solidloop_periodic'))
    )
    op.create_index('ix_solidloop_jobs_host_message', 'solidloop_jobs', ['message_id'], unique=False, postgresql_where=sa.text("actor_name = 'solidloop.job'"))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_jobs_host_message', table_name='solidloop_jobs', postgresql_where=sa.text("actor_name = 'solidloop.job'"))
    op.drop_table('solidloop_periodic')
    op.drop_index('ix_solidloop_results_expires_at', table_name='solidloop_results')
    op.drop_table('solidloop_results')
    op.drop_index('ix_solidloop_host_jobs_queue_status', table_name='solidloop_host_jobs')
    op.drop_index('ix_solidloop_host_jobs_expires_at', table_name='solidloop_host_jobs', postgresql_where=sa.text('expires_at IS NOT NULL'))
    op.drop_table('solidloop_host_jobs')
