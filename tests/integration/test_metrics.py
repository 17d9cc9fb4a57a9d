"""The Prometheus metrics, in-process: their values after known turns, tool
calls, failures and reaper passes; the fleet's figures; the admin's view and
its authorization."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

import pytest
from flask import Flask
from sqlalchemy import func, select

from flask_solidloop.maintenance.reaper import reap
from flask_solidloop.models import Loop, Message
from flask_solidloop.runtime import metrics as runtime_metrics
from flask_solidloop.telemetry import metrics

from ..support.support_app import Assistant, create_app

PRICES = {"test-model": {"input": 2, "output": 10}}


@pytest.fixture
def metrics_dir(tmp_path):
    """Metrics on in this process, into a directory of the test's own."""
    directory = str(tmp_path / "metrics")
    metrics.enable(directory)
    runtime_metrics.count_loop_ends()
    yield directory
    metrics.disable()


@pytest.fixture
def priced_app(database_url, llm):
    llm.reset()
    app = create_app(SOLIDLOOP_PRICES=PRICES)
    with app.app_context():
        yield app
        app.extensions["sqlalchemy"].session.remove()
        for engine in app.extensions["sqlalchemy"].engines.values():
            engine.dispose()
    app.extensions["solidloop"].stop_renewer()
    app.extensions["solidloop"].broker.close()


def samples(directory: str) -> dict[str, dict[tuple, float]]:
    """Every sample the directory holds: name -> {sorted label pairs: value}."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    found: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in registry.collect():
        for sample in family.samples:
            found[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float:
    return found.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def test_answered_turns_tokens_cost_and_tool_calls(priced_app, llm, metrics_dir):
    from flask_solidloop.testing.drain import drain

    llm.script("add please", {"content": "adding", "tool_calls": [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "explode", "arguments": {"reason": "test"}},
        {"name": "no_such_tool", "arguments": {}},
    ], "usage": {"prompt_tokens": 100, "completion_tokens": 20}})
    llm.script(lambda body: body["messages"][-1]["role"] == "tool",
               {"content": "done", "usage": {"prompt_tokens": 300, "completion_tokens": 10}})
    loop = Assistant.start(message="add please")
    drain(priced_app)
    session = priced_app.extensions["sqlalchemy"].session
    assert session.get(Loop, loop.id).status == "completed"

    found = samples(metrics_dir)
    turns = dict(agent="assistant", model="test-model")
    assert value(found, "solidloop_llm_turns_total", outcome="ok", **turns) == 2
    assert value(found, "solidloop_llm_tokens_total", kind="input", **turns) == 400
    assert value(found, "solidloop_llm_tokens_total", kind="output", **turns) == 30
    stored = session.scalar(select(func.sum(Message.cost)).where(Message.loop_id == loop.id))
    assert stored == Decimal("0.0011")  # (400 * 2 + 30 * 10) / 1e6
    assert value(found, "solidloop_llm_cost_usd_total", **turns) == pytest.approx(float(stored))
    assert value(found, "solidloop_llm_request_seconds_count", **turns) == 2
    tools = dict(agent="assistant")
    assert value(found, "solidloop_tool_calls_total", tool="add", outcome="ok", **tools) == 1
    assert value(found, "solidloop_tool_calls_total", tool="explode", outcome="error",
                 **tools) == 1
    # A name no server offers is one label, whatever the model made up.
    assert value(found, "solidloop_tool_calls_total", tool=metrics.UNKNOWN_TOOL,
                 outcome="error", **tools) == 1
    assert value(found, "solidloop_tool_call_seconds_count", tool="add", outcome="ok") == 1
    # Every step is counted once, delivered or inline.
    steps = found["solidloop_steps_total"]
    assert sum(v for k, v in steps.items() if ("kind", "llm_turn") in k) == 2
    assert sum(v for k, v in steps.items() if ("kind", "tool_call") in k) == 3
    assert value(found, "solidloop_loops_ended_total", status="completed", failure_class="") == 1
    # No label carries an id.
    for name, series in found.items():
        for labels in series:
            assert all(str(loop.id) != v for _, v in labels), (name, labels)


def test_failed_turns_count_by_class(app, llm, drain, metrics_dir):
    llm.fault_next("status", status=400)
    loop = Assistant.start(message="hi")
    drain()
    session = app.extensions["sqlalchemy"].session
    failed = session.get(Loop, loop.id)
    assert failed.status == "failed"
    found = samples(metrics_dir)
    turns = dict(agent="assistant", model="test-model")
    assert value(found, "solidloop_llm_turns_total", outcome="failed", **turns) == 1
    assert value(found, "solidloop_llm_turns_total", outcome="ok", **turns) == 0
    assert value(found, "solidloop_llm_errors_total", error="infra:http", **turns) == 1
    assert value(found, "solidloop_loops_ended_total", status="failed",
                 failure_class="infra:http") == 1


def test_reaper_heals_and_takeovers(app, session, metrics_dir):
    from datetime import UTC, datetime, timedelta
    from uuid import uuid4

    loop = Assistant.start(message="hi")
    # A worker claimed the turn and died: its lease expired a minute ago.
    session.execute(Loop.__table__.update().where(Loop.id == loop.id).values(
        status="running", execution_token=uuid4(),
        lease_expires_at=datetime.now(UTC) - timedelta(minutes=1)))
    session.commit()
    report = reap(app.extensions["solidloop"])
    assert report.expired_llm == [loop.id]
    found = samples(metrics_dir)
    assert value(found, "solidloop_reaper_heals_total", case="expired_llm") == 1
    assert value(found, "solidloop_lease_takeovers_total", kind="loop") == 1
    assert value(found, "solidloop_reaper_passes_total") == 1


def test_hooks_write_nothing_while_off(app, llm, drain, tmp_path):
    directory = tmp_path / "metrics"
    metrics.enable(str(directory))
    metrics.disable()
    llm.script("hi", {"content": "hello"})
    Assistant.start(message="hi")
    drain()
    assert not metrics.enabled()
    found = samples(str(directory))
    assert "solidloop_llm_turns_total" not in found and "solidloop_steps_total" not in found
    assert all(v == 0 for series in found.values() for v in series.values())


def test_fleet_figures(app, session):
    Assistant.start(message="one")
    Assistant.start(message="two")
    body = runtime_metrics.exposition(app.extensions["solidloop"], None).decode()
    lines = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert float(lines['solidloop_queue_jobs{queue="solidloop_llm",state="due"}']) == 2
    assert float(lines['solidloop_queue_jobs{queue="solidloop_tool",state="due"}']) == 0
    assert float(lines['solidloop_queue_oldest_due_age_seconds{queue="solidloop_llm"}']) >= 0
    assert float(lines['solidloop_tool_calls_waiting{waits_for="approval"}']) == 0
    assert float(lines["solidloop_database_up"]) == 1
    assert 'solidloop_workers{state="lost"}' in lines


def test_admin_metrics_view_is_behind_authorize(app, session, metrics_dir):
    solidloop = app.extensions["solidloop"].extension
    allowed = {"yes": False}
    host = Flask("metrics_host")
    host.config.update(app.config)
    host.extensions = app.extensions
    host.register_blueprint(
        solidloop.admin_blueprint(authorize=lambda request: allowed["yes"]),
        url_prefix="/admin")
    client = host.test_client()
    denied = client.get("/admin/metrics")
    assert denied.status_code == 403
    assert b"solidloop_" not in denied.data
    allowed["yes"] = True
    shown = client.get("/admin/metrics")
    assert shown.status_code == 200
    assert shown.content_type.startswith("text/plain; version=0.0.4")
    assert b"solidloop_queue_jobs" in shown.data


def test_one_endpoint_per_host_taken_over_when_its_holder_stops(app, tmp_path, monkeypatch):
    """Two worker processes' slots contend for one port: one serves, and when it
    stops the other takes the port over."""
    import time
    import urllib.request

    from ..support.prometheus import free_port

    port = free_port()
    state = app.extensions["solidloop"]
    monkeypatch.setattr(state, "config", state.config.__class__(
        **{**vars(state.config), "metrics_port": port}))
    monkeypatch.setattr(runtime_metrics, "RETRY_SECONDS", 0.2)
    directory = str(tmp_path)
    first, second = (runtime_metrics.ServerSlot(state, directory) for _ in range(2))

    def serving(slot) -> bool:
        return slot.server is not None

    def wait(check) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    first.start()
    wait(lambda: serving(first))
    second.start()
    try:
        time.sleep(0.6)  # a few of the second's tries: the port is taken
        assert not serving(second)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert b"solidloop_database_up 1.0" in answer.read()
        first.stop()
        wait(lambda: serving(second))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert b"solidloop_queue_jobs" in answer.read()
    finally:
        first.stop()
        second.stop()


def test_a_previous_runs_dead_files_are_removed(tmp_path):
    import os
    import subprocess
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    old = tmp_path / f"counter_{dead.pid}.db"
    recent = tmp_path / f"histogram_{dead.pid}.db"
    live = tmp_path / f"counter_{os.getpid()}.db"
    for path in (old, recent, live):
        path.write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    os.utime(live, (past, past))
    assert runtime_metrics.remove_dead_files(str(tmp_path), before=time.time() - 60) == 1
    assert not old.exists() and recent.exists() and live.exists()


def test_a_lease_taken_over_is_counted_and_a_turn_that_ended_is_not(state, session, pg,
                                                                      metrics_dir):
    from flask_solidloop.leases import LeaseRenewer
    from flask_solidloop.queue.broker import libpq_url

    from .loop_states import running_loop

    ended_id, ended_token = running_loop(session)
    taken_id, taken_token = running_loop(session)
    renewer = LeaseRenewer(libpq_url(state.broker.url))
    try:
        renewer.register(ended_id, ended_token, lease_seconds=30, ceiling_seconds=3600)
        renewer.register(taken_id, taken_token, lease_seconds=30, ceiling_seconds=3600)
        pg.execute("UPDATE solidloop_loops SET status = 'completed', execution_token = NULL, "
                   "lease_expires_at = NULL WHERE id = %s", (ended_id,))
        pg.execute("UPDATE solidloop_loops SET status = 'queued', execution_token = NULL, "
                   "lease_expires_at = NULL WHERE id = %s", (taken_id,))
        renewer.renew_once()
    finally:
        renewer.stop()
    found = samples(metrics_dir)
    assert value(found, "solidloop_lease_losses_total", kind="loop", reason="taken_over") == 1
    assert sum(found["solidloop_lease_losses_total"].values()) == 1
