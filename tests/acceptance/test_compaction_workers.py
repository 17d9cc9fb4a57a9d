"""Compaction with real ``flask solidloop worker`` processes: a worker fleet
SIGKILLed while the summarizer's answer is on its way leaves no summary and
marks nothing; the next fleet runs the summary turn again, and the loop ends
with exactly one summary for the span (docs/decisions/0038-compaction.md)."""

from __future__ import annotations

import signal
import threading

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message, ToolCall
from flask_solidloop.pipeline.compaction import DEFAULT_INSTRUCTIONS

from ..support.support_app import QuickCompactingAgent
from .test_approvals_workers import fleet, poll  # noqa: F401 - fleet is a fixture
from .test_e2e_workers import kill_group

pytestmark = pytest.mark.e2e

TURNS = 8


def test_a_worker_killed_during_a_summary_turn_leaves_one_summary(
        app, session, llm, fleet):  # noqa: F811 - the imported fixture
    summary_asked = threading.Event()
    release = threading.Event()
    summary_requests: list[dict] = []
    asked: list[int] = []

    def reply(body: dict) -> dict:
        if body["messages"][0]["content"] == DEFAULT_INSTRUCTIONS:
            summary_requests.append(body)
            if len(summary_requests) == 1:
                # The first summary's answer is held until its worker is dead.
                summary_asked.set()
                release.wait(60)
            return {"content": f"Summary {len(summary_requests)}: pages read so far."}
        if len(asked) == TURNS:
            return {"content": "Done reading."}
        asked.append(len(asked) + 1)
        return {"tool_calls": [{"name": "read_page", "arguments": {"page": asked[-1]}}]}

    llm.script(lambda body: True, reply)
    first = fleet("first")
    loop_id = QuickCompactingAgent.start(message="Read the book.").id
    try:
        assert summary_asked.wait(120), "the summary turn never started"
        kill_group(first, signal.SIGKILL)
    finally:
        release.set()
    # Nothing of the killed summary turn is written: no summary, nothing marked.
    session.expire_all()
    rows = list(session.scalars(select(Message).where(Message.loop_id == loop_id)))
    assert [m for m in rows if m.kind == "summary" or m.compacted_by is not None] == []
    assert session.get(Loop, loop_id).status == "running"  # its lease outlives the worker
    session.rollback()

    fleet("second")
    poll(session, lambda: session.get(Loop, loop_id).status == "completed", timeout=120,
         what="the loop to run its summary turn again and finish")
    assert len(summary_requests) == 2  # the killed one, and the one run again
    assert asked == list(range(1, TURNS + 1))
    rows = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                .order_by(Message.id)))
    (summary,) = [m for m in rows if m.kind == "summary"]
    assert summary.content.endswith("Summary 2: pages read so far.")
    replaced = [m for m in rows if m.compacted_by is not None]
    assert replaced and {m.compacted_by for m in replaced} == {summary.id}
    assert len(replaced) == summary.meta["replaced"]
    # Every original message is kept: the prompt, the task, each call and its
    # result, the answer.
    originals = [m for m in rows if m.kind == "message"]
    assert [m.role for m in originals] == (["system", "user"] + ["assistant", "tool"] * TURNS
                                           + ["assistant"])
    calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
    assert len(calls) == TURNS and all(c.response_message_id is not None for c in calls)
