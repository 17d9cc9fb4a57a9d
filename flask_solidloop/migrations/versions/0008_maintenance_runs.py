"""Maintenance runs and the indexes the admin and the MCP server read by.

* ``solidloop_maintenance_runs``: one row per maintenance task (``reap``,
  ``prune``), upserted at the end of each pass, for the admin dashboard.
* ``ix_solidloop_jobs_dead``: dead-lettered job rows by id (the dashboard's
  count, the Jobs page's list, requeue-all), partial on ``state = 'dead'``.
* ``ix_solidloop_tool_calls_response_message_id``: the foreign key's lookups
  when messages are deleted.
* ``ix_solidloop_events_mcp_inbound`` and ``..._mcp_inbound_session``: inbound
  MCP events newest first, all or by session (admin, janitor), partial on
  ``kind = 'mcp_inbound'``.

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-05 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0008'
down_revision: str | Sequence[str] | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INBOUND = sa.text("kind = 'mcp_inbound'")


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('solidloop_maintenance_runs',
    sa.Column('task', sa.String(length=50), nullable=False),
    sa.Column('last_started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_finished_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('duration_ms', sa.Float(), nullable=False),
    sa.Column('last_ok', sa.Boolean(), nullable=False),
    sa.Column('total', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('counts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('last_error_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('holder', sa.String(length=200), nullable=False),
    sa.Column('passes', sa.BigInteger(), server_default='1', nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('task', name=op.f('pk_solidloop_maintenance_runs'))
    )
    # The three tables may be large and are written by every turn: build their
    # indexes without blocking writes (CONCURRENTLY, outside a transaction).
    with op.get_context().autocommit_block():
        op.create_index('ix_solidloop_jobs_dead', 'solidloop_jobs', ['id'], unique=False,
                        postgresql_where=sa.text("state = 'dead'"),
                        postgresql_concurrently=True)
        op.create_index('ix_solidloop_tool_calls_response_message_id', 'solidloop_tool_calls',
                        ['response_message_id'], unique=False, postgresql_concurrently=True)
        op.create_index('ix_solidloop_events_mcp_inbound', 'solidloop_events', ['id'],
                        unique=False, postgresql_where=INBOUND, postgresql_concurrently=True)
        op.create_index('ix_solidloop_events_mcp_inbound_session', 'solidloop_events',
                        [sa.text("(payload ->> 'session_id')"), 'id'], unique=False,
                        postgresql_where=INBOUND, postgresql_concurrently=True)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_events_mcp_inbound_session', table_name='solidloop_events',
                  postgresql_where=INBOUND)
    op.drop_index('ix_solidloop_events_mcp_inbound', table_name='solidloop_events',
                  postgresql_where=INBOUND)
    op.drop_index('ix_solidloop_tool_calls_response_message_id',
                  table_name='solidloop_tool_calls')
    op.drop_index('ix_solidloop_jobs_dead', table_name='solidloop_jobs',
                  postgresql_where=sa.text("state = 'dead'"))
    op.drop_table('solidloop_maintenance_runs')
