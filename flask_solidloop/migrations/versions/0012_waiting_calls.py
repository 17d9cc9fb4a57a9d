"""A loop that waits: the ``waiting`` status, and what a tool call waits for.

* ``solidloop_loops.status`` may be ``waiting`` (its tool phase has nothing
  left to run but calls that wait for a decision or a result). The check
  constraint is replaced ``NOT VALID`` and validated after, so the table is
  scanned under a lock that lets writes go on.
* ``solidloop_tool_calls`` gains what a waiting call needs: ``waits_for``
  (``approval`` or ``result``), the one ``decision`` (``approved``, ``denied``,
  ``completed``) with ``decided_at``, ``decided_by`` and
  ``decision_reason``, ``requested_arguments`` (the model's, when an approval
  edited them) and ``wait_deadline``. New nullable columns without a default:
  no rewrite.
* ``ix_solidloop_tool_calls_awaiting``: the calls still awaiting, by
  deadline (the approvals listing and the reaper's expired waits), partial,
  so a call pays for an entry only while it waits. Built concurrently.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 12:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0012'
down_revision: str | Sequence[str] | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUS = 'ck_solidloop_loops_status_valid'
AWAITING = sa.text("waits_for IS NOT NULL AND decision IS NULL")


def _status_check(statuses: str) -> None:
    op.drop_constraint(op.f(STATUS), 'solidloop_loops', type_='check')
    op.execute(f"ALTER TABLE solidloop_loops ADD CONSTRAINT {STATUS} "
               f"CHECK (status IN ({statuses})) NOT VALID")
    op.execute(f"ALTER TABLE solidloop_loops VALIDATE CONSTRAINT {STATUS}")


def upgrade() -> None:
    """Upgrade schema."""
    _status_check("'init','queued','running','completed','failed','paused','waiting'")
    op.add_column('solidloop_tool_calls', sa.Column('waits_for', sa.String(length=20)))
    op.add_column('solidloop_tool_calls', sa.Column('decision', sa.String(length=20)))
    op.add_column('solidloop_tool_calls',
                  sa.Column('decided_at', sa.DateTime(timezone=True)))
    op.add_column('solidloop_tool_calls', sa.Column('decided_by', sa.String(length=200)))
    op.add_column('solidloop_tool_calls', sa.Column('decision_reason', sa.Text()))
    op.add_column('solidloop_tool_calls', sa.Column(
        'requested_arguments', postgresql.JSONB(astext_type=sa.Text())))
    op.add_column('solidloop_tool_calls',
                  sa.Column('wait_deadline', sa.DateTime(timezone=True)))
    op.create_check_constraint('waits_for_valid', 'solidloop_tool_calls',
                               "waits_for IN ('approval','result')")
    op.create_check_constraint('decision_valid', 'solidloop_tool_calls',
                               "decision IN ('approved','denied','completed')")
    with op.get_context().autocommit_block():
        op.create_index('ix_solidloop_tool_calls_awaiting', 'solidloop_tool_calls',
                        ['wait_deadline'], unique=False, postgresql_where=AWAITING,
                        postgresql_concurrently=True)


def downgrade() -> None:
    """Downgrade schema: waiting loops are paused (their calls' decisions go)."""
    op.drop_index('ix_solidloop_tool_calls_awaiting', table_name='solidloop_tool_calls',
                  postgresql_where=AWAITING)
    op.drop_constraint(op.f('ck_solidloop_tool_calls_decision_valid'), 'solidloop_tool_calls',
                       type_='check')
    op.drop_constraint(op.f('ck_solidloop_tool_calls_waits_for_valid'), 'solidloop_tool_calls',
                       type_='check')
    for column in ('wait_deadline', 'requested_arguments', 'decision_reason', 'decided_by',
                   'decided_at', 'decision', 'waits_for'):
        op.drop_column('solidloop_tool_calls', column)
    op.execute("UPDATE solidloop_loops SET status = 'paused', execution_token = NULL "
               "WHERE status = 'waiting'")
    _status_check("'init','queued','running','completed','failed','paused'")
