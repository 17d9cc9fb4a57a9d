"""A loop run's trace context (docs/decisions/0033-tracing.md).

* ``solidloop_loops.trace``: the current run's OpenTelemetry context, written
  when the loop starts or resumes while tracing is on:
  ``{"traceparent", "parent", "start_ns", "previous"}`` (the run's
  ``invoke_agent`` span, the span it is a child of, when it began, the
  previous run's span it links to). NULL when tracing was off. A new column,
  no index, no rewrite; a running loop's updates never change it, so they
  stay HOT.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-03 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0026'
down_revision: str | Sequence[str] | None = '0025'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops',
                  sa.Column('trace', postgresql.JSONB(astext_type=sa.Text())))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column('solidloop_loops', 'trace')
