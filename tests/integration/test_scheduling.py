"""Continuation-first claims: started loops finish before new loops start."""

from __future__ import annotations

from sqlalchemy import select, text

from flask_solidloop.models import Job, Loop
from flask_solidloop.state import get_state
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant, create_app


def script_one_tool_loops(llm) -> None:
    llm.script("loop", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    llm.script("3", {"content": "three"})


def advance_first_started_loop_to_its_next_turn(app, session):
    """Loop A runs its first turn and its tool; loop B is still waiting for its first."""
    first = Assistant.start(message="loop A").id
    second = Assistant.start(message="loop B").id
    assert run(app, queues=("solidloop_llm",), max_jobs=1) == 1  # A's first turn (older)
    assert run(app, queues=("solidloop_tool",)) == 1  # A's tool; A's next turn is queued
    session.expire_all()
    tiers = {j.loop_id: j.tier for j in session.scalars(
        select(Job).where(Job.state == "queued", Job.queue_name == "solidloop_llm"))}
    return first, second, tiers


def test_a_started_loop_is_claimed_before_a_new_one(app, session, llm):
    script_one_tool_loops(llm)
    first, second, tiers = advance_first_started_loop_to_its_next_turn(app, session)
    assert tiers == {first: 0, second: 1}  # B's first turn is older, but tier 1
    run(app, queues=("solidloop_llm",), max_jobs=1)
    session.expire_all()
    assert session.get(Loop, first).status == "completed"
    assert session.get(Loop, second).status == "queued"


def test_a_new_loop_waits_no_longer_than_the_bound(app, session, llm):
    script_one_tool_loops(llm)
    first, second, _ = advance_first_started_loop_to_its_next_turn(app, session)
    broker = get_state(app).broker
    # B's first turn has been due for longer than SOLIDLOOP_FIRST_TURN_MAX_WAIT:
    session.execute(text("UPDATE solidloop_jobs SET eta = now() - interval '1 hour' "
                         "WHERE loop_id = :id AND state = 'queued'"), {"id": second})
    session.commit()
    broker.recover_expired()  # the recovery pass applies the bound
    run(app, queues=("solidloop_llm",), max_jobs=1)
    session.expire_all()
    assert session.get(Loop, second).status != "queued"  # claimed first, by age
    assert session.get(Loop, first).status == "queued"


def test_with_continuation_first_off_claims_are_first_due(database_url, llm):
    script_one_tool_loops(llm)
    app = create_app(SOLIDLOOP_CONTINUATION_FIRST=False)
    try:
        with app.app_context():
            session = app.extensions["sqlalchemy"].session
            first, second, tiers = advance_first_started_loop_to_its_next_turn(app, session)
            assert tiers == {first: 1, second: 1}
            assert get_state(app).broker.promote_after is None
            run(app, queues=("solidloop_llm",), max_jobs=1)
            session.expire_all()
            assert session.get(Loop, second).status != "queued"  # B was due first
            assert session.get(Loop, first).status == "queued"
            session.remove()
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
    finally:
        get_state(app).broker.close()
