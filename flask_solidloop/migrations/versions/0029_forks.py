"""A fork's origin, and a loop's own provider settings
(docs/decisions/0039-forks.md).

* ``solidloop_loops.forked_from_loop_id`` and ``forked_at_message_id``: the
  loop and the message a fork was made from (``Agent(loop).fork``). A record,
  not a reference: no foreign key, so retention may delete the original while
  its fork lives on, and deleting a loop checks nothing here.
* ``solidloop_loops.llm_override``: provider settings merged over the agent's
  ``llm`` option for this loop only (a replay's ``{"model": ...}``); NULL for
  every loop that has none.

New nullable columns, no index, no rewrite; a running loop's updates never
change them, so they stay HOT.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-03 16:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0029'
down_revision: str | Sequence[str] | None = '0028'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops', sa.Column('forked_from_loop_id', sa.BigInteger()))
    op.add_column('solidloop_loops', sa.Column('forked_at_message_id', sa.BigInteger()))
    op.add_column('solidloop_loops',
                  sa.Column('llm_override', postgresql.JSONB(astext_type=sa.Text())))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_loops', 'llm_override')
    op.drop_column('solidloop_loops', 'forked_at_message_id')
    op.drop_column('solidloop_loops', 'forked_from_loop_id')
