"""A conversation's queued messages (docs/decisions/0026-conversations.md).

* ``solidloop_loops.inbox``: user messages sent while the loop was live
  (``send_message`` with ``on_new_message="queue"``), oldest first, each
  ``{"content", "metadata", "queued_at"}``; NULL when none waits. They are not
  messages yet: the statement that delivers them inserts them as visible user
  messages and clears the column, under the loop row's lock, in one commit.
  A new column, no index, no rewrite: a running loop's updates stay HOT.

Revision ID: 0019
Revises: 0017
Create Date: 2026-12-12 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0019'
down_revision: str | Sequence[str] | None = '0017'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops',
                  sa.Column('inbox', postgresql.JSONB(astext_type=sa.Text())))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_loops', 'inbox')
