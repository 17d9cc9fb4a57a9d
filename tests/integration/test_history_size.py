"""A long history (docs/decisions/0018-no-fault-ends-a-loop.md, item 4): read as
rows instead of one JSON value past loops/sql.HISTORY_INLINE_BYTES, sent as a
streamed body with its Content-Length, and refused past
SOLIDLOOP_MAX_HISTORY_BYTES before anything is sent."""

from __future__ import annotations

import dataclasses

from flask_solidloop.llm.client import STREAMED_BODY_CHARS
from flask_solidloop.loops.sql.parts import HISTORY_INLINE_BYTES
from flask_solidloop.models import Loop

from ..support.support_app import Assistant


def finished(session, loop_id):
    session.expire_all()
    loop = session.get(Loop, loop_id)
    session.rollback()
    return loop


def test_a_history_past_the_inline_limit_is_read_as_rows_and_sent_whole(
        app, session, llm, drain):
    big = "y" * (max(HISTORY_INLINE_BYTES, STREAMED_BODY_CHARS) + 1000)
    llm.script(lambda body: True, {"content": "read it all"})
    loop = Assistant.start(message=big)
    drain()
    assert finished(session, loop.id).status == "completed"
    (request,) = llm.requests
    assert request.json["messages"][-1]["content"] == big  # every character arrived
    # Sent with its length, not chunked: every provider takes that.
    assert int(request.headers["content-length"]) == len(request.body.encode())
    assert "transfer-encoding" not in request.headers


def test_a_history_past_the_cap_fails_the_loop_before_sending(app, state, session, llm,
                                                               drain, monkeypatch):
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config,
                                                             max_history_bytes=5000))
    loop = Assistant.start(message="z" * 6000)
    drain()
    failed = finished(session, loop.id)
    assert failed.status == "failed"
    assert failed.error_message.startswith(
        "HistoryTooLargeError: the loop's history is 6,025 characters of text, past "
        "SOLIDLOOP_MAX_HISTORY_BYTES (5,000 characters); no model takes a prompt that large")
    assert llm.requests == []  # nothing was sent, or billed
