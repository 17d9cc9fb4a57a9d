"""solidloop_maintenance_runs: every reaper and janitor pass leaves its row, against
the real database, whichever way the pass ran (direct call, the in-worker
periodic thread, the maintenance actor, the CLI), and a failed pass records
its (redacted) error while its exception still propagates."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from sqlalchemy import text

from flask_solidloop.leases import worker_identity
from flask_solidloop.loops import store
from flask_solidloop.maintenance import janitor, run_maintenance
from flask_solidloop.maintenance.janitor import prune
from flask_solidloop.maintenance.reaper import reap

from .test_durability import running_loop


def rows(pg):
    cursor = pg.execute(
        "SELECT task, last_ok, total, counts, holder, passes, last_error, duration_ms,"
        " last_started_at, last_finished_at, last_error_at, updated_at,"
        " (extract(epoch FROM last_finished_at - last_started_at) * 1000)::float8 AS span_ms,"
        " now() - last_finished_at AS age"
        " FROM solidloop_maintenance_runs ORDER BY task")
    names = [c.name for c in cursor.description]
    return {row[0]: dict(zip(names, row, strict=True)) for row in cursor.fetchall()}


def test_a_reap_and_a_prune_pass_each_upsert_their_row(app, state, session, pg):
    assert rows(pg) == {}
    loop_id, _ = running_loop(session)
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second'")
    report = reap(state)
    assert report.expired_llm == [loop_id]
    first = rows(pg)["reap"]
    assert first["last_ok"] is True and first["last_error"] is None
    assert first["total"] == report.healed == 1
    assert first["counts"]["expired_llm"] == 1 and first["counts"]["stuck_queued"] == 0
    assert first["holder"] == worker_identity()
    assert first["passes"] == 1
    assert first["duration_ms"] == pytest.approx(report.duration_ms)
    assert first["span_ms"] == pytest.approx(report.duration_ms, abs=1)
    assert first["age"].total_seconds() < 60  # the database clock, not a fixed value

    # A second pass updates the one row: nothing left to heal, one more pass.
    assert reap(state).healed == 0
    second = rows(pg)["reap"]
    assert pg.execute("SELECT count(*) FROM solidloop_maintenance_runs").fetchone() == (1,)
    assert second["passes"] == 2 and second["total"] == 0
    assert second["counts"]["expired_llm"] == 0
    assert second["last_finished_at"] > first["last_finished_at"]
    assert second["updated_at"] > first["updated_at"]

    # The janitor: 3 old events past a one-hour retention (of no loop: the
    # reaped loop is live again, and its events are kept).
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload, created_at) "
               "SELECT NULL, 'mcp_inbound', '{}', now() - interval '2 hours' "
               "FROM generate_series(1, 3)")
    state.config = dataclasses.replace(state.config, event_retention=3600)
    assert prune(state).events == 3
    assert prune(state).events == 0
    after = rows(pg)
    assert set(after) == {"reap", "prune"}
    assert after["prune"]["passes"] == 2 and after["prune"]["total"] == 0
    assert after["prune"]["last_ok"] is True and after["prune"]["holder"] == worker_identity()
    assert set(after["prune"]["counts"]) == {"events", "jobs", "host_jobs", "results",
                                             "inbound_sessions", "workers", "spend", "loops"}
    assert after["reap"]["updated_at"] == second["updated_at"]  # the other row is untouched


def test_the_first_prune_records_what_it_deleted(app, state, session, pg):
    loop_id, _ = running_loop(session)
    pg.execute("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s", (loop_id,))
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload, created_at) "
               "SELECT %s, 'llm_request', '{}', now() - interval '2 hours' "
               "FROM generate_series(1, 4)", (loop_id,))
    state.config = dataclasses.replace(state.config, event_retention=3600)
    report = prune(state)
    row = rows(pg)["prune"]
    assert row["total"] == report.pruned == 4 and row["counts"]["events"] == 4


def test_a_failing_pass_records_its_error_and_still_raises(app, state, session, pg,
                                                          monkeypatch):
    running_loop(session)
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second'")
    boom = RuntimeError("lost postgresql://app:s3cret@db.internal/prod <b>mid-pass</b>")

    def broken(*args, **kwargs):
        raise boom

    monkeypatch.setattr(store, "heal_stuck_queued", broken)
    with pytest.raises(RuntimeError) as raised:
        reap(state)
    assert raised.value is boom  # the original exception, not one from the record
    row = rows(pg)["reap"]
    assert row["last_ok"] is False
    assert row["last_error"].startswith("RuntimeError: lost postgresql://app:***@db.internal")
    assert "s3cret" not in row["last_error"]
    assert row["last_error_at"] == row["last_finished_at"]
    # What the pass did before it failed was committed, and is counted.
    assert row["counts"]["expired_llm"] == 1 and row["total"] == 1
    assert state.last_reaped_at is None  # only a pass that finished counts there

    # The next pass succeeds: the row says so, and keeps the failure for a look.
    monkeypatch.undo()
    reap(state)
    row = rows(pg)["reap"]
    assert row["last_ok"] is True and row["passes"] == 2
    assert row["last_error"].startswith("RuntimeError: lost")
    assert row["last_error_at"] < row["last_finished_at"]

    # The janitor alike.
    def no_workers(state):
        raise ValueError("worker table gone")

    monkeypatch.setattr(janitor, "_prune_workers", no_workers)
    with pytest.raises(ValueError, match="worker table gone"):
        prune(state)
    row = rows(pg)["prune"]
    assert row["last_ok"] is False and row["last_error"] == "ValueError: worker table gone"
    assert row["passes"] == 1
    # the session is usable after both failures
    assert session.execute(text("SELECT count(*) FROM solidloop_loops")).scalar_one() == 1


def test_without_the_table_passes_still_run_and_errors_still_surface(
        app, state, session, pg, monkeypatch, caplog):
    pg.execute("ALTER TABLE solidloop_maintenance_runs RENAME TO solidloop_maintenance_gone")
    try:
        with caplog.at_level(logging.WARNING, logger="flask_solidloop.maintenance"):
            assert reap(state).healed == 0
            assert reap(state).healed == 0
        warnings = [r for r in caplog.records if "could not record the reap" in r.getMessage()]
        assert len(warnings) == 1  # once per process, not every pass
        assert state.last_reaped_at is not None

        def broken(*args, **kwargs):
            raise RuntimeError("the real failure")

        monkeypatch.setattr(store, "heal_orphan_shells", broken)
        with pytest.raises(RuntimeError, match="the real failure"):
            reap(state)
        monkeypatch.undo()
        assert reap(state).healed == 0  # the session recovered from the failed record
    finally:
        pg.execute("ALTER TABLE solidloop_maintenance_gone RENAME TO solidloop_maintenance_runs")


def test_every_way_a_pass_runs_records_it(app, state, session, pg, drain):
    from flask_solidloop.extension import _maintenance_in_workers

    # The in-worker periodic thread (one pass, as the thread runs it).
    state.config = dataclasses.replace(state.config, event_retention=3600)
    periodic = {task.name: task for task in _maintenance_in_workers(state)}
    try:
        assert periodic["reaper"].run_once() is True
        assert periodic["janitor"].run_once() is True
    finally:
        for task in periodic.values():
            task.stop()
    assert {t: r["passes"] for t, r in rows(pg).items()} == {"reap": 1, "prune": 1}

    # The maintenance actor, through the queue.
    state.actors["maintenance"].send("reap")
    state.actors["maintenance"].send("prune")
    drain()
    assert {t: r["passes"] for t, r in rows(pg).items()} == {"reap": 2, "prune": 2}
    run_maintenance(state, "reap")
    assert rows(pg)["reap"]["passes"] == 3

    # The CLI.
    runner = app.test_cli_runner()
    assert runner.invoke(args=["solidloop", "reap"]).exit_code == 0
    assert runner.invoke(args=["solidloop", "prune"]).exit_code == 0
    assert {t: r["passes"] for t, r in rows(pg).items()} == {"reap": 4, "prune": 3}
    assert all(r["last_ok"] for r in rows(pg).values())
