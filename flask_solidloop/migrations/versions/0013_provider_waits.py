"""A turn that waits for its provider: an outage defers the turn, never fails it.

* ``solidloop_loops.provider_wait_since``: when the provider outage that
  keeps deferring the loop's turn began (NULL when none does);
  ``provider_wait_attempts``: the turns deferred since; ``provider_wait_error``:
  the last outage's error. The turn's end clears them; a resume too. New
  columns, no index (a running loop's updates stay HOT), no rewrite.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 13:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0013'
down_revision: str | Sequence[str] | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops',
                  sa.Column('provider_wait_since', sa.DateTime(timezone=True)))
    op.add_column('solidloop_loops', sa.Column('provider_wait_attempts', sa.Integer(),
                                               server_default='0', nullable=False))
    op.add_column('solidloop_loops', sa.Column('provider_wait_error', sa.Text()))


def downgrade() -> None:
    """Downgrade schema."""
    for column in ('provider_wait_error', 'provider_wait_attempts', 'provider_wait_since'):
        op.drop_column('solidloop_loops', column)
