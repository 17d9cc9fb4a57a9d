"""A real Prometheus (Debian's binary, a config and data directory of its own)
scrapes real worker processes running loops, and its HTTP API answers with
the turn and tool-call counts our tables show."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import pytest
from sqlalchemy import func, select

from flask_solidloop.models import Message, ToolCall

from ..support.prometheus import free_port, prometheus, require
from ..support.support_app import Assistant
from .test_e2e_workers import (
    assert_completed_once,
    kill_group,
    script_tool_round_trip,
    spawn_workers,
    wait_for,
)

pytestmark = pytest.mark.e2e

LOOPS = 6


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def wait_until(check, *, timeout: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} after {timeout}s\n{log()}")
        time.sleep(0.25)


def promql_value(server, query: str) -> float | None:
    result = server.query(query)
    return float(result[0]["value"][1]) if result else None


@pytest.mark.timeout(480)  # each wait below is bounded; a loaded machine boots workers slowly
def test_prometheus_scrapes_workers_and_counts_the_turns_our_tables_show(
        app, session, llm, tmp_path, monkeypatch):
    require()
    port = free_port()
    directory = tmp_path / "metrics"
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({
        "SOLIDLOOP_METRICS": True, "SOLIDLOOP_METRICS_PORT": port,
        "SOLIDLOOP_METRICS_DIR": str(directory)}))
    script_tool_round_trip(llm)
    log = tmp_path / "workers.log"
    workers = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                             "--processes", "2", "--threads", "2"], log=log)
    try:
        def endpoint_up() -> bool:
            try:
                return "solidloop_database_up 1.0" in scrape(port)
            except OSError:
                if workers.poll() is not None:
                    pytest.fail(f"workers exited:\n{log.read_text()[-4000:]}")
                return False

        # The server is a process the dramatiq master forks once its workers
        # are up; it loads the app first.
        wait_until(endpoint_up, timeout=180, what="no metrics endpoint",
                   log=lambda: log.read_text()[-4000:])
        with prometheus([f"127.0.0.1:{port}"]) as server:
            wait_until(server.targets_up, timeout=60, what="the target is not up",
                       log=server.log)
            loop_ids = [Assistant.start(message=f"add please #{i}").id for i in range(LOOPS)]
            wait_for(session, loop_ids, timeout=180, proc=workers, log=log)
            assert_completed_once(session, loop_ids)

            # What our tables show: every answered LLM turn is a completed
            # assistant message, every tool run a call with its checkpoint.
            turns = session.scalar(select(func.count()).select_from(Message).where(
                Message.role == "assistant", Message.status == "completed"))
            calls = session.scalar(select(func.count()).select_from(ToolCall).where(
                ToolCall.executed_at.is_not(None)))
            session.rollback()
            assert turns == 2 * LOOPS and calls == 2 * LOOPS

            query = 'sum(solidloop_llm_turns_total{outcome="ok"})'
            wait_until(lambda: promql_value(server, query) == turns, timeout=30,
                       what=f"{query} != {turns}: {server.query(query)}", log=server.log)
            assert promql_value(server, 'sum(solidloop_tool_calls_total{outcome="ok"})') \
                == calls
            assert promql_value(server, 'sum(solidloop_loops_ended_total{status="completed"})') \
                == LOOPS
            assert promql_value(server, 'sum(solidloop_steps_total{kind="llm_turn"})') == turns
            # The fleet's figures: both worker processes alive, nothing waiting.
            assert promql_value(server, 'max(solidloop_workers{state="alive"})') == 2
            assert promql_value(
                server, 'max(solidloop_queue_jobs{queue="solidloop_llm",state="due"})') == 0
            # dramatiq's own middleware reports into the same endpoint.
            delivered = promql_value(server, "sum(dramatiq_messages_total)")
            assert delivered is not None and delivered >= LOOPS
            # One endpoint per host: every worker process's files in one directory.
            pids = {name.rsplit("_", 1)[1] for name in os.listdir(directory)
                    if name.startswith("counter_")}
            assert len(pids) >= 2, os.listdir(directory)
    finally:
        kill_group(workers)
