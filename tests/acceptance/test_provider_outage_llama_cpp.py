"""A real llama-cpp-python server stopped for 60 s in the middle of 10 loops
and started again (docs/decisions/0018-no-fault-ends-a-loop.md, item 6): all
10 complete, and while it is down no worker thread waits for it.

Opt in: it needs llama-cpp-python's server, an sdist that builds llama.cpp
(scripts/llama_server.sh sets it up in .llama-venv, a few minutes), so the
default suite skips it. ``SOLIDLOOP_TEST_LLAMA_PYTHON`` names that
interpreter; ``SOLIDLOOP_TEST_OUTAGE_SECONDS`` the outage (default 60). The
model is tests/support/tiny_gguf.py's: random weights, noise for answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from flask_solidloop.models import Job, Loop

from ..support.support_app import LLAMA_URL_ENV, LlamaAgent
from .test_e2e_workers import kill_group, spawn_workers
from .test_provider_outage_workers import assert_no_thread_waits

pytestmark = pytest.mark.e2e

LLAMA_PYTHON = os.environ.get("SOLIDLOOP_TEST_LLAMA_PYTHON")
OUTAGE = float(os.environ.get("SOLIDLOOP_TEST_OUTAGE_SECONDS", "60"))
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, port: int, log: Path) -> subprocess.Popen:
    """llama_cpp.server on ``port``, once it answers."""
    assert LLAMA_PYTHON is not None
    proc = subprocess.Popen(
        [LLAMA_PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--chat_format", "chatml", "--n_ctx", "2048"],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return proc
        except OSError:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
    raise AssertionError(f"llama_cpp.server did not answer: {log.read_text()[-2000:]}")


@pytest.mark.skipif(LLAMA_PYTHON is None, reason="set SOLIDLOOP_TEST_LLAMA_PYTHON "
                    "(scripts/llama_server.sh) to run against a real llama-cpp-python server")
@pytest.mark.timeout(0)
def test_ten_loops_ride_out_a_real_llama_cpp_server_stopped_for_a_minute(
        app, session, monkeypatch, tmp_path, effects):
    model = tmp_path / "tiny.gguf"
    subprocess.run([LLAMA_PYTHON, str(SUPPORT / "tiny_gguf.py"), str(model)], check=True,
                   capture_output=True, timeout=120)
    port = free_port()
    server_log = tmp_path / "llama.log"
    server = serve(model, port, server_log)
    monkeypatch.setenv(LLAMA_URL_ENV, f"http://127.0.0.1:{port}")
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps({"SOLIDLOOP_LIVENESS_TTL": 10.0}))
    log = tmp_path / "worker.log"
    worker = spawn_workers([sys.executable, "-m", "flask", "solidloop", "worker",
                            "--processes", "1", "--threads", "2"], log=log)
    try:
        # The loops arrive over time: the first ones finish, then the server
        # goes away with the rest on their way.
        loops = [LlamaAgent.start(message=f"say something {n}").id for n in range(3)]
        deadline = time.monotonic() + 60
        while session.scalar(select(func.count()).select_from(Loop).where(
                Loop.id.in_(loops), Loop.status == "completed")) < 3:
            session.rollback()
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        session.rollback()
        server.terminate()
        server.wait(timeout=30)
        down_at = time.monotonic()
        loops += [LlamaAgent.start(message=f"say something {n}").id for n in range(3, 10)]
        deadline = time.monotonic() + 30
        while session.scalar(select(func.count()).select_from(Loop).where(
                Loop.id.in_(loops), Loop.provider_wait_since.is_not(None))) < 7:
            session.rollback()
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        session.rollback()
        assert_no_thread_waits(session, effects, "llama outage")
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
        server = serve(model, port, server_log)
        deadline = time.monotonic() + 180
        while True:
            statuses = [s for (s,) in session.execute(select(Loop.status).where(
                Loop.id.in_(loops)))]
            session.rollback()
            if all(s in ("completed", "failed", "paused") for s in statuses):
                break
            assert time.monotonic() < deadline, (statuses, log.read_text()[-3000:])
            time.sleep(0.2)
        print(f"\n[llama-cpp-python outage] server down {OUTAGE:.0f} s; "
              f"{statuses.count('completed')} of {len(loops)} loops completed")
        assert statuses == ["completed"] * 10
        assert session.scalar(select(func.count()).select_from(Job).where(
            Job.state == "dead")) == 0
    finally:
        kill_group(worker)
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
