"""A stream event of a loop whose row the transaction wrote takes no row lock,
and stream events leave with their loop by a statement trigger, not a foreign
key (docs/decisions/0032-turn-cost.md).

``solidloop_stream_emit()`` took ``FOR NO KEY UPDATE`` on the loop's row for
every event, so that ids of one loop commit in order. Nearly every event is
written by a statement that has just updated that row (a turn's end, a tool
call's answer, a claim) or inserted it (a new loop): the transaction holds
the row already, and no other transaction can lock or update it before it
commits. Locking the new row version again still wrote a WAL record (a heap
``LOCK``) and dirtied its page, 3.4 times per LLM turn in bench/turns.py.
Now the function reads the row first, and locks it only when the version it
sees was not written by the current transaction (``xmin`` is not its id).
The ordering guarantee is unchanged: either way the transaction holds the
row until it commits. A version written by an open subtransaction has
another id: it is locked as before (harmless, only not skipped).

The foreign key from ``solidloop_stream_events.loop_id`` to the loop made
every event's insert check the loop row (a query, 4.4 per LLM turn) and take
``FOR KEY SHARE`` on it, a WAL record whenever the transaction held no
stronger lock on that version, so skipping the function's own lock alone
saved nothing. The event's loop is checked by the function itself (under the
row lock, or on the version its transaction wrote); the cascade becomes
``solidloop_stream_loops_deleted``, one ``AFTER DELETE ... FOR EACH
STATEMENT`` trigger on the loops table that deletes the deleted loops'
events (a transition table: one statement per delete, however many loops).
TRUNCATE of the loops table no longer reaches the events: name both.

The function's behaviour is otherwise the same as migration 0017's
(``_INLINE_BYTES``, the previous id read only for a notification, the
NOTIFY payload); a later migration that changes it again must start from
this text.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-20 10:00:00

"""
from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0024'
down_revision: str | Sequence[str] | None = '0023'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Largest delta carried inside its NOTIFY (the payload limit is 8000 bytes).
_INLINE_BYTES = 6000

#: The row lock of migration 0017 (taken for every event), and this one's:
#: a read, and the lock only when the transaction did not write the version.
_LOCK_ALWAYS = """
    -- The loop's row lock: while it is held no other transaction draws an id
    -- for this loop, so ids commit in order. Every history writer holds it
    -- already; taking it again costs nothing.
    SELECT observed OR coalesce(watched_until > now(), false) INTO watched
      FROM solidloop_loops WHERE id = p_loop FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;"""
_LOCK_UNLESS_OWN = """
    -- The loop's row lock: while it is held no other transaction draws an id
    -- for this loop, so ids commit in order. A row version this transaction
    -- wrote (an update or an insert of the same statement or an earlier one)
    -- is held until commit already: locking it again would only write a WAL
    -- record. Any other version is locked here.
    SELECT observed OR coalesce(watched_until > now(), false),
           xmin = pg_current_xact_id()::xid
      INTO watched, own
      FROM solidloop_loops WHERE id = p_loop;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT own THEN
        SELECT observed OR coalesce(watched_until > now(), false) INTO watched
          FROM solidloop_loops WHERE id = p_loop FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;"""


def _emit(lock: str) -> str:
    return f"""
CREATE OR REPLACE FUNCTION solidloop_stream_emit(
    p_loop bigint, p_kind text, p_message bigint, p_call bigint, p_data jsonb, p_text text)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    watched boolean;
    own boolean;
    prev bigint;
    new_id bigint;
    inline text := '';
BEGIN{lock}
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


_FK = "fk_solidloop_stream_events_loop_id_solidloop_loops"

_CASCADE = """
CREATE OR REPLACE FUNCTION solidloop_stream_loops_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM solidloop_stream_events e USING gone WHERE e.loop_id = gone.id;
    RETURN NULL;
END
$$
"""
_CASCADE_TRIGGER = """CREATE TRIGGER solidloop_stream_loops_deleted
    AFTER DELETE ON solidloop_loops REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION solidloop_stream_loops_deleted()"""


def upgrade() -> None:
    """Upgrade schema."""
    op.execute(_emit(_LOCK_UNLESS_OWN))
    op.execute(_CASCADE)
    op.execute(_CASCADE_TRIGGER)
    op.drop_constraint(_FK, "solidloop_stream_events", type_="foreignkey")


def downgrade() -> None:
    """Downgrade schema."""
    op.execute("DELETE FROM solidloop_stream_events e WHERE NOT EXISTS "
               "(SELECT 1 FROM solidloop_loops l WHERE l.id = e.loop_id)")
    op.create_foreign_key(_FK, "solidloop_stream_events", "solidloop_loops",
                          ["loop_id"], ["id"], ondelete="CASCADE")
    op.execute("DROP TRIGGER IF EXISTS solidloop_stream_loops_deleted ON solidloop_loops")
    op.execute("DROP FUNCTION IF EXISTS solidloop_stream_loops_deleted()")
    op.execute(_emit(_LOCK_ALWAYS))
