"""flask solidloop ... through Flask's CLI runner."""

from __future__ import annotations

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import SolidLoop
from flask_solidloop.models import Loop

from ..support.support_app import Assistant


@pytest.fixture
def runner(app):
    return app.test_cli_runner()


def test_help_is_useful(runner):
    result = runner.invoke(args=["solidloop", "--help"])
    assert result.exit_code == 0
    for command in ("worker", "db", "start", "status", "pause", "resume", "stop", "demo"):
        assert command in result.output
    worker_help = runner.invoke(args=["solidloop", "worker", "--help"])
    assert "--processes" in worker_help.output and "--threads" in worker_help.output
    assert "threads + 1" in worker_help.output


def test_db_upgrade_and_current(runner):
    result = runner.invoke(args=["solidloop", "db", "upgrade"])
    assert result.exit_code == 0, result.output
    current = runner.invoke(args=["solidloop", "db", "current"])
    from flask_solidloop.migrations import head_revision

    assert f"applied: {head_revision()}" in current.output


def test_start_and_status(runner, llm, drain, session):
    llm.script("cli", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]})
    llm.script("2", {"content": "two"})
    result = runner.invoke(args=["solidloop", "start", "assistant", "cli please"])
    assert result.exit_code == 0, result.output
    assert "loop 1 queued" in result.output
    drain()
    status = runner.invoke(args=["solidloop", "status", "1"])
    assert status.exit_code == 0
    assert "status=completed" in status.output
    assert "-> tool call add" in status.output and "[ok]" in status.output
    assert "two" in status.output


def test_start_unknown_agent_is_a_clear_error(runner):
    result = runner.invoke(args=["solidloop", "start", "nobody", "hi"])
    assert result.exit_code == 1
    assert "agent 'nobody' is not registered; known agents:" in result.output


def test_pause_resume_stop_commands(runner, session):
    loop = Assistant.start(message="x")
    assert "paused" in runner.invoke(args=["solidloop", "pause", str(loop.id)]).output
    again = runner.invoke(args=["solidloop", "pause", str(loop.id)])
    assert again.exit_code == 1 and "nothing was paused" in again.output
    assert "resumed" in runner.invoke(args=["solidloop", "resume", str(loop.id)]).output
    out = runner.invoke(args=["solidloop", "stop", str(loop.id), "--reason", "bye"]).output
    assert "stopped" in out
    session.expire_all()
    assert session.get(Loop, loop.id).error_message == "bye"


def test_status_of_missing_loop(runner):
    result = runner.invoke(args=["solidloop", "status", "999"])
    assert result.exit_code == 1 and "no loop with id 999" in result.output


def test_unreachable_database_names_the_url():
    app = Flask("unreachable")
    app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql+psycopg://u:pw@127.0.0.1:1/nowhere"
    SolidLoop(app, SQLAlchemy(app))
    result = app.test_cli_runner().invoke(args=["solidloop", "db", "upgrade"])
    assert result.exit_code == 1
    assert "cannot connect to PostgreSQL at postgresql+psycopg://u:***@127.0.0.1:1/nowhere" \
        in result.output


def test_reap_and_prune_commands(app, runner, session):
    result = runner.invoke(args=["solidloop", "reap"])
    assert result.exit_code == 0, result.output
    assert "reap: expired_llm=0" in result.output
    result = runner.invoke(args=["solidloop", "prune"])
    assert result.exit_code == 0 and "prune: events=0 jobs=0" in result.output
    assert "--every" in runner.invoke(args=["solidloop", "reap", "--help"]).output


def test_force_stop_freeze_unfreeze_commands(runner, session):
    loop = Assistant.start(message="x")
    assert "frozen" in runner.invoke(args=["solidloop", "freeze", str(loop.id)]).output
    refused = runner.invoke(args=["solidloop", "resume", str(loop.id)])
    assert refused.exit_code == 1 and "is frozen; run `flask solidloop unfreeze" in refused.output
    assert "unfrozen" in runner.invoke(args=["solidloop", "unfreeze", str(loop.id)]).output
    out = runner.invoke(args=["solidloop", "force-stop", str(loop.id)]).output
    assert "force stopped" in out
    session.expire_all()
    assert session.get(Loop, loop.id).error_message == "force stopped: from the command line"


def test_status_says_who_holds_each_tool_call(app, runner, llm, session):
    """Each call shows running (holder and lease expiry), queued, or answered."""
    import uuid

    from flask_solidloop.leases import worker_identity
    from flask_solidloop.loops import store
    from flask_solidloop.models import ToolCall
    from flask_solidloop.state import get_state
    from flask_solidloop.testing import drain as run

    llm.script("two calls", {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}},
                                            {"name": "add", "arguments": {"a": 2, "b": 2}}]})
    loop = Assistant.start(message="two calls")
    run(app, queues=("solidloop_llm",))
    session.expire_all()
    first, _second = session.query(ToolCall).order_by(ToolCall.position).all()
    loop_row = session.get(Loop, loop.id)
    outcome, lease = store.claim_tool_call(get_state(), session, first,
                                           loop_row.execution_token, sequential=False,
                                           lease_seconds=30)
    assert outcome is store.ToolClaim.CLAIMED and isinstance(lease, uuid.UUID)
    # The call object holds the claim as written (no reload), on SQLAlchemy 2.0
    # too, which does not refresh it from the UPDATE's RETURNING by itself.
    assert (first.lease_token, first.lease_holder) == (lease, worker_identity())
    status = runner.invoke(args=["solidloop", "status", str(loop.id)])
    assert status.exit_code == 0, status.output
    assert f"[running on {worker_identity()}, lease until " in status.output
    assert "[queued]" in status.output  # the second call's job waits in the queue
    assert "[pending]" not in status.output


def test_resume_of_a_completed_loop_needs_a_message_or_again(runner, llm, drain, session):
    llm.script("done", {"content": "finished"})
    loop = Assistant.start(message="done")
    drain()
    refused = runner.invoke(args=["solidloop", "resume", str(loop.id)])
    assert refused.exit_code == 1
    assert "is completed" in refused.output and "--message" in refused.output
    assert "--again" in refused.output
    session.expire_all()
    assert session.get(Loop, loop.id).status == "completed"  # nothing was queued
    again = runner.invoke(args=["solidloop", "resume", str(loop.id), "--again"])
    assert again.exit_code == 0, again.output
    continued = runner.invoke(args=["solidloop", "resume", "--from", "completed",
                                    str(loop.id), "--message", "and then?"])
    assert continued.exit_code == 1  # already queued by --again: nothing to resume
    assert "stop" in runner.invoke(args=["solidloop", "stop", "--help"]).output
    assert "can be resumed" in runner.invoke(args=["solidloop", "stop", "--help"]).output


def test_list_finds_loops_by_status_agent_age_and_shows_why_they_failed(
        runner, llm, drain, session):
    from flask_solidloop.cli import parse_since

    llm.script("ok", {"content": "fine"})
    done = Assistant.start(message="ok please")
    drain()
    failed = Assistant.start(message="doomed")
    Assistant(failed).stop(reason="the order was cancelled by the customer long ago")
    waiting = Assistant.start(message="later")
    everything = runner.invoke(args=["solidloop", "list"])
    assert everything.exit_code == 0, everything.output
    lines = everything.output.splitlines()
    assert lines[0].split() == ["id", "agent", "status", "steps", "tokens", "cost", "budget",
                                "age", "reason"]
    assert [int(x.split()[0]) for x in lines[1:]] == [waiting.id, failed.id, done.id]
    done_row = next(x for x in lines if x.split()[0] == str(done.id))
    assert done_row.split()[1:5] == ["assistant", "completed", "1", done_row.split()[4]]
    assert int(done_row.split()[4]) > 0 and "$" in done_row and done_row.split()[6] == "-"
    assert done_row.split()[7].endswith("s")
    only_failed = runner.invoke(args=["solidloop", "list", "--failed"]).output.splitlines()
    assert len(only_failed) == 2 and "the order was cancelled" in only_failed[1]
    queued = runner.invoke(args=["solidloop", "list", "--status", "queued"]).output
    assert str(waiting.id) in queued and "completed" not in queued
    assert runner.invoke(args=["solidloop", "list", "--agent", "nobody"]).output.strip() \
        == "no loops match"
    assert runner.invoke(args=["solidloop", "list", "--limit", "1"]).output.splitlines()[-1] \
        == "(newest 1; --limit shows more)"
    assert "no loops match" in runner.invoke(
        args=["solidloop", "list", "--since", "2999-01-01"]).output
    assert str(done.id) in runner.invoke(args=["solidloop", "list", "--since", "1h"]).output
    bad = runner.invoke(args=["solidloop", "list", "--since", "yesterday"])
    assert bad.exit_code == 2 and "neither a duration (30m, 2h, 7d) nor an ISO date" in bad.output
    assert parse_since("2025-01-31").tzinfo is not None


def test_workers_lists_whole_identities_and_queue_names(runner, session):
    from flask_solidloop.models import Worker

    long_host = "helpdesk-worker-07.eu-west-1.compute.internal"
    queues = ["solidloop_llm", "solidloop_tool", "solidloop_maintenance",
              "helpdesk_nightly_ticket_rollup"]
    session.add_all([Worker(identity=f"{long_host}:4242", host=long_host, pid=4242,
                            threads=8, queues=queues),
                     Worker(identity="w:1", host="w", pid=1, threads=1, queues=["solidloop_llm"])])
    session.commit()
    result = runner.invoke(args=["solidloop", "workers"])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    row = next(line for line in lines if line.startswith(f"{long_host}:4242 "))
    assert f" {','.join(queues)} " in row, row
    # The columns still line up: each row's queues start under the header's.
    short = next(line for line in lines if line.startswith("w:1 "))
    assert row.index("solidloop_llm") == short.index("solidloop_llm") == header.index("queues")
