"""The lease renewer, the janitor, and the turn's end under a moved fence, against the
real database (the reaper's cases: test_store_heals.py; the loop controls:
test_store_commands.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import func, select, text, update

from flask_solidloop.leases import APPLICATION_NAME, LeaseRenewer
from flask_solidloop.maintenance.janitor import prune
from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Event, Loop, Message, ToolCall
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant
from .loop_states import running_loop


def lease_of(pg, loop_id):
    return pg.execute("SELECT lease_expires_at - now() FROM solidloop_loops WHERE id = %s",
                      (loop_id,)).fetchone()[0]


# -- the renewer ------------------------------------------------------------------------


def test_renewer_extends_a_registered_lease(state, session, pg):
    loop_id, token = running_loop(session, lease_seconds=2)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        reg = renewer.register(loop_id, token, lease_seconds=30, ceiling_seconds=3600)
        renewer.renew_once()
        assert lease_of(pg, loop_id) > timedelta(seconds=25)
        assert not reg.lost()
    finally:
        renewer.stop()
    assert not renewer.running


def test_renewer_cadence_follows_the_smallest_lease(state):
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    renewer.register(1, uuid.uuid4(), lease_seconds=40, ceiling_seconds=99)
    assert renewer.interval() == 10
    renewer.register(2, uuid.uuid4(), lease_seconds=2, ceiling_seconds=99)
    assert renewer.interval() == 1.0  # never under a second
    renewer.stop()


def test_rotated_token_marks_lost_but_a_cleared_lease_does_not(state, session, pg):
    rotated_id, rotated_token = running_loop(session)
    cleared_id, cleared_token = running_loop(session)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        rotated = renewer.register(rotated_id, rotated_token, lease_seconds=30,
                                   ceiling_seconds=3600)
        cleared = renewer.register(cleared_id, cleared_token, lease_seconds=30,
                                   ceiling_seconds=3600)
        pg.execute("UPDATE solidloop_loops SET execution_token = gen_random_uuid() "
                   "WHERE id = %s", (rotated_id,))
        # our own commit entered the tool phase: lease NULL on purpose
        pg.execute("UPDATE solidloop_loops SET lease_expires_at = NULL WHERE id = %s",
                   (cleared_id,))
        renewer.renew_once()
        assert rotated.lost()
        assert not cleared.lost()
        # and the cleared lease was not revived
        assert pg.execute("SELECT lease_expires_at FROM solidloop_loops WHERE id = %s",
                          (cleared_id,)).fetchone()[0] is None
    finally:
        renewer.stop()


def test_a_turn_that_ended_is_not_logged_as_taken_over(state, session, pg, caplog):
    """A renewal that runs between a turn's last commit and the release of its
    registration finds the lease gone: the turn ended, nobody took it over."""
    ended_id, ended_token = running_loop(session)
    taken_id, taken_token = running_loop(session)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        ended = renewer.register(ended_id, ended_token, lease_seconds=30, ceiling_seconds=3600)
        taken = renewer.register(taken_id, taken_token, lease_seconds=30, ceiling_seconds=3600)
        # The turn's own end (FINISH_TURN completing the loop) ...
        pg.execute("UPDATE solidloop_loops SET status = 'completed', execution_token = NULL, "
                   "lease_expires_at = NULL WHERE id = %s", (ended_id,))
        # ... and a takeover (the reaper's expired_llm: queued, generation cleared).
        pg.execute("UPDATE solidloop_loops SET status = 'queued', execution_token = NULL, "
                   "lease_expires_at = NULL WHERE id = %s", (taken_id,))
        with caplog.at_level("DEBUG", logger="flask_solidloop.renewer"):
            renewer.renew_once()
        assert ended.lost() and taken.lost()  # neither turn may write any more
        lines = [r.getMessage() for r in caplog.records]
        assert f"loop {ended_id}: its turn ended; its lease has ended" in lines
        assert f"loop {taken_id}: lease lost (taken over)" in lines
        assert f"loop {ended_id}: lease lost (taken over)" not in lines
    finally:
        renewer.stop()


def test_leak_ceiling_drops_a_registration(state, session):
    loop_id, token = running_loop(session)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        reg = renewer.register(loop_id, token, lease_seconds=30, ceiling_seconds=0.05)
        time.sleep(0.1)
        renewer.renew_once()
        assert not renewer.is_registered(reg)
        assert not reg.lost()  # dropped, not lost: the lease simply lapses
    finally:
        renewer.stop()


KILL_RENEWER = ("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database()")


class database_refuses_connections:
    """ALTER DATABASE ... ALLOW_CONNECTIONS false: nobody may open a new connection."""

    def __init__(self, pg):
        self.name = pg.execute("SELECT current_database()").fetchone()[0]
        info = pg.info
        self.admin = psycopg.connect(host=info.host, port=info.port, user=info.user,
                                     dbname="postgres", autocommit=True)

    def __enter__(self):
        self.admin.execute(f'ALTER DATABASE "{self.name}" WITH ALLOW_CONNECTIONS false')

    def __exit__(self, *exc):
        self.admin.execute(f'ALTER DATABASE "{self.name}" WITH ALLOW_CONNECTIONS true')
        self.admin.close()


def test_a_killed_renewer_connection_is_replaced_without_losing_turns(state, session, pg):
    loop_id, token = running_loop(session, lease_seconds=2)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        reg = renewer.register(loop_id, token, lease_seconds=30, ceiling_seconds=3600)
        renewer.renew_once()
        assert pg.execute(KILL_RENEWER, (APPLICATION_NAME,)).fetchall()
        renewer.renew_once()  # finds the connection dead, reconnects, renews
        assert not reg.lost()
        assert lease_of(pg, loop_id) > timedelta(seconds=25)
    finally:
        renewer.stop()


def test_a_renewer_that_cannot_reconnect_marks_lost_only_leases_that_may_have_lapsed(
        state, session, pg):
    first = running_loop(session)
    second = running_loop(session)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        regs = [renewer.register(i, t, lease_seconds=30, ceiling_seconds=3600)
                for i, t in (first, second)]
        renewer.renew_once()
        with database_refuses_connections(pg):
            assert pg.execute(KILL_RENEWER, (APPLICATION_NAME,)).fetchall()
            renewer.renew_once()
            # Renewed a moment ago: both leases still hold in the database.
            assert not any(r.lost() for r in regs) and renewer.errors == 1
            # The outage outlasts the first lease (its last renewal is older than
            # it): that one may have lapsed, and is lost; the other is kept.
            regs[0].renewed_at -= 30
            renewer.renew_once()
        assert (regs[0].lost(), regs[1].lost()) == (True, False)
        assert renewer.errors == 2
        # once the database takes connections again, new turns renew normally
        third = running_loop(session)
        reg = renewer.register(*third, lease_seconds=30, ceiling_seconds=3600)
        renewer.renew_once()
        assert not reg.lost()
    finally:
        renewer.stop()


def test_one_renewer_per_process_even_under_a_race(state):
    seen = []
    barrier = threading.Barrier(8)

    def grab():
        barrier.wait()
        seen.append(state.renewer())

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in seen}) == 1
    state.stop_renewer()
    assert not seen[0].running


def test_turn_yields_when_the_renewer_loses_its_lease_and_the_reaper_heals(
        app, state, session, llm, pg):
    """The renewer's connection is killed mid-request and cannot come back: the
    turn writes nothing, and the reaper recovers the loop once the lease lapses."""

    def kill_renewer_then_answer(body):
        renewer = state.renewer()
        renewer.renew_once()  # the renewer's connection is open and renewing
        with database_refuses_connections(pg):
            pg.execute(KILL_RENEWER, (APPLICATION_NAME,))
            # As if the outage had outlasted the lease: the last good renewal is
            # older than it, so the lease may have lapsed.
            for registration in list(renewer._registrations.values()):
                registration.renewed_at -= registration.lease_seconds
            renewer.renew_once()  # the tick that cannot renew
        return {"content": "too late"}

    llm.script("renewer", {"content": "second try"})
    llm.script("renewer", kill_renewer_then_answer, times=1)  # newest first: runs first
    loop = Assistant.start(message="renewer test")
    run(app)
    session.expire_all()
    row = session.get(Loop, loop.id)
    assert row.status == "running"  # nothing written by the lost turn
    assert [m.status for m in session.scalars(
        select(Message).where(Message.role == "assistant"))] == ["processing"]
    # its lease lapses; the reaper rotates the generation and requeues it
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second'")
    report = reap(state)
    assert report.expired_llm == [loop.id]
    run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    visible = [m.content for m in session.scalars(
        select(Message).where(Message.role == "assistant", Message.is_hidden.is_(False)))]
    assert visible == ["second try"]


def test_a_renewer_blip_mid_request_costs_nothing(app, state, session, llm, pg):
    def blip_then_answer(body):
        state.renewer().renew_once()
        pg.execute(KILL_RENEWER, (APPLICATION_NAME,))
        state.renewer().renew_once()
        return {"content": "kept"}

    llm.script("blip", blip_then_answer)
    loop = Assistant.start(message="blip")
    run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


# -- the reaper -------------------------------------------------------------------------


# -- the janitor ------------------------------------------------------------------------


def test_janitor_keeps_everything_when_each_retention_is_none(state, session, llm):
    """``None`` keeps forever: with every retention None, 999-day-old events and
    done jobs of a completed loop stay. (The defaults: test_retention.py.)"""
    llm.script("keep", {"content": "kept"})
    Assistant.start(message="keep")
    run(state.app)
    session.execute(update(Event).values(created_at=func.now() - timedelta(days=999)))
    session.execute(text("UPDATE solidloop_jobs SET finished_at = now() - interval '999 days'"))
    session.commit()
    state.config = dataclasses.replace(state.config, event_retention=None,
                                       finished_job_retention=None)
    report = prune(state)
    assert (report.events, report.jobs) == (0, 0)
    assert session.scalar(select(func.count()).select_from(Event)) > 0
    assert state.last_pruned_at is not None


def test_janitor_prunes_in_batches(app, session, pg):
    from ..support.support_app import create_app

    other = create_app(SOLIDLOOP_EVENT_RETENTION=3600, SOLIDLOOP_FINISHED_JOB_RETENTION=60,
                       SOLIDLOOP_JANITOR_BATCH_SIZE=7)
    other_state = other.extensions["solidloop"]
    loop_id, _ = running_loop(session)
    pg.execute("UPDATE solidloop_loops SET status = 'completed' WHERE id = %s", (loop_id,))
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload, created_at) "
               "SELECT %s, 'llm_request', '{}', now() - interval '2 hours' "
               "FROM generate_series(1, 30)", (loop_id,))
    pg.execute("INSERT INTO solidloop_events (loop_id, kind, payload) VALUES (%s, 'x', '{}')",
               (loop_id,))
    pg.execute("UPDATE solidloop_jobs SET state = 'done', finished_at = now() - interval '1 hour'")
    pg.execute("INSERT INTO solidloop_jobs (queue_name, actor_name, message_id, message, state,"
               " finished_at) VALUES ('solidloop_llm', 'x', gen_random_uuid(), '{}', 'dead', "
               "now() - interval '9 hours')")
    try:
        with other.app_context():
            report = prune(other_state)
    finally:
        other_state.broker.close()
    assert report.events == 30 and report.jobs == 1
    assert pg.execute("SELECT count(*) FROM solidloop_events").fetchone() == (1,)
    assert pg.execute("SELECT state FROM solidloop_jobs").fetchall() == [("dead",)]


# -- loop controls ----------------------------------------------------------------------


def test_a_slow_healthy_tool_keeps_its_lease_and_runs_once(app, state, session, llm, pg):
    """Longer than its lease, but its worker is alive: the renewer keeps it."""
    from flask_solidloop import Agent, Toolset

    from ..support.support_app import llm_settings, solidloop

    slow = Toolset("slow")
    runs = []

    @slow.tool
    def crawl() -> str:
        runs.append(1)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the reaper keeps looking meanwhile
            assert reap(state).stalled_tools == []
            time.sleep(0.3)
        return "crawled"

    class Slow(Agent):
        mcps = [{"name": "slow", "toolset": slow}]

        def llm(self):
            return llm_settings()

    solidloop.agent("slow")(Slow)
    # a 4 s liveness lease, renewed about every second (3 s of slack for a late
    # renewal on a loaded machine), outlived by the 5 s tool
    object.__setattr__(state, "config", dataclasses.replace(state.config, liveness_ttl=4.0))
    llm.script("crawl", {"tool_calls": [{"name": "crawl", "arguments": {}}]})
    llm.script("crawled", {"content": "done"})
    loop = Slow.start(message="crawl")
    run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    assert runs == [1]


@pytest.mark.parametrize("alone", [False, True], ids=["in-a-transaction", "autocommit"])
def test_a_turn_end_after_the_loop_changed_hands_writes_nothing(state, session, alone):
    """The turn's end is one fenced statement for the loop, its shell and its
    wire event: when the generation moved on during the request, none of them
    (nor a tool call) is written. Alone (a final answer, nothing read since the
    last commit) the statement is its own transaction; the fence holds the same."""
    from flask_solidloop.errors import LostLeaseError
    from flask_solidloop.llm.types import AssistantTurn, Usage
    from flask_solidloop.loops import store
    from flask_solidloop.wire import WireRecord

    loop_id, token = running_loop(session)
    shell_id = store.open_shell(session, loop_id, token)
    # Another generation takes the loop while the request is out.
    session.execute(update(Loop).where(Loop.id == loop_id).values(execution_token=uuid.uuid4()))
    session.commit()
    steps_before = session.get(Loop, loop_id).step_count
    wire = WireRecord(url="http://llm/v1", request_headers={}, request_body={"model": "m"},
                      status=200, response_body={"ok": True})
    call = store.NewToolCall(call_id="c1", name="add", arguments_raw='{"a": 1}',
                             arguments={"a": 1})
    if alone:
        session.commit()
    with pytest.raises(LostLeaseError):
        store.finish_llm_turn(
            state, session, loop_id=loop_id, token=token, shell_id=shell_id,
            response=AssistantTurn(content="late", tool_calls=[],
                                   finish_reason="stop" if alone else "tool_calls",
                                   usage=Usage(input_tokens=3, output_tokens=1)),
            meta={}, turn_cost=None, calls=[] if alone else [call], wire=wire,
            sequential=False, adopt=False)
    assert session.get(Loop, loop_id).status == "running"  # not completed either
    session.expire_all()
    shell = session.get(Message, shell_id)
    assert shell.status == "processing" and shell.content == ""
    assert session.get(Loop, loop_id).step_count == steps_before
    assert session.scalars(select(Event).where(Event.loop_id == loop_id)).all() == []
    assert session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)).all() == []
