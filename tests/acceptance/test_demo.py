"""The README's main command, run as a newcomer would: a subprocess, a fresh database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ..conftest import drop_database

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_demo_creates_the_database_runs_workers_and_completes_a_tool_loop(database_url):
    url = database_url + "_demo"
    drop_database(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEMO_LLM_", "SOLIDLOOP_"))}
    env["DATABASE_URL"] = url
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "example_app", "solidloop", "demo"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert "created database" in out and "built-in offline model" in out
        assert '-> tool call get_weather({"city": "Paris"})' in out
        assert "tool <- get_weather\n" in out
        assert "Sunny, 21°C" in out
        assert "completed in 2 LLM turns, 1 tool call(s)" in out
        engine = create_engine(url)
        with engine.connect() as conn:
            status = conn.execute(text("SELECT status FROM solidloop_loops")).scalar_one()
            states = set(conn.execute(text("SELECT state FROM solidloop_jobs")).scalars())
        engine.dispose()
        assert status == "completed" and states == {"done"}
    finally:
        drop_database(url)


def test_demo_says_why_it_exits_non_zero(database_url):
    """A provider nobody answers: the loop fails, and the last line says so and where
    to look, instead of a bare exit status 1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = database_url + "_demo_fail"
    drop_database(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEMO_LLM_", "SOLIDLOOP_"))}
    env.update(DATABASE_URL=url, DEMO_LLM_BASE_URL=f"http://127.0.0.1:{port}",
               DEMO_LLM_MODEL="nobody")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "example_app", "solidloop", "demo",
             "--timeout", "90"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert "shared by every demo run" in result.stdout
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("demo failed: the loop did not complete (exit 1)"), result.stderr
        assert "flask solidloop status" in last and "solidloop-demo-workers-" in last
    finally:
        drop_database(url)


def test_demo_says_what_it_waits_for_while_the_model_is_slow(database_url):
    """Issue 27, item 5: a first turn that takes seconds (a slow model, or workers
    still starting) prints `... waiting for the first turn` lines instead of
    silence, before the conversation goes on as usual."""
    from flask_solidloop.testing import LLMEmulator

    emulator = LLMEmulator(offline_model=True).start()
    emulator.fault_next("slow_prefill", seconds=7)
    url = database_url + "_demo_slow"
    drop_database(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEMO_LLM_", "SOLIDLOOP_"))}
    env.update(DATABASE_URL=url, DEMO_LLM_BASE_URL=emulator.base_url,
               DEMO_LLM_MODEL="solidloop-offline")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "example_app", "solidloop", "demo"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert out.startswith(f"preparing database {url.rsplit('/', 1)[-1]}\n"), out
        waiting = out.find("    ... waiting for the first turn (loop 1 ")
        assert 0 < waiting < out.index("] assistant\n"), out
        assert "completed in 2 LLM turns, 1 tool call(s)" in out
    finally:
        emulator.stop()
        drop_database(url)
