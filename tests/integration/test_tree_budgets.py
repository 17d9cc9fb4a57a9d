"""Budgets across a tree of child agents: a loop's budget limits the spend of
itself and all its descendants, and a child's turn is checked against every
budgeted ancestor's (docs/decisions/0037-child-agents.md, "Budgets across the
tree"; docs/guides/limits.md). Driven in-process (drain) against the strict LLM
emulator and PostgreSQL."""

from __future__ import annotations

import psycopg
from sqlalchemy import select

from flask_solidloop import spending
from flask_solidloop.loops.queries import classify_failure
from flask_solidloop.models import Job, Loop
from flask_solidloop.state import get_state

from ..support.children_app import Lead, Researcher
from ..support.rows import loop_of

#: The tree read (limits/sql.TREE_SPEND), as the driver sends it.
TREE_READ = "WITH RECURSIVE up AS"


def children_of(session, loop_id):
    session.expire_all()
    return list(session.scalars(select(Loop).where(Loop.parent_loop_id == loop_id)
                                .order_by(Loop.id)))


def live_jobs(session, loop_id):
    return list(session.scalars(select(Job).where(
        Job.loop_id == loop_id, Job.state.in_(("queued", "running")))))


def has_tool_results(body) -> bool:
    return any(m.get("role") == "tool" for m in body.get("messages", []))


def script_one_research(llm):
    llm.script("plan", {"content": "Delegating.", "tool_calls": [
        {"name": "research", "arguments": {"message": "research apples"}}]})
    llm.script("research apples", {"content": "apples: red"})
    llm.script(has_tool_results, {"content": "Apples are red."})


def test_a_parents_budget_counts_its_childs_turns(app, session, llm, drain):
    """Two LLM turns: the lead's first and its child's. On its own the lead
    spent one, under its limit; its tree spent two, and the lead pauses when it
    wakes with its child's answer."""
    script_one_research(llm)
    lead = Lead.start(message="plan the fruit", subject=None, budget={"llm_turns": 2})
    drain()
    (child,) = children_of(session, lead.id)
    assert loop_of(session, child.id).status == "completed"
    parent = loop_of(session, lead.id)
    assert parent.step_count == 1
    assert parent.status == "paused"
    assert parent.error_message == (
        "BudgetExceededError: the loop's budget llm_turns is spent: 2 LLM turns by it and "
        "its child agents of 2 LLM turns; resume(budget=...) raises it and continues")
    assert classify_failure(parent.error_message) == "budget_exceeded"
    # status and the loop's admin page show the same count against the limit.
    shown = spending.loop_budget(get_state(), session, parent).gauges
    assert [(g.key, g.spent, g.limit) for g in shown] == [("llm_turns", 2.0, 2.0)]
    # The child's answer is there; raising the budget lets the lead use it.
    assert Lead(lead.id).resume(budget={"llm_turns": 5})
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert Lead(lead.id).result() == "Apples are red."


def test_a_child_pauses_at_its_ancestors_budget_and_resume_lets_it_finish(
        app, session, llm, drain):
    """The lead may spend one LLM turn for its whole tree: its own is the one.
    Its child (no budget of its own) pauses before sending anything, naming the
    lead and the fix; the lead waits, holding nothing. Resumed with a budget,
    the child finishes, its answer wakes the lead, and the lead's own check
    finds its tree over its limit."""
    script_one_research(llm)
    lead = Lead.start(message="plan the fruit", subject=None, budget={"llm_turns": 1})
    drain()
    (child,) = children_of(session, lead.id)
    child = loop_of(session, child.id)
    assert child.status == "paused"
    assert child.step_count == 0
    assert child.error_message == (
        f"BudgetExceededError: ancestor loop {lead.id}'s budget llm_turns is spent: "
        "1 LLM turns by it and its child agents of 1 LLM turns; resume(budget=...) on "
        f"this loop lets it go on past it, or stop it to answer loop {lead.id}'s call "
        "(which then checks its own budget)")
    assert classify_failure(child.error_message) == "budget_exceeded"
    # Only the lead's request went out.
    assert len(llm.requests) == 1
    parent = loop_of(session, lead.id)
    assert parent.status == "waiting"
    assert live_jobs(session, lead.id) == [] and live_jobs(session, child.id) == []

    assert Researcher(child.id).resume(budget={"llm_turns": 3})
    drain()
    assert loop_of(session, child.id).status == "completed"
    parent = loop_of(session, lead.id)
    assert parent.status == "paused"
    assert parent.error_message.startswith(
        "BudgetExceededError: the loop's budget llm_turns is spent: 2 LLM turns by it and "
        "its child agents of 1 LLM turns")
    assert Lead(lead.id).resume(budget={"llm_turns": 5})
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert Lead(lead.id).result() == "Apples are red."


def test_stopping_a_child_paused_by_its_ancestor_answers_the_parents_call(
        app, session, llm, drain):
    script_one_research(llm)
    lead = Lead.start(message="plan the fruit", subject=None, budget={"llm_turns": 1})
    drain()
    (child,) = children_of(session, lead.id)
    assert loop_of(session, child.id).status == "paused"
    assert Researcher(child.id).stop(reason="over the lead's budget")
    drain()
    # The call is answered (the child ended); the lead woke, and its own check
    # paused it: its tree spent its one turn.
    parent = loop_of(session, lead.id)
    assert parent.status == "paused"
    assert parent.error_message.startswith("BudgetExceededError: the loop's budget llm_turns")
    assert live_jobs(session, lead.id) == []


def test_a_grandparents_budget_stops_a_grandchild(app, session, llm, drain):
    """The check walks every ancestor: the lead's budget is reached by its
    tree; its child has no budget; the grandchild is stopped by the lead's."""
    chain0 = get_state().agent_class("chain0")
    llm.script("go 0", {"content": "", "tool_calls": [
        {"name": "delegate", "arguments": {"message": "go 1"}}]})
    llm.script("go 1", {"content": "", "tool_calls": [
        {"name": "delegate", "arguments": {"message": "go 2"}}]})
    llm.script("go 2", {"content": "deep"})
    top = chain0.start(message="go 0", subject=None, budget={"llm_turns": 2})
    drain()
    (middle,) = children_of(session, top.id)
    (bottom,) = children_of(session, middle.id)
    assert loop_of(session, middle.id).status == "waiting"
    bottom = loop_of(session, bottom.id)
    assert bottom.status == "paused"
    assert f"ancestor loop {top.id}'s budget llm_turns is spent: 2 LLM turns" \
        in bottom.error_message


def test_a_plain_loop_reads_no_tree_and_a_budgeted_one_reads_it_once_a_turn(
        app, session, llm, drain, monkeypatch):
    """The tree read runs only for a loop with a budget of its own or a parent:
    a root without budgets sends no statement more than before."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def observed(cursor, query, *args, **kwargs):
        sent.append(query if isinstance(query, str) else str(query))
        return execute(cursor, query, *args, **kwargs)

    llm.script("research pears", {"content": "pears: green"})
    monkeypatch.setattr(psycopg.Cursor, "execute", observed)
    plain = Researcher.start(message="research pears", subject=None)
    drain()
    assert loop_of(session, plain.id).status == "completed"
    assert [q for q in sent if TREE_READ in q] == []

    sent.clear()
    llm.script("research plums", {"content": "plums: purple"})
    budgeted = Researcher.start(message="research plums", subject=None,
                                budget={"llm_turns": 5})
    drain()
    assert loop_of(session, budgeted.id).status == "completed"
    assert len([q for q in sent if TREE_READ in q]) == 1
