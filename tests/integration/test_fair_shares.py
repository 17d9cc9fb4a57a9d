"""Fair shares and concurrency caps on PostgreSQL (decision 0023): a new loop's
fair rank and its jobs' place in the claim order; a capped loop's admission,
its hold, and the wake-up the database sends when a loop of its cap leaves
flight, under the races that could lose one."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy import text

from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.loops import store
from flask_solidloop.models import Loop
from flask_solidloop.queue import sql as jobs_sql
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.queue.current_job import CurrentJob, set_current_job
from flask_solidloop.state import get_state

from ..support.support_app import Assistant, CappedAgent, create_app


@contextmanager
def app_with(**config):
    app = create_app(**config)
    try:
        with app.app_context():
            session = app.extensions["sqlalchemy"].session
            yield app, session
            session.remove()
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
    finally:
        get_state(app).stop_renewer()
        get_state(app).broker.close()


def ranks(session, ids):
    session.expire_all()
    return [session.get(Loop, i).fair_rank for i in ids]


def jobs(session, ids):
    """{loop id: (seconds its fair place is after its due time, or None)} of queued jobs."""
    rows = session.execute(text(
        "SELECT loop_id, extract(epoch FROM fair_at - eta)::float8 FROM solidloop_jobs "
        "WHERE state = 'queued' AND loop_id = ANY(:ids)"), {"ids": ids}).all()
    session.rollback()
    return dict(rows)


def test_a_new_loop_ranks_by_its_subjects_live_loops(app, session):
    ids = Assistant.start_many(
        [{"message": "a", "subject": ("Team", "A")}] * 3
        + [{"message": "b", "subject": ("Team", "B")}] * 2 + ["nobody"])
    session.commit()
    assert ranks(session, ids) == [0, 1, 2, 0, 1, 0]
    one_more = Assistant.start(message="a again", subject=("Team", "A")).id
    session.commit()
    assert ranks(session, [one_more]) == [3]
    # Each job carries its loop's rank: due now, placed rank x 0.5 s later.
    offsets = jobs(session, [*ids, one_more])
    assert [offsets[i] for i in [*ids, one_more]] == [0.0, 0.5, 1.0, 0.0, 0.5, 0.0, 1.5]
    # Only live loops count: a paused one does not.
    assert store.pause(session, ids[0])
    session.commit()
    later = Assistant.start(message="a later", subject=("Team", "A")).id
    session.commit()
    assert ranks(session, [later]) == [3]


def test_the_claim_takes_a_small_subjects_job_before_a_big_backlog(app, session):
    big = Assistant.start_many([{"message": "a", "subject": ("Team", "A")}] * 20)
    small = Assistant.start(message="b", subject=("Team", "B")).id
    session.commit()
    order = [row[0] for row in session.execute(text(
        "SELECT loop_id FROM solidloop_jobs WHERE queue_name = 'solidloop_llm' "
        "AND state = 'queued' ORDER BY tier, coalesce(fair_at, eta), id"))]
    session.rollback()
    # B's job, enqueued after all of A's, goes before A's ranks >= 1 (or 2, if the
    # clock moved between the two starts).
    assert order.index(small) <= 2
    broker = get_state(app).broker
    with broker.pool.connection() as conn:
        claimed = conn.execute(jobs_sql.CLAIM, {"lease": 30, "queue": "solidloop_llm",
                                                "limit": 3}).fetchall()
    claimed_loops = {row[2]["options"]["solidloop_loop_id"] for row in claimed}
    assert small in claimed_loops and big[0] in claimed_loops


def test_fair_shares_off_writes_no_rank_and_no_place(database_url, llm):
    with app_with(SOLIDLOOP_FAIR_SHARE_QUANTUM=0) as (_app, session):
        ids = Assistant.start_many([{"message": "a", "subject": ("Team", "A")}] * 3)
        session.commit()
        assert ranks(session, ids) == [0, 0, 0]
        assert set(jobs(session, ids).values()) == {None}


def test_the_claim_index_serves_the_claim_over_thousands_of_jobs(app, session):
    session.execute(text(
        "INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, eta, fair_at, "
        "tier) SELECT 'solidloop_llm', 'solidloop.llm_turn', gen_random_uuid(), '{}'::jsonb, "
        "now() - make_interval(secs => g), now() + make_interval(secs => g % 50), 1 + g % 2 "
        "FROM generate_series(1, 5000) AS g"))
    session.commit()
    session.execute(text("ANALYZE solidloop_jobs"))
    session.commit()
    with psycopg.connect(libpq_url(get_state(app).broker.url), autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + jobs_sql.CLAIM, {"lease": 30, "queue": "solidloop_llm", "limit": 4}))
    assert "ix_solidloop_jobs_claim" in plan, plan
    assert "Sort" not in plan, plan


# -- caps: admission, hold, wake-up ------------------------------------------------------

def start_capped(n, subject=("Team", "S")):
    return [CappedAgent.start(message=f"nap {i}", subject=subject).id for i in range(n)]


def admit(app, session, loop_id, *, subject_cap=None, agent_cap=2):
    """The admission a worker runs for the loop's delivered first-turn job (the
    job claimed as a consumer claims it, and the thread's current job)."""
    state = get_state(app)
    job_id, token = session.execute(text(
        "UPDATE solidloop_jobs SET state = 'running', lease_token = gen_random_uuid() "
        "WHERE loop_id = :id AND state = 'queued' RETURNING id, lease_token"),
        {"id": loop_id}).one()
    session.commit()
    session.expire_all()
    loop = session.get(Loop, loop_id)
    set_current_job(CurrentJob(job_id, token, 1))
    try:
        admitted = store.admit(state, session, loop, store.Caps(agent_cap, subject_cap))
    finally:
        set_current_job(None)
    if admitted:  # the claim would take the job; give it back for the next step
        session.execute(text("UPDATE solidloop_jobs SET state = 'queued', lease_token = NULL "
                             "WHERE id = :id"), {"id": job_id})
        session.commit()
    return admitted


def loop_row(session, loop_id):
    row = session.execute(text(
        "SELECT status, capped_at IS NOT NULL, held_by, held_since IS NOT NULL FROM "
        "solidloop_loops WHERE id = :id"), {"id": loop_id}).one()
    session.rollback()
    return tuple(row)


def job_due(session, loop_id):
    """Whether the loop's queued job is due now (and it has exactly one)."""
    rows = session.execute(text(
        "SELECT eta <= now() FROM solidloop_jobs WHERE loop_id = :id AND state = 'queued'"),
        {"id": loop_id}).all()
    session.rollback()
    assert len(rows) == 1, rows
    return rows[0][0]


def test_a_loop_past_its_agents_cap_is_held_and_woken_when_one_ends(app, session):
    first, second, third = start_capped(3)
    session.commit()
    assert admit(app, session, first) and admit(app, session, second)
    assert not admit(app, session, third)
    assert loop_row(session, third) == ("queued", False, "agent", True)
    assert not job_due(session, third)  # put off to the recheck, not a hot retry
    assert store.pause(session, first)
    # The pause's commit woke the held loop: its job is due, it keeps its place.
    assert loop_row(session, first) == ("paused", False, None, False)
    assert loop_row(session, third) == ("queued", False, None, True)
    assert job_due(session, third)
    assert admit(app, session, third)
    assert loop_row(session, third) == ("queued", True, None, False)


def test_a_subjects_cap_counts_only_that_subjects_loops(app, session):
    a1, a2 = start_capped(2, subject=("Team", "A"))
    b1 = start_capped(1, subject=("Team", "B"))[0]
    session.commit()
    assert admit(app, session, a1, subject_cap=1, agent_cap=None)
    assert not admit(app, session, a2, subject_cap=1, agent_cap=None)
    assert loop_row(session, a2)[2] == "subject"
    assert admit(app, session, b1, subject_cap=1, agent_cap=None)
    assert store.stop(session, b1, reason="done")  # B's end wakes none of A's
    assert not job_due(session, a2)
    assert store.stop(session, a1, reason="done")
    assert job_due(session, a2)


def end_at_once(url, loop_ids):
    """Fail each loop in its own transaction, the commits racing: each UPDATE
    runs, then all commit together."""
    barrier = threading.Barrier(len(loop_ids))
    errors = []

    def end(loop_id):
        try:
            with psycopg.connect(url) as conn:
                barrier.wait()
                conn.execute("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s",
                             (loop_id,))
                conn.commit()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=end, args=(i,)) for i in loop_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


@pytest.mark.parametrize("run", range(3))
def test_two_loops_ending_at_once_wake_two_held_loops(app, session, run):
    running = start_capped(2)
    held = start_capped(3)
    session.commit()
    assert all(admit(app, session, i) for i in running)
    assert not any(admit(app, session, i) for i in held)
    session.execute(text("UPDATE solidloop_loops SET status = 'running' WHERE id = ANY(:ids)"),
                    {"ids": running})
    session.commit()
    end_at_once(libpq_url(get_state(app).broker.url), running)
    # The two oldest holds are woken, one each; the third sleeps on (the cap is 2).
    assert [job_due(session, i) for i in held] == [True, True, False]
    assert [loop_row(session, i)[2] for i in held] == [None, None, "agent"]


def test_a_hold_racing_an_end_is_woken(app, session):
    """The admission holds the loop while a loop of its cap ends: the end waits
    on the cap's lock, and its wake-up sees the hold."""
    running = start_capped(2)
    late = start_capped(1)[0]
    session.commit()
    assert all(admit(app, session, i) for i in running)
    url = libpq_url(get_state(app).broker.url)
    params = {"loop_id": late, "agent_name": "capped", "subject_type": "Team",
              "subject_id": "S", "agent_cap": 2, "subject_cap": None}
    ended = threading.Event()
    with psycopg.connect(url) as admission:
        admission.execute(loop_sql.CAP_LOCKS, params)
        assert admission.execute(loop_sql.ADMIT, params).fetchone()[0] == "agent"
        admission.execute("UPDATE solidloop_jobs SET eta = now() + interval '1 hour' "
                          "WHERE loop_id = %s AND state = 'queued'", (late,))

        def end():
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("UPDATE solidloop_loops SET status = 'failed' WHERE id = %s",
                             (running[0],))
            ended.set()

        ender = threading.Thread(target=end)
        ender.start()
        time.sleep(0.3)
        assert not ended.is_set()  # waits on the cap's lock
        admission.commit()
    ender.join(10)
    assert ended.is_set()
    assert job_due(session, late)


def test_an_uncapped_loop_never_asks(app, session):
    loop_id = Assistant.start(message="hi", subject=("Team", "A")).id
    session.commit()
    loop = session.get(Loop, loop_id)
    agent = get_state(app).agent_for(loop.agent_name, loop)
    assert store.caps_for(get_state(app), agent, loop) is None
