"""Issue 27, item 5: the first run. The README's two commands (the demo's set-up
installs only the runtime; ``--tests`` adds what the suite needs), .ci/run running
exactly the README's test command, and the progress helper every long set-up step
runs under (scripts/progress.sh)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    demo, tests = commands
    return {"demo": demo, "tests": tests}


def test_ci_runs_exactly_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == quick_start_commands()["tests"] == (
        "bash scripts/setup.sh --tests && .venv/bin/pytest")


def test_the_demo_command_sets_up_the_runtime_only():
    assert quick_start_commands()["demo"] == (
        "bash scripts/setup.sh && .venv/bin/flask --app example_app solidloop demo")


def test_setup_rejects_an_unknown_option_in_one_line_naming_the_fix():
    # The whole output is that line: the options are read before any step starts.
    result = subprocess.run(["bash", "scripts/setup.sh", "--test"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr == (
        "setup: unknown option '--test'; use: bash scripts/setup.sh [--tests]\n")


def with_progress(command: str, every: int = 1) -> subprocess.CompletedProcess[str]:
    script = f'source scripts/progress.sh; with_progress demo "doing it" {command}'
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PROGRESS_EVERY": str(every)})


def test_a_long_step_says_it_is_alive_with_its_latest_output():
    result = with_progress("sh -c 'echo Collecting flask; sleep 4'")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    ticks = result.stderr.splitlines()
    assert ticks, "no progress line during a 4 s step"
    for line in ticks:
        assert re.fullmatch(r"demo:       still doing it \(\d+s\)(: Collecting flask)?", line), line


def test_a_failed_step_shows_its_output_and_keeps_its_status():
    result = with_progress("sh -c 'echo no such package >&2; exit 3'", every=60)
    assert result.returncode == 3
    assert result.stderr == "no such package\ndemo: doing it failed (exit 3, output above)\n"
