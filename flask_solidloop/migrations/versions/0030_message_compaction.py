"""Compaction of long histories: a summary message, and the messages it
summarises marked, never deleted (docs/decisions/0038-compaction.md).

``solidloop_messages.kind`` tells a summary (``'summary'``, written by the
``Compaction`` middleware's summary turn) from every other message
(``'message'``). ``compacted_by`` is set on each message a summary replaced,
to that summary's id, in the statement that inserts the summary: the history
a turn reads skips those rows (``compacted_by IS NULL``), the admin shows them
folded under their summary.

No foreign key on ``compacted_by``: a summary and the messages it replaced are
rows of one loop and go with it, and a key's check would run for every message
deleted with a loop (the janitor's retention). No index either: only the
loop's own reads (by ``loop_id``) look at the column.

Both columns are added with constant defaults: no table rewrite.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-03 16:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0030'
down_revision: str | Sequence[str] | None = '0029'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_messages', sa.Column(
        'kind', sa.String(length=20), server_default='message', nullable=False))
    op.add_column('solidloop_messages', sa.Column('compacted_by', sa.BigInteger(),
                                                  nullable=True))
    op.create_check_constraint(op.f('ck_solidloop_messages_kind_valid'), 'solidloop_messages',
                               "kind IN ('message','summary')")


def downgrade() -> None:
    """Downgrade schema. Compacted messages come back into the history; the
    summaries leave it (hidden, so a downgraded loop reads what it had)."""
    op.execute("UPDATE solidloop_messages SET is_hidden = true WHERE kind = 'summary'")
    op.drop_constraint(op.f('ck_solidloop_messages_kind_valid'), 'solidloop_messages',
                       type_='check')
    op.drop_column('solidloop_messages', 'compacted_by')
    op.drop_column('solidloop_messages', 'kind')
