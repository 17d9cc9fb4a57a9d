"""The chaos suite: kill workers at random while 50 loops run; every loop finishes."""

from __future__ import annotations

import os

import pytest

from .chaos import ChaosSettings, run_chaos

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(420)
def test_fifty_loops_survive_random_worker_kills(database_url, llm, tmp_path):
    from .support_app import create_app

    settings = ChaosSettings(
        loops=int(os.environ.get("SOLIDLOOP_CHAOS_LOOPS", "50")),
        seed=int(os.environ.get("SOLIDLOOP_CHAOS_SEED", "7")),
    )
    result = run_chaos(settings, database_url=database_url, emulator=llm, log_dir=tmp_path,
                       make_app=create_app, progress=None)
    print("\n" + result.table())
    assert result.kills >= 3, "the killer must actually have killed workers"
    assert result.problems == []
    assert result.statuses["completed"] == settings.loops
    assert result.tool_calls == settings.loops * settings.turns * settings.tools_per_turn
