"""A tool's MCP task survives its worker: the conformance blueprint under gunicorn
(4 processes), ``slow_compute`` called as a task, its worker process SIGKILLed
mid-run, and a new worker finishing the task once the job's lease lapsed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flask_solidloop.jobs import Job
from flask_solidloop.state import get_state

ROOT = Path(__file__).resolve().parents[2]
MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"


def rpc(base: str, method: str, params: dict) -> dict:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {
        **params, "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                            "io.modelcontextprotocol/clientCapabilities": {
                                "extensions": {TASKS: {}}}}}}
    headers = {"Accept": "application/json, text/event-stream", "Mcp-Method": method,
               "MCP-Protocol-Version": MODERN,
               "Mcp-Name": params.get("name") or params.get("taskId")}
    reply = httpx.post(f"{base}/mcp/conformance", json=body, headers=headers, timeout=30)
    return reply.json()["result"]


def worker(database_url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FLASK_APP": "tests.support.mcp_server_app:create_app()",
           "SOLIDLOOP_TEST_DATABASE_URL": database_url,
           # A short lease, so the killed worker's job is redelivered within seconds.
           "SOLIDLOOP_TEST_APP_CONFIG": json.dumps({"SOLIDLOOP_JOB_LEASE": 3}),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "1",
             "--threads", "2"], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True)


def stop(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def until(fetch, done, *, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: {value}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_tool_task_survives_a_killed_worker(app, database_url, mcp_gunicorn, tmp_path):
    log = tmp_path / "workers.log"
    first = worker(database_url, log)
    second = None
    try:
        created = rpc(mcp_gunicorn, "tools/call", {
            "name": "slow_compute", "arguments": {"seconds": 6, "label": "survivor"}})
        task_id = created["taskId"]

        def job() -> Job:
            get_state().db.session.expire_all()
            return Job.fetch(task_id)

        until(lambda: job().get_status(), lambda s: s == "started", timeout=60,
              what="the first worker never started the task", log=log)
        stop(first, signal.SIGKILL)  # mid-run: no ack, no result
        assert rpc(mcp_gunicorn, "tasks/get", {"taskId": task_id})["status"] == "working"
        second = worker(database_url, log)
        done = until(lambda: rpc(mcp_gunicorn, "tasks/get", {"taskId": task_id}),
                     lambda t: t["status"] != "working", timeout=90,
                     what="the task did not end after its worker was killed", log=log)
        assert done["status"] == "completed", done
        assert done["result"]["content"][0]["text"] == "computed survivor after 6.0s"
        assert job().attempts >= 2  # delivered again, to the second worker
    finally:
        stop(first, signal.SIGKILL)
        if second is not None:
            stop(second, signal.SIGTERM)
