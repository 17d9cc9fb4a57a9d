"""Loops put in a given state for the tests that start from it."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import func, update

from flask_solidloop.models import Job, Loop
from flask_solidloop.testing import drain as run

from ..support.support_app import Assistant


def running_loop(session, *, lease_seconds: float = 60) -> tuple[int, uuid.UUID]:
    """A loop claimed by a (pretend) worker: running, with a token and a lease."""
    loop = Assistant.start(message="hello there")
    token = uuid.uuid4()
    session.execute(update(Job).where(Job.loop_id == loop.id).values(state="done"))
    session.execute(update(Loop).where(Loop.id == loop.id).values(
        status="running", execution_token=token,
        lease_expires_at=func.now() + timedelta(seconds=lease_seconds),
        started_at=func.now(), run_started_at=func.now()))
    session.commit()
    return loop.id, token


def tool_phase(app, session, llm, *, calls: int = 1) -> int:
    """A loop in its tool phase: its first LLM turn asked for ``calls`` calls
    (their jobs queued, not run), then answers once they are answered."""
    llm.script("tools", {"tool_calls": [
        {"name": "add", "arguments": {"a": i, "b": 1}} for i in range(calls)]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "all done"})
    loop = Assistant.start(message="tools please")
    run(app, queues=("solidloop_llm",))
    return loop.id
