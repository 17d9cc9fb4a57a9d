"""Child agents: a loop started by another loop's tool call
(docs/decisions/0037-child-agents.md).

``parent_loop_id`` names the loop whose call started this one and
``parent_tool_call_id`` that call (its result is the child's answer, written
in the child's final transaction); ``depth`` counts the ancestors (0 for a
loop the host started). ``parent_loop_id`` is ``ON DELETE SET NULL``: the
loop retention holds a loop back while a loop linked to it has not ended
(loops/sql/retention.py), so a link is cut only between ended loops. The
call's id has no foreign key (a second join path between loops and calls);
the retention's hold covers it too.
``ix_solidloop_loops_parent`` (partial: only children) serves the cascades'
recursive walk and the retention's check.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-22 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0031'
down_revision: str | Sequence[str] | None = '0030'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops', sa.Column('parent_loop_id', sa.BigInteger(), nullable=True))
    op.add_column('solidloop_loops',
                  sa.Column('parent_tool_call_id', sa.BigInteger(), nullable=True))
    op.add_column('solidloop_loops', sa.Column('depth', sa.Integer(), server_default='0',
                                               nullable=False))
    op.create_foreign_key(op.f('fk_solidloop_loops_parent_loop_id_solidloop_loops'),
                          'solidloop_loops', 'solidloop_loops', ['parent_loop_id'], ['id'],
                          ondelete='SET NULL')
    op.create_index('ix_solidloop_loops_parent', 'solidloop_loops', ['parent_loop_id'],
                    unique=False, postgresql_where=sa.text('parent_loop_id IS NOT NULL'))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_loops_parent', table_name='solidloop_loops',
                  postgresql_where=sa.text('parent_loop_id IS NOT NULL'))
    op.drop_constraint(op.f('fk_solidloop_loops_parent_loop_id_solidloop_loops'),
                       'solidloop_loops', type_='foreignkey')
    op.drop_column('solidloop_loops', 'depth')
    op.drop_column('solidloop_loops', 'parent_tool_call_id')
    op.drop_column('solidloop_loops', 'parent_loop_id')
