"""End to end with real ``dramatiq`` worker subprocesses against PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop.models import Loop, Message, ToolCall

from ..support.support_app import DATABASE_URL_ENV, LLM_URL_ENV, Assistant

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def spawn_workers(cmd: list[str], *, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["FLASK_APP"] = "tests.support.support_app:create_app()"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    assert env.get(DATABASE_URL_ENV) and env.get(LLM_URL_ENV)
    handle = open(log, "wb")  # noqa: SIM115 - closed when the process is reaped
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(session, loop_ids, *, timeout: float, proc: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        session.expire_all()
        statuses = {lid: session.get(Loop, lid).status for lid in loop_ids}
        session.rollback()
        if all(s in ("completed", "failed", "paused") for s in statuses.values()):
            return statuses
        if proc.poll() is not None:
            pytest.fail(f"workers exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"loops not finished after {timeout}s: {statuses}\n"
                        f"{log.read_text()[-4000:]}")
        time.sleep(0.1)


def script_tool_round_trip(llm) -> None:
    llm.script("add", {"content": "adding", "tool_calls": [
        {"name": "add", "arguments": {"a": 20, "b": 22}},
        {"name": "lookup", "arguments": {"key": "abc"}},
    ]})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool", {"content": "42, done"})


def assert_completed_once(session, loop_ids) -> None:
    for loop_id in loop_ids:
        loop = session.get(Loop, loop_id)
        assert loop.status == "completed", loop.error_message
        calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
        assert len(calls) == 2 and all(c.is_success for c in calls)
        tool_messages = list(session.scalars(
            select(Message).where(Message.loop_id == loop_id, Message.role == "tool")))
        assert sorted(m.tool_call_id for m in tool_messages) == sorted(c.id for c in calls)
        assistants = list(session.scalars(
            select(Message).where(Message.loop_id == loop_id, Message.role == "assistant",
                                  Message.is_hidden.is_(False)).order_by(Message.id)))
        assert [m.content for m in assistants] == ["adding", "42, done"]


def test_dramatiq_cli_workers_run_loops_to_completion(app, session, llm, tmp_path):
    script_tool_round_trip(llm)
    log = tmp_path / "workers.log"
    proc = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                          "--processes", "2", "--threads", "2"], log=log)
    try:
        loop_ids = [Assistant.start(message=f"add please #{i}").id for i in range(6)]
        wait_for(session, loop_ids, timeout=60, proc=proc, log=log)
        assert_completed_once(session, loop_ids)
    finally:
        kill_group(proc)


def test_flask_worker_command_survives_a_killed_worker(app, session, llm, tmp_path):
    """SIGKILL the whole worker fleet between loops; a new fleet finishes the rest."""
    script_tool_round_trip(llm)
    log = tmp_path / "workers.log"
    cmd = [sys.executable, "-m", "flask", "solidloop", "worker", "--processes", "1",
           "--threads", "2"]
    proc = spawn_workers(cmd, log=log)
    try:
        first = [Assistant.start(message="add first").id]
        wait_for(session, first, timeout=60, proc=proc, log=log)
        kill_group(proc, signal.SIGKILL)
        # queued while no worker runs: nothing is lost, the next fleet picks it up
        second = [Assistant.start(message=f"add second #{i}").id for i in range(3)]
        proc = spawn_workers(cmd, log=log)
        wait_for(session, second, timeout=60, proc=proc, log=log)
        assert_completed_once(session, first + second)
    finally:
        kill_group(proc)
