"""The janitor that workers run by default, with real worker processes (issue 27,
item 3): with no retention setting at all, a worker prunes a completed loop's
old rows, and never a running loop's, however old they look, until that loop
has ended. Only the sweep interval is shortened (SOLIDLOOP_JANITOR_INTERVAL),
so the test sees many sweeps; every retention is its default."""

from __future__ import annotations

import json
import signal

import psycopg
import pytest

from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant, SlowAgent
from .test_e2e_workers import kill_group, spawn_workers
from .test_liveness import WORKER_CMD, poll, running_calls, slow_calls

pytestmark = pytest.mark.e2e

CONFIG = {"SOLIDLOOP_JANITOR_INTERVAL": 0.5, "SOLIDLOOP_LIVENESS_TTL": 10.0,
          "SOLIDLOOP_REAPER_INTERVAL": 0.5}


@pytest.fixture
def pg(database_url):
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        yield conn


def scalar(session, query: str, **params):
    from sqlalchemy import text

    value = session.execute(text(query), params).scalar()
    session.rollback()
    return value


def sweeps(session) -> int:
    return scalar(session, "SELECT coalesce((SELECT passes FROM solidloop_maintenance_runs "
                           "WHERE task = 'prune'), 0)")


def old_rows(session, loop_id: int) -> tuple[int, int]:
    """(events, jobs) of the loop that look older than every default retention."""
    return (scalar(session, "SELECT count(*) FROM solidloop_events WHERE loop_id = :id AND "
                            "created_at < now() - interval '30 days'", id=loop_id),
            scalar(session, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = :id AND "
                            "finished_at < now() - interval '7 days'", id=loop_id))


def backdate(pg, loop_id: int, days: int) -> None:
    pg.execute("UPDATE solidloop_events SET created_at = now() - make_interval(days => %s) "
               "WHERE loop_id = %s", (days, loop_id))
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - make_interval(days => %s) "
               "WHERE loop_id = %s AND state = 'done'", (days, loop_id))
    # A done job of an earlier run of the loop, so there is one whatever the
    # engine ran inline.
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state,"
               " loop_id, finished_at) VALUES ('solidloop_llm', 'solidloop.llm_turn', "
               "gen_random_uuid(), '{}', 'done', %s, now() - make_interval(days => %s))",
               (loop_id, days))


def test_the_default_janitor_in_workers_never_deletes_a_running_loops_rows(
        app, session, llm, pg, effects, monkeypatch, tmp_path):
    state = app.extensions["solidloop"]
    assert state.config.event_retention == 30 * 86400  # the defaults, in the workers too
    # A completed loop whose rows are past the defaults: proof that the sweeps run.
    llm.script("finish", {"content": "finished"})
    done = Assistant.start(message="finish").id
    run(app)
    backdate(pg, done, 60)
    assert all(old_rows(session, done))

    slow_calls(llm, 600)  # a tool that outlives the test: the loop stays running
    live = SlowAgent.start(message="slow please").id
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(CONFIG))
    log = tmp_path / "workers.log"
    workers = spawn_workers(WORKER_CMD, log=log)
    try:
        poll(session, lambda: old_rows(session, done) == (0, 0),
             what=f"the workers' janitor to prune the completed loop\n{log}")
        poll(session, lambda: running_calls(session, live), what="the slow tool to start")
        backdate(pg, live, 60)
        before = old_rows(session, live)
        assert before[0] >= 1 and before[1] >= 1, before

        # Sweeps that all started after the backdating (one may have been under
        # way while it ran), with the loop running throughout.
        after = sweeps(session) + 3
        poll(session, lambda: sweeps(session) >= after, what="three more sweeps")
        assert scalar(session, "SELECT status FROM solidloop_loops WHERE id = :id",
                      id=live) == "running"
        assert running_calls(session, live)
        assert old_rows(session, live) == before

        # Once the loop has ended, the same rows go at the next sweep.
        stopped = app.test_cli_runner().invoke(args=["solidloop", "force-stop", str(live)])
        assert stopped.exit_code == 0, stopped.output
        poll(session, lambda: old_rows(session, live) == (0, 0),
             what="the janitor to prune the loop once it ended")
        assert workers.poll() is None, log.read_text()[-4000:]
    finally:
        # The slow tool's thread sleeps on: no clean shutdown to wait for.
        kill_group(workers, signal.SIGKILL)


def loop_rows(session, loop_id: int) -> int:
    """The loop's own row and every row that goes with it."""
    return scalar(session, "SELECT (SELECT count(*) FROM solidloop_loops WHERE id = :id) + "
                           "(SELECT count(*) FROM solidloop_messages WHERE loop_id = :id) + "
                           "(SELECT count(*) FROM solidloop_tool_calls WHERE loop_id = :id) + "
                           "(SELECT count(*) FROM solidloop_events WHERE loop_id = :id) + "
                           "(SELECT count(*) FROM solidloop_stream_events WHERE loop_id = :id)",
                  id=loop_id)


def test_workers_delete_loops_past_the_loop_retention_and_never_a_live_one(
        app, session, llm, pg, effects, monkeypatch, tmp_path):
    """SOLIDLOOP_LOOP_RETENTION set in the workers: their janitor deletes an
    ended loop past it with all its rows, and keeps a young ended loop, a
    running loop and a paused one, however old their finished_at looks (a loop
    resumed after an old end)."""
    llm.script("finish", {"content": "finished"})
    old = Assistant.start(message="finish").id
    young = Assistant.start(message="finish").id
    run(app)
    pg.execute("UPDATE solidloop_loops SET finished_at = now() - interval '3 days' "
               "WHERE id = %s", (old,))
    paused = Assistant.start(message="finish later").id
    pg.execute("UPDATE solidloop_jobs SET state = 'done', finished_at = now() "
               "WHERE loop_id = %s", (paused,))
    pg.execute("UPDATE solidloop_loops SET status = 'paused', finished_at = now() - interval "
               "'400 days' WHERE id = %s", (paused,))
    slow_calls(llm, 600)  # a tool that outlives the test: the loop stays running
    live = SlowAgent.start(message="slow please").id
    assert loop_rows(session, old) > 1
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(
        {**CONFIG, "SOLIDLOOP_LOOP_RETENTION": 86400}))
    log = tmp_path / "workers.log"
    workers = spawn_workers(WORKER_CMD, log=log)
    try:
        poll(session, lambda: running_calls(session, live), what="the slow tool to start")
        pg.execute("UPDATE solidloop_loops SET finished_at = now() - interval '400 days' "
                   "WHERE id = %s", (live,))
        kept = {loop_id: loop_rows(session, loop_id) for loop_id in (young, paused, live)}
        poll(session, lambda: loop_rows(session, old) == 0,
             what=f"the workers' janitor to delete the old loop\n{log}")
        after = sweeps(session) + 3
        poll(session, lambda: sweeps(session) >= after, what="three more sweeps")
        assert {loop_id: loop_rows(session, loop_id) for loop_id in kept} == kept
        assert scalar(session, "SELECT status FROM solidloop_loops WHERE id = :id",
                      id=live) == "running"
        assert workers.poll() is None, log.read_text()[-4000:]
    finally:
        kill_group(workers, signal.SIGKILL)
