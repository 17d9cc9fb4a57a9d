"""A tool call counts the runs whose lease lapsed: a call that keeps losing
its worker is not run for ever.

* ``solidloop_tool_calls.lapsed_runs``: incremented by the reaper each time it
  takes over a call whose lease lapsed before a result (loops/sql.HEAL_STALLED_TOOLS);
  at SOLIDLOOP_TOOL_MAX_ATTEMPTS the call is answered with an error instead of
  run again. A new column with a constant default: no rewrite, no index.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 14:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0014'
down_revision: str | Sequence[str] | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_tool_calls', sa.Column('lapsed_runs', sa.Integer(),
                                                    server_default='0', nullable=False))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_tool_calls', 'lapsed_runs')
