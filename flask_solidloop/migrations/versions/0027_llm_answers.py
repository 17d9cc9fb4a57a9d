"""An LLM request's answer in a row of its own: the request is written once
(docs/decisions/0032-turn-cost.md).

A turn puts its request on record before sending it (decision 0025), as an
``llm_request`` row of ``solidloop_events``; the write that ended the turn
then updated that row (``payload = payload || answer``, the status, the
duration, the error). The update could not be HOT (``payload`` is in the
inbound-session expression index), so it wrote a second version of the whole
row, the request body again, with a primary-key and a ``loop_id`` entry:
about 1.5 KB of WAL per LLM turn in bench/turns.py, the largest single write
of a turn. ``solidloop_llm_answers`` takes the answer instead, one small row
keyed by the event's id; the request's row is never written again.
``Event`` reads the two as one (models/event.py), and a pending request is
one with no duration and no answer (loops/sql.request_pending).

No foreign key to the event: its check would lock the event's row (a WAL
record) on every answer. ``solidloop_llm_answers_events_deleted``, an
``AFTER DELETE ... FOR EACH STATEMENT`` trigger on the events table (a
transition table), deletes the answers of deleted events: the janitor's
retention, a loop's cascade. TRUNCATE of the events table must name this
table too.

Rows completed before the upgrade keep their answer merged in the event's
row; the downgrade merges the answers back into their rows.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-21 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = '0027'
down_revision: str | Sequence[str] | None = '0026'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CASCADE = """
CREATE OR REPLACE FUNCTION solidloop_llm_answers_events_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM solidloop_llm_answers a USING gone WHERE a.event_id = gone.id;
    RETURN NULL;
END
$$
"""
_CASCADE_TRIGGER = """CREATE TRIGGER solidloop_llm_answers_events_deleted
    AFTER DELETE ON solidloop_events REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION solidloop_llm_answers_events_deleted()"""


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        'solidloop_llm_answers',
        sa.Column('event_id', sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=True),
        sa.Column('duration_ms', sa.Float(), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('answer', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.PrimaryKeyConstraint('event_id', name=op.f('pk_solidloop_llm_answers')),
    )
    op.execute(_CASCADE)
    op.execute(_CASCADE_TRIGGER)


def downgrade() -> None:
    """Downgrade schema."""
    op.execute("UPDATE solidloop_events e SET status_code = a.status_code, "
               "duration_ms = a.duration_ms, error = a.error, payload = e.payload || a.answer, "
               "updated_at = a.created_at FROM solidloop_llm_answers a WHERE a.event_id = e.id")
    op.execute("DROP TRIGGER IF EXISTS solidloop_llm_answers_events_deleted ON solidloop_events")
    op.execute("DROP FUNCTION IF EXISTS solidloop_llm_answers_events_deleted()")
    op.drop_table('solidloop_llm_answers')
