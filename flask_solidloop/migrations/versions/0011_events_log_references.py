"""Events name the message and the tool call they are about, without foreign keys.

``solidloop_events.message_id`` and ``tool_call_id`` were foreign keys with
``ON DELETE SET NULL``, and neither column is indexed (every turn writes two
events, and an index per column would add two B-tree entries to each). So a
delete of a loop, cascading to its messages and tool calls, made PostgreSQL
scan the whole events table once for every message and every call deleted,
to null references that the same cascade was deleting anyway (an event's
``loop_id`` is a cascading foreign key, indexed). Events are a log: they keep
the ids they were written with. Their loop's cascade still removes them.

Dropping a constraint takes a brief ``ACCESS EXCLUSIVE`` lock on the table and
scans nothing.

The downgrade nulls the references that no longer resolve, then adds the
constraints back ``NOT VALID`` and validates them (validation scans the table
under a lock that lets writes go on).

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-20 10:00:00

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0011'
down_revision: str | Sequence[str] | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (column, referenced table, constraint name as 0001 named it)
REFERENCES = (
    ('message_id', 'solidloop_messages', 'fk_solidloop_events_message_id_solidloop_messages'),
    ('tool_call_id', 'solidloop_tool_calls',
     'fk_solidloop_events_tool_call_id_solidloop_tool_calls'),
)


def upgrade() -> None:
    """Upgrade schema."""
    for _, _, name in REFERENCES:
        op.drop_constraint(name, 'solidloop_events', type_='foreignkey')


def downgrade() -> None:
    """Downgrade schema."""
    for column, table, name in REFERENCES:
        op.execute(f'UPDATE solidloop_events e SET {column} = NULL WHERE {column} IS NOT NULL '
                   f'AND NOT EXISTS (SELECT 1 FROM {table} t WHERE t.id = e.{column})')
        op.execute(f'ALTER TABLE solidloop_events ADD CONSTRAINT {name} FOREIGN KEY ({column}) '
                   f'REFERENCES {table} (id) ON DELETE SET NULL NOT VALID')
        op.execute(f'ALTER TABLE solidloop_events VALIDATE CONSTRAINT {name}')
