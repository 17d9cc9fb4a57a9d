"""HOT-friendly loop rows, and fewer index entries per turn.

A loop now stays ``running`` from turn to turn (inline continuation adopts its
next step in the same commit), so its updates change the lease, the token, the
counters and ``updated_at``, never the status. Two partial indexes covered such
columns and made every one of those updates rewrite all five indexes:

* ``ix_solidloop_loops_running_lease`` (``lease_expires_at``, running loops) is
  dropped: the reaper finds expired leases through ``ix_solidloop_loops_status``
  (running loops are bounded by the fleet's threads).
* ``ix_solidloop_loops_queued_since`` (``updated_at``, queued loops) becomes
  ``ix_solidloop_loops_queued_at`` on a new ``queued_at`` column, set only when a
  loop becomes queued (existing queued loops start from their ``updated_at``).

The table gets ``fillfactor = 80``, so the new version of a row usually fits on
its page (a HOT update needs that); it applies to pages written from now on.

Two indexes every turn paid an entry for without needing one:

* ``ix_solidloop_events_created_at`` (the janitor's retention scan) becomes a
  BRIN index: events are append-only, so a block-range summary finds the old
  ones, and no B-tree entry is written per event.
* ``ix_solidloop_tool_calls_response_message_id`` (the foreign key's lookups)
  becomes partial on ``response_message_id IS NOT NULL``: a call is inserted
  unanswered and gets its entry when its answer is written.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-12 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0009'
down_revision: str | Sequence[str] | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("status = 'queued'")
RUNNING = sa.text("status = 'running'")
ANSWERED = sa.text("response_message_id IS NOT NULL")


def upgrade() -> None:
    """Upgrade schema."""
    # A default now() is evaluated once: adding the column rewrites nothing.
    op.add_column('solidloop_loops', sa.Column(
        'queued_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
        nullable=False))
    op.execute("UPDATE solidloop_loops SET queued_at = updated_at WHERE status = 'queued'")
    op.execute("ALTER TABLE solidloop_loops SET (fillfactor = 80)")
    with op.get_context().autocommit_block():
        op.create_index('ix_solidloop_loops_queued_at', 'solidloop_loops', ['queued_at'],
                        unique=False, postgresql_where=QUEUED, postgresql_concurrently=True)
        op.drop_index('ix_solidloop_loops_queued_since', table_name='solidloop_loops',
                      postgresql_where=QUEUED, postgresql_concurrently=True)
        op.drop_index('ix_solidloop_loops_running_lease', table_name='solidloop_loops',
                      postgresql_where=RUNNING, postgresql_concurrently=True)
        op.drop_index('ix_solidloop_events_created_at', table_name='solidloop_events',
                      postgresql_concurrently=True)
        op.create_index('ix_solidloop_events_created_at', 'solidloop_events', ['created_at'],
                        unique=False, postgresql_using='brin', postgresql_concurrently=True)
        op.drop_index('ix_solidloop_tool_calls_response_message_id',
                      table_name='solidloop_tool_calls', postgresql_concurrently=True)
        op.create_index('ix_solidloop_tool_calls_response_message_id', 'solidloop_tool_calls',
                        ['response_message_id'], unique=False, postgresql_where=ANSWERED,
                        postgresql_concurrently=True)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_tool_calls_response_message_id',
                  table_name='solidloop_tool_calls', postgresql_where=ANSWERED)
    op.create_index('ix_solidloop_tool_calls_response_message_id', 'solidloop_tool_calls',
                    ['response_message_id'], unique=False)
    op.drop_index('ix_solidloop_events_created_at', table_name='solidloop_events',
                  postgresql_using='brin')
    op.create_index('ix_solidloop_events_created_at', 'solidloop_events', ['created_at'],
                    unique=False)
    op.create_index('ix_solidloop_loops_running_lease', 'solidloop_loops',
                    ['lease_expires_at'], unique=False, postgresql_where=RUNNING)
    op.create_index('ix_solidloop_loops_queued_since', 'solidloop_loops', ['updated_at'],
                    unique=False, postgresql_where=QUEUED)
    op.drop_index('ix_solidloop_loops_queued_at', table_name='solidloop_loops',
                  postgresql_where=QUEUED)
    op.execute("ALTER TABLE solidloop_loops RESET (fillfactor)")
    op.drop_column('solidloop_loops', 'queued_at')
