"""Retention on by default (issue 27, item 3), against the real database: what the
janitor's defaults delete, one test per rule of what no sweep deletes (rows of a
loop that has not ended, unfinished jobs, failed jobs inside their retention),
``flask solidloop prune --dry-run`` on a seeded database, and the workers'
janitor sweeping once per interval across processes. The same with real worker
processes: tests/acceptance/test_retention_workers.py."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

import pytest

from flask_solidloop.maintenance.janitor import prune, prune_if_due
from flask_solidloop.state import get_state
from flask_solidloop.testing import drain as run

from ..support import jobs_app
from ..support.jobs_app import default
from ..support.support_app import Assistant
from .loop_states import running_loop

DAY = 86400
#: Statuses of a loop that has not ended.
LIVE_STATUSES = ("init", "queued", "running", "waiting", "paused")


def count(pg, query: str, *params) -> int:
    return pg.execute(query, params).fetchone()[0]


def old_events(pg, loop_id: int | None, days: float, n: int = 1) -> None:
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload, created_at) "
               "SELECT %s, 'llm_request', '{}', now() - make_interval(secs => %s) "
               "FROM generate_series(1, %s)", (loop_id, days * DAY, n))


def done_job(pg, loop_id: int | None, days: float) -> None:
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state,"
               " loop_id, finished_at) VALUES ('solidloop_llm', 'solidloop.llm_turn', "
               "gen_random_uuid(), '{}', 'done', %s, now() - make_interval(secs => %s))",
               (loop_id, days * DAY))


def completed_loop(llm, app) -> int:
    llm.script("finish", {"content": "finished"})
    loop = Assistant.start(message="finish")
    run(app)
    return loop.id


def seed(pg, llm, app) -> dict[str, int]:
    """A database with something on each side of every default retention: a
    completed loop whose real jobs finished 8 days ago; old and young events of it
    and of no loop; inbound MCP sessions; expired and live results; and a running
    loop with 400-day-old rows (never deleted)."""
    done = completed_loop(llm, app)
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - interval '8 days' "
               "WHERE loop_id = %s", (done,))
    old_events(pg, done, 31, n=3)
    old_events(pg, done, 29, n=2)
    old_events(pg, None, 31)
    done_job(pg, done, 6)
    pg.execute("INSERT INTO solidloop_mcp_inbound_sessions (id, server_name, principal_label,"
               " protocol_version, created_at) VALUES "
               "('old', 'tools', 'p', '2025-06-18', now() - interval '25 hours'), "
               "('young', 'tools', 'p', '2025-06-18', now() - interval '23 hours')")
    pg.execute("INSERT INTO solidloop_results (key, value, expires_at) VALUES "
               "('gone', '1', now() - interval '1 second'), "
               "('kept', '2', now() + interval '1 hour')")
    live = running_loop_via_pg(pg, llm)
    return {"done": done, "live": live,
            "done_jobs": count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s "
                                   "AND finished_at < now() - interval '7 days'", done)}


def running_loop_via_pg(pg, llm) -> int:
    loop = Assistant.start(message="still going")
    pg.execute("UPDATE solidloop_loops SET status = 'running' WHERE id = %s", (loop.id,))
    pg.execute("UPDATE solidloop_jobs SET state = 'done', finished_at = now() - interval "
               "'400 days' WHERE loop_id = %s", (loop.id,))
    old_events(pg, loop.id, 400, n=2)
    return loop.id


def test_the_defaults_delete_what_is_past_its_retention(app, state, session, llm, pg):
    config = state.config
    assert (config.event_retention, config.finished_job_retention,
            config.mcp_inbound_session_retention) == (30 * DAY, 7 * DAY, DAY)
    seeded = seed(pg, llm, app)
    assert seeded["done_jobs"] >= 1
    report = prune(state)
    # 3 events of the completed loop and 1 of no loop past 30 days; its jobs past
    # 7 days; the session past a day; the expired result.
    assert (report.events, report.jobs, report.inbound_sessions, report.results) == (
        4, seeded["done_jobs"], 1, 1)
    assert count(pg, "SELECT count(*) FROM solidloop_events WHERE loop_id = %s AND "
                     "created_at < now() - interval '30 days'", seeded["done"]) == 0
    assert count(pg, "SELECT count(*) FROM solidloop_events WHERE loop_id = %s AND "
                     "created_at < now() - interval '28 days'", seeded["done"]) == 2
    assert count(pg, "SELECT count(*) FROM solidloop_events WHERE loop_id IS NULL") == 0
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s",
                 seeded["done"]) == 1  # the one that finished 6 days ago
    assert pg.execute("SELECT id FROM solidloop_mcp_inbound_sessions").fetchall() == [("young",)]
    assert pg.execute("SELECT key FROM solidloop_results").fetchall() == [("kept",)]
    # The running loop's 400-day-old rows are all there.
    assert count(pg, "SELECT count(*) FROM solidloop_events WHERE loop_id = %s",
                 seeded["live"]) == 2
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s",
                 seeded["live"]) >= 1
    assert prune(state).pruned == 0  # idempotent


@pytest.mark.parametrize("status", LIVE_STATUSES)
def test_rows_of_a_loop_not_ended_are_never_deleted(status, app, state, session, pg):
    loop_id, _ = running_loop(session)
    pg.execute("UPDATE solidloop_loops SET status = %s WHERE id = %s", (status, loop_id))
    old_events(pg, loop_id, 400, n=3)
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - interval '400 days' "
               "WHERE loop_id = %s", (loop_id,))
    done_job(pg, loop_id, 400)
    jobs = count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s", loop_id)
    state.config = dataclasses.replace(state.config, event_retention=1,
                                       finished_job_retention=1)

    report = prune(state)
    assert (report.events, report.jobs) == (0, 0)
    assert count(pg, "SELECT count(*) FROM solidloop_events WHERE loop_id = %s", loop_id) == 3
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s", loop_id) == jobs

    # The same rows go once the loop has ended: the guard is the loop's status.
    pg.execute("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s", (loop_id,))
    report = prune(state)
    assert (report.events, report.jobs) == (3, jobs)


HOST_QUEUES = ("default", "reports", "host_jobs")


def test_an_unfinished_job_is_never_deleted(japp, pg):
    queued = default.enqueue(jobs_app.record, "queued", 1, result_ttl=0)
    later = default.enqueue_in(timedelta(hours=1), jobs_app.record, "later", 2, result_ttl=0)
    finished = default.enqueue(jobs_app.record, "finished", 3, result_ttl=0)
    run(japp, queues=HOST_QUEUES, max_jobs=1)  # the first due job only
    assert queued.get_status() == "finished"
    # What a sweep sees at its worst: the live jobs' rows look ancient (a stale
    # expiry, a finished_at from an earlier life), as old as the finished one's.
    pg.execute("UPDATE solidloop_host_jobs SET expires_at = now() - interval '1 day' "
               "WHERE id IN (%s, %s)", (later.id, finished.id))
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - interval '400 days'")
    state = get_state(japp)
    state.config = dataclasses.replace(state.config, finished_job_retention=1)

    report = prune(state)
    assert report.host_jobs == 1  # the finished one (result_ttl=0)
    assert later.get_status() == "scheduled" and finished.get_status() == "queued"
    states = pg.execute("SELECT state, count(*) FROM solidloop_jobs "
                        "GROUP BY state ORDER BY state").fetchall()
    assert states == [("queued", 2)]  # the done delivery went; the queued ones stay
    assert run(japp, queues=HOST_QUEUES) == 1 and finished.get_status() == "finished"


def test_a_failed_job_inside_its_retention_is_never_deleted(japp, pg):
    kept = default.enqueue(jobs_app.flaky, "kept", 5)
    gone = default.enqueue(jobs_app.flaky, "gone", 5, failure_ttl=0)
    run(japp, queues=HOST_QUEUES, raise_errors=False)
    assert kept.get_status() == gone.get_status() == "failed"
    # Failed 364 days ago: inside the default failure TTL (a year) by a day.
    pg.execute("UPDATE solidloop_host_jobs SET ended_at = now() - interval '364 days', "
               "expires_at = now() + interval '1 day' WHERE id = %s", (kept.id,))
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - interval '400 days'")
    state = get_state(japp)
    state.config = dataclasses.replace(state.config, finished_job_retention=1)

    report = prune(state)
    assert report.host_jobs == 1  # the one with failure_ttl=0
    assert kept.get_status() == "failed" and "flaky attempt 1 of kept" in kept.exc_info
    assert default.failed_job_registry.get_job_ids() == [kept.id]
    # Both dead-lettered deliveries stay, however old: someone has to look at them.
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE state = 'dead'") == 2


def test_the_delivery_of_a_kept_rq_job_stays_with_it(japp, pg):
    """A job record read its args, attempts and start time from its delivery: a
    record kept for ever keeps its done delivery however old; an expired one
    takes its delivery with it in the same sweep."""
    kept = default.enqueue(jobs_app.record, "kept", 1, result_ttl=-1)
    gone = default.enqueue(jobs_app.record, "gone", 2, result_ttl=0)
    run(japp, queues=HOST_QUEUES)
    pg.execute("UPDATE solidloop_jobs SET finished_at = now() - interval '400 days'")
    report = prune(get_state(japp))
    assert (report.host_jobs, report.jobs) == (1, 1)
    assert kept.get_status() == "finished" and kept.args == ["kept", 1]
    assert kept.started_at is not None and kept.attempts == 1
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE message->'options'->>"
                     "'solidloop_job' = %s", gone.id) == 0


# -- flask solidloop prune --dry-run --------------------------------------------------

DRY_RUN = re.compile(r"^  (\w+) +(\d+)  (.+)$")


def dry_run_counts(output: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in map(DRY_RUN.match, output.splitlines()) if m}


def test_prune_dry_run_on_a_seeded_database_prints_what_would_go(app, state, session, llm,
                                                                  pg):
    seeded = seed(pg, llm, app)
    before = {t: count(pg, f"SELECT count(*) FROM {t}") for t in (
        "solidloop_events", "solidloop_jobs", "solidloop_mcp_inbound_sessions",
        "solidloop_results")}
    runner = app.test_cli_runner()

    preview = runner.invoke(args=["solidloop", "prune", "--dry-run"])
    assert preview.exit_code == 0, preview.output
    lines = preview.output.splitlines()
    total = 4 + seeded["done_jobs"] + 1 + 1
    assert lines[0] == (f"prune --dry-run: nothing deleted; a sweep now would delete "
                        f"{total} row(s):")
    assert lines[1:9] == [
        "  events                  4  wire-log events older than 30 days, of ended loops or "
        "of none (SOLIDLOOP_EVENT_RETENTION)",
        f"  jobs             {seeded['done_jobs']:>8}  done jobs finished more than 7 days ago, "
        "of ended loops or of none (SOLIDLOOP_FINISHED_JOB_RETENTION)",
        "  host_jobs               0  RQ-style jobs that ended and are past their result_ttl "
        "/ failure_ttl",
        "  results                 1  dramatiq results past their expiry",
        "  inbound_sessions        1  inbound MCP sessions created more than 1 day ago, with "
        "their events (SOLIDLOOP_MCP_INBOUND_SESSION_RETENTION)",
        "  workers                 0  worker rows stopped or silent for more than 1 day "
        "(SOLIDLOOP_WORKER_RETENTION)",
        "  spend                   0  subjects' ledger rows older than 31 days "
        "(SOLIDLOOP_SPEND_RETENTION, at least the subject budget's window)",
        "  loops                   0  none: SOLIDLOOP_LOOP_RETENTION is None (kept forever)"]
    assert lines[9].startswith("never deleted: loops not yet ended")
    assert len(lines) == 10
    # Nothing deleted, no pass recorded.
    assert {t: count(pg, f"SELECT count(*) FROM {t}") for t in before} == before
    assert count(pg, "SELECT count(*) FROM solidloop_maintenance_runs") == 0

    # A sweep then deletes exactly what the dry run counted.
    result = runner.invoke(args=["solidloop", "prune"])
    assert result.exit_code == 0, result.output
    deleted = dict(re.findall(r"(\w+)=(\d+)", result.output))
    assert {k: int(v) for k, v in deleted.items()} == dry_run_counts(preview.output)


def test_prune_dry_run_names_a_retention_of_none_and_refuses_every(app, state, llm, pg):
    completed_loop(llm, app)
    pg.execute("UPDATE solidloop_events SET created_at = now() - interval '999 days'")
    state.config = dataclasses.replace(state.config, event_retention=None)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["solidloop", "prune", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert ("  events                  0  none: SOLIDLOOP_EVENT_RETENTION is None "
            "(kept forever)") in result.output.splitlines()

    both = runner.invoke(args=["solidloop", "prune", "--dry-run", "--every", "60"])
    assert both.exit_code == 2 and "--dry-run prints once: drop --every" in both.output


# -- the workers' janitor -------------------------------------------------------------


def test_the_workers_janitor_sweeps_once_per_interval_across_processes(app, state, pg):
    """Every worker process wakes every SOLIDLOOP_JANITOR_INTERVAL; one that finds a
    sweep finished within 90% of it (by any process) skips, so many workers cost
    one sweep per interval, and a failed sweep is retried at the next wake-up."""
    assert state.config.janitor_interval == 300.0
    assert prune_if_due(state) is not None  # no sweep ever: due
    assert prune_if_due(state) is None  # another wake-up right after: skipped
    passes = "SELECT passes FROM solidloop_maintenance_runs WHERE task = 'prune'"
    assert count(pg, passes) == 1
    # Some process swept 271 s ago (more than 90% of 300 s): due again.
    pg.execute("UPDATE solidloop_maintenance_runs SET last_finished_at = now() - "
               "interval '271 seconds'")
    assert prune_if_due(state) is not None and count(pg, passes) == 2
    # The last sweep failed: due at once.
    pg.execute("UPDATE solidloop_maintenance_runs SET last_ok = false")
    assert prune_if_due(state) is not None and count(pg, passes) == 3
