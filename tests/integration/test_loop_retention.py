"""SOLIDLOOP_LOOP_RETENTION against the real database
(docs/decisions/0030-loop-retention.md): ended loops go with every row that
depends on them, in batches; loops not ended, or needed by a live job or tool
lease, stay; ``on_loop_archive`` hooks see each loop first and keep it by
raising; a resume racing the deletion on another connection finds the loop
either whole or gone. With real worker processes:
tests/acceptance/test_retention_workers.py."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text

from flask_solidloop import ArchivedLoop
from flask_solidloop.loops import control, store
from flask_solidloop.loops import sql as loop_sql
from flask_solidloop.maintenance.janitor import preview, prune, purge_loops
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant, solidloop
from .loop_states import running_loop
from .row_locks import loop_row_locked

DAY = 86400
#: Statuses of a loop that has not ended.
LIVE_STATUSES = ("init", "queued", "running", "waiting", "paused")
#: Tables whose rows go with their loop.
DEPENDENTS = ("solidloop_messages", "solidloop_tool_calls", "solidloop_events",
              "solidloop_stream_events", "solidloop_mcp_sessions")


def count(pg, query: str, *params):
    return pg.execute(query, params).fetchone()[0]


def rows_of(pg, loop_id: int) -> dict[str, int]:
    """The loop's rows in every table that depends on it, and its own."""
    found = {table: count(pg, f"SELECT count(*) FROM {table} WHERE loop_id = %s", loop_id)
             for table in DEPENDENTS}
    found["solidloop_loops"] = count(pg, "SELECT count(*) FROM solidloop_loops WHERE id = %s",
                                     loop_id)
    return found


def finished_loop(app, llm, pg, *, days: float = 2, fail: bool = False) -> int:
    """A loop that ran an LLM turn, a tool call and its final answer (or was
    stopped: failed) ``days`` ago, with an MCP session row."""
    llm.script("loop", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})
    loop = Assistant.start(message="loop please")
    if fail:
        assert control.stop(app.extensions["solidloop"], loop.id, reason="not wanted")
    run(app)
    pg.execute("INSERT INTO solidloop_mcp_sessions (loop_id, server_name, tools) "
               "VALUES (%s, 'remote', '[]')", (loop.id,))
    pg.execute("UPDATE solidloop_loops SET finished_at = now() - make_interval(secs => %s) "
               "WHERE id = %s", (days * DAY, loop.id))
    return loop.id


def retain(state, seconds: int | None = DAY, batch: int | None = None) -> None:
    changes: dict = {"loop_retention": seconds}
    if batch is not None:
        changes["loop_purge_batch_size"] = batch
    state.config = dataclasses.replace(state.config, **changes)


@pytest.fixture
def archive_hooks():
    """Hooks registered for one test (the extension's list is the session's)."""
    added: list = []

    def add(hook):
        solidloop.on_loop_archive(hook)
        added.append(hook)
        return hook

    yield add
    for hook in added:
        solidloop.loop_archive_hooks.remove(hook)


def test_ended_loops_go_with_every_row_and_nothing_else_does(app, state, llm, pg):
    completed = finished_loop(app, llm, pg)
    failed = finished_loop(app, llm, pg, fail=True)
    young = finished_loop(app, llm, pg, days=0.5)
    before = rows_of(pg, completed)
    # Something in every dependent table, so "0 after" means deleted.
    assert all(before.values()), before
    assert count(pg, "SELECT status FROM solidloop_loops WHERE id = %s", failed) == "failed"
    jobs = count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s", completed)
    assert jobs >= 1
    retain(state)

    assert preview(state).loops == 2  # the dry run counts what the sweep deletes
    report = prune(state)
    assert report.loops == 2
    for gone in (completed, failed):
        assert set(rows_of(pg, gone).values()) == {0}, rows_of(pg, gone)
    assert all(rows_of(pg, young).values())  # the young loop is whole
    # Done jobs are the done-jobs rule's (SOLIDLOOP_FINISHED_JOB_RETENTION).
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s",
                 completed) == jobs
    assert prune(state).loops == 0  # idempotent


def test_the_default_keeps_every_loop(app, state, llm, pg):
    old = finished_loop(app, llm, pg, days=3650)
    assert state.config.loop_retention is None
    assert prune(state).loops == 0
    assert preview(state).loops == 0
    assert rows_of(pg, old)["solidloop_loops"] == 1


@pytest.mark.parametrize("status", LIVE_STATUSES)
def test_a_loop_not_ended_is_never_deleted(status, app, state, session, pg):
    loop_id, _ = running_loop(session)
    # What a loop resumed long after it ended looks like: an old finished_at.
    pg.execute("UPDATE solidloop_loops SET status = %s, finished_at = now() - interval "
               "'400 days' WHERE id = %s", (status, loop_id))
    retain(state)
    assert prune(state).loops == 0
    assert rows_of(pg, loop_id)["solidloop_loops"] == 1
    # The guard is the status: the same loop goes once it has ended.
    pg.execute("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s", (loop_id,))
    assert prune(state).loops == 1


def test_an_ended_loop_a_live_job_or_tool_lease_needs_is_kept(app, state, llm, pg):
    queued = finished_loop(app, llm, pg)
    leased = finished_loop(app, llm, pg)
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, "
               "state, loop_id) VALUES ('solidloop_tool', 'solidloop.tool_call', "
               "gen_random_uuid(), '{}', 'queued', %s)", (queued,))
    pg.execute("UPDATE solidloop_tool_calls SET leased_until = now() + interval '1 minute' "
               "WHERE loop_id = %s", (leased,))
    retain(state)
    assert preview(state).loops == 0
    assert prune(state).loops == 0
    assert rows_of(pg, queued)["solidloop_loops"] == rows_of(pg, leased)["solidloop_loops"] == 1

    pg.execute("UPDATE solidloop_jobs SET state = 'done', finished_at = now() "
               "WHERE loop_id = %s AND state = 'queued'", (queued,))
    pg.execute("UPDATE solidloop_tool_calls SET leased_until = now() - interval '1 second' "
               "WHERE loop_id = %s", (leased,))
    assert prune(state).loops == 2


def test_batches_take_the_oldest_first_each_in_its_own_transaction(
        app, state, session, llm, pg, archive_hooks):
    loops = [finished_loop(app, llm, pg, days=10 - i) for i in range(5)]
    # One batch of two: the two that ended first.
    done = store.purge_ended_loops(session, age=timedelta(days=1), batch=2)
    assert (done.taken, done.deleted) == (2, 2)
    assert [rows_of(pg, lp)["solidloop_loops"] for lp in loops] == [0, 0, 1, 1, 1]

    # A pass with hooks, batches of two: each batch its own transaction.
    transactions: list[tuple[int, int]] = []
    archive_hooks(lambda archived, s: transactions.append(
        (archived.id, s.execute(text("SELECT txid_current()")).scalar_one())))
    retain(state, batch=2)
    assert purge_loops(state).deleted == 3
    assert [loop_id for loop_id, _ in transactions] == loops[2:]
    txids = [txid for _, txid in transactions]
    assert txids[0] == txids[1] != txids[2]
    assert count(pg, "SELECT count(*) FROM solidloop_loops") == 0


def test_a_hook_gets_the_loop_and_its_writes_commit_with_the_delete(
        app, state, llm, pg, archive_hooks):
    pg.execute("CREATE TABLE IF NOT EXISTS retention_archive "
               "(loop_id bigint PRIMARY KEY, body jsonb)")
    pg.execute("TRUNCATE retention_archive")
    seen: list[ArchivedLoop] = []

    def copy(archived: ArchivedLoop, session) -> None:
        import json

        seen.append(archived)
        session.execute(text("INSERT INTO retention_archive VALUES (:id, :body)"),
                        {"id": archived.id, "body": json.dumps(archived.to_dict())})

    archive_hooks(copy)
    loop_id = finished_loop(app, llm, pg)
    retain(state)
    assert prune(state).loops == 1

    (archived,) = seen
    assert archived.loop["id"] == loop_id and archived.loop["status"] == "completed"
    assert [m["role"] for m in archived.messages] == [
        "system", "user", "assistant", "tool", "assistant"]
    assert archived.messages[-1]["content"] == "three"
    (call,) = archived.tool_calls
    assert call["name"] == "calc__add" or call["tool_name"] == "add"
    assert call["arguments"] == {"a": 1, "b": 2}
    # The copy committed with the delete.
    body = pg.execute("SELECT body FROM retention_archive WHERE loop_id = %s",
                      (loop_id,)).fetchone()[0]
    assert body["loop"]["id"] == loop_id and len(body["messages"]) == 5
    assert isinstance(body["loop"]["finished_at"], str)
    assert rows_of(pg, loop_id)["solidloop_loops"] == 0


def test_a_hook_that_raises_keeps_its_loop_and_the_rest_go(
        app, state, llm, pg, archive_hooks, caplog):
    pg.execute("CREATE TABLE IF NOT EXISTS retention_archive "
               "(loop_id bigint PRIMARY KEY, body jsonb)")
    pg.execute("TRUNCATE retention_archive")
    loops = [finished_loop(app, llm, pg, days=10 - i) for i in range(4)]
    refused = {loops[0], loops[2]}

    def copy(archived: ArchivedLoop, session) -> None:
        session.execute(text("INSERT INTO retention_archive VALUES (:id, '{}')"),
                        {"id": archived.id})
        if archived.id in refused:
            raise RuntimeError(f"storage refused loop {archived.id}")

    archive_hooks(copy)
    retain(state, batch=3)
    with caplog.at_level(logging.WARNING, logger="flask_solidloop.janitor"):
        report = prune(state)
    assert (report.loops, report.loops_kept) == (2, 2)
    assert {lp for lp in loops if rows_of(pg, lp)["solidloop_loops"]} == refused
    # Only the copies of the deleted loops committed: the refusing hook's
    # writes were undone with its savepoint.
    archived = {lp for (lp,) in pg.execute("SELECT loop_id FROM retention_archive")}
    assert archived == set(loops) - refused
    # One line for the pass, not one per loop.
    lines = [r for r in caplog.records if r.name == "flask_solidloop.janitor"
             and r.levelno == logging.WARNING]
    assert len(lines) == 1
    assert "2 loop(s)" in lines[0].getMessage()
    assert f"loop {loops[0]}" in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage()

    # The next pass tries them again.
    refused.clear()
    assert prune(state).loops == 2
    assert count(pg, "SELECT count(*) FROM solidloop_loops") == 0


# -- a resume racing the deletion, on two connections -------------------------------


def test_a_resume_that_holds_the_loop_wins_and_the_loop_stays_whole(app, state, llm, pg,
                                                                     database_url):
    """The resume took the loop row first (it waits on a table lock the test
    holds, after its LOCK_LOOP): the purge skips the loop, and once the resume
    commits, the loop is live and keeps every row."""
    loop_id = finished_loop(app, llm, pg)
    before = rows_of(pg, loop_id)
    retain(state)
    outcome: dict = {}
    with psycopg.connect(libpq_url(database_url)) as blocker:
        blocker.execute("LOCK TABLE solidloop_messages IN SHARE MODE")

        def resume() -> None:
            with app.app_context():
                try:
                    outcome["value"] = control.resume(state, loop_id, message="once more")
                finally:
                    state.db.session.remove()

        thread = threading.Thread(target=resume)
        thread.start()
        assert loop_row_locked(pg, loop_id), "the resume never took the loop row"
        assert thread.is_alive()
        assert purge_loops(state).deleted == 0  # skipped, and not blocked
        blocker.rollback()
        thread.join(10)
    assert outcome == {"value": True}
    assert count(pg, "SELECT status FROM solidloop_loops WHERE id = %s", loop_id) == "queued"
    assert purge_loops(state).deleted == 0
    after = rows_of(pg, loop_id)
    assert after["solidloop_messages"] == before["solidloop_messages"] + 1
    assert {k: v for k, v in after.items() if k not in (
        "solidloop_messages", "solidloop_stream_events")} == {
        k: v for k, v in before.items() if k not in (
            "solidloop_messages", "solidloop_stream_events")}


def test_a_resume_that_waits_for_the_purge_finds_no_loop(app, state, llm, pg,
                                                         archive_hooks):
    """The purge took the loop row first (its hook holds the batch open): the
    resume waits for the row, then finds no loop, writes nothing and enqueues
    nothing; the loop is gone whole."""
    loop_id = finished_loop(app, llm, pg)
    release = threading.Event()
    in_hook = threading.Event()

    def slow_copy(archived: ArchivedLoop, session) -> None:
        in_hook.set()
        assert release.wait(20)

    archive_hooks(slow_copy)
    retain(state)
    purged: dict = {}

    def purge() -> None:
        with app.app_context():
            try:
                purged["value"] = purge_loops(state).deleted
            finally:
                state.db.session.remove()

    purger = threading.Thread(target=purge)
    purger.start()
    assert in_hook.wait(20)
    resumed: dict = {}

    def resume() -> None:
        with app.app_context():
            try:
                resumed["value"] = control.resume(state, loop_id, message="once more")
            except Exception as exc:  # reported to the test
                resumed["error"] = exc
            finally:
                state.db.session.remove()

    resumer = threading.Thread(target=resume)
    resumer.start()
    deadline = time.monotonic() + 10
    # A resume that may resume a paused tree locks the tree first (LOCK_TREE),
    # then the loop (LOCK_LOOP): either statement waits on the purge's lock.
    while time.monotonic() < deadline and not count(
            pg, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND (starts_with(query, %s) OR starts_with(query, %s))",
            loop_sql.LOCK_LOOP.split(" WHERE")[0], loop_sql.LOCK_TREE.split(" WHERE")[0]):
        time.sleep(0.01)
    waited = time.monotonic() < deadline
    release.set()
    purger.join(20)
    resumer.join(20)
    assert waited, "the resume never waited for the purge's row lock"
    assert purged == {"value": 1}
    assert resumed == {"value": False}  # no loop to resume: nothing written
    assert set(rows_of(pg, loop_id).values()) == {0}
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE loop_id = %s "
                     "AND state IN ('queued', 'running')", loop_id) == 0


# -- readers of a deleted loop --------------------------------------------------------


def test_readers_of_a_deleted_loop_say_so(app, state, llm, pg):
    from flask_solidloop import Agent, InvalidArgumentError

    loop_id = finished_loop(app, llm, pg)
    retain(state)
    assert prune(state).loops == 1
    with pytest.raises(InvalidArgumentError, match=f"there is no loop {loop_id}"):
        solidloop.events(loop_id)
    with pytest.raises(InvalidArgumentError, match="SOLIDLOOP_LOOP_RETENTION deleted it"):
        Agent(loop_id).events()
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        Agent(loop_id).result()
    with app.test_request_context():
        from werkzeug.exceptions import NotFound

        with pytest.raises(NotFound):
            solidloop.sse_response(loop_id)
    # The admin's pages of the loop answer a clean 404 (its live stream too,
    # so the browser's EventSource stops reconnecting).
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    client = app.test_client()
    for path in ("", "/regions", "/stream"):
        response = client.get(f"/admin/loops/{loop_id}{path}")
        assert response.status_code == 404, (path, response.status_code)
    # The other pages render with the loop gone (its done jobs are left).
    for page in ("/admin/", "/admin/loops", "/admin/jobs", "/admin/approvals", "/admin/workers"):
        assert client.get(page).status_code == 200, page


# -- the scan, and the operators' command ---------------------------------------------


def test_a_pass_reads_ended_loops_through_their_index(pg):
    """Over many loops, most of them recent or live, a batch's scan, the dry
    run's count and the delete read loops through ix_solidloop_loops_ended or
    the primary key, under custom and generic plans: never a sequential scan."""
    from datetime import UTC, datetime

    from .test_indexes import assert_uses, plans

    pg.execute("INSERT INTO solidloop_loops (agent_name, status, finished_at) "
               "SELECT 'assistant', CASE WHEN i % 10 = 0 THEN 'running' "
               "WHEN i % 7 = 0 THEN 'failed' ELSE 'completed' END, "
               "CASE WHEN i % 10 = 0 THEN NULL "
               "ELSE now() - make_interval(secs => i) END "
               "FROM generate_series(1, 20000) AS i")
    pg.execute("VACUUM ANALYZE solidloop_loops")
    params = {"age": "5 hours", "batch": 100, "after_at": datetime(1900, 1, 1, tzinfo=UTC),
              "after_id": 0}
    for statement in (loop_sql.PURGE_ENDED, loop_sql.LOCK_ENDED, loop_sql.COUNT_ENDED):
        for plan in plans(pg, statement, params if "after_at" in statement
                          else {"age": "5 hours"}):
            assert_uses(plan, "ix_solidloop_loops_ended", "solidloop_loops")
    for plan in plans(pg, loop_sql.DELETE_ENDED, {"ids": [1, 2, 3], "age": "5 hours"}):
        assert_uses(plan, "pk_solidloop_loops", "solidloop_loops")


def test_operators_count_then_purge_loops_from_the_command_line(app, state, llm, pg):
    loops = [finished_loop(app, llm, pg, days=3) for _ in range(2)]
    young = finished_loop(app, llm, pg, days=0.5)
    runner = app.test_cli_runner()

    kept = runner.invoke(args=["solidloop", "prune", "--loops", "--dry-run"])
    assert kept.exit_code == 0, kept.output
    assert ("  loops                   0  none: SOLIDLOOP_LOOP_RETENTION is None "
            "(kept forever)") in kept.output.splitlines()

    counted = runner.invoke(args=["solidloop", "prune", "--loops", "--dry-run",
                                  "--loop-retention", str(DAY)])
    assert counted.exit_code == 0, counted.output
    lines = counted.output.splitlines()
    assert lines[0] == ("prune --dry-run: nothing deleted; a sweep now would delete "
                        "2 loop(s), each with its rows:")
    assert lines[1] == ("  loops                   2  loops that ended more than 1 day ago, "
                        "with their messages, tool calls and events (SOLIDLOOP_LOOP_RETENTION)")
    assert count(pg, "SELECT count(*) FROM solidloop_loops") == 3  # nothing deleted

    purged = runner.invoke(args=["solidloop", "prune", "--loops", "--loop-retention", str(DAY)])
    assert purged.exit_code == 0, purged.output
    assert purged.output.startswith("prune: loops=2 kept_by_hooks=0 ")
    assert [rows_of(pg, lp)["solidloop_loops"] for lp in (*loops, young)] == [0, 0, 1]

    bad = runner.invoke(args=["solidloop", "prune", "--loops", "--loop-retention", "0"])
    assert bad.exit_code == 2 and "--loop-retention takes seconds > 0" in bad.output


def test_a_hook_is_registered_by_decorator_or_constructor_and_must_be_callable():
    from flask_solidloop import InvalidArgumentError, SolidLoop

    def copy(archived, session) -> None:
        pass

    assert SolidLoop(on_loop_archive=copy).loop_archive_hooks == [copy]
    extension = SolidLoop()
    assert extension.on_loop_archive(copy) is copy and extension.loop_archive_hooks == [copy]
    with pytest.raises(InvalidArgumentError, match="must decorate a function hook"):
        extension.on_loop_archive("not a function")  # type: ignore[arg-type]


def test_a_late_job_of_a_deleted_loop_does_nothing(app, state, llm, pg):
    """A dead-lettered job requeued after its loop was deleted (its turn, its
    tool call) runs to nothing: no error, no row written."""
    loop_id = finished_loop(app, llm, pg)
    (call_id,) = [r[0] for r in pg.execute(
        "SELECT id FROM solidloop_tool_calls WHERE loop_id = %s", (loop_id,))]
    retain(state)
    assert prune(state).loops == 1
    state.actors["llm_turn"].send(loop_id)
    state.actors["tool_call"].send(call_id, "00000000-0000-0000-0000-000000000000")
    assert run(app) == 2  # an actor that raised would raise here (raise_errors)
    assert set(rows_of(pg, loop_id).values()) == {0}
    assert count(pg, "SELECT count(*) FROM solidloop_jobs WHERE state <> 'done'") == 0
