"""The host's queues against real worker processes.

An RQ user's ``Queue("default")`` created in a view (never at import) is
consumed by a worker started with no ``-Q``, as ``rq worker`` consumes it; a
queue named only in a view, which no worker consumes, is warned about once in
the web process and flagged by ``flask solidloop jobs``; and the chaos fixture
waits for the host's jobs before it stops its workers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from werkzeug.serving import make_server

from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.queue.middleware.worker_registry import live_queues
from flask_solidloop.state import get_state

from ..support import host_queues_app
from ..support.host_queues_app import EFFECTS_DDL, VIEW_QUEUE
from ..support.support_app import DATABASE_URL_ENV

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
APP = "tests.support.host_queues_app:create_app()"
WARNING = "no live worker consumes queue"


def effects(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return {key for (key,) in conn.execute("SELECT key FROM host_queue_effects")}


def wait_until(check, *, timeout: float, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout}s\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


@pytest.fixture
def web(database_url) -> Iterator[tuple[object, str]]:
    """The app, served over real HTTP on 127.0.0.1 from a thread of this process
    (so its log records reach caplog): (app, base URL)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)
        conn.execute("TRUNCATE host_queue_effects")
    app = host_queues_app.create_app()
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield app, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
        with app.app_context():
            host_queues_app.db.session.remove()
            host_queues_app.db.engine.dispose()
        get_state(app).broker.close()


@pytest.fixture
def default_worker(database_url, tmp_path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`flask solidloop worker` with no -Q, as a new user starts it."""
    log = tmp_path / "worker.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env[DATABASE_URL_ENV] = database_url
    with open(log, "ab") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", APP, "solidloop", "worker", "-p", "1",
             "-t", "2"], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_a_default_queue_named_only_in_a_view_is_consumed_by_a_default_worker(
        web, default_worker, database_url, caplog):
    caplog.set_level(logging.WARNING, logger="flask_solidloop.jobs")
    app, base = web
    proc, log = default_worker
    heartbeat = get_state(app).config.worker_heartbeat

    def registered() -> set[str]:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            return live_queues(conn, interval=heartbeat)

    consumed = wait_until(registered, timeout=60, proc=proc, log=log,
                          what="the worker in the registry")
    assert "default" in consumed and VIEW_QUEUE not in consumed

    with httpx.Client(base_url=base) as client:
        job = client.post("/reports", data={"key": "report-1"}).json()["job"]
        wait_until(lambda: "report-1" in effects(database_url), timeout=60, proc=proc, log=log,
                   what=f"job {job} on 'default', run by the worker")
        # A queue no worker declared: the job waits, and the web process says so once.
        for n in range(2):
            assert client.post("/elsewhere", data={"key": f"else-{n}"}).status_code == 201

    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1 and f"{WARNING} {VIEW_QUEUE!r}" in warnings[0]
    assert f"solidloop.queue({VIEW_QUEUE!r})" in warnings[0]

    listing = app.test_cli_runner().invoke(args=["solidloop", "jobs"])
    assert listing.exit_code == 0, listing.output
    rows = [line.split() for line in listing.output.splitlines()[1:] if line[:8].strip()]
    assert [row[1] for row in rows if row[2] == "queued"] == [VIEW_QUEUE + "*"] * 2
    assert [row[1] for row in rows if row[2] == "done"] == ["default"]
    assert f"consumes: {VIEW_QUEUE} (2)." in listing.output.splitlines()[-1]
    assert effects(database_url) == {"report-1"}


@pytest.mark.timeout(0)  # progress-bounded: the fixture fails when nothing moves for 60 s
def test_the_chaos_fixture_waits_for_the_hosts_jobs(solidloop_chaos, llm, app):
    """Loops that end in one turn beside a chain of host jobs that outlives them:
    the fixture returns only when the whole chain ran, through the kills."""
    from ..support.chaos import ChaosSettings
    from ..support.support_app import Assistant, solidloop

    url = app.config["SQLALCHEMY_DATABASE_URI"]
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)
        conn.execute("TRUNCATE host_queue_effects")
    llm.script("host chaos", {"content": "done"})
    links = 6  # 2.4 s of work at least: it outlives the one-turn loops

    def start_loops() -> list[int]:
        solidloop.queue("default").enqueue(host_queues_app.countdown, "chain", links, 0.4,
                                           job_id=f"chain-{links}")
        return [Assistant.start(message=f"host chaos {i}").id for i in range(2)]

    report = solidloop_chaos(
        "tests.support.support_app:create_app()", start_loops,
        workers=2, kill_min=1.0, kill_max=2.0, min_kills=1, seed=11,
        env={"SOLIDLOOP_TEST_APP_CONFIG": json.dumps(ChaosSettings().app_config())})
    assert report.statuses == {"completed": 2}
    assert effects(url) == {f"chain:{n}" for n in range(links + 1)}
    assert report.host_jobs["done"] >= links + 1 and not report.host_jobs["queued"]
