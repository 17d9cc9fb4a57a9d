"""Budgets and shared rate limits: what a loop may spend, and what a provider
key may take per period, across every worker.

* ``solidloop_loops.budget``: the loop's own limits (``start(budget=)``,
  raised by ``resume(budget=)``), over the agent's ``budget`` option; NULL
  when the loop has none of its own.
* ``solidloop_loops.capacity_deferrals``: the turns deferred because a rate
  limit had no capacity; ``capacity_slot``: the reservation a deferred turn
  holds for its LLM step (its keys, amounts and due time). New columns, no
  index, no rewrite: a running loop's updates stay HOT.
* ``solidloop_rate_buckets``: one row per rate-limited key and dimension
  (``requests``, ``tokens``, ...): its level, when it was last drained, the
  block a provider's Retry-After set, and counts of deferrals and of the
  provider's refusals (limits/rates.py).
* ``solidloop_spend``: a subject's ledger over its budget's window, a row per
  LLM turn, written as the turn's reservation and settled to its real usage
  (limits/budgets.py); pruned by the janitor past the longest window.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 21:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0015'
down_revision: str | Sequence[str] | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops',
                  sa.Column('budget', postgresql.JSONB(astext_type=sa.Text())))
    op.add_column('solidloop_loops', sa.Column('capacity_deferrals', sa.Integer(),
                                               server_default='0', nullable=False))
    op.add_column('solidloop_loops',
                  sa.Column('capacity_slot', postgresql.JSONB(astext_type=sa.Text())))
    op.create_table(
        'solidloop_rate_buckets',
        sa.Column('key', sa.Text(), nullable=False),
        sa.Column('dimension', sa.String(length=40), nullable=False),
        sa.Column('level', sa.Float(), server_default='0', nullable=False),
        sa.Column('drained_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.Column('blocked_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('deferrals', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('refusals', sa.BigInteger(), server_default='0', nullable=False),
        sa.PrimaryKeyConstraint('key', 'dimension'),
    )
    op.create_table(
        'solidloop_spend',
        sa.Column('id', sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column('subject', sa.Text(), nullable=False),
        sa.Column('loop_id', sa.BigInteger(), nullable=True),
        sa.Column('at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.Column('cost', sa.Numeric(precision=18, scale=8), server_default='0',
                  nullable=False),
        sa.Column('tokens', sa.BigInteger(), server_default='0', nullable=False),
        sa.Column('llm_turns', sa.Integer(), server_default='0', nullable=False),
        sa.Column('tool_calls', sa.Integer(), server_default='0', nullable=False),
        sa.Column('settled', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_solidloop_spend_subject_at', 'solidloop_spend', ['subject', 'at'],
                    unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index('ix_solidloop_spend_subject_at', table_name='solidloop_spend')
    op.drop_table('solidloop_spend')
    op.drop_table('solidloop_rate_buckets')
    for column in ('capacity_slot', 'capacity_deferrals', 'budget'):
        op.drop_column('solidloop_loops', column)
