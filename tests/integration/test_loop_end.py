"""``@solidloop.on_loop_end`` runs inside the transaction that ends a loop
(docs/decisions/0021-tool-writes-and-loop-ends.md, item 2), and
``Agent(loop).result()`` reads the final answer. Real PostgreSQL, the real
LLM emulator, the in-process drain."""

from __future__ import annotations

import uuid

import pytest

from flask_solidloop import Agent, InvalidArgumentError, LoopFailedError
from flask_solidloop.loops import store
from flask_solidloop.models import Loop

from ..support.support_app import llm_settings, solidloop

ENDED: list[tuple[int, str, str | None]] = []


@solidloop.actor(queue_name="loop_endings")
def notify_owner(loop_id: int) -> None:
    """The host's notification job (not run here: its enqueued row is the point)."""


@solidloop.agent("ending")
class Ending(Agent):
    system_prompt = "You answer."

    def llm(self) -> dict:
        return llm_settings()


@solidloop.agent("ending_other")
class OtherAgent(Ending):
    pass


@pytest.fixture
def hooks():
    """Hooks registered for one test (the extension's list is the app's for
    the whole session)."""
    added: list = []

    def add(hook, agent=None):
        before = len(solidloop.loop_end_hooks)
        solidloop.on_loop_end(agent=agent)(hook)
        added.extend(solidloop.loop_end_hooks[before:])

    ENDED.clear()
    yield add
    for entry in added:
        solidloop.loop_end_hooks.remove(entry)


def record_and_notify(loop, session):
    ENDED.append((loop.id, loop.status, loop.error_message))
    notify_owner.send_with_options(args=(loop.id,), session=session)


def notification_jobs(pg, loop_id):
    """The notification jobs enqueued for the loop: (id, xmin) pairs."""
    return pg.execute("SELECT id, xmin::text FROM solidloop_jobs WHERE actor_name = "
                      "'notify_owner' AND message->'args' = %s::jsonb",
                      (f"[{loop_id}]",)).fetchall()


def test_a_completing_loop_runs_the_hook_in_its_final_commit(app, session, llm, drain, pg,
                                                             hooks):
    hooks(record_and_notify, agent="ending")
    llm.script("hello", {"content": "hi there"})
    loop = Ending.start(message="hello")
    drain()
    assert [(loop.id, "completed", None)] == ENDED
    assert len(notification_jobs(pg, loop.id)) == 1
    assert Ending(loop.id).result() == "hi there"


@pytest.fixture
def completion_commit_fails_once(pg, session):
    """The first COMMIT that completes a loop fails (a deferred trigger raises a
    serialization failure at COMMIT, after the hook wrote): all of that
    transaction is undone. The sequence's count survives the rollback."""
    from ..support.db_faults import failing_once

    with failing_once(pg, "loop_end_fail_once", table="solidloop_loops",
                      when="NEW.status = 'completed'",
                      trigger="CREATE CONSTRAINT TRIGGER {name} AFTER UPDATE ON {table} "
                              "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                              "EXECUTE FUNCTION {name}()"):
        yield
        session.rollback()  # its read locks would hold the DROP up


def test_the_hooks_job_commits_with_the_ending_or_not_at_all(
        app, session, llm, drain, pg, hooks, completion_commit_fails_once, caplog):
    hooks(record_and_notify, agent="ending")
    llm.script("hello", {"content": "hi there"})
    loop = Ending.start(message="hello")
    drain()
    # The first COMMIT of the ending failed after the hook had enqueued its job:
    # both were undone, and the turn's end was written again (a transient
    # failure is retried in place), running the hook again. One job.
    assert "the turn's end: the database failed" in caplog.text
    assert [status for _, status, _ in ENDED] == ["completed", "completed"]
    assert len(notification_jobs(pg, loop.id)) == 1
    assert Ending(loop.id).result() == "hi there"


def test_a_failing_loop_runs_the_hook_with_its_error(app, pg, llm, drain, hooks):
    hooks(record_and_notify, agent=Ending)
    llm.fail_next(400, body={"error": {"message": "bad request"}})
    loop = Ending.start(message="broken")
    drain()
    ((loop_id, status, error),) = ENDED
    assert (loop_id, status) == (loop.id, "failed") and "bad request" in error
    assert len(notification_jobs(pg, loop.id)) == 1
    with pytest.raises(LoopFailedError, match=f"loop {loop.id} failed: .*bad request") as caught:
        Ending(loop.id).result()
    assert caught.value.loop_id == loop.id


def test_stop_and_force_stop_run_the_hook(app, pg, hooks):
    hooks(record_and_notify)
    stopped = Ending.start(message="one")
    forced = OtherAgent.start(message="two")
    assert Ending(stopped.id).stop(reason="the customer closed the ticket")
    assert OtherAgent(forced.id).force_stop(reason="runaway")
    assert [(stopped.id, "failed", "the customer closed the ticket"),
                     (forced.id, "failed", "force stopped: runaway")] == ENDED
    assert len(notification_jobs(pg, stopped.id)) == 1
    assert len(notification_jobs(pg, forced.id)) == 1


def test_a_hook_for_another_agent_is_not_run(app, llm, drain, hooks):
    hooks(record_and_notify, agent="ending_other")
    llm.script("hello", {"content": "hi"})
    Ending.start(message="hello")
    drain()
    stopped = Ending.start(message="stop me")
    Ending(stopped.id).stop(reason="no")
    assert ENDED == []


def test_a_raising_hook_is_undone_and_the_loop_ends_all_the_same(app, session, pg, llm, drain,
                                                                 hooks, caplog):
    def notify_then_fail(loop, session):
        notify_owner.send_with_options(args=(loop.id,), session=session)
        raise RuntimeError("the notifier is down")

    hooks(notify_then_fail, agent="ending")
    llm.script("hello", {"content": "hi"})
    loop = Ending.start(message="hello")
    drain()
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"
    session.rollback()
    assert notification_jobs(pg, loop.id) == []
    assert "on_loop_end hook" in caplog.text and "the notifier is down" in caplog.text


def test_an_ending_a_newer_generation_preempted_runs_no_hook(app, session, pg, hooks):
    hooks(record_and_notify)
    loop = Ending.start(message="hello")
    ends = store.loop_ends(app.extensions["solidloop"], "ending")
    # A turn of a rotated generation: its fence matches nothing.
    assert not store.end_turn(session, loop.id, uuid.uuid4(), to="failed",
                              error_message="stale", ends=ends)
    assert ENDED == [] and notification_jobs(pg, loop.id) == []


def test_result_is_none_until_the_loop_finishes(app, session):
    loop = Ending.start(message="hello")
    assert Ending(loop.id).result() is None


def test_on_loop_end_refuses_what_it_cannot_use():
    class Unregistered(Agent):
        pass

    with pytest.raises(InvalidArgumentError, match=r"decorate it with @solidloop\.agent"):
        solidloop.on_loop_end(agent=Unregistered)
    with pytest.raises(InvalidArgumentError, match="registered name or its class"):
        solidloop.on_loop_end(agent=42)  # type: ignore[arg-type]
