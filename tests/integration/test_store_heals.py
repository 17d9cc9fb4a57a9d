"""The reaper's repairs (loops/store/heals.py, run by maintenance/reaper.py's
``reap``): each case against what a dead worker or a lost job leaves
behind, one repair per loop however many reapers race."""

from __future__ import annotations

import threading
import time
import uuid

from sqlalchemy import select

from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Job, Loop, Message, ToolCall
from flask_solidloop.testing import drain as run

from ..support.support_app import SIDE_EFFECTS, Assistant
from .loop_states import running_loop, tool_phase


def test_reaper_requeues_an_expired_llm_turn_and_hides_its_shell(state, session, pg):
    loop_id, _ = running_loop(session)
    session.add(Message(loop_id=loop_id, role="assistant", status="processing",
                        is_hidden=True, content="partial"))
    session.commit()
    assert reap(state).healed == 0  # lease still live: nothing to do
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second'")
    report = reap(state)
    assert report.expired_llm == [loop_id]
    session.expire_all()
    loop = session.get(Loop, loop_id)
    assert (loop.status, loop.execution_token, loop.lease_expires_at) == ("queued", None, None)
    shell = session.scalars(select(Message).where(Message.role == "assistant")).one()
    assert (shell.status, shell.is_hidden) == ("failed", True)
    live = list(session.scalars(select(Job).where(Job.state == "queued")))
    assert [(j.actor_name, j.loop_id) for j in live] == [("solidloop.llm_turn", loop_id)]
    assert reap(state).healed == 0  # idempotent


def test_reaper_reclaims_one_stalled_tool_without_fencing_its_sibling(app, state, session,
                                                                      llm, pg):
    loop_id = tool_phase(app, session, llm, calls=2)
    calls = list(session.scalars(select(ToolCall).order_by(ToolCall.position)))
    dead_lease = uuid.uuid4()
    # call 0: claimed by a worker that died long ago; call 1: its job is still queued
    pg.execute("UPDATE solidloop_tool_calls SET lease_token = %s, "
               "leased_until = now() - interval '1 second' WHERE id = %s",
               (dead_lease, calls[0].id))
    pg.execute("UPDATE solidloop_jobs SET state = 'done' "
               "WHERE message->'args'->>0 = %s", (str(calls[0].id),))
    report = reap(state)
    assert report.stalled_tools == [calls[0].id]
    session.expire_all()
    reclaimed = session.get(ToolCall, calls[0].id)
    assert reclaimed.lease_token not in (None, dead_lease)
    assert reap(state).stalled_tools == []  # the new lease is live
    run(app)
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    assert len(SIDE_EFFECTS) == 2
    tool_messages = list(session.scalars(select(Message).where(Message.role == "tool")))
    assert sorted(m.tool_call_id for m in tool_messages) == sorted(c.id for c in calls)


def test_reaper_finishes_a_checkpointed_call_whose_continuation_was_dropped(
        app, state, session, llm, pg):
    loop_id = tool_phase(app, session, llm)
    call = session.scalars(select(ToolCall)).one()
    # the worker executed the tool, checkpointed, and died before answering
    pg.execute("UPDATE solidloop_tool_calls SET executed_at = now(), is_success = true, "
               "result = %s, lease_token = gen_random_uuid(), leased_until = now() + "
               "interval '1 hour', updated_at = now() - interval '1 hour' WHERE id = %s",
               ('{"content": [{"type": "text", "text": "1"}], "isError": false}', call.id))
    pg.execute("UPDATE solidloop_jobs SET state = 'done'")
    report = reap(state)
    assert report.dropped_tools == [call.id]
    run(app)
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"
    assert SIDE_EFFECTS == []  # the body never ran again: the checkpoint was restored
    tool_message = session.scalars(select(Message).where(Message.role == "tool")).one()
    assert tool_message.content == "1"


def test_reaper_reenqueues_a_tool_call_whose_job_was_lost(app, state, session, llm, pg):
    loop_id = tool_phase(app, session, llm)
    pg.execute("UPDATE solidloop_jobs SET state = 'dead'")
    pg.execute("UPDATE solidloop_tool_calls SET updated_at = now() - interval '1 hour'")
    assert reap(state).dropped_tools != []
    run(app)
    session.expire_all()
    assert session.get(Loop, loop_id).status == "completed"


def test_reaper_requeues_a_queued_loop_with_no_live_job(app, state, session, llm, pg):
    llm.script("stuck", {"content": "unstuck"})
    loop = Assistant.start(message="stuck in the queue")
    pg.execute("UPDATE solidloop_jobs SET state = 'dead'")
    assert reap(state).stuck_queued == []  # younger than SOLIDLOOP_QUEUED_REAP_THRESHOLD
    # Its age is queued_at, the moment it became queued (updated_at moves with
    # any update, and is not indexed: migration 0009).
    pg.execute("UPDATE solidloop_loops SET updated_at = now() - interval '1 hour'")
    assert reap(state).stuck_queued == []
    pg.execute("UPDATE solidloop_loops SET queued_at = now() - interval '1 hour'")
    assert reap(state).stuck_queued == [loop.id]
    assert reap(state).stuck_queued == []  # a live job exists now
    run(app)
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"


def test_reaper_fails_orphan_shells_on_paused_loops(state, session):
    loop_id, _ = running_loop(session)
    Assistant(loop_id).pause()
    session.add(Message(loop_id=loop_id, role="assistant", status="processing",
                        is_hidden=False, content="half"))
    session.commit()
    report = reap(state)
    assert len(report.orphan_shells) == 1
    session.expire_all()
    shell = session.scalars(select(Message).where(Message.role == "assistant")).one()
    assert (shell.status, shell.is_hidden) == ("failed", True)


def test_reaper_recovers_expired_broker_jobs(state, session, pg):
    Assistant.start(message="job lease")
    pg.execute("UPDATE solidloop_jobs SET state = 'running', lease_token = gen_random_uuid(), "
               "lease_until = now() - interval '1 second', attempts = 1")
    assert reap(state).expired_jobs == 1
    assert pg.execute("SELECT state FROM solidloop_jobs").fetchone() == ("queued",)


def test_concurrent_reapers_repair_each_loop_once(app, state, session, pg):
    ids = [running_loop(session)[0] for _ in range(20)]
    pg.execute("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1 second'")
    reports, errors = [], []

    def one_reaper():
        from ..support.support_app import create_app

        other = create_app()
        try:
            with other.app_context():
                reports.append(reap(other.extensions["solidloop"]))
        except Exception as exc:
            errors.append(exc)
        finally:
            other.extensions["solidloop"].broker.close()

    threads = [threading.Thread(target=one_reaper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    healed = sorted(i for r in reports for i in r.expired_llm)
    assert healed == sorted(ids)  # each loop exactly once across all reapers
    jobs = pg.execute("SELECT loop_id, count(*) FROM solidloop_jobs WHERE state = 'queued' "
                      "GROUP BY loop_id").fetchall()
    assert sorted(j[0] for j in jobs) == sorted(ids) and {j[1] for j in jobs} == {1}


def test_last_reaped_at_is_exposed(state):
    assert state.last_reaped_at is None
    reap(state)
    assert state.last_reaped_at is not None and state.last_reaped_at <= time.time()


def test_reaper_leaves_a_stalled_call_alone_while_a_job_for_it_is_queued(
        app, state, session, llm, pg):
    tool_phase(app, session, llm)
    call = session.scalars(select(ToolCall)).one()
    pg.execute("UPDATE solidloop_tool_calls SET lease_token = gen_random_uuid(), "
               "leased_until = now() - interval '1 second' WHERE id = %s", (call.id,))
    # its job is still queued (a backlog): it will claim the call when it runs
    assert reap(state).stalled_tools == []
    pg.execute("UPDATE solidloop_jobs SET state = 'done'")
    assert reap(state).stalled_tools == [call.id]


def test_reaper_reenqueues_a_lost_free_call_but_never_an_awaiting_one(app, state, session,
                                                                      llm, pg):
    from ..support.support_app import ShopAgent

    llm.script("refund and look", {"tool_calls": [
        {"name": "refund", "arguments": {"order": "1", "amount": 90}},
        {"name": "lookup_order", "arguments": {"order": "1"}}]})
    loop = ShopAgent.start(message="refund and look")
    run(app, queues=("solidloop_llm",))
    session.expire_all()
    assert session.get(Loop, loop.id).status == "running"  # the lookup's job is queued
    refund, lookup = session.scalars(select(ToolCall).order_by(ToolCall.position)).all()
    pg.execute("UPDATE solidloop_jobs SET state = 'dead' WHERE queue_name <> 'notifications'")
    pg.execute("UPDATE solidloop_tool_calls SET updated_at = now() - interval '1 hour'")
    assert reap(state).dropped_tools == [lookup.id]
    run(app, queues=("solidloop_llm", "solidloop_tool"))
    session.expire_all()
    assert session.get(Loop, loop.id).status == "waiting"
    assert session.get(ToolCall, refund.id).lease_token is None
    pg.execute("UPDATE solidloop_tool_calls SET updated_at = now() - interval '1 hour'")
    assert reap(state).healed == 0  # a waiting loop is left to its decision


def test_reaper_gives_a_wait_past_its_deadline_a_timeout_job_again(app, state, session, llm,
                                                                   pg):
    from ..support.support_app import ShopAgent

    llm.script("risky", {"tool_calls": [{"name": "risky", "arguments": {"note": "r"}}]})
    loop = ShopAgent.start(message="risky one")
    run(app, queues=("solidloop_llm",))
    (call,) = session.scalars(select(ToolCall)).all()
    assert reap(state).expired_waits == []  # its timeout job is queued
    pg.execute("UPDATE solidloop_jobs SET state = 'dead' "
               "WHERE actor_name = 'solidloop.wait_timeout'")
    assert reap(state).expired_waits == []  # not past its deadline yet (and the grace)
    pg.execute("UPDATE solidloop_tool_calls SET wait_deadline = now() - interval '1 hour'")
    assert reap(state).expired_waits == [call.id]
    assert reap(state).expired_waits == []  # its new job is live
    llm.script("before the approval's timeout", {"content": "Timed out."})
    run(app)
    session.expire_all()
    assert session.get(ToolCall, call.id).decided_by == "timeout"
    assert session.get(Loop, loop.id).status == "completed"


def test_a_claim_of_a_reaper_lease_runs_its_lease_from_the_claim(app, state, session, llm,
                                                                  pg):
    """The reaper's lease may have nearly lapsed while its job waited in the
    queue: the claim renews it, so the next reap does not take the call over
    from the live worker that just claimed it (found by the 1,000-loop chaos
    run: calls taken over three times with no fault behind them)."""
    from flask_solidloop.loops import store

    tool_phase(app, session, llm)
    call = session.scalars(select(ToolCall)).one()
    pg.execute("UPDATE solidloop_tool_calls SET lease_token = %s, lease_holder = 'w:1', "
               "leased_until = now() - interval '1 second' WHERE id = %s",
               (uuid.uuid4(), call.id))
    pg.execute("UPDATE solidloop_jobs SET state = 'done' WHERE state = 'queued'")
    assert reap(state).stalled_tools == [call.id]
    minted, loop_token = pg.execute(
        "SELECT t.lease_token, l.execution_token FROM solidloop_tool_calls t "
        "JOIN solidloop_loops l ON l.id = t.loop_id WHERE t.id = %s", (call.id,)).fetchone()
    # Its job waited: the minted lease is about to run out.
    pg.execute("UPDATE solidloop_tool_calls SET leased_until = now() + interval '50 ms' "
               "WHERE id = %s", (call.id,))
    session.expire_all()
    outcome, lease = store.claim_tool_call(state, session, session.get(ToolCall, call.id),
                                           loop_token, sequential=False, lease_seconds=30,
                                           reaper_lease_token=minted)
    session.commit()
    assert outcome is store.ToolClaim.CLAIMED and lease == minted
    left = pg.execute("SELECT extract(epoch FROM leased_until - now()) FROM "
                      "solidloop_tool_calls WHERE id = %s", (call.id,)).fetchone()[0]
    assert left > 25
    time.sleep(0.1)
    assert reap(state).stalled_tools == []  # the live claim keeps its call
