"""Finished loops have a retention (docs/decisions/0030-loop-retention.md).

* ``ix_solidloop_loops_ended``: ended loops (``completed``, ``failed``) by
  ``(finished_at, id)``, the janitor's loop rule's scan, oldest first, with a
  cursor. Partial, and over columns a running loop's updates never change, so
  those updates stay HOT; a loop pays for the entry once, when it ends. Built
  concurrently: existing loops keep being written while it builds.

Revision ID: 0023
Revises: 0019
Create Date: 2026-12-14 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0023'
down_revision: str | Sequence[str] | None = '0019'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENDED = sa.text("status IN ('completed','failed')")


def upgrade() -> None:
    """Upgrade schema."""
    with op.get_context().autocommit_block():
        op.create_index('ix_solidloop_loops_ended', 'solidloop_loops', ['finished_at', 'id'],
                        unique=False, postgresql_where=ENDED, postgresql_concurrently=True)


def downgrade() -> None:
    """Downgrade schema."""
    with op.get_context().autocommit_block():
        op.drop_index('ix_solidloop_loops_ended', table_name='solidloop_loops',
                      postgresql_where=ENDED, postgresql_concurrently=True)
