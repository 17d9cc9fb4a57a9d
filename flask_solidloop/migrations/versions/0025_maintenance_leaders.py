"""One leader per maintenance task across the fleet (docs/decisions/0029-fleet.md).

``solidloop_leaders``: one row per in-worker periodic task (``reaper``,
``janitor``), naming the worker process that runs its passes and until when
its leadership holds. The leader renews it before each pass; any other
process takes it over only once it has lapsed (its holder died or froze), so
the fleet runs one pass per interval however many processes it has, and the
processes that do not lead read one row now and then and hold no connection.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-21 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0025'
down_revision: str | Sequence[str] | None = '0024'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'solidloop_leaders',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('holder', sa.String(length=300), nullable=False),
        sa.Column('until', sa.DateTime(timezone=True), nullable=False),
        sa.Column('since', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('solidloop_leaders')
