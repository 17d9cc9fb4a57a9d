"""Structured output on real ``flask solidloop worker`` processes: a fleet
SIGKILLed while the retry turn (the one an invalid answer's error asked for)
streams; another fleet takes the turn over, and the loop records one error
message and one valid answer (docs/decisions/0036-structured-output.md)."""

from __future__ import annotations

import json
import signal

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message

from ..support.support_app import Profile, ProfileAgent
from .test_approvals_workers import fleet, poll  # noqa: F401 - fleet is a fixture
from .test_e2e_workers import kill_group

pytestmark = pytest.mark.e2e

#: Partial text written onto the hidden shell (text deltas off) every 50 ms.
FAST_PARTIALS = {"SOLIDLOOP_STREAM_UPDATE_INTERVAL": 0.05, "SOLIDLOOP_STREAM_MAX_HZ": 0}
GOOD = {"name": " ".join(["Ada Lovelace"] * 40), "city": "London"}
MARK = "does not match the required output schema"


@pytest.fixture
def profile_fleet(fleet, monkeypatch):  # noqa: F811 - the imported fixture
    from . import test_approvals_workers

    monkeypatch.setattr(test_approvals_workers, "WORKER_CONFIG",
                        {**test_approvals_workers.WORKER_CONFIG, **FAST_PARTIALS})
    return fleet


def rows(session, loop_id):
    session.expire_all()
    found = list(session.scalars(select(Message).where(Message.loop_id == loop_id)
                                 .order_by(Message.id)))
    return found


def retry_streaming(session, loop_id):
    """The retry turn's shell, once some of its text has been written."""
    messages = rows(session, loop_id)
    asked = any(m.role == "user" and m.meta.get("output_retry") for m in messages)
    return asked and any(m.status == "processing" and m.content for m in messages)


def test_a_retry_turn_killed_mid_stream_is_taken_over_once(app, session, llm, profile_fleet):
    llm.fault_next("slow_prefill", seconds=0)       # the first request: as it is
    llm.fault_next("slow_stream", seconds=0.1)      # the retry: slow enough to kill
    llm.script("who is ada", {"output": {"name": "Ada"}})   # city missing
    llm.script(MARK, {"output": GOOD})
    first = profile_fleet("first")
    loop_id = ProfileAgent.start(message="Who is Ada?").id
    poll(session, lambda: retry_streaming(session, loop_id), what="the retry turn to stream")
    kill_group(first, signal.SIGKILL)

    profile_fleet("second")
    poll(session, lambda: session.get(Loop, loop_id).status in ("completed", "failed"),
         timeout=120, what="the second fleet to take the retry turn over")
    loop = session.get(Loop, loop_id)
    assert loop.status == "completed", loop.error_message
    assert loop.output == GOOD
    visible = [(m.role, m.meta.get("output_retry")) for m in rows(session, loop_id)
               if not m.is_hidden]
    assert visible == [("system", None), ("user", None), ("assistant", None), ("user", 1),
                       ("assistant", None)]
    profile = ProfileAgent(loop_id).output()
    assert isinstance(profile, Profile) and profile.city == "London"
    # The killed turn's request went again, the same: nothing was added between.
    chats = [r.json for r in llm.requests if r.method == "POST" and r.json]
    assert len(chats) == 3 and chats[1] == chats[2]
    assert MARK in chats[2]["messages"][-1]["content"]
    assert json.loads(rows(session, loop_id)[-1].content) == GOOD
    # The killed turn's partial answer is kept hidden, out of the history.
    hidden = [m for m in rows(session, loop_id) if m.is_hidden]
    assert [(m.role, m.status) for m in hidden] == [("assistant", "failed")]
    assert hidden[0].content and json.dumps(GOOD).startswith(hidden[0].content)
