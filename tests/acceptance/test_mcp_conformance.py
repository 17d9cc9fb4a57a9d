"""The official MCP conformance suite against the MCP server blueprint under gunicorn.

``@modelcontextprotocol/conformance`` 0.1.16 (handshake era) and 0.2.0-alpha.12
(adds 2026-07-28), run by Node 22, both installed by scripts/mcp_conformance.sh
(scripts/setup.sh --tests runs it). The server is tests/support/mcp_server_app.py's
``/mcp/conformance`` blueprint, whose toolset implements the suite's fixture
tools, under ``gunicorn -w 4 -k gthread``; for the 2026-07-28 run a real
``dramatiq`` worker process (the same app) runs the tools the tasks scenarios
call as MCP tasks. The suite's exit code is the
verdict: a failure not in the baseline (tests/acceptance/conformance/) fails
the test, and so does a baseline entry that passes (a stale baseline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".mcp-conformance"
NODE_BIN = PREFIX / "node" / "node_modules" / "node" / "bin"
BASELINES = Path(__file__).parent / "conformance"

RUNS = {
    # id: (suite directory, extra arguments, baseline)
    "0.1.16-handshake": ("v0.1", [], "baseline-0.1.16.yml"),
    "0.2.0-alpha.12-handshake": ("v0.2", [], "baseline-0.2-handshake.yml"),
    "0.2.0-alpha.12-2026-07-28": ("v0.2", ["--requirements", "2026-07-28"],
                                  "baseline-0.2-2026-07-28.yml"),
}


def conformance(suite: str) -> Path:
    binary = PREFIX / suite / "node_modules" / ".bin" / "conformance"
    if not binary.exists() or not (NODE_BIN / "node").exists():
        pytest.fail(f"{binary} or Node 22 is missing: run bash scripts/mcp_conformance.sh "
                    "(scripts/setup.sh --tests runs it)")
    return binary


@pytest.fixture
def task_worker(database_url, tmp_path):
    """A dramatiq worker process of tests/support/mcp_server_app.py: it runs the
    conformance toolset's task tools (slow_compute, confirm_delete, ...)."""
    env = {**os.environ, "FLASK_APP": "tests.support.mcp_server_app:create_app()",
           "SOLIDLOOP_TEST_DATABASE_URL": database_url,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "worker.log"
    with open(log, "wb") as handle:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "flask_solidloop.worker", "--processes", "1",
             "--threads", "8"], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            yield log
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()


@pytest.mark.parametrize("run", list(RUNS))
def test_official_conformance_suite(run, mcp_gunicorn, tmp_path, request):
    suite, extra, baseline = RUNS[run]
    if "--requirements" in extra:  # the 2026-07-28 run: its tasks run on a worker
        request.getfixturevalue("task_worker")
    command = [str(conformance(suite)), "server", "--url", f"{mcp_gunicorn}/mcp/conformance",
               *extra, "--expected-failures", str(BASELINES / baseline),
               "-o", str(tmp_path / "results")]
    env = {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_COLOR": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"conformance {run} failed:\n{output[-6000:]}"
    assert "Baseline check passed" in output, output[-3000:]
