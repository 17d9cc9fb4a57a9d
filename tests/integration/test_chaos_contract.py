"""The chaos contract check (flask_solidloop/testing/chaos.verify_contract), which
the user fixture and our own chaos suite share: silent on a loop that finished
cleanly, and naming each way a loop can be left broken."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from flask_solidloop.loops import store
from flask_solidloop.testing.chaos import verify_contract

from ..support.support_app import Assistant


def _finished_with_a_tool_call(llm, drain) -> int:
    llm.script(lambda req: req["messages"][-1]["role"] == "user",
               {"tool_calls": [{"name": "calc__add", "arguments": {"a": 1, "b": 2}}]})
    llm.script(lambda req: req["messages"][-1]["role"] == "tool", {"content": "3"})
    loop = Assistant.start(message="add 1 and 2")
    drain()
    return loop.id


def test_a_cleanly_finished_loop_passes(app, session, llm, drain, database_url):
    loop_id = _finished_with_a_tool_call(llm, drain)
    assert verify_contract(database_url, [loop_id]) == []


def test_a_loop_left_running_with_a_shell_and_a_live_job_is_named(app, session,
                                                                   database_url):
    loop = Assistant.start(message="left behind")  # queued, with its job queued
    claim = store.claim_llm_turn(session, loop.id, lease_seconds=30, open_shell=False,
                                 read_history=False)
    assert claim is not None
    store.open_shell(session, loop.id, claim.token)
    problems = verify_contract(database_url, [loop.id])
    assert any(p.startswith("not every loop completed") for p in problems), problems
    assert any(p.startswith("processing shells left") for p in problems), problems
    assert any(p.startswith("jobs left live") for p in problems), problems


def test_a_call_answered_twice_is_refused_by_the_schema(app, session, llm, drain):
    # The contract also checks for a call answered twice; the schema already
    # makes that impossible (a unique tool_call_id on messages).
    loop_id = _finished_with_a_tool_call(llm, drain)
    with pytest.raises(IntegrityError, match="uq_solidloop_messages_tool_call_id"):
        session.execute(text(
            "INSERT INTO solidloop_messages (loop_id, role, content, tool_call_id, status,"
            " is_hidden) SELECT loop_id, role, content, tool_call_id, status, is_hidden"
            " FROM solidloop_messages WHERE loop_id = :id AND role = 'tool'"), {"id": loop_id})
    session.rollback()


def test_an_unanswered_call_and_a_dead_job_are_named(app, session, llm, drain, database_url):
    never = _finished_with_a_tool_call(llm, drain)
    session.execute(text("UPDATE solidloop_tool_calls SET response_message_id = NULL"
                         " WHERE loop_id = :id"), {"id": never})
    session.execute(text("UPDATE solidloop_jobs SET state = 'dead' WHERE id = ("
                         "SELECT max(id) FROM solidloop_jobs WHERE loop_id = :id)"),
                    {"id": never})
    session.commit()
    problems = verify_contract(database_url, [never])
    assert any(p.startswith("tool calls without their one tool message") for p in problems), \
        problems
    assert any("dead-lettered" in p for p in problems), problems
