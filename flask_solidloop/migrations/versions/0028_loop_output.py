"""A loop's structured output: the JSON Schema it was started with, and the
validated answer (docs/decisions/0036-structured-output.md).

``output_schema`` is written once, when the loop is inserted, from the
agent's ``output_type``: every worker validates the loop's answers against
what the loop started with, whatever version of the agent's class it runs.
``output`` is written by the turn's end that completes the loop with a valid
answer. Both are NULL for a loop without structured output. Neither is in an
index, so a running loop's updates stay HOT.

``output_schema`` is ``json``, not ``jsonb``: ``jsonb`` sorts an object's keys,
and the order of a schema's properties is the order a model writes the
fields in (a ``reasoning`` field declared before ``answer`` is written
first).

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-03 15:30:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0028'
down_revision: str | Sequence[str] | None = '0027'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops',
                  sa.Column('output_schema', postgresql.JSON(astext_type=sa.Text()),
                            nullable=True))
    op.add_column('solidloop_loops',
                  sa.Column('output', postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_loops', 'output')
    op.drop_column('solidloop_loops', 'output_schema')
