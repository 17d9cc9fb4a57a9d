"""Child agents: an ``mcps`` entry ``{"name": ..., "agent": ...}`` gives the parent
a tool whose call starts a loop of that agent and waits, holding nothing, for
its end, which the child's final transaction writes as the call's result
(docs/guides/conversations.md, docs/decisions/0037-child-agents.md). Driven
in-process (drain) against the strict LLM emulator and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select, text

from flask_solidloop import DecisionConflictError, Toolset
from flask_solidloop.errors import AgentDefinitionError, ToolDefinitionError
from flask_solidloop.loops import queries, store
from flask_solidloop.mcp.registry import ToolRegistry
from flask_solidloop.models import Job, Loop, Message, ToolCall
from flask_solidloop.state import get_state

from ..support.children_app import (
    Lead,
    LeadByName,
    Ping,
    Researcher,
    SequentialLead,
    ToolsetLead,
)
from ..support.rows import loop_of
from ..support.support_app import Agent, solidloop

_ = (Researcher, Ping)


def children_of(session, loop_id):
    session.expire_all()
    return list(session.scalars(select(Loop).where(Loop.parent_loop_id == loop_id)
                                .order_by(Loop.id)))


def calls_of(session, loop_id):
    session.expire_all()
    return list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)
                                .order_by(ToolCall.position)))


def live_jobs(session, loop_id):
    return list(session.scalars(select(Job).where(
        Job.loop_id == loop_id, Job.state.in_(("queued", "running")))))


def tool_messages(session, loop_id):
    session.expire_all()
    return [m.content for m in session.scalars(
        select(Message).where(Message.loop_id == loop_id, Message.role == "tool")
        .order_by(Message.id))]


def has_tool_results(body) -> bool:
    return any(m.get("role") == "tool" for m in body.get("messages", []))


def script_research(llm, *topics, answer="All researched."):
    """The lead asks for one research call per topic; each child answers its
    topic; the lead answers once it has the results."""
    llm.script("plan", {"content": "Delegating.", "tool_calls": [
        {"name": "research", "arguments": {"message": f"research {topic}"}}
        for topic in topics]})
    for topic in topics:
        llm.script(f"research {topic}", {"content": f"{topic}: found it"})
    llm.script(has_tool_results, {"content": answer})


def test_the_tool_is_the_child_agent_named_and_described_by_its_docstring(app):
    registry = ToolRegistry.build(Lead().tool_entries(), agent="lead", remote=False)
    research = registry.resolve("research")
    assert research is not None
    assert research.definition["description"] == (
        "Research one topic and report the findings in a paragraph.")
    assert research.definition["inputSchema"]["required"] == ["message"]
    named = ToolRegistry.build(LeadByName().tool_entries(), agent="lead_by_name", remote=False)
    assert named.resolve("ask").definition["description"] == "Ask a researcher."


def test_an_agent_entry_is_checked(app):
    class Unregistered(Agent):
        system_prompt = "x"

    with pytest.raises(AgentDefinitionError, match="is not registered"):
        ToolRegistry.build([{"name": "x", "agent": Unregistered}], agent="a", remote=False)
    with pytest.raises(AgentDefinitionError, match="agent= must be an Agent class"):
        ToolRegistry.build([{"name": "x", "agent": 3}], agent="a", remote=False)
    with pytest.raises(AgentDefinitionError, match="exactly one of"):
        ToolRegistry.build([{"name": "x", "agent": "researcher", "toolset": object()}],
                           agent="a", remote=False)


def test_two_children_start_with_the_call_and_their_answers_are_its_results(
        app, session, llm, drain):
    llm.script("plan", {"content": "Delegating.", "tool_calls": [
        {"name": "research", "arguments": {"message": "research apples"}},
        {"name": "research", "arguments": {"message": "research pears"}}]})
    lead = Lead.start(message="plan the fruit", subject=None)
    # Only the lead's turn: the children are started by its turn's end.
    drain(queues=("solidloop_llm",), max_jobs=1)
    parent = loop_of(session, lead.id)
    assert parent.status == "waiting"
    assert parent.lease_expires_at is None
    calls = calls_of(session, lead.id)
    assert [(c.waits_for, c.decision) for c in calls] == [("result", None), ("result", None)]
    children = children_of(session, lead.id)
    assert [(c.agent_name, c.status, c.depth, c.parent_tool_call_id) for c in children] == [
        ("researcher", "queued", 1, calls[0].id), ("researcher", "queued", 1, calls[1].id)]
    # Each child's first message is its call's message; each has its first job.
    assert [queries.messages(session, c.id)[-1].content for c in children] == [
        "research apples", "research pears"]
    assert [[j.actor_name for j in live_jobs(session, c.id)] for c in children] == [
        ["solidloop.llm_turn"], ["solidloop.llm_turn"]]
    # The waiting parent holds nothing: no job of its own.
    assert live_jobs(session, lead.id) == []

    llm.script("research apples", {"content": "apples: red"})
    llm.script("research pears", {"content": "pears: green"})
    llm.script(has_tool_results, {"content": "Apples are red and pears are green."})
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert Lead(lead).result() == "Apples are red and pears are green."
    calls = calls_of(session, lead.id)
    assert [(c.decision, c.decided_by, c.is_success) for c in calls] == [
        ("completed", f"loop {children[0].id}", True),
        ("completed", f"loop {children[1].id}", True)]
    assert tool_messages(session, lead.id) == ["apples: red", "pears: green"]
    # The last request of the lead carried both results to the model.
    last = llm.requests[-1].json["messages"]
    assert [m["content"] for m in last if m["role"] == "tool"] == ["apples: red", "pears: green"]


def test_the_childs_end_decides_the_call_in_its_own_final_commit(app, session, llm, drain,
                                                                  state):
    """The child's completion and its parent's call's result are one
    transaction: when that transaction cannot commit (a deferred trigger
    refuses the call's result at COMMIT), the child has not completed either.
    Healed, the child's turn runs again and decides the call once."""
    script_research(llm, "plums")
    lead = Lead.start(message="plan plums")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    session.execute(text(
        "CREATE FUNCTION refuse_child_result() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"))
    session.execute(text(
        "CREATE CONSTRAINT TRIGGER refuse_child_result AFTER UPDATE ON solidloop_tool_calls "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.decided_by LIKE 'loop %') "
        "EXECUTE FUNCTION refuse_child_result()"))
    session.commit()
    try:
        drain(queues=("solidloop_llm",), max_jobs=1, raise_errors=False)
        call = calls_of(session, lead.id)[0]
        assert call.decision is None and call.executed_at is None
        assert loop_of(session, child.id).status == "running"  # left to its lease
        assert loop_of(session, lead.id).status == "waiting"
    finally:
        session.rollback()
        session.execute(text("DROP TRIGGER refuse_child_result ON solidloop_tool_calls"))
        session.execute(text("DROP FUNCTION refuse_child_result()"))
        session.commit()
    session.execute(text("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1s' "
                         "WHERE id = :id"), {"id": child.id})
    session.commit()
    from flask_solidloop.maintenance import reaper

    assert reaper.reap(state).healed >= 1
    drain()
    assert loop_of(session, child.id).status == "completed"
    call = calls_of(session, lead.id)[0]
    assert (call.decision, call.decided_by, call.result["content"][0]["text"]) == (
        "completed", f"loop {child.id}", "plums: found it")
    assert loop_of(session, lead.id).status == "completed"
    assert tool_messages(session, lead.id) == ["plums: found it"]


def test_a_failed_child_is_an_error_result_the_model_reads(app, session, llm, drain):
    llm.script("plan", {"content": "Delegating.", "tool_calls": [
        {"name": "research", "arguments": {"message": "research lemons"}}]})
    llm.script(has_tool_results, {"content": "The research failed."})
    lead = Lead.start(message="plan lemons")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    Researcher(child.id).stop(reason="out of time")
    call = calls_of(session, lead.id)[0]
    assert (call.decision, call.is_success, call.error_kind) == (
        "completed", False, "child_failed")
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert tool_messages(session, lead.id) == [
        f"the child agent 'researcher' (loop {child.id}) did not complete: out of time"]


def test_exactly_one_result_when_the_host_answers_first(app, session, llm, drain):
    script_research(llm, "figs")
    lead = Lead.start(message="plan figs")
    drain(queues=("solidloop_llm",), max_jobs=1)
    call = calls_of(session, lead.id)[0]
    child = children_of(session, lead.id)[0]
    Lead(lead).complete_call(call.id, "figs: the host knew", by="alice")
    with pytest.raises(DecisionConflictError):
        Lead(lead).complete_call(call.id, "again")
    drain()
    # The child ran to its end; its result lost the compare-and-set, and the
    # host's stands.
    assert loop_of(session, child.id).status == "completed"
    call = calls_of(session, lead.id)[0]
    assert (call.decided_by, call.result["content"][0]["text"]) == (
        "alice", "figs: the host knew")
    assert loop_of(session, lead.id).status == "completed"
    assert tool_messages(session, lead.id) == ["figs: the host knew"]


def test_a_child_by_registered_name_and_in_sequential_mode(app, session, llm, drain):
    llm.script("by name", {"content": "Asking.", "tool_calls": [
        {"name": "ask", "arguments": {"message": "research kiwis"}}]})
    llm.script("research kiwis", {"content": "kiwis: fuzzy"})
    llm.script(has_tool_results, {"content": "Kiwis are fuzzy."})
    lead = LeadByName.start(message="by name")
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert tool_messages(session, lead.id) == ["kiwis: fuzzy"]

    script_research(llm, "dates", "limes", answer="Both, one after the other.")
    seq = SequentialLead.start(message="plan dates and limes")
    drain()
    assert loop_of(session, seq.id).status == "completed"
    assert tool_messages(session, seq.id) == ["dates: found it", "limes: found it"]


def test_a_toolsets_agent_tool_starts_the_child_too(app, session, llm, drain):
    llm.script("consult on figs", {"content": "Asking.", "tool_calls": [
        {"name": "consult", "arguments": {"message": "research figs"}}]})
    llm.script("research figs", {"content": "figs: sweet"})
    llm.script(has_tool_results, {"content": "Figs are sweet."})
    lead = ToolsetLead.start(message="consult on figs")
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert [c.agent_name for c in children_of(session, lead.id)] == ["researcher"]
    assert tool_messages(session, lead.id) == ["figs: sweet"]
    tools = llm.requests[0].json["tools"]
    assert [(t["function"]["name"], t["function"]["description"]) for t in tools] == [
        ("consult", "Consult a researcher about one topic.")]

    tools = Toolset("bad")
    with pytest.raises(ToolDefinitionError, match="declare a parameter message: str"):
        @tools.agent_tool(Researcher)
        def ask(topic: str) -> str:
            """Ask."""
    assert tools.list_tools() == []
    with pytest.raises(ToolDefinitionError, match="an Agent class or a registered agent"):
        tools.agent_tool(42)


def test_a_call_without_a_message_is_an_error_the_model_corrects(app, session, llm, drain):
    llm.script("plan melons", {"content": "Oops.", "tool_calls": [
        {"name": "research", "arguments": {"topic": "melons"}}]})
    llm.script(has_tool_results, {"content": "I will ask properly next time."})
    lead = Lead.start(message="plan melons")
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert children_of(session, lead.id) == []
    assert "with {\"message\": \"...\"}" in tool_messages(session, lead.id)[0]


def test_stop_freeze_and_force_stop_cascade_to_live_children(app, session, llm, drain, state):
    script_research(llm, "cherries", "grapes")
    lead = Lead.start(message="plan cherries and grapes")
    drain(queues=("solidloop_llm",), max_jobs=1)
    children = children_of(session, lead.id)

    assert Lead(lead).freeze()
    assert [(c.status, c.frozen) for c in children_of(session, lead.id)] == [
        ("paused", True), ("paused", True)]
    assert (loop_of(session, lead.id).status, loop_of(session, lead.id).frozen) == (
        "paused", True)
    assert Lead(lead).unfreeze()
    assert [c.frozen for c in children_of(session, lead.id)] == [False, False]

    assert Lead(lead).stop(reason="cancelled by the user")
    parent = loop_of(session, lead.id)
    assert (parent.status, parent.error_message) == ("failed", "cancelled by the user")
    assert [(c.status, c.error_message) for c in children_of(session, lead.id)] == [
        ("failed", f"its parent loop {lead.id} was stopped: cancelled by the user")] * 2
    # Each child's end was written on its call, kept on the stopped parent:
    # nothing was enqueued for it.
    calls = calls_of(session, lead.id)
    assert [(c.decision, c.is_success) for c in calls] == [("completed", False)] * 2
    assert live_jobs(session, lead.id) == []
    assert drain() == 0 or all(c.status == "failed" for c in children_of(session, lead.id))
    assert [c.id for c in children] == [c.id for c in children_of(session, lead.id)]

    # Force stop, on a fresh tree: the children's queued jobs are cancelled.
    script_research(llm, "quinces")
    other = Lead.start(message="plan quinces")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, other.id)[0]
    assert [j.actor_name for j in live_jobs(session, child.id)] == ["solidloop.llm_turn"]
    assert Lead(other).force_stop(reason="now")
    assert loop_of(session, child.id).status == "failed"
    assert live_jobs(session, child.id) == []


def test_pause_takes_the_tree_and_resume_brings_it_back(app, session, llm, drain):
    script_research(llm, "figs", "plums", answer="Figs and plums, researched.")
    lead = Lead.start(message="plan figs and plums")
    drain(queues=("solidloop_llm",), max_jobs=1)
    children = children_of(session, lead.id)
    assert [c.status for c in children] == ["queued", "queued"]

    assert Lead(lead).pause()
    assert loop_of(session, lead.id).status == "paused"
    assert [(c.status, c.error_message) for c in children_of(session, lead.id)] == [
        ("paused", f"paused with its parent loop {lead.id}")] * 2
    # The children's queued turns belong to the old generation: nothing runs.
    requests_then = len(llm.requests)
    drain()
    assert len(llm.requests) == requests_then
    assert [c.status for c in children_of(session, lead.id)] == ["paused", "paused"]

    assert Lead(lead).resume()
    parent = loop_of(session, lead.id)
    assert parent.status == "waiting"
    assert [(c.status, c.error_message) for c in children_of(session, lead.id)] == [
        ("queued", None), ("queued", None)]
    drain()
    assert loop_of(session, lead.id).status == "completed"
    assert Lead(lead).result() == "Figs and plums, researched."
    assert sorted(tool_messages(session, lead.id)) == ["figs: found it", "plums: found it"]
    # Each child asked the model once: the paused generation sent nothing.
    assert sum(1 for r in llm.requests if r.json and any(
        "research figs" in str(m.get("content")) for m in r.json.get("messages", []))) == 1


def test_resuming_a_paused_parent_leaves_a_frozen_child_frozen(app, session, llm, drain):
    script_research(llm, "limes")
    lead = Lead.start(message="plan limes")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    assert Researcher(child.id).freeze()
    assert Lead(lead).pause()
    assert Lead(lead).resume()
    assert loop_of(session, lead.id).status == "waiting"
    assert (loop_of(session, child.id).status, loop_of(session, child.id).frozen) == (
        "paused", True)
    # Unfrozen and resumed on its own, it answers the call and the lead goes on.
    assert Researcher(child.id).unfreeze()
    assert Researcher(child.id).resume()
    drain()
    assert loop_of(session, lead.id).status == "completed"


def test_a_chain_past_the_depth_cap_is_refused_with_the_setting_named(
        app, session, llm, drain):
    for n in range(7):
        llm.script(f"link {n} task", {"content": "Passing on.", "tool_calls": [
            {"name": "delegate", "arguments": {"message": f"link {n + 1} task"}}]})
    llm.script(has_tool_results, lambda body: {"content": "done: " + next(
        m["content"] for m in reversed(body["messages"]) if m["role"] == "tool")})
    chain0 = solidloop.agents["chain0"]
    root = chain0.start(message="link 0 task")
    drain()
    assert loop_of(session, root.id).status == "completed"
    depths = session.execute(text(
        "SELECT agent_name, depth, status FROM solidloop_loops ORDER BY depth")).all()
    # chain0 (depth 0) ... chain5 (depth 5); chain6 would be depth 6: refused.
    assert [(a, d) for a, d, _ in depths] == [(f"chain{n}", n) for n in range(6)]
    assert {s for _, _, s in depths} == {"completed"}
    deepest = session.execute(text(
        "SELECT id FROM solidloop_loops WHERE depth = 5")).scalar()
    refused = calls_of(session, deepest)[0]
    assert (refused.decided_by, refused.error_kind, refused.is_success) == (
        "solidloop", "child_refused", False)
    message = refused.result["content"][0]["text"]
    assert message == ("the child agent 'chain6' was not started: it would be 6 levels "
                       "deep, past SOLIDLOOP_MAX_AGENT_DEPTH (5)")
    # The refusal travels up as each link's answer.
    assert Agent(root.id).result() == "done: done: done: done: done: done: " + message


def test_the_depth_cap_is_a_setting(app, session, llm, drain):
    app.config["SOLIDLOOP_MAX_AGENT_DEPTH"] = 1
    get_state(app).config = type(get_state(app).config).from_mapping(app.config)
    llm.script("link 0 task", {"content": "Passing on.", "tool_calls": [
        {"name": "delegate", "arguments": {"message": "link 1 task"}}]})
    llm.script("link 1 task", {"content": "Passing on.", "tool_calls": [
        {"name": "delegate", "arguments": {"message": "link 2 task"}}]})
    llm.script(has_tool_results, {"content": "stopped there"})
    root = solidloop.agents["chain0"].start(message="link 0 task")
    drain()
    assert loop_of(session, root.id).status == "completed"
    assert session.execute(text("SELECT max(depth) FROM solidloop_loops")).scalar() == 1


def test_a_cycle_is_refused_at_start(app, session, llm, drain):
    llm.script("ping task", {"content": "To pong.", "tool_calls": [
        {"name": "pong", "arguments": {"message": "pong task"}}]})
    llm.script("pong task", {"content": "Back to ping.", "tool_calls": [
        {"name": "ping", "arguments": {"message": "ping again"}}]})
    llm.script(has_tool_results, lambda body: {"content": next(
        m["content"] for m in reversed(body["messages"]) if m["role"] == "tool")})
    root = Ping.start(message="ping task")
    drain()
    assert loop_of(session, root.id).status == "completed"
    assert session.execute(text("SELECT count(*) FROM solidloop_loops")).scalar() == 2
    assert Ping(root).result() == (
        "the child agent 'ping' was not started: it is already an ancestor of this loop, "
        "a cycle (ping -> pong -> ping)")


def test_a_child_killed_mid_turn_is_healed_and_decides_once(app, session, llm, drain, state):
    """A child whose worker died holding its turn: the reaper takes it back,
    the turn runs again, and its end decides the call once."""
    script_research(llm, "olives")
    lead = Lead.start(message="plan olives")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    # Claim the child's turn as a dead worker would have, and drop its job.
    claim = store.claim_llm_turn(session, child.id, lease_seconds=0.01, open_shell=False,
                                 read_history=False)
    assert claim is not None
    session.execute(text("UPDATE solidloop_jobs SET state = 'done' WHERE loop_id = :id"),
                    {"id": child.id})
    session.execute(text("UPDATE solidloop_loops SET lease_expires_at = now() - interval '1s' "
                         "WHERE id = :id"), {"id": child.id})
    session.commit()
    from flask_solidloop.maintenance import reaper

    assert reaper.reap(state).healed >= 1
    drain()
    assert loop_of(session, lead.id).status == "completed"
    call = calls_of(session, lead.id)[0]
    assert call.decided_by == f"loop {child.id}"
    assert tool_messages(session, lead.id) == ["olives: found it"]


def test_status_and_the_store_show_the_tree(app, session, llm, drain):
    script_research(llm, "pears")
    lead = Lead.start(message="plan pears")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    runner = app.test_cli_runner()
    shown = runner.invoke(args=["solidloop", "status", str(lead.id)])
    assert shown.exit_code == 0, shown.output
    assert f"children: {child.id} (researcher, queued)" in shown.output
    # The waiting call names the child whose end answers it, not a command.
    assert (f"[awaiting child agent loop {child.id} (researcher, queued): its end answers "
            "the call") in shown.output
    assert "flask solidloop complete" not in shown.output
    shown = runner.invoke(args=["solidloop", "status", str(child.id)])
    assert shown.exit_code == 0, shown.output
    call = calls_of(session, lead.id)[0]
    assert f"parent: loop {lead.id} (lead), tool call {call.id}, depth 1" in shown.output


def test_the_admin_loop_page_shows_the_tree(app, session, llm, drain):
    script_research(llm, "pears")
    lead = Lead.start(message="plan pears")
    drain(queues=("solidloop_llm",), max_jobs=1)
    child = children_of(session, lead.id)[0]
    call = calls_of(session, lead.id)[0]
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True),
                           url_prefix="/admin")
    client = app.test_client()
    page = client.get(f"/admin/loops/{lead.id}").get_data(as_text=True)
    assert f'<li data-loop="{child.id}"><a href="/admin/loops/{child.id}">loop #{child.id}</a> ' \
           f'researcher <span class="badge">queued</span> (tool call #{call.id})</li>' in page
    page = client.get(f"/admin/loops/{child.id}").get_data(as_text=True)
    assert (f'Child agent of <a href="/admin/loops/{lead.id}">loop #{lead.id}</a> '
            f'(lead, waiting), for its tool call #{call.id}; depth 1.') in page
    # A loop with no tree shows none.
    assert 'id="tree"' not in client.get(
        f"/admin/loops/{Researcher.start(message='alone').id}").get_data(as_text=True)


def test_a_child_with_structured_output_answers_with_its_validated_object(
        app, session, llm, drain):
    """The child loop takes its agent's output_type (decision 0036) and the
    parent's call reads the validated object: as JSON text, and as the
    result's structured content."""
    from ..support.children_app import ProfilingLead
    from ..support.support_app import Profile

    llm.script("plan", {"content": "Delegating.", "tool_calls": [
        {"name": "profile", "arguments": {"message": "profile ada"}}]})
    llm.script("profile ada", {"output": {"name": "Ada", "city": "London"}})
    llm.script(has_tool_results, {"content": "Ada lives in London."})
    lead = ProfilingLead.start(message="plan the profile")
    drain()
    assert loop_of(session, lead.id).status == "completed"
    (child,) = children_of(session, lead.id)
    assert child.output_schema == Profile.model_json_schema()
    assert child.output == {"name": "Ada", "city": "London"}
    (call,) = calls_of(session, lead.id)
    assert (call.decision, call.decided_by, call.is_success) == (
        "completed", f"loop {child.id}", True)
    assert call.result["structuredContent"] == {"name": "Ada", "city": "London"}
    assert [__import__("json").loads(t) for t in tool_messages(session, lead.id)] == [
        {"name": "Ada", "city": "London"}]
