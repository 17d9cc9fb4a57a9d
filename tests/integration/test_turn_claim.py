"""The LLM turn's claim, initialization and shell share one transaction
(store.start_llm_turn / commit_claim). What must hold while it is open."""

from __future__ import annotations

from sqlalchemy import select

from flask_solidloop import Agent
from flask_solidloop.models import Event, Job, Loop, Message
from flask_solidloop.state import get_state

from ..support.support_app import calc, llm_settings, solidloop


class RenewWhileClaiming:
    """A middleware before AgentInitialization: it runs inside the claim's open
    transaction and makes the process's lease renewer run a pass right then."""

    def __init__(self, next_step):
        self.next_step = next_step

    def __call__(self, ctx):
        get_state().renewer().renew_once()
        return self.next_step(ctx)


@solidloop.agent("renew_while_claiming")
class RenewWhileClaimingAgent(Agent):
    system_prompt = "You answer."
    mcps = [{"name": "calc", "toolset": calc}]

    def llm(self) -> dict:
        return llm_settings()

    def configure_llm_middlewares(self, builder) -> None:
        from flask_solidloop.pipeline.llm_stack import AgentInitialization

        builder.insert_before(AgentInitialization, RenewWhileClaiming)


def test_a_renewal_while_the_claim_is_uncommitted_does_not_lose_the_turn(
        app, session, llm, drain):
    """A renewal reads committed rows: inside the claim's transaction it would see
    the loop still queued and call the lease lost. The lease is registered with
    the renewer only once the claim commits, so the turn goes on."""
    llm.script("hello", {"content": "hi"})
    loop = RenewWhileClaimingAgent.start(message="hello")
    drain()
    session.expire_all()
    done = session.get(Loop, loop.id)
    assert done.status == "completed", (done.status, done.error_message)
    assert len(llm.requests) == 1


def test_one_commit_holds_the_claim_the_job_and_the_shell(app, session, llm, database_url):
    """Between the claim and the request, the turn's writes are one transaction:
    seen from outside, the loop is queued with no shell, or running with its
    shell; never in between. (Run outside a worker, no job is marked.)"""
    import psycopg

    from flask_solidloop.loops import store
    from flask_solidloop.queue.broker import libpq_url

    from ..support.support_app import Assistant

    loop = Assistant.start(message="hello")
    claim = store.start_llm_turn(session, loop.id, lease_seconds=30)
    assert claim is not None
    shell_id = store.open_shell(session, loop.id, claim.token, claim)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as outside:
        def seen():
            status = outside.execute("SELECT status FROM solidloop_loops WHERE id = %s",
                                     (loop.id,)).fetchone()[0]
            shells = outside.execute("SELECT count(*) FROM solidloop_messages WHERE id = %s",
                                     (shell_id,)).fetchone()[0]
            return status, shells
        assert seen() == ("queued", 0)
        store.commit_claim(session, claim)
        assert seen() == ("running", 1)
    session.expire_all()
    assert session.get(Message, shell_id).status == "processing"
    assert session.scalars(select(Event)).all() == []
    assert {j.state for j in session.scalars(select(Job))} == {"queued"}  # no job of ours ran
