"""HOT-friendly loop rows: no index on a column a running loop's updates change.

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


def downgrade() -> None:
    """Downgrade schema."""
    op.create_index('ix_solidloop_loops_running_lease', 'solidloop_loops',
                    ['lease_expires_at'], unique=False, postgresql_where=RUNNING)
    op.create_index('ix_solidloop_loops_queued_since', 'solidloop_loops', ['updated_at'],
                    unique=False, postgresql_where=QUEUED)
    op.drop_index('ix_solidloop_loops_queued_at', table_name='solidloop_loops',
                  postgresql_where=QUEUED)
    op.execute("ALTER TABLE solidloop_loops RESET (fillfactor)")
    op.drop_column('solidloop_loops', 'queued_at')
