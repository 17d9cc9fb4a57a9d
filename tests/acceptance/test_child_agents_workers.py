"""Child agents on real ``flask solidloop worker`` processes
(docs/guides/conversations.md, "Child agents"): a parent whose two children
run in parallel survives the SIGKILL of the fleet running both, with exactly
one result per child call; stopping the parent stops both children; a chain
deeper than SOLIDLOOP_MAX_AGENT_DEPTH is refused with an error naming it; a
paused tree killed with its fleet finishes when resumed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from sqlalchemy import select, text

from flask_solidloop.models import Job, Loop, Message, ToolCall

from ..support.children_app import Lead
from ..support.support_app import SLOW_EFFECTS_DDL, solidloop
from .test_approvals_workers import fleet, poll, status_of  # noqa: F401  (fleet: a fixture)

pytestmark = pytest.mark.e2e


def system_is(prompt: str):
    return lambda body: body["messages"][0]["content"] == prompt


def first_user(body) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def has_tool_results(body) -> bool:
    return any(m.get("role") == "tool" for m in body["messages"])


def script(llm, session, *, seconds: float) -> None:
    """The lead asks two researchers; each researcher runs a slow tool for
    ``seconds``, then answers with its topic; the lead answers with both. The
    slow tool's log table is made first (two first calls racing to create it
    would collide)."""
    session.execute(text(SLOW_EFFECTS_DDL))
    session.commit()
    llm.script(lambda body: system_is("You lead.")(body) and not has_tool_results(body),
               {"content": "Delegating.", "tool_calls": [
                   {"name": "research", "arguments": {"message": "research apples"}},
                   {"name": "research", "arguments": {"message": "research pears"}}]})
    llm.script(lambda body: system_is("You research.")(body) and not has_tool_results(body),
               {"content": "Digging.", "tool_calls": [
                   {"name": "slow", "arguments": {"seconds": seconds}}]})
    llm.script(lambda body: system_is("You research.")(body) and has_tool_results(body),
               lambda body: {"content": first_user(body).replace("research ", "found ")})
    llm.script(lambda body: system_is("You lead.")(body) and has_tool_results(body),
               lambda body: {"content": " and ".join(
                   m["content"] for m in body["messages"] if m["role"] == "tool")})


def children_of(session, loop_id):
    session.expire_all()
    return list(session.scalars(select(Loop).where(Loop.parent_loop_id == loop_id)
                                .order_by(Loop.id)))


def slow_starts(session, keys) -> int:
    session.rollback()
    if not session.execute(text("SELECT to_regclass('slow_effects')")).scalar():
        return 0
    return session.execute(text(
        "SELECT count(DISTINCT idempotency_key) FROM slow_effects "
        "WHERE phase = 'start' AND idempotency_key = ANY(:keys)"), {"keys": keys}).scalar()


def child_tool_keys(session, children) -> list[str]:
    session.expire_all()
    return [f"solidloop:tool_call:{c.id}" for c in session.scalars(
        select(ToolCall).where(ToolCall.loop_id.in_([k.id for k in children])))]


def test_two_children_survive_the_fleet_killed_while_both_run(app, session, llm, fleet):  # noqa: F811 - the imported fixture
    script(llm, session, seconds=4)
    first = fleet("first", ttl=4.0)
    lead = Lead.start(message="plan the fruit")
    children = poll(session, lambda: len(children_of(session, lead.id)) == 2
                    and children_of(session, lead.id), what="the two children to start")
    # Both children are in their slow tools, on the first fleet, when it dies.
    poll(session, lambda: len(child_tool_keys(session, children)) == 2 and slow_starts(
        session, child_tool_keys(session, children)) == 2, what="both children's tools to run")
    assert {status_of(session, c.id) for c in children} == {"running"}
    assert status_of(session, lead.id) == "waiting"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    fleet("second", ttl=4.0)
    poll(session, lambda: status_of(session, lead.id) in ("completed", "failed"),
         timeout=120, what="the lead to finish on the second fleet")
    assert status_of(session, lead.id) == "completed"
    assert {status_of(session, c.id) for c in children} == {"completed"}
    session.expire_all()
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == lead.id)
                                 .order_by(ToolCall.position)))
    # Exactly one result per child call: decided once, by its child, answered once.
    assert [(c.decision, c.decided_by, c.is_success) for c in calls] == [
        ("completed", f"loop {children[0].id}", True),
        ("completed", f"loop {children[1].id}", True)]
    answers = [m.content for m in session.scalars(
        select(Message).where(Message.loop_id == lead.id, Message.role == "tool")
        .order_by(Message.id))]
    # Each call has its own child's answer, and one tool message (in the order
    # the children finished).
    assert [c.result["content"][0]["text"] for c in calls] == ["found apples", "found pears"]
    assert sorted(answers) == ["found apples", "found pears"]
    final = session.scalars(select(Message.content).where(
        Message.loop_id == lead.id, Message.role == "assistant", Message.is_hidden.is_(False))
        .order_by(Message.id.desc()).limit(1)).one()
    assert final in ("found apples and found pears", "found pears and found apples")
    # The lead asked the model twice: the delegation, and the answer.
    lead_requests = [r for r in llm.requests if r.json and system_is("You lead.")(r.json)]
    assert len(lead_requests) == 2


def test_stopping_the_parent_stops_both_children(app, session, llm, fleet):  # noqa: F811 - the imported fixture
    script(llm, session, seconds=6)
    fleet("one")
    lead = Lead.start(message="plan the fruit")
    children = poll(session, lambda: len(children_of(session, lead.id)) == 2
                    and children_of(session, lead.id), what="the two children to start")
    poll(session, lambda: len(child_tool_keys(session, children)) == 2 and slow_starts(
        session, child_tool_keys(session, children)) == 2, what="both children's tools to run")
    assert Lead(lead).stop(reason="the user cancelled")
    session.expire_all()
    assert status_of(session, lead.id) == "failed"
    assert [(status_of(session, c.id), session.get(Loop, c.id).error_message)
            for c in children] == [
        ("failed", f"its parent loop {lead.id} was stopped: the user cancelled")] * 2
    # The slow tools finish on their workers; their results find the children
    # stopped and start nothing: no more requests, no live jobs, and the
    # children stay failed.
    requests_then = len(llm.requests)
    time.sleep(8)
    session.expire_all()
    assert [status_of(session, c.id) for c in children] == ["failed", "failed"]
    assert status_of(session, lead.id) == "failed"
    assert len(llm.requests) == requests_then
    assert list(session.scalars(select(Job).where(
        Job.loop_id.in_([lead.id, *[c.id for c in children]]),
        Job.state.in_(("queued", "running"))))) == []
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == lead.id)))
    assert [(c.decision, c.is_success) for c in calls] == [("completed", False)] * 2


def test_a_depth_six_chain_is_refused_with_a_clear_error(app, session, llm, fleet):  # noqa: F811 - the imported fixture
    for n in range(7):
        llm.script(f"link {n} task", {"content": "Passing on.", "tool_calls": [
            {"name": "delegate", "arguments": {"message": f"link {n + 1} task"}}]})
    llm.script(has_tool_results, lambda body: {"content": "done: " + next(
        m["content"] for m in reversed(body["messages"]) if m["role"] == "tool")})
    fleet("one")
    root = solidloop.agents["chain0"].start(message="link 0 task")
    poll(session, lambda: status_of(session, root.id) in ("completed", "failed"),
         timeout=120, what="the chain to finish")
    session.expire_all()
    rows = session.execute(text(
        "SELECT agent_name, depth, status FROM solidloop_loops ORDER BY depth")).all()
    assert [tuple(r) for r in rows] == [(f"chain{n}", n, "completed") for n in range(6)]
    refused = session.scalars(select(ToolCall).where(ToolCall.decided_by == "solidloop")).one()
    assert refused.result["content"][0]["text"] == (
        "the child agent 'chain6' was not started: it would be 6 levels deep, past "
        "SOLIDLOOP_MAX_AGENT_DEPTH (5)")
    answer = solidloop.agents["chain0"](root.id).result()
    assert answer.endswith("past SOLIDLOOP_MAX_AGENT_DEPTH (5)")


def test_a_paused_tree_killed_with_its_fleet_finishes_when_resumed(app, session, llm, fleet):  # noqa: F811 - the imported fixture
    script(llm, session, seconds=4)
    first = fleet("first", ttl=4.0)
    lead = Lead.start(message="plan the fruit")
    children = poll(session, lambda: len(children_of(session, lead.id)) == 2
                    and children_of(session, lead.id), what="the two children to start")
    poll(session, lambda: len(child_tool_keys(session, children)) == 2 and slow_starts(
        session, child_tool_keys(session, children)) == 2, what="both children's tools to run")
    # Pausing the lead pauses both children while their tools run; the fleet
    # then dies with the tools mid-run.
    assert Lead(lead).pause()
    session.expire_all()
    assert [status_of(session, c.id) for c in [lead, *children]] == ["paused"] * 3
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    requests_then = len(llm.requests)
    fleet("second", ttl=4.0)
    time.sleep(3)
    # Paused, the tree asks nothing of the model, whatever the new fleet does.
    assert len(llm.requests) == requests_then
    assert [status_of(session, c.id) for c in [lead, *children]] == ["paused"] * 3

    assert Lead(lead).resume()
    poll(session, lambda: status_of(session, lead.id) in ("completed", "failed"),
         timeout=120, what="the resumed tree to finish")
    assert status_of(session, lead.id) == "completed"
    assert {status_of(session, c.id) for c in children} == {"completed"}
    session.expire_all()
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == lead.id)
                                 .order_by(ToolCall.position)))
    assert [(c.decision, c.decided_by, c.is_success) for c in calls] == [
        ("completed", f"loop {children[0].id}", True),
        ("completed", f"loop {children[1].id}", True)]
    # Each child's slow call, cut by the kill, ran again after the resume and
    # succeeded: one call, one result.
    for child in children:
        slow = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == child.id)))
        assert [(c.name, c.is_success) for c in slow] == [("slow", True)]
        assert len(session.scalars(select(Message.id).where(
            Message.loop_id == child.id, Message.role == "tool")).all()) == 1
    assert sorted(m.content for m in session.scalars(select(Message).where(
        Message.loop_id == lead.id, Message.role == "tool"))) == ["found apples", "found pears"]
