"""The Postgres broker and the transactional-dispatch invariants, on the real database.

No mocks: every test writes real job rows, claims them with the broker's own
consumer (or ``flask_solidloop.testing.drain``, or a real ``dramatiq.Worker``)
and checks the rows, the loop state and the NOTIFY traffic a second psycopg
connection sees.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import dramatiq
import psycopg
from psycopg import sql
from sqlalchemy import select, text

from flask_solidloop.config import QUEUE_LLM, QUEUE_MAINTENANCE, QUEUE_TOOL
from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.loops import store
from flask_solidloop.loops.store.transaction import execute
from flask_solidloop.models import Loop, Message, ToolCall
from flask_solidloop.queue.broker import PostgresMessageProxy
from flask_solidloop.queue.current_job import current_job, mark_current_job_done
from flask_solidloop.queue.sql import CHANNEL_PREFIX
from flask_solidloop.queue.sql import CLAIM as _CLAIM
from flask_solidloop.runtime.turns import tool_call_job
from flask_solidloop.urls import libpq_url

from ..support.support_app import SIDE_EFFECTS, Assistant

LLM_CHANNEL = CHANNEL_PREFIX + QUEUE_LLM  # "solidloop_q_solidloop_llm"
MAINTENANCE_CHANNEL = CHANNEL_PREFIX + QUEUE_MAINTENANCE


# -- helpers ---------------------------------------------------------------------------


@contextlib.contextmanager
def listening(database_url, channel):
    conn = psycopg.connect(libpq_url(database_url), autocommit=True)
    try:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        yield conn
    finally:
        conn.close()


def notifications(conn, timeout):
    """Every channel notified on ``conn`` within ``timeout`` seconds."""
    return [n.channel for n in conn.notifies(timeout=timeout)]


def first_wakeup(conn, timeout=2.0):
    """The channel of the first notification within ``timeout``, as a list ([] if none)."""
    return [n.channel for n in conn.notifies(timeout=timeout, stop_after=1)]


@contextlib.contextmanager
def consuming(broker, queue=QUEUE_MAINTENANCE, *, prefetch=1, timeout=100):
    consumer = broker.consume(queue, prefetch=prefetch, timeout=timeout)
    try:
        yield consumer
    finally:
        consumer.close()


def send_job(state, *, delay=None, connection=None):
    """A real solidloop message (the maintenance actor) written as a job row; its id."""
    message = state.actors["maintenance"].message("recover_jobs")
    state.broker.enqueue(message, delay=delay, connection=connection)
    return job_id_of(state.broker, message.message_id)


def job_id_of(broker, message_id):
    rows = broker._run("SELECT id FROM solidloop_jobs WHERE message_id = %s", (message_id,))
    assert len(rows) == 1, rows
    return rows[0][0]


def job(pg, job_id):
    row = pg.execute(
        "SELECT state, attempts, lease_token, lease_until, last_error, finished_at "
        "FROM solidloop_jobs WHERE id = %s", (job_id,),
    ).fetchone()
    assert row is not None, f"no job {job_id}"
    keys = ("state", "attempts", "lease_token", "lease_until", "last_error", "finished_at")
    return dict(zip(keys, row, strict=True))


def expire_lease(pg, job_id):
    pg.execute("UPDATE solidloop_jobs SET lease_until = now() - interval '1 second' "
               "WHERE id = %s", (job_id,))


def count(pg, table, where="true", params=()):
    return pg.execute(f"SELECT count(*) FROM {table} WHERE {where}", params).fetchone()[0]


def script_two_adds(llm):
    llm.script("two sums", {"content": "Adding.", "tool_calls": [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "add", "arguments": {"a": 3, "b": 4}},
    ]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "3 and 7"})


# -- 1. atomic dispatch ------------------------------------------------------------------


def test_rolled_back_start_leaves_no_loop_no_job_and_no_notify(app, session, pg, database_url):
    with listening(database_url, LLM_CHANNEL) as listener:
        loop = Assistant.start(message="never happened", commit=False)
        assert loop.id is not None
        # the job is really written inside the open transaction ...
        assert session.execute(text("SELECT count(*) FROM solidloop_jobs")).scalar() == 1
        session.rollback()
        # ... and goes away with it, together with the loop and its wake-up
        assert count(pg, "solidloop_loops") == 0
        assert count(pg, "solidloop_messages") == 0
        assert count(pg, "solidloop_jobs") == 0
        assert notifications(listener, 0.5) == []

        loop = Assistant.start(message="this one happens", commit=False)
        loop_id = loop.id
        assert count(pg, "solidloop_jobs") == 0  # not visible before the commit
        assert notifications(listener, 0.2) == []  # NOTIFY is delivered on commit only
        session.commit()
        assert first_wakeup(listener) == [LLM_CHANNEL]
    assert pg.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                      (loop_id,)).fetchone() == ("queued",)
    assert pg.execute(
        "SELECT actor_name, state, loop_id FROM solidloop_jobs"
    ).fetchall() == [("solidloop.llm_turn", "queued", loop_id)]


def test_a_state_change_and_its_job_roll_back_together(app, session, state, pg,
                                                        database_url):
    loop = Assistant.start(message="pause me")
    loop_id = loop.id
    assert Assistant(loop_id).pause()
    jobs_before = count(pg, "solidloop_jobs")
    with listening(database_url, LLM_CHANNEL) as listener:
        # The loop queued again (a resume's statement) with its job, in one transaction.
        execute(session, loop_sql.RESUME_TO_TURN, {"loop_id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
        session.rollback()
        assert pg.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                          (loop_id,)).fetchone() == ("paused",)
        assert count(pg, "solidloop_jobs") == jobs_before
        assert notifications(listener, 0.5) == []

        execute(session, loop_sql.RESUME_TO_TURN, {"loop_id": loop_id})
        state.dispatch.llm_turn(session, loop_id)
        session.commit()
        assert first_wakeup(listener) == [LLM_CHANNEL]
    assert pg.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                      (loop_id,)).fetchone() == ("queued",)
    assert count(pg, "solidloop_jobs") == jobs_before + 1


# -- 2. a stale generation writes nothing ------------------------------------------------


def test_stale_token_cannot_transition_or_run_a_tool_call(app, session, state, llm, drain, pg):
    script_two_adds(llm)
    loop = Assistant.start(message="two sums please")
    loop_id = loop.id
    drain(queues=(QUEUE_LLM,))
    old_token, status = pg.execute(
        "SELECT execution_token, status FROM solidloop_loops WHERE id = %s", (loop_id,)
    ).fetchone()
    assert status == "running" and old_token is not None
    new_token = uuid.uuid4()
    pg.execute("UPDATE solidloop_loops SET execution_token = %s WHERE id = %s",
               (new_token, loop_id))
    session.rollback()
    session.expire_all()

    # the old generation's canonical transition is refused and writes nothing
    assert not store.fenced_transition(session, loop_id, old_token, from_="running",
                                       to="completed")
    assert pg.execute(
        "SELECT status, execution_token, finished_at FROM solidloop_loops WHERE id = %s",
        (loop_id,),
    ).fetchone() == ("running", new_token, None)

    # the old generation's tool job runs nothing and writes nothing
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    assert len(calls) == 2
    tool_call_job(state, calls[0].id, str(old_token))
    session.rollback()
    assert SIDE_EFFECTS == []
    assert count(pg, "solidloop_messages", "role = 'tool'") == 0
    assert pg.execute(
        "SELECT executed_at, lease_token, response_message_id FROM solidloop_tool_calls "
        "WHERE id = %s", (calls[0].id,),
    ).fetchone() == (None, None, None)

    # control: the current generation does get through both fences
    tool_call_job(state, calls[0].id, str(new_token))
    session.rollback()
    assert [("add", f"solidloop:tool_call:{calls[0].id}")] == SIDE_EFFECTS
    assert count(pg, "solidloop_messages", "role = 'tool'") == 1
    assert store.fenced_transition(session, loop_id, new_token, from_="running",
                                   to="completed")


def test_old_tool_jobs_no_op_after_pause_and_resume(app, session, llm, drain, pg):
    script_two_adds(llm)
    loop = Assistant.start(message="two sums please")
    loop_id = loop.id
    drain(queues=(QUEUE_LLM,))
    old_token = pg.execute("SELECT execution_token FROM solidloop_loops WHERE id = %s",
                           (loop_id,)).fetchone()[0]
    old_jobs = [r[0] for r in pg.execute(
        "SELECT id FROM solidloop_jobs WHERE actor_name = 'solidloop.tool_call' "
        "AND state = 'queued' ORDER BY id").fetchall()]
    assert len(old_jobs) == 2

    assert Assistant(loop_id).pause()
    assert Assistant(loop_id).resume(from_=("paused",))
    new_token, status = pg.execute(
        "SELECT execution_token, status FROM solidloop_loops WHERE id = %s", (loop_id,)
    ).fetchone()
    assert status == "running" and new_token not in (None, old_token)
    new_jobs = [r[0] for r in pg.execute(
        "SELECT id FROM solidloop_jobs WHERE actor_name = 'solidloop.tool_call' "
        "AND state = 'queued' AND id <> ALL(%s) ORDER BY id", (old_jobs,)).fetchall()]
    assert len(new_jobs) == 2

    # the old generation's jobs are claimed first (lower eta/id) and must no-op
    assert drain(queues=(QUEUE_TOOL,), max_jobs=2) == 2
    assert [job(pg, j)["state"] for j in old_jobs] == ["done", "done"]
    assert [job(pg, j)["state"] for j in new_jobs] == ["queued", "queued"]
    assert SIDE_EFFECTS == []
    assert count(pg, "solidloop_messages", "role = 'tool'") == 0
    assert count(pg, "solidloop_tool_calls", "executed_at IS NOT NULL") == 0
    assert pg.execute("SELECT status, execution_token FROM solidloop_loops WHERE id = %s",
                      (loop_id,)).fetchone() == ("running", new_token)

    # the new generation completes the loop, one tool message per call
    drain()
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert loop.status == "completed", loop.error_message
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    tool_messages = list(session.scalars(
        select(Message).where(Message.loop_id == loop_id, Message.role == "tool")))
    assert len(tool_messages) == 2
    assert sorted(c.response_message_id for c in calls) == sorted(m.id for m in tool_messages)
    assert sorted(m.content for m in tool_messages) == ["3", "7"]
    assert sorted(SIDE_EFFECTS) == sorted(
        ("add", f"solidloop:tool_call:{c.id}") for c in calls)


# -- 3/4. job leases: redelivery, dead-lettering, fenced ack -----------------------------


def test_expired_lease_is_redelivered_to_another_consumer(app, state, broker, pg, database_url):
    job_id = send_job(state)
    with consuming(broker) as first:
        m1 = next(first)
        assert isinstance(m1, PostgresMessageProxy)
        assert (m1.job_id, m1.attempts) == (job_id, 1)
        assert job(pg, job_id)["state"] == "running"
        # a live lease is not recovered
        assert broker.recover_expired() == 0
        with consuming(broker) as second:
            assert next(second) is None  # nothing claimable while the lease lives
            expire_lease(pg, job_id)
            with listening(database_url, MAINTENANCE_CHANNEL) as listener:
                assert broker.recover_expired() == 1
                assert first_wakeup(listener) == [MAINTENANCE_CHANNEL]
            row = job(pg, job_id)
            assert (row["state"], row["lease_token"], row["lease_until"]) == ("queued", None,
                                                                              None)
            assert "lease expired" in row["last_error"]
            m2 = next(second)
            assert m2 is not None
            assert (m2.job_id, m2.attempts) == (job_id, 2)
            assert m2.lease_token != m1.lease_token
            assert m2.message_id == m1.message_id
            second.ack(m2)
    assert job(pg, job_id)["state"] == "done"


def test_job_is_dead_lettered_after_max_deliveries(app, state, broker, pg):
    job_id = send_job(state)
    assert broker.max_deliveries == state.config.job_max_deliveries == 10
    for delivery in range(1, broker.max_deliveries + 1):
        assert job(pg, job_id)["state"] == "queued"
        with consuming(broker) as consumer:
            message = next(consumer)
            assert (message.job_id, message.attempts) == (job_id, delivery)
            expire_lease(pg, job_id)  # the holder "dies" without an ack
            assert broker.recover_expired() == 1
    row = job(pg, job_id)
    assert row["state"] == "dead" and row["attempts"] == broker.max_deliveries
    assert row["finished_at"] is not None and "lease expired" in row["last_error"]
    with consuming(broker) as consumer:
        assert next(consumer) is None
    assert broker.recover_expired() == 0


def test_stale_holders_ack_and_nack_change_nothing(app, state, broker, pg):
    job_id = send_job(state)
    with consuming(broker) as stale, consuming(broker) as current:
        old = next(stale)
        expire_lease(pg, job_id)
        assert broker.recover_expired() == 1
        new = next(current)
        assert new.job_id == job_id and new.lease_token != old.lease_token
        before = job(pg, job_id)

        stale.ack(old)
        assert job(pg, job_id) == before
        stale.nack(old)
        assert job(pg, job_id) == before
        stale.requeue([old])
        assert job(pg, job_id) == before
        assert before["state"] == "running" and before["lease_token"] == new.lease_token

        current.ack(new)
    row = job(pg, job_id)
    assert row["state"] == "done" and row["finished_at"] is not None


def test_stale_holders_renewal_does_not_extend_the_new_lease(app, state, broker, pg):
    job_id = send_job(state)
    with consuming(broker) as stale, consuming(broker) as current:
        next(stale)
        expire_lease(pg, job_id)
        assert broker.recover_expired() == 1
        assert next(current).job_id == job_id
        pg.execute("UPDATE solidloop_jobs SET lease_until = now() + interval '5 seconds' "
                   "WHERE id = %s", (job_id,))
        stale.last_renewal = 0.0  # make its renewal due now
        next(stale)
        remaining = pg.execute("SELECT EXTRACT(EPOCH FROM lease_until - now()) "
                               "FROM solidloop_jobs WHERE id = %s", (job_id,)).fetchone()[0]
        assert float(remaining) <= 5.0


# -- 5. delays live in the row -----------------------------------------------------------


def test_delay_is_stored_as_eta_and_gates_the_claim(app, state, broker, pg):
    job_id = send_job(state, delay=2000)
    due_in, options = pg.execute(
        "SELECT EXTRACT(EPOCH FROM eta - now()), message->'options' FROM solidloop_jobs "
        "WHERE id = %s", (job_id,)).fetchone()
    assert 1.0 < float(due_in) <= 2.0
    assert "eta" not in options  # never held in worker memory
    with consuming(broker) as consumer:
        assert next(consumer) is None
        assert job(pg, job_id)["state"] == "queued"
        # A row made due by hand: a NOTIFY on its queue's channel wakes the
        # consumer (it would otherwise look at its next poll or due time).
        pg.execute("UPDATE solidloop_jobs SET eta = now() - interval '1 millisecond' "
                   "WHERE id = %s", (job_id,))
        pg.execute("SELECT pg_notify(%s, '')", (CHANNEL_PREFIX + consumer.queue_name,))
        message = next(consumer)
        assert message is not None and message.job_id == job_id
        consumer.ack(message)
    assert job(pg, job_id)["state"] == "done"


# -- 6. actor retries, then dead-letter --------------------------------------------------


def test_failing_actor_is_retried_then_dead_lettered(app, broker, pg):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError(f"boom number {len(calls)}")

    actor = dramatiq.Actor(boom, broker=broker, actor_name="test.boom",
                           queue_name=QUEUE_MAINTENANCE, priority=0,
                           options={"max_retries": 1})
    actor.send()
    from flask_solidloop.testing import drain

    assert drain(app, queues=(QUEUE_MAINTENANCE,), raise_errors=False) == 1
    rows = pg.execute("SELECT id, state, EXTRACT(EPOCH FROM eta - now()), "
                      "message->'options'->>'retries' FROM solidloop_jobs ORDER BY id").fetchall()
    assert [(r[1], r[3]) for r in rows] == [("done", None), ("queued", "1")]
    assert float(rows[1][2]) > 1.0  # the retry's backoff is a row eta
    assert drain(app, queues=(QUEUE_MAINTENANCE,), raise_errors=False) == 0  # not due yet

    pg.execute("UPDATE solidloop_jobs SET eta = now() WHERE state = 'queued'")
    assert drain(app, queues=(QUEUE_MAINTENANCE,), raise_errors=False) == 1
    assert len(calls) == 2
    rows = pg.execute("SELECT state, last_error, finished_at FROM solidloop_jobs "
                      "ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["done", "dead"]
    assert "boom number 2" in rows[1][1] and rows[1][2] is not None
    assert drain(app, queues=(QUEUE_MAINTENANCE,), raise_errors=False) == 0


# -- 7. SKIP LOCKED ----------------------------------------------------------------------


def enqueue_backlog(state, n):
    with state.broker.connect() as conn, conn.transaction():
        for _ in range(n):
            message = state.actors["maintenance"].message("recover_jobs")
            state.broker.enqueue(message, connection=conn)
    ids = [r[0] for r in state.broker._run("SELECT id FROM solidloop_jobs ORDER BY id")]
    assert len(ids) == n
    return ids


def test_claim_skips_rows_locked_by_an_open_claim(app, state, broker, database_url):
    all_ids = enqueue_backlog(state, 50)
    params = {"lease": 60, "queue": QUEUE_MAINTENANCE}
    with psycopg.connect(libpq_url(database_url)) as holder, \
            psycopg.connect(libpq_url(database_url), autocommit=True) as other:
        other.execute("SET lock_timeout = '2s'")  # a blocking claim would fail, not hang
        held = [r[0] for r in holder.execute(_CLAIM, {**params, "limit": 10}).fetchall()]
        assert len(held) == 10  # transaction still open: those rows stay locked
        rest = [r[0] for r in other.execute(_CLAIM, {**params, "limit": 50}).fetchall()]
        assert set(held).isdisjoint(rest) and sorted(held + rest) == all_ids
        holder.rollback()  # the claim never happened: its rows are claimable again
        again = [r[0] for r in other.execute(_CLAIM, {**params, "limit": 50}).fetchall()]
        assert sorted(again) == sorted(held)


def test_concurrent_consumers_never_share_a_job(app, state, broker, pg):
    all_ids = enqueue_backlog(state, 50)
    barrier = threading.Barrier(2)
    received: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def consume(slot):
        try:
            with consuming(broker, prefetch=3) as consumer:
                barrier.wait(timeout=5)
                while (message := next(consumer)) is not None:
                    received[slot].append(message.job_id)
                    consumer.ack(message)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    first, second = received
    assert len(first) == len(set(first)) and len(second) == len(set(second))
    assert set(first).isdisjoint(second)
    assert sorted(first + second) == all_ids
    assert count(pg, "solidloop_jobs", "state = 'done' AND attempts = 1") == 50


# -- 8. mark_current_job_done shares the caller's transaction ----------------------------


@contextlib.contextmanager
def processing(broker, message):
    """The broker middleware around one message, as a worker thread runs it."""
    broker.emit_before("process_message", message)
    try:
        yield
    finally:
        broker.emit_after("process_message", message, result=None)


def test_mark_current_job_done_rolls_back_with_the_transaction(app, state, broker, pg):
    job_id = send_job(state)
    with consuming(broker) as consumer:
        message = next(consumer)
        with processing(broker, message):
            assert current_job().job_id == job_id
            session = state.db.session
            session.execute(text("SELECT 1"))
            assert mark_current_job_done(session) is True
            session.rollback()
        assert current_job() is None
        row = job(pg, job_id)
        assert row["state"] == "running" and row["lease_token"] == message.lease_token
        assert row["finished_at"] is None
        consumer.ack(message)  # the ack path still owns it
    assert job(pg, job_id)["state"] == "done"


def test_mark_current_job_done_commits_without_an_ack(app, state, broker, pg):
    job_id = send_job(state)
    with consuming(broker) as consumer:
        message = next(consumer)
        with processing(broker, message):
            session = state.db.session
            session.execute(text("SELECT 1"))
            assert mark_current_job_done(session) is True
            assert job(pg, job_id)["state"] == "running"  # not before the commit
            session.commit()
        row = job(pg, job_id)
        assert row["state"] == "done" and row["finished_at"] is not None
        assert row["lease_until"] is None
        # no ack ever follows (the worker "died", its lease runs out): nothing redelivers it
        expire_lease(pg, job_id)
        assert broker.recover_expired() == 0
        assert next(consumer) is None
    after = job(pg, job_id)
    assert (after["state"], after["attempts"], after["finished_at"]) == (
        "done", 1, row["finished_at"])
    assert mark_current_job_done(state.db.session) is False  # no current job here


# -- 9. the consumer under dramatiq's own Worker -----------------------------------------


def test_consumer_wakes_on_notify_not_on_poll(app, state, broker):
    # The poll would fire only after an hour: a consumer that returns the job at all
    # was woken by the NOTIFY (a loaded machine makes it slower, not wrong).
    broker.poll_interval = 3600.0
    with consuming(broker, timeout=3_600_000) as consumer:
        result: list = []
        thread = threading.Thread(target=lambda: result.append(next(consumer)), daemon=True)
        thread.start()
        time.sleep(0.3)  # let it block in LISTEN on an empty queue
        job_id = send_job(state)
        thread.join(timeout=120)  # a guard against hanging the suite, not a speed check
        assert not thread.is_alive()
        assert result and result[0] is not None and result[0].job_id == job_id
        consumer.ack(result[0])


def test_real_dramatiq_worker_runs_a_loop_to_completion(app, state, broker, llm, pg):
    script_two_adds(llm)
    worker = dramatiq.Worker(broker, worker_threads=2)
    worker.start()
    try:
        loop = Assistant.start(message="two sums please")
        plain_job = send_job(state)  # an actor that never marks its job: only an ack ends it
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = pg.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                                (loop.id,)).fetchone()[0]
            live = count(pg, "solidloop_jobs", "state IN ('queued', 'running')")
            if status not in ("queued", "running") and live == 0:
                break
            time.sleep(0.05)
    finally:
        worker.stop(timeout=10000)
    assert status == "completed", pg.execute(
        "SELECT error_message FROM solidloop_loops WHERE id = %s", (loop.id,)).fetchone()
    states = pg.execute("SELECT actor_name, state, attempts FROM solidloop_jobs "
                        "ORDER BY id").fetchall()
    # The first turn and the batch's second call are jobs; the first call and
    # the last turn were claimed by the commits before them for the thread that
    # made them (inline continuation adopts them: no job row).
    assert sorted(states) == sorted([
        ("solidloop.llm_turn", "done", 1),
        ("solidloop.maintenance", "done", 1),
        ("solidloop.tool_call", "done", 1),
    ])
    assert job(pg, plain_job)["state"] == "done"
    assert count(pg, "solidloop_messages", "role = 'tool' AND loop_id = %s", (loop.id,)) == 2
    assert len(SIDE_EFFECTS) == 2 and len(llm.requests) == 2
