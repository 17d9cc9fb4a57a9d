"""A subject's budget on real ``flask solidloop worker`` processes: ten loops of
one tenant, run at once by two worker processes, stop together at the tenant's
daily budget (overshooting it by at most one turn's estimate), each paused
with ``budget_exceeded``; a resume with a budget lets one finish."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from decimal import Decimal

import pytest
from sqlalchemy import select

from flask_solidloop.loops.queries import classify_failure
from flask_solidloop.models import Loop, Spend

from ..support.support_app import Assistant
from .test_approvals_workers import poll
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e

#: Dear tokens, so that a turn costs about a cent and a dollar is some dozens of turns.
PRICES = {"test-model": {"input": 100.0, "output": 100.0}}
BUDGET = Decimal("1.00")
#: The largest estimate one turn of these loops reserves: its payload (under
#: 4 KB of history here: at most 1,000 tokens) plus the 1,024 output tokens
#: reserved for a request without max_tokens, at 100 USD per million.
ONE_TURN_ESTIMATE = Decimal("0.21")
WORKER_CONFIG = {"SOLIDLOOP_PRICES": PRICES,
                 "SOLIDLOOP_SUBJECT_BUDGET": {"cost_usd": float(BUDGET), "window": 86400}}
WORKER_CMD = [sys.executable, "-m", "flask", "solidloop", "worker", "--processes", "2",
              "--threads", "4"]
#: What the resumed loop is told: the model then answers and the loop completes.
FINISH = "finish now"


@pytest.fixture
def workers(monkeypatch, tmp_path):
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(WORKER_CONFIG))
    proc = spawn_workers(WORKER_CMD, log=tmp_path / "workers.log")
    yield proc
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
    kill_group(proc)


def test_ten_loops_of_one_subject_stop_at_its_budget_together(app, session, llm, workers):
    llm.script(lambda req: True, {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    # The model adds numbers for ever, until it is told to finish.
    llm.script(FINISH, {"content": "done"})
    ids = Assistant.start_many([{"message": f"add numbers {i}", "subject": ("Tenant", "acme")}
                                for i in range(10)])

    def all_paused():
        return all(session.get(Loop, i).status == "paused" for i in ids)

    poll(session, all_paused, timeout=90, what="every loop to pause at the budget")
    loops = [session.get(Loop, i) for i in ids]
    for loop in loops:
        assert loop.error_message.startswith(
            "BudgetExceededError: subject Tenant:acme's 24 h budget cost_usd is spent"), \
            loop.error_message
        assert classify_failure(loop.error_message) == "budget_exceeded"
    spent = sum((loop.cost for loop in loops), Decimal(0))
    # Together they ran many turns (most loops more than one) and stopped within
    # one turn's estimate past the budget.
    assert sum(loop.step_count for loop in loops) > 20
    assert spent <= BUDGET + ONE_TURN_ESTIMATE, spent
    rows = session.scalars(select(Spend).where(Spend.subject == "Tenant:acme")).all()
    assert all(row.settled for row in rows)
    assert sum((row.cost for row in rows), Decimal(0)) == spent
    session.rollback()

    Assistant(ids[0]).resume(budget={"cost_usd": 20.0}, message=FINISH)
    poll(session, lambda: session.get(Loop, ids[0]).status == "completed", timeout=120,
         what="the resumed loop to finish")
    # The others stay paused: the subject's budget is still spent for them.
    assert all(session.get(Loop, i).status == "paused" for i in ids[1:])
