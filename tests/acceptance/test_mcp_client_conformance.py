"""The official MCP conformance suite's client auth scenarios against our MCP client.

``@modelcontextprotocol/conformance`` 0.2.0-alpha.12 (installed by
scripts/mcp_conformance.sh) runs ``conformance client --scenario <auth
scenario> --spec-version 2026-07-28`` for every client auth scenario the
frozen 2026-07-28 requirement set names (plus the client-credentials
extensions), four at a time: each starts a test MCP server and
authorization server and runs tests/support/conformance_client.py against them,
which signs in through the product's sign-in blueprint (or takes a
client-credentials token), then lists and calls a tool through the product's
OAuth transport. The harness's token store is this test's database. The suite's
exit code is the verdict: a failure not in the baseline
(tests/acceptance/conformance/baseline-client-auth.yml) fails the test, and so
does a baseline entry that passes (a stale baseline).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".mcp-conformance"
NODE_BIN = PREFIX / "node" / "node_modules" / "node" / "bin"
PACKAGE = PREFIX / "v0.2" / "node_modules" / "@modelcontextprotocol" / "conformance"
BINARY = PREFIX / "v0.2" / "node_modules" / ".bin" / "conformance"
BASELINE = Path(__file__).parent / "conformance" / "baseline-client-auth.yml"
#: The extensions run too: the ones our client has a grant for.
EXTENSIONS = ["auth/client-credentials-basic", "auth/client-credentials-jwt"]


def scenarios() -> list[str]:
    """The client auth scenarios 2026-07-28 requires (its frozen requirement set)."""
    requirements = PACKAGE / "requirements" / "2026-07-28.yaml"
    if not requirements.exists():
        return []  # the test below fails, naming the install script
    required = yaml.safe_load(requirements.read_text())["client"]
    return [name for name in required if name.startswith("auth/")] + EXTENSIONS


@pytest.fixture(scope="module")
def verdicts(database_url, tmp_path_factory, request):
    """Every selected scenario's run: {scenario: (exit code, output)}, four at a time."""
    if not BINARY.exists() or not (NODE_BIN / "node").exists():
        pytest.fail(f"{BINARY} or Node 22 is missing: run bash scripts/mcp_conformance.sh "
                    "(scripts/setup.sh --tests runs it)")
    results = tmp_path_factory.mktemp("client-conformance")
    harness = f"{sys.executable} -m tests.support.conformance_client"
    env = {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_COLOR": "1",
           # The harness's token store: this test session's database.
           "SOLIDLOOP_TEST_DATABASE_URL": database_url,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(scenario: str) -> tuple[int, str]:
        command = [str(BINARY), "client", "--command", harness, "--scenario", scenario,
                   "--spec-version", "2026-07-28", "--timeout", "60000",
                   "--expected-failures", str(BASELINE), "-o", str(results)]
        if scenario in EXTENSIONS:  # not on the spec timeline: the suite skips them unasked
            command.append("--force")
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        return done.returncode, done.stdout + done.stderr

    # Only the scenarios this session selected (``-k iss`` runs those alone).
    names = [item.callspec.params["scenario"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(names, pool.map(run, names), strict=True))


@pytest.mark.timeout(600)  # the first test's setup runs every scenario (~3 min loaded)
@pytest.mark.parametrize("scenario", scenarios())
def test_official_client_auth_scenario(scenario, verdicts):
    code, output = verdicts[scenario]
    assert code == 0, f"conformance client {scenario} failed:\n{output[-6000:]}"
    assert "Baseline check passed" in output, output[-3000:]


def test_the_baseline_names_only_scenarios_that_run():
    entries = yaml.safe_load(BASELINE.read_text())["client"]
    names = set(scenarios())
    assert names, f"{PACKAGE} is missing: run bash scripts/mcp_conformance.sh"
    assert [e for e in entries if e.split(":")[0] not in names] == []
