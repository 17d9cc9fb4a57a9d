"""Agent.start_many: many loops, their messages and first jobs in one
transaction with one NOTIFY, each loop as start() writes it."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import func, select

from flask_solidloop import InvalidArgumentError, signals
from flask_solidloop.config import QUEUE_LLM
from flask_solidloop.models import Job, Loop, Message
from flask_solidloop.queue.sql import CHANNEL_PREFIX
from flask_solidloop.urls import libpq_url

from ..support.support_app import Assistant


def shape(session, loop_id):
    """What start() writes for a loop, without its ids and clocks."""
    loop = session.get(Loop, loop_id)
    messages = session.scalars(select(Message).where(Message.loop_id == loop_id)
                               .order_by(Message.id)).all()
    (job,) = session.scalars(select(Job).where(Job.loop_id == loop_id)).all()
    return {
        "loop": (loop.agent_name, loop.status, loop.subject_type, loop.subject_id, loop.state,
                 loop.step_count, loop.execution_token),
        "messages": [(m.role, m.content, m.status, m.is_hidden, m.meta) for m in messages],
        "job": (job.queue_name, job.actor_name, job.state, job.tier, job.message["args"],
                job.message["options"]),
    }


def test_each_loop_is_written_as_start_writes_one(app, session):
    one = Assistant.start(message="hello\x00there", subject=("User", 7), state={"k": 1})
    ids = Assistant.start_many([{"message": "hello\x00there", "subject": ("User", 7),
                                 "state": {"k": 1}}, "second"])
    session.expire_all()
    single, bulk = shape(session, one.id), shape(session, ids[0])
    single["job"] = (*single["job"][:4], [ids[0]], {"solidloop_loop_id": ids[0]})
    assert bulk == single
    # The NUL could not be stored: replaced, and the message says so.
    assert bulk["messages"][1][4] == {"sanitized": ["content"]}
    assert shape(session, ids[1])["messages"][1][:2] == ("user", "second")
    assert ids == sorted(ids) and len(set(ids)) == 2


def test_a_batch_commits_whole_with_one_notify(app, session, database_url):
    channel = CHANNEL_PREFIX + QUEUE_LLM
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{channel}"')
        ids = Assistant.start_many([f"task {i}" for i in range(200)])
        assert [n.channel for n in conn.notifies(timeout=1.0)] == [channel]
    assert len(ids) == 200
    assert session.scalar(select(func.count()).select_from(Loop)) == 200
    assert session.scalar(select(func.count()).select_from(Message)) == 400
    assert session.scalar(select(func.count()).select_from(Job).where(
        Job.loop_id.in_(ids), Job.state == "queued")) == 200


def test_with_commit_false_the_batch_joins_the_callers_transaction(app, session):
    ids = Assistant.start_many(["a", "b"], commit=False)
    assert session.scalar(select(func.count()).select_from(Loop)) == 2
    session.rollback()
    assert session.scalar(select(func.count()).select_from(Loop)) == 0
    assert session.scalar(select(func.count()).select_from(Job)) == 0
    assert len(ids) == 2


@pytest.mark.parametrize(("item", "says"), [
    ("  ", "item 2: message must be a non-empty string"),
    (42, "item 2 is a int; pass a message string"),
    ({"message": "x", "subjct": 1}, "item 2 has unknown keys ['subjct']"),
    ({"message": "x", "state": {"when": object()}}, "item 2: state must be JSON-friendly"),
])
def test_a_bad_item_names_its_index_and_writes_nothing(app, session, item, says):
    with pytest.raises(InvalidArgumentError, match=says.replace("[", r"\[").replace("]", r"\]")):
        Assistant.start_many(["fine", "also fine", item])
    assert session.scalar(select(func.count()).select_from(Loop)) == 0
    assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_an_empty_batch_writes_nothing(app, session):
    assert Assistant.start_many([]) == []
    assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_every_loop_is_announced_after_the_commit_and_runs(app, session, llm, drain):
    started = []

    def receive(sender, **data):
        started.append(data)

    signals.loop_started.connect(receive, sender=app)
    try:
        ids = Assistant.start_many(["one", "two", "three"], commit=False)
        assert started == []  # not before the commit
        session.commit()
    finally:
        signals.loop_started.disconnect(receive, sender=app)
    assert started == [{"loop_id": i, "agent": "assistant"} for i in ids]
    for text in ("one", "two", "three"):
        llm.script(text, {"content": f"done {text}"})
    drain()
    session.expire_all()
    assert [session.get(Loop, i).status for i in ids] == ["completed"] * 3
