"""One index entry fewer for every message that is not a tool answer.

``solidloop_messages.tool_call_id`` is unique (a tool call has one answer:
the "recorded exactly once" rule). It was a UNIQUE constraint, whose index
holds an entry for every row, NULL included, though only tool answers have a
``tool_call_id``: the system and user messages, every assistant message and
every turn's hidden shell paid for one (twice for a shell: its finalizing
``UPDATE`` is not HOT, as its status changes). It becomes a unique index on
``tool_call_id IS NOT NULL``, which enforces the same rule (NULLs never
collide) and still serves the foreign key's lookups from ``solidloop_tool_calls``
(``tool_call_id = $1`` implies the predicate).

The new index is built concurrently under a temporary name, then the
constraint is dropped and the index takes its name.

Revision ID: 0010
Revises: 0009
Create Date: 2027-02-02 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0010'
down_revision: str | Sequence[str] | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = 'uq_solidloop_messages_tool_call_id'
BUILDING = 'uq_solidloop_messages_tool_call_id_0010'
ANSWERS = sa.text('tool_call_id IS NOT NULL')


def upgrade() -> None:
    """Upgrade schema."""
    with op.get_context().autocommit_block():
        op.create_index(BUILDING, 'solidloop_messages', ['tool_call_id'], unique=True,
                        postgresql_where=ANSWERS, postgresql_concurrently=True)
    op.drop_constraint(NAME, 'solidloop_messages', type_='unique')
    op.execute(f'ALTER INDEX {BUILDING} RENAME TO {NAME}')


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index(NAME, table_name='solidloop_messages', postgresql_where=ANSWERS)
    op.create_unique_constraint(NAME, 'solidloop_messages', ['tool_call_id'])
