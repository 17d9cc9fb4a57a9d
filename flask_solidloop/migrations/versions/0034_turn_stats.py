"""The admin charts' rollup (docs/decisions/0047-admin-charts.md).

``solidloop_turn_stats``: per agent, per minute and per hour, LLM turns, tool
turns, tokens, cost, a latency histogram and failed loops by class;
``solidloop_rollup_marks``: up to which minute the rollup pass has gone.

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-04 03:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0034'
down_revision: str | Sequence[str] | None = '0033'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'solidloop_turn_stats',
        sa.Column('span_seconds', sa.Integer(), nullable=False),
        sa.Column('starts_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('agent_name', sa.String(length=200), nullable=False),
        sa.Column('llm_turns', sa.Integer(), server_default='0', nullable=False),
        sa.Column('tool_turns', sa.Integer(), server_default='0', nullable=False),
        sa.Column('input_tokens', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('output_tokens', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('cost', sa.Numeric(precision=18, scale=8), server_default='0', nullable=False),
        sa.Column('latency', postgresql.ARRAY(sa.Integer()),
                  server_default=sa.text("'{}'::integer[]"), nullable=False),
        sa.Column('failures', postgresql.JSONB(astext_type=sa.Text()),
                  server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.PrimaryKeyConstraint('span_seconds', 'starts_at', 'agent_name',
                                name=op.f('pk_solidloop_turn_stats')),
    )
    op.create_table(
        'solidloop_rollup_marks',
        sa.Column('name', sa.String(length=50), nullable=False),
        sa.Column('rolled_to', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_solidloop_rollup_marks')),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('solidloop_rollup_marks')
    op.drop_table('solidloop_turn_stats')
