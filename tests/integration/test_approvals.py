"""Tool calls that wait: for a person's approval, or for a result the host
supplies; the loop that waits on them holds nothing (docs/guides/approvals.md,
docs/decisions/0017-waiting-loops.md). Driven in-process (drain) against the
real LLM emulator and PostgreSQL."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text

from flask_solidloop import DecisionConflictError, InvalidArgumentError, signals
from flask_solidloop.loops import queries
from flask_solidloop.models import Job, Message, ToolCall

from ..support.rows import loop_of
from ..support.support_app import (
    WAIT_REQUESTS,
    PolicyShopAgent,
    SequentialShopAgent,
    ShopAgent,
)


@pytest.fixture(autouse=True)
def _fresh_requests():
    WAIT_REQUESTS.clear()


def calls_of(session, loop_id):
    session.expire_all()
    return {c.name: c for c in session.scalars(
        select(ToolCall).where(ToolCall.loop_id == loop_id).order_by(ToolCall.position))}


def live_jobs(session, loop_id):
    return list(session.scalars(select(Job).where(
        Job.loop_id == loop_id, Job.state.in_(("queued", "running")))))


def tool_messages(session, loop_id):
    return [m.content for m in session.scalars(
        select(Message).where(Message.loop_id == loop_id, Message.role == "tool")
        .order_by(Message.id))]


def start_waiting(llm, drain, session, *calls, agent=ShopAgent, message="refund order 7"):
    """A loop whose first turn asks for ``calls`` (name, arguments), drained until
    it waits."""
    llm.script(message, {"content": "On it.", "tool_calls": [
        {"name": name, "arguments": arguments} for name, arguments in calls]})
    loop = agent.start(message=message)
    drain()
    return loop


def test_a_gated_call_waits_while_the_free_one_runs_and_the_loop_holds_nothing(
        app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("refund", {"order": "7", "amount": 80}),
                         ("lookup_order", {"order": "7"}))
    waiting = loop_of(session, loop.id)
    assert waiting.status == "waiting"
    assert waiting.lease_expires_at is None and waiting.lease_holder is None
    assert waiting.execution_token is not None  # the tool phase's generation stays
    calls = calls_of(session, loop.id)
    assert calls["lookup_order"].response_message_id is not None
    refund = calls["refund"]
    assert (refund.waits_for, refund.decision, refund.lease_token) == ("approval", None, None)
    assert refund.wait_deadline is None  # no timeout declared, none configured
    # No job of the loop's is queued: a waiting loop costs no worker anything.
    assert live_jobs(session, loop.id) == []
    assert effects(f"solidloop:tool_call:{refund.id}", "refund") == []
    states = queries.tool_call_states(session, loop.id)
    assert states[refund.id].state == "awaiting_approval"
    assert states[calls["lookup_order"].id].state == "answered"
    assert [c.id for c in ShopAgent(loop).pending_approvals()] == [refund.id]
    # The agent's on_wait hook saw it, and the host job it enqueued committed
    # with the wait (its queue, "notifications", is the host's).
    assert [(r.tool_call_id, r.tool, r.waits_for) for r in WAIT_REQUESTS] == [
        (refund.id, "refund", "approval")]
    notify = session.execute(text(
        "SELECT count(*) FROM solidloop_jobs WHERE queue_name = 'notifications'")).scalar()
    assert notify == 1


def test_a_policy_lets_a_small_refund_through(app, session, llm, drain):
    llm.script("refunded 20", {"content": "Done."})
    loop = start_waiting(llm, drain, session, ("refund", {"order": "8", "amount": 20}))
    assert loop_of(session, loop.id).status == "completed"
    assert calls_of(session, loop.id)["refund"].waits_for is None


def test_approve_runs_the_tool_once_and_the_loop_completes(app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("refund", {"order": "7", "amount": 80}))
    refund = calls_of(session, loop.id)["refund"]
    llm.script("refunded 80", {"content": "Refunded."})
    decided = ShopAgent(loop).approve(refund.id, by="alice")
    assert (decided.decision, decided.enqueued) == ("approved", True)
    assert loop_of(session, loop.id).status == "running"  # woken, with the call's job
    assert [j.actor_name for j in live_jobs(session, loop.id)] == ["solidloop.tool_call"]
    drain()
    assert loop_of(session, loop.id).status == "completed"
    refund = calls_of(session, loop.id)["refund"]
    assert (refund.decision, refund.decided_by, refund.is_success) == ("approved", "alice", True)
    assert refund.decided_at is not None and refund.requested_arguments is None
    assert effects(f"solidloop:tool_call:{refund.id}", "refund") != []
    assert len(effects(f"solidloop:tool_call:{refund.id}", "refund")) == 1
    assert tool_messages(session, loop.id) == ["refunded 80 on 7"]


def test_approve_with_edited_arguments_keeps_both_versions(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("refund", {"order": "7", "amount": 80}))
    refund = calls_of(session, loop.id)["refund"]
    llm.script("refunded 60", {"content": "Refunded 60."})
    ShopAgent(loop).approve(refund.id, by="bob", arguments={"order": "7", "amount": 60})
    drain()
    refund = calls_of(session, loop.id)["refund"]
    assert refund.requested_arguments == {"order": "7", "amount": 80}
    assert refund.arguments == {"order": "7", "amount": 60}
    assert tool_messages(session, loop.id) == ["refunded 60 on 7"]
    # The model's own call stays in its history as it asked for it.
    second = llm.requests[-1].json["messages"]
    assert '"amount": 80' in second[-2]["tool_calls"][0]["function"]["arguments"]


def test_deny_gives_the_model_the_reason_and_never_runs_the_tool(
        app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "ceo", "body": "hi"}))
    email = calls_of(session, loop.id)["send_email"]
    llm.script("not run", {"content": "Understood, no email."})
    decided = ShopAgent(loop).deny(email.id, "we never email the CEO", by="carol")
    assert decided.decision == "denied"
    drain()
    assert loop_of(session, loop.id).status == "completed"
    last = llm.requests[-1].json["messages"][-1]
    assert last["role"] == "tool" and "we never email the CEO" in last["content"]
    assert "denied by carol" in last["content"]
    email = calls_of(session, loop.id)["send_email"]
    assert (email.decision, email.is_success, email.error_kind) == ("denied", False, "denied")
    assert effects(f"solidloop:tool_call:{email.id}", "email") == []


def test_a_second_decision_names_the_first(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "y"}))
    email = calls_of(session, loop.id)["send_email"]
    ShopAgent(loop).deny(email.id, "no", by="dave")
    with pytest.raises(DecisionConflictError) as caught:
        ShopAgent(loop).approve(email.id, by="erin")
    assert caught.value.decision == "denied" and caught.value.decided_by == "dave"
    assert "was denied by dave at " in str(caught.value)
    # The losing decision wrote nothing and enqueued nothing more.
    assert calls_of(session, loop.id)["send_email"].decision == "denied"
    assert len(live_jobs(session, loop.id)) == 1


def test_twenty_threads_deciding_at_once_take_exactly_one_decision(
        app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "race"}))
    email = calls_of(session, loop.id)["send_email"]
    barrier = threading.Barrier(20)
    outcomes: list[str] = []
    lock = threading.Lock()

    def decide(n: int) -> None:
        with app.app_context():
            barrier.wait()
            try:
                if n % 2:
                    ShopAgent(loop.id).approve(email.id, by=f"t{n}")
                else:
                    ShopAgent(loop.id).deny(email.id, "race", by=f"t{n}")
                got = "won"
            except DecisionConflictError:
                got = "lost"
            finally:
                app.extensions["sqlalchemy"].session.remove()
            with lock:
                outcomes.append(got)

    threads = [threading.Thread(target=decide, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["lost"] * 19 + ["won"]
    jobs = live_jobs(session, loop.id)
    assert [j.actor_name for j in jobs] == ["solidloop.tool_call"]
    llm.script("sent to x", {"content": "Sent."})
    llm.script("not run", {"content": "Not sent."})
    drain()
    email = calls_of(session, loop.id)["send_email"]
    runs = effects(f"solidloop:tool_call:{email.id}", "email")
    assert len(runs) == (1 if email.decision == "approved" else 0)
    assert loop_of(session, loop.id).status == "completed"


def test_a_decision_in_the_callers_transaction_is_undone_by_its_rollback(
        app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("refund", {"order": "7", "amount": 99}))
    refund = calls_of(session, loop.id)["refund"]
    ShopAgent(loop).approve(refund.id, by="frank", session=session)
    session.rollback()
    assert calls_of(session, loop.id)["refund"].decision is None
    assert loop_of(session, loop.id).status == "waiting"
    assert live_jobs(session, loop.id) == []
    # And committed by the caller, it lands with the caller's own write.
    session.execute(text("CREATE TABLE IF NOT EXISTS audit_log (note text)"))
    session.execute(text("INSERT INTO audit_log VALUES ('approved refund')"))
    ShopAgent(loop).approve(refund.id, by="frank", session=session)
    session.commit()
    assert calls_of(session, loop.id)["refund"].decision == "approved"
    assert len(live_jobs(session, loop.id)) == 1
    session.execute(text("DROP TABLE audit_log"))
    session.commit()


def test_a_deferred_call_waits_for_the_hosts_result(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("ask_human", {"question": "ship today?"}))
    assert loop_of(session, loop.id).status == "waiting"
    ask = calls_of(session, loop.id)["ask_human"]
    assert ask.waits_for == "result"
    assert queries.tool_call_states(session, loop.id)[ask.id].state == "awaiting_result"
    assert ShopAgent(loop).pending_approvals() == []
    assert [c.id for c in ShopAgent(loop).pending_calls()] == [ask.id]
    with pytest.raises(InvalidArgumentError, match=r"is not a deferred call|needs no approval"):
        ShopAgent(loop).approve(ask.id)
    llm.script("yes, ship it", {"content": "Shipping today."})
    ShopAgent(loop).complete_call(ask.id, "yes, ship it", by="ops")
    drain()
    assert loop_of(session, loop.id).status == "completed"
    ask = calls_of(session, loop.id)["ask_human"]
    assert (ask.decision, ask.decided_by, ask.is_success) == ("completed", "ops", True)
    assert tool_messages(session, loop.id) == ["yes, ship it"]
    with pytest.raises(DecisionConflictError, match=r"answered already|was completed"):
        ShopAgent(loop).complete_call(ask.id, "again")


def test_a_deferred_result_may_be_an_error_or_an_mcp_result(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("ask_human", {"question": "a?"}),
                         ("ask_human", {"question": "b?"}))
    first, second = sorted(calls_of_list(session, loop.id), key=lambda c: c.position)
    ShopAgent(loop).complete_call(first.id, "nobody knows", is_error=True)
    assert loop_of(session, loop.id).status == "running"  # first's answer job queued
    drain()
    # The first answered, the second still waits: the loop waits again.
    assert loop_of(session, loop.id).status == "waiting"
    llm.script("structured", {"content": "Both in."})
    ShopAgent(loop).complete_call(second.id, {"content": [{"type": "text",
                                                           "text": "structured"}]})
    drain()
    assert loop_of(session, loop.id).status == "completed"
    session.expire_all()
    first, second = (session.get(ToolCall, first.id), session.get(ToolCall, second.id))
    assert (first.is_success, second.is_success) == (False, True)
    with pytest.raises(InvalidArgumentError, match="must be text"):
        ShopAgent(loop).complete_call(second.id, 42)


def calls_of_list(session, loop_id):
    session.expire_all()
    return list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))


def test_bad_decisions_get_one_line_errors_and_change_nothing(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "y"}))
    other = start_waiting(llm, drain, session, ("send_email", {"to": "z", "body": "w"}),
                          message="another email")
    email = calls_of(session, loop.id)["send_email"]
    attempts = [
        ("non-empty string", lambda: ShopAgent(loop).deny(email.id, "  ")),
        ("arguments must be a dict", lambda: ShopAgent(loop).approve(email.id, arguments=["x"])),
        (f"belongs to loop {loop.id}, not loop {other.id}",
         lambda: ShopAgent(other).approve(email.id)),
        ("there is no tool call 999999", lambda: ShopAgent(loop).approve(999999)),
        ("is not a deferred call", lambda: ShopAgent(loop).complete_call(email.id, "done")),
    ]
    for expected, attempt in attempts:
        with pytest.raises(InvalidArgumentError) as caught:
            attempt()
        assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert calls_of(session, loop.id)["send_email"].decision is None
    assert loop_of(session, loop.id).status == "waiting"


def test_sequential_calls_behind_a_waiting_call_wait_too(app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "1"}),
                         ("lookup_order", {"order": "9"}), agent=SequentialShopAgent)
    assert loop_of(session, loop.id).status == "waiting"
    calls = calls_of(session, loop.id)
    lookup = calls["lookup_order"]
    assert lookup.executed_at is None and lookup.lease_token is None
    assert live_jobs(session, loop.id) == []
    assert queries.tool_call_states(session, loop.id)[lookup.id].state == "waiting"
    llm.script("order 9", {"content": "Both done."})
    SequentialShopAgent(loop).approve(calls["send_email"].id)
    drain()
    assert loop_of(session, loop.id).status == "completed"
    assert tool_messages(session, loop.id) == ["sent to x: 1", "order 9: paid"]


def test_a_sequential_line_waits_again_at_its_next_gated_call(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("lookup_order", {"order": "1"}),
                         ("send_email", {"to": "x", "body": "2"}),
                         ("lookup_order", {"order": "3"}), agent=SequentialShopAgent)
    # The first ran; the line stopped at the email.
    assert loop_of(session, loop.id).status == "waiting"
    assert tool_messages(session, loop.id) == ["order 1: paid"]
    email = calls_of(session, loop.id)["send_email"]
    llm.script("order 3", {"content": "All three."})
    SequentialShopAgent(loop).approve(email.id)
    drain()
    assert loop_of(session, loop.id).status == "completed"
    assert tool_messages(session, loop.id) == ["order 1: paid", "sent to x: 2", "order 3: paid"]


def test_a_decision_on_a_paused_loop_is_kept_and_acts_on_resume(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "y"}))
    email = calls_of(session, loop.id)["send_email"]
    assert ShopAgent(loop).pause() is True
    decided = ShopAgent(loop).approve(email.id, by="gina")
    assert decided.enqueued is False
    assert loop_of(session, loop.id).status == "paused"
    assert live_jobs(session, loop.id) == []
    llm.script("sent to x", {"content": "Sent after all."})
    assert ShopAgent(loop).resume() is True
    assert loop_of(session, loop.id).status == "running"
    drain()
    assert loop_of(session, loop.id).status == "completed"


def test_a_waiting_loop_paused_and_resumed_waits_again(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "y"}))
    ShopAgent(loop).pause()
    assert ShopAgent(loop).resume() is True
    assert loop_of(session, loop.id).status == "waiting"
    assert live_jobs(session, loop.id) == []
    ShopAgent(loop).stop(reason="changed my mind")
    assert loop_of(session, loop.id).status == "failed"
    ShopAgent(loop).deny(calls_of(session, loop.id)["send_email"].id, "no longer needed")
    llm.script("not run", {"content": "OK."})
    ShopAgent(loop).resume(from_=("failed",))
    drain()
    assert loop_of(session, loop.id).status == "completed"


def test_resuming_with_a_message_cancels_the_waiting_call(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "y"}))
    ShopAgent(loop).pause()
    llm.script("forget the email", {"content": "Forgotten."})
    ShopAgent(loop).resume(message="forget the email")
    drain()
    assert loop_of(session, loop.id).status == "completed"
    email = calls_of(session, loop.id)["send_email"]
    assert email.error_kind == "cancelled" and email.decision is None
    with pytest.raises(DecisionConflictError, match="answered already"):
        ShopAgent(loop).approve(email.id)


def test_an_approval_timeout_approves_or_denies_as_its_tool_says(
        app, session, llm, drain, effects):
    loop = start_waiting(llm, drain, session, ("nudge", {"note": "a"}), ("risky", {"note": "b"}))
    calls = calls_of(session, loop.id)
    nudge, risky = calls["nudge"], calls["risky"]
    assert nudge.wait_deadline is not None and risky.wait_deadline is not None
    timeouts = [j for j in live_jobs(session, loop.id)
                if j.actor_name == "solidloop.wait_timeout"]
    # Committed with the wait, due at its deadline (a second after, on the
    # database's clock), not before.
    assert len(timeouts) == 2
    for job in timeouts:
        assert 0.9 < (job.eta - job.created_at).total_seconds() < 1.5
    time.sleep(1.2)
    llm.script(lambda body: len([m for m in body["messages"] if m["role"] == "tool"]) == 2,
               {"content": "Timed out both ways."})
    drain()
    assert loop_of(session, loop.id).status == "completed"
    calls = calls_of(session, loop.id)
    assert (calls["nudge"].decision, calls["nudge"].decided_by) == ("approved", "timeout")
    assert (calls["risky"].decision, calls["risky"].decided_by) == ("denied", "timeout")
    assert len(effects(f"solidloop:tool_call:{nudge.id}", "nudge")) == 1
    assert effects(f"solidloop:tool_call:{risky.id}", "risky") == []
    assert any("before the approval's timeout" in m for m in tool_messages(session, loop.id))


def test_a_result_timeout_answers_with_an_error(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("webhook", {"ref": "r1"}))
    time.sleep(1.2)
    llm.script("no result came", {"content": "The webhook never came."})
    drain()
    assert loop_of(session, loop.id).status == "completed"
    hook = calls_of(session, loop.id)["webhook"]
    assert (hook.decision, hook.decided_by, hook.is_success, hook.error_kind) == (
        "completed", "timeout", False, "timeout")


def test_a_decision_that_commits_first_wins_over_its_timeout(app, session, llm, drain):
    loop = start_waiting(llm, drain, session, ("risky", {"note": "c"}))
    risky = calls_of(session, loop.id)["risky"]
    ShopAgent(loop).approve(risky.id, by="hank")
    time.sleep(1.2)
    llm.script("risky: c", {"content": "Ran."})
    drain()  # the tool job, and the timeout job, which finds nothing to decide
    risky = calls_of(session, loop.id)["risky"]
    assert (risky.decision, risky.decided_by, risky.is_success) == ("approved", "hank", True)
    assert loop_of(session, loop.id).status == "completed"


def test_the_agents_policy_gates_a_remote_style_tool_and_a_raising_policy_gates_too(
        app, session, llm, drain, caplog):
    loop = start_waiting(llm, drain, session, ("lookup_order", {"order": "vip-1"}),
                         ("lookup_order", {"order": "crash"}),
                         ("lookup_order", {"order": "plain"}), agent=PolicyShopAgent)
    calls = sorted(calls_of_list(session, loop.id), key=lambda c: c.position)
    assert [c.waits_for for c in calls] == ["approval", "approval", None]
    assert "approval_policy for 'lookup_order' raised" in caplog.text


def test_a_raising_on_wait_hook_loses_its_writes_but_not_the_wait(
        app, session, llm, drain, caplog):
    loop = start_waiting(llm, drain, session, ("send_email", {"to": "boom", "body": "x"}))
    assert loop_of(session, loop.id).status == "waiting"
    assert "on_wait raised" in caplog.text
    notify = session.execute(text(
        "SELECT count(*) FROM solidloop_jobs WHERE queue_name = 'notifications'")).scalar()
    assert notify == 0


def test_signals_announce_each_wait_and_each_decision(app, session, llm, drain):
    got = []

    def receive(name):
        return lambda sender, **data: got.append((name, data))

    receivers = {name: receive(name) for name in
                 ("approval_requested", "result_requested", "tool_call_decided")}
    for name, fn in receivers.items():
        getattr(signals, name).connect(fn, sender=app)
    try:
        loop = start_waiting(llm, drain, session, ("send_email", {"to": "x", "body": "s"}),
                             ("ask_human", {"question": "q"}))
        calls = calls_of(session, loop.id)
        ShopAgent(loop).deny(calls["send_email"].id, "no", by="ivy", session=session)
        assert [n for n, _ in got] == ["approval_requested", "result_requested"]
        session.commit()  # the decision's signal waits for the caller's commit
    finally:
        for name, fn in receivers.items():
            getattr(signals, name).disconnect(fn, sender=app)
    assert got[0][1]["tool"] == "send_email" and got[0][1]["arguments"] == {"to": "x",
                                                                             "body": "s"}
    assert got[2] == ("tool_call_decided", {"loop_id": loop.id,
                                            "tool_call_id": calls["send_email"].id,
                                            "decision": "denied", "by": "ivy"})


# -- the command line -----------------------------------------------------------------


def test_the_cli_lists_approves_denies_and_completes(app, session, llm, drain):
    runner = app.test_cli_runner()
    loop = start_waiting(llm, drain, session, ("refund", {"order": "5", "amount": 70}),
                         ("send_email", {"to": "x", "body": "b"}),
                         ("ask_human", {"question": "why?"}))
    calls = calls_of(session, loop.id)
    listing = runner.invoke(args=["solidloop", "approvals"])
    assert listing.exit_code == 0, listing.output
    assert f"{calls['refund'].id:>7} {loop.id:>7}  approval refund" in listing.output
    assert '"amount": 70' in listing.output and "ask_human" not in listing.output
    assert "ask_human" in runner.invoke(args=["solidloop", "approvals", "--results"]).output
    assert "nothing awaits" in runner.invoke(
        args=["solidloop", "approvals", "--agent", "assistant"]).output
    waiting = runner.invoke(args=["solidloop", "list", "--status", "waiting"])
    assert f"{loop.id:>7}  shop" in waiting.output and "waiting" in waiting.output
    status = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert "status=waiting" in status.output
    assert f"awaiting approval: `flask solidloop approve {calls['refund'].id}`" in status.output
    assert f"awaiting its result: `flask solidloop complete {calls['ask_human'].id}" \
        in status.output

    bad = runner.invoke(args=["solidloop", "approve", str(calls["refund"].id),
                              "--arguments", "[1]"])
    assert bad.exit_code == 2 and "must be a JSON object" in bad.output
    approved = runner.invoke(args=["solidloop", "approve", str(calls["refund"].id),
                                   "--arguments", '{"order": "5", "amount": 50}', "--by", "jo"])
    assert approved.exit_code == 0, approved.output
    assert f"tool call {calls['refund'].id} (loop {loop.id}) approved; its job is queued" \
        in approved.output
    again = runner.invoke(args=["solidloop", "deny", str(calls["refund"].id),
                                "--reason", "late"])
    assert again.exit_code == 1 and "was approved by jo at" in again.output
    denied = runner.invoke(args=["solidloop", "deny", str(calls["send_email"].id),
                                 "--reason", "no mail today"])
    assert denied.exit_code == 0 and "denied" in denied.output
    missing = runner.invoke(args=["solidloop", "deny", str(calls["send_email"].id)])
    assert missing.exit_code == 2 and "--reason" in missing.output
    llm.script("the customer asked", {"content": "All handled."})
    completed = runner.invoke(args=["solidloop", "complete", str(calls["ask_human"].id),
                                    "the customer asked"])
    assert completed.exit_code == 0, completed.output
    drain()
    assert loop_of(session, loop.id).status == "completed"
    calls = calls_of(session, loop.id)
    assert calls["send_email"].decided_by.startswith("cli")
    status = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert "approved by jo (with edited arguments)" in status.output
    assert "denied by cli" in status.output and ": no mail today" in status.output


def test_a_timeout_racing_a_decision_takes_exactly_one(app, session, llm, drain, pg):
    from flask_solidloop.runtime.turns import wait_timeout_job

    state = app.extensions["solidloop"]
    llm.script("risky: race", {"content": "Ran."})
    llm.script("before the approval's timeout", {"content": "Timed out."})
    winners = []
    for round_ in range(8):
        loop = start_waiting(llm, drain, session, ("risky", {"note": f"race {round_}"}),
                             message=f"risky race {round_}")
        call = calls_of(session, loop.id)["risky"]
        session.rollback()
        pg.execute("UPDATE solidloop_tool_calls SET wait_deadline = now() - interval '1 second' "
                   "WHERE id = %s", (call.id,))
        barrier = threading.Barrier(2)
        lost: list[DecisionConflictError] = []

        def time_it_out(call_id=call.id, barrier=barrier):
            with app.app_context():
                barrier.wait()
                try:
                    wait_timeout_job(state, call_id)
                finally:
                    app.extensions["sqlalchemy"].session.remove()

        def approve_it(call_id=call.id, loop_id=loop.id, barrier=barrier, lost=lost):
            with app.app_context():
                barrier.wait()
                try:
                    ShopAgent(loop_id).approve(call_id, by="staff")
                except DecisionConflictError as exc:
                    lost.append(exc)
                finally:
                    app.extensions["sqlalchemy"].session.remove()

        threads = [threading.Thread(target=time_it_out), threading.Thread(target=approve_it)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        decided = calls_of(session, loop.id)["risky"]
        winners.append(decided.decided_by)
        if decided.decided_by == "staff":
            assert decided.decision == "approved" and lost == []
        else:
            assert (decided.decided_by, decided.decision) == ("timeout", "denied")
            assert [e.decided_by for e in lost] == ["timeout"]
        # Either way, one job for the call (beside the timeout's own job, run
        # here by hand: when it comes, it finds nothing to decide), and the
        # loop finishes.
        assert sorted(j.actor_name for j in live_jobs(session, loop.id)) == [
            "solidloop.tool_call", "solidloop.wait_timeout"]
        pg.execute("UPDATE solidloop_jobs SET eta = now() "
                   "WHERE actor_name = 'solidloop.wait_timeout' AND state = 'queued'")
        drain()
        assert loop_of(session, loop.id).status == "completed"
    assert set(winners) <= {"staff", "timeout"}
