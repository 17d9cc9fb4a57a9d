"""A loop's event stream (docs/decisions/0024-loop-event-stream.md).

* ``solidloop_stream_events``: the loop's events, append-only; primary key
  ``(loop_id, id)``, ``id`` from one global sequence drawn while the
  transaction holds the loop's row lock, so per loop id order is commit order.
* ``solidloop_loops.watched_until``: pushed forward by open streams; a watched
  loop's events are NOTIFYed and its partial text flushes at
  SOLIDLOOP_STREAM_MAX_HZ.
* ``solidloop_stream_emit()``: the one writer of an event (lock, previous id,
  row, NOTIFY); ``solidloop_stream_delta()``: a streaming turn's text since its
  last flush.
* Triggers: a new loop's status, and messages and tool calls (end of
  statement); a loop's status change (deferred to commit, so it follows the
  other events of its transaction).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-10 10:00:00

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0017'
down_revision: str | Sequence[str] | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Largest delta carried inside its NOTIFY (the payload limit is 8000 bytes).
_INLINE_BYTES = 6000

_EMIT = f"""
CREATE OR REPLACE FUNCTION solidloop_stream_emit(
    p_loop bigint, p_kind text, p_message bigint, p_call bigint, p_data jsonb, p_text text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    watched boolean;
    prev bigint;
    new_id bigint;
    inline text := '';
BEGIN
    -- The loop's row lock: while it is held no other transaction draws an id
    -- for this loop, so ids commit in order. Every history writer holds it
    -- already; taking it again costs nothing.
    SELECT observed OR coalesce(watched_until > now(), false) INTO watched
      FROM solidloop_loops WHERE id = p_loop FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF watched OR p_kind IN ('status_changed', 'completed', 'failed') THEN
        -- The loop's event before this one, read under the same lock: a
        -- listener whose feed ends there takes this one as it comes.
        SELECT id INTO prev FROM solidloop_stream_events
         WHERE loop_id = p_loop ORDER BY id DESC LIMIT 1;
    END IF;
    INSERT INTO solidloop_stream_events (loop_id, kind, message_id, tool_call_id, data, text)
    VALUES (p_loop, p_kind, p_message, p_call, p_data, p_text)
    RETURNING id INTO new_id;
    IF watched OR p_kind IN ('status_changed', 'completed', 'failed') THEN
        -- A delta or a status travels inside its notification: the streams
        -- of every web process send it with no read.
        IF p_kind IN ('text_delta', 'reasoning_delta', 'status_changed', 'completed', 'failed')
           AND coalesce(octet_length(p_text), 0) + coalesce(octet_length(p_data::text), 0)
               <= {_INLINE_BYTES} THEN
            inline := chr(10) || jsonb_build_object(
                'k', p_kind, 'm', p_message, 'd', p_data, 't', p_text,
                'a', extract(epoch FROM now()))::text;
        END IF;
        PERFORM pg_notify('solidloop_live',
                          p_loop || ':' || new_id || ':' || coalesce(prev, 0) || inline);
    END IF;
    RETURN watched;
END
$$
"""
_DELTA = """
CREATE OR REPLACE FUNCTION solidloop_stream_delta(
    p_loop bigint, p_message bigint, p_text text, p_offset integer,
    p_reasoning text, p_reasoning_offset integer)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    watched boolean;
BEGIN
    IF coalesce(p_reasoning, '') <> '' THEN
        watched := solidloop_stream_emit(p_loop, 'reasoning_delta', p_message, NULL,
                                         jsonb_build_object('offset', p_reasoning_offset),
                                         p_reasoning);
    END IF;
    IF coalesce(p_text, '') <> '' THEN
        watched := solidloop_stream_emit(p_loop, 'text_delta', p_message, NULL,
                                         jsonb_build_object('offset', p_offset), p_text);
    END IF;
    IF watched IS NULL THEN
        SELECT observed OR coalesce(watched_until > now(), false) INTO watched
          FROM solidloop_loops WHERE id = p_loop;
    END IF;
    RETURN watched;
END
$$
"""
_LOOP_STATUS = """
CREATE OR REPLACE FUNCTION solidloop_stream_loop_status() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    kind text := 'status_changed';
    data jsonb := jsonb_build_object('status', NEW.status);
BEGIN
    IF TG_OP = 'UPDATE' THEN
        data := data || jsonb_build_object('previous', OLD.status);
        IF NEW.status = 'completed' THEN
            kind := 'completed';
        ELSIF NEW.status = 'failed' THEN
            kind := 'failed';
        END IF;
        IF NEW.status IN ('failed', 'paused') AND NEW.error_message IS NOT NULL THEN
            data := data || jsonb_build_object('error', left(NEW.error_message, 2000));
        END IF;
    END IF;
    PERFORM solidloop_stream_emit(NEW.id, kind, NULL, NULL, data, NULL);
    RETURN NULL;
END
$$
"""
_MESSAGE = """
CREATE OR REPLACE FUNCTION solidloop_stream_message() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.role = 'tool' THEN
            IF NOT NEW.is_hidden THEN
                PERFORM solidloop_stream_emit(NEW.loop_id, 'tool_result', NEW.id,
                                              NEW.tool_call_id, NULL, NULL);
            END IF;
        ELSIF NEW.role = 'assistant' AND NEW.status = 'processing' THEN
            PERFORM solidloop_stream_emit(NEW.loop_id, 'message_started', NEW.id, NULL,
                                          jsonb_build_object('role', NEW.role), NULL);
        ELSIF NOT NEW.is_hidden AND NEW.status = 'completed' THEN
            PERFORM solidloop_stream_emit(NEW.loop_id, 'message_started', NEW.id, NULL,
                                          jsonb_build_object('role', NEW.role), NULL);
            IF NEW.role = 'assistant' THEN
                PERFORM solidloop_stream_emit(NEW.loop_id, 'message_completed', NEW.id, NULL,
                                              jsonb_build_object('role', NEW.role), NULL);
            END IF;
        END IF;
    ELSIF OLD.status = 'processing' AND NEW.status <> 'processing' THEN
        PERFORM solidloop_stream_emit(
            NEW.loop_id,
            CASE WHEN NEW.status = 'completed' AND NOT NEW.is_hidden
                 THEN 'message_completed' ELSE 'message_discarded' END,
            NEW.id, NULL, jsonb_build_object('role', NEW.role), NULL);
    ELSE
        -- A message kept hidden until its delivery (a queued user message).
        PERFORM solidloop_stream_emit(NEW.loop_id, 'message_started', NEW.id, NULL,
                                      jsonb_build_object('role', NEW.role), NULL);
    END IF;
    RETURN NULL;
END
$$
"""
_CALL = """
CREATE OR REPLACE FUNCTION solidloop_stream_call() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM solidloop_stream_emit(NEW.loop_id, 'tool_call', NEW.message_id, NEW.id,
                                      NULL, NULL);
        IF NEW.waits_for = 'approval' THEN
            PERFORM solidloop_stream_emit(NEW.loop_id, 'approval_requested', NEW.message_id,
                                          NEW.id, NULL, NULL);
        END IF;
    ELSIF OLD.waits_for IS NULL THEN
        PERFORM solidloop_stream_emit(NEW.loop_id, 'approval_requested', NEW.message_id,
                                      NEW.id, NULL, NULL);
    ELSE
        PERFORM solidloop_stream_emit(NEW.loop_id, 'approval_decided', NEW.message_id, NEW.id,
                                      jsonb_build_object('decision', NEW.decision,
                                                         'by', NEW.decided_by,
                                                         'reason', NEW.decision_reason),
                                      NULL);
    END IF;
    RETURN NULL;
END
$$
"""
_TRIGGERS = [
    # A new loop's status comes first: before its messages' events.
    """CREATE TRIGGER solidloop_stream_loop_created
    AFTER INSERT ON solidloop_loops
    FOR EACH ROW EXECUTE FUNCTION solidloop_stream_loop_status()""",
    # Deferred to commit: a status change follows every other event of its
    # transaction.
    """CREATE CONSTRAINT TRIGGER solidloop_stream_loop_status
    AFTER UPDATE OF status ON solidloop_loops DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION solidloop_stream_loop_status()""",
    """CREATE TRIGGER solidloop_stream_message_insert
    AFTER INSERT ON solidloop_messages
    FOR EACH ROW WHEN (NEW.role <> 'system')
    EXECUTE FUNCTION solidloop_stream_message()""",
    """CREATE TRIGGER solidloop_stream_message_update
    AFTER UPDATE ON solidloop_messages
    FOR EACH ROW WHEN ((OLD.status = 'processing' AND NEW.status <> 'processing')
                       OR (OLD.is_hidden AND NOT NEW.is_hidden AND NEW.role = 'user'))
    EXECUTE FUNCTION solidloop_stream_message()""",
    """CREATE TRIGGER solidloop_stream_call_insert
    AFTER INSERT ON solidloop_tool_calls
    FOR EACH ROW EXECUTE FUNCTION solidloop_stream_call()""",
    """CREATE TRIGGER solidloop_stream_call_update
    AFTER UPDATE ON solidloop_tool_calls
    FOR EACH ROW WHEN ((OLD.waits_for IS NULL AND NEW.waits_for = 'approval')
                       OR (OLD.decision IS NULL AND NEW.decision IS NOT NULL
                           AND NEW.waits_for = 'approval'))
    EXECUTE FUNCTION solidloop_stream_call()""",
]
_TRIGGER_NAMES = [("solidloop_stream_loop_created", "solidloop_loops"),
                  ("solidloop_stream_loop_status", "solidloop_loops"),
                  ("solidloop_stream_message_insert", "solidloop_messages"),
                  ("solidloop_stream_message_update", "solidloop_messages"),
                  ("solidloop_stream_call_insert", "solidloop_tool_calls"),
                  ("solidloop_stream_call_update", "solidloop_tool_calls")]


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column('solidloop_loops', sa.Column('watched_until', sa.DateTime(timezone=True)))
    op.execute("CREATE SEQUENCE solidloop_stream_events_id_seq CACHE 1")
    op.create_table(
        'solidloop_stream_events',
        sa.Column('loop_id', sa.BigInteger(), nullable=False),
        sa.Column('id', sa.BigInteger(), nullable=False,
                  server_default=sa.text("nextval('solidloop_stream_events_id_seq')")),
        sa.Column('kind', sa.String(length=30), nullable=False),
        sa.Column('message_id', sa.BigInteger(), nullable=True),
        sa.Column('tool_call_id', sa.BigInteger(), nullable=True),
        sa.Column('data', sa.dialects.postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('text', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.ForeignKeyConstraint(['loop_id'], ['solidloop_loops.id'],
                                name=op.f('fk_solidloop_stream_events_loop_id_solidloop_loops'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('loop_id', 'id', name=op.f('pk_solidloop_stream_events')),
    )
    op.execute("ALTER SEQUENCE solidloop_stream_events_id_seq "
               "OWNED BY solidloop_stream_events.id")
    for statement in (_EMIT, _DELTA, _LOOP_STATUS, _MESSAGE, _CALL, *_TRIGGERS):
        op.execute(statement)


def downgrade() -> None:
    """Downgrade schema."""
    for name, table in _TRIGGER_NAMES:
        op.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
    for function in ("solidloop_stream_call()", "solidloop_stream_message()",
                     "solidloop_stream_loop_status()",
                     "solidloop_stream_delta(bigint, bigint, text, integer, text, integer)",
                     "solidloop_stream_emit(bigint, text, bigint, bigint, jsonb, text)"):
        op.execute(f"DROP FUNCTION IF EXISTS {function}")
    op.drop_table('solidloop_stream_events')
    op.drop_column('solidloop_loops', 'watched_until')
