"""Fair shares between subjects, and concurrency caps (docs/decisions/0023-fair-shares.md).

* ``solidloop_loops.fair_rank``: how many loops of its subject were live
  (queued, running or waiting) when the loop was created, plus its place in a
  bulk start's batch of that subject; 0 without a subject.
* ``solidloop_jobs.fair_at``: the job's place in the claim order when its
  loop's rank moves it back (its due time plus rank x SOLIDLOOP_FAIR_SHARE_QUANTUM);
  NULL means its due time. The claim index orders by ``coalesce(fair_at, eta)``,
  so rows written without it (host jobs, rank 0, a rolling deploy's old
  processes) keep their place by due time.
* ``solidloop_loops.capped_at``: set when a capped loop is admitted (it counts
  against its subject's and agent's caps while set); ``held_since`` and
  ``held_by`` (``'agent'`` or ``'subject'``): a loop a cap holds before its
  first turn, and which cap. Partial indexes over the few rows that set them;
  a running loop's updates do not touch them, so they stay HOT.
* ``solidloop_loops_leave_flight``: a trigger on a loop leaving flight
  (running, waiting or queued to anything else) that clears those columns
  and, for an admitted loop, makes the job of the earliest loop held by each
  of its caps due now, with its NOTIFY, in the same commit. It serializes
  with admission on the caps' advisory locks, so no wake-up is lost between a
  hold and an end; its WHEN clause keeps it off every other update.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-09 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0016'
down_revision: str | Sequence[str] | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_WAKE = """
CREATE OR REPLACE FUNCTION solidloop_wake_held(woken bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    queue text;
BEGIN
    -- Woken, not admitted: it keeps its place (held_since) if it is held again.
    UPDATE solidloop_loops SET held_by = NULL WHERE id = woken;
    FOR queue IN
        UPDATE solidloop_jobs
           SET fair_at = CASE WHEN fair_at IS NULL THEN NULL ELSE now() + (fair_at - eta) END,
               eta = now()
         WHERE loop_id = woken AND state = 'queued' AND eta > now()
        RETURNING queue_name
    LOOP
        PERFORM pg_notify('solidloop_q_' || queue, '');
    END LOOP;
END
$$
"""
_LEAVE_FLIGHT = """
CREATE OR REPLACE FUNCTION solidloop_leave_flight() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    woken bigint;
BEGIN
    NEW.held_by := NULL;
    NEW.held_since := NULL;
    IF OLD.capped_at IS NULL THEN
        RETURN NEW;
    END IF;
    NEW.capped_at := NULL;
    -- The caps' advisory locks, in admission's order (agent, then subject): an
    -- admission that holds a loop either committed before this point (and its
    -- hold is seen below) or waits, and then counts this loop gone.
    PERFORM pg_advisory_xact_lock(hashtextextended('solidloop.cap.agent:' || OLD.agent_name, 0));
    IF OLD.subject_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(
            'solidloop.cap.subject:' || coalesce(OLD.subject_type, '') || ':' || OLD.subject_id, 0));
    END IF;
    -- One slot freed per cap: the earliest loop each cap holds. SKIP LOCKED: a
    -- loop another end is waking is not woken twice.
    SELECT id INTO woken FROM solidloop_loops
     WHERE held_by = 'agent' AND agent_name = OLD.agent_name AND status = 'queued'
     ORDER BY held_since, id LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        PERFORM solidloop_wake_held(woken);
    END IF;
    IF OLD.subject_id IS NOT NULL THEN
        SELECT id INTO woken FROM solidloop_loops
         WHERE held_by = 'subject' AND subject_type = OLD.subject_type
           AND subject_id = OLD.subject_id AND status = 'queued'
         ORDER BY held_since, id LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            PERFORM solidloop_wake_held(woken);
        END IF;
    END IF;
    RETURN NEW;
END
$$
"""
_TRIGGER = """
CREATE TRIGGER solidloop_loops_leave_flight
BEFORE UPDATE OF status ON solidloop_loops
FOR EACH ROW
WHEN (NEW.status NOT IN ('queued', 'running', 'waiting')
      AND (OLD.capped_at IS NOT NULL OR OLD.held_by IS NOT NULL OR OLD.held_since IS NOT NULL))
EXECUTE FUNCTION solidloop_leave_flight()
"""


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops', sa.Column('fair_rank', sa.Integer(), server_default='0',
                                               nullable=False))
    op.add_column('solidloop_loops', sa.Column('capped_at', sa.DateTime(timezone=True)))
    op.add_column('solidloop_loops', sa.Column('held_since', sa.DateTime(timezone=True)))
    op.add_column('solidloop_loops', sa.Column('held_by', sa.String(length=10)))
    op.create_check_constraint(op.f('ck_solidloop_loops_held_by_valid'), 'solidloop_loops',
                               "held_by IN ('agent','subject')")
    op.add_column('solidloop_jobs', sa.Column('fair_at', sa.DateTime(timezone=True)))
    op.create_index('ix_solidloop_loops_subject_live', 'solidloop_loops',
                    ['subject_type', 'subject_id'], unique=False,
                    postgresql_where=sa.text("status IN ('queued','running','waiting')"))
    op.create_index('ix_solidloop_loops_capped_subject', 'solidloop_loops',
                    ['subject_type', 'subject_id'], unique=False,
                    postgresql_where=sa.text('capped_at IS NOT NULL'))
    op.create_index('ix_solidloop_loops_capped_agent', 'solidloop_loops', ['agent_name'],
                    unique=False, postgresql_where=sa.text('capped_at IS NOT NULL'))
    op.create_index('ix_solidloop_loops_held_subject', 'solidloop_loops',
                    ['subject_type', 'subject_id', 'held_since'], unique=False,
                    postgresql_where=sa.text("held_by = 'subject'"))
    op.create_index('ix_solidloop_loops_held_agent', 'solidloop_loops',
                    ['agent_name', 'held_since'], unique=False,
                    postgresql_where=sa.text("held_by = 'agent'"))
    op.drop_index('ix_solidloop_jobs_claim', table_name='solidloop_jobs',
                  postgresql_where=sa.text("state = 'queued'"))
    op.create_index('ix_solidloop_jobs_claim', 'solidloop_jobs',
                    ['queue_name', 'tier', sa.text('coalesce(fair_at, eta)'), 'id'],
                    unique=False, postgresql_where=sa.text("state = 'queued'"))
    op.execute(_WAKE)
    op.execute(_LEAVE_FLIGHT)
    op.execute(_TRIGGER)


def downgrade() -> None:
    """Downgrade schema."""
    op.execute("DROP TRIGGER IF EXISTS solidloop_loops_leave_flight ON solidloop_loops")
    op.execute("DROP FUNCTION IF EXISTS solidloop_leave_flight()")
    op.execute("DROP FUNCTION IF EXISTS solidloop_wake_held(bigint)")
    op.drop_index('ix_solidloop_jobs_claim', table_name='solidloop_jobs',
                  postgresql_where=sa.text("state = 'queued'"))
    op.create_index('ix_solidloop_jobs_claim', 'solidloop_jobs',
                    ['queue_name', 'tier', 'eta', 'id'], unique=False,
                    postgresql_where=sa.text("state = 'queued'"))
    for index in ('ix_solidloop_loops_held_agent', 'ix_solidloop_loops_held_subject',
                  'ix_solidloop_loops_capped_agent', 'ix_solidloop_loops_capped_subject',
                  'ix_solidloop_loops_subject_live'):
        op.drop_index(index, table_name='solidloop_loops')
    op.drop_column('solidloop_jobs', 'fair_at')
    op.drop_constraint(op.f('ck_solidloop_loops_held_by_valid'), 'solidloop_loops',
                       type_='check')
    for column in ('held_by', 'held_since', 'capped_at', 'fair_rank'):
        op.drop_column('solidloop_loops', column)
