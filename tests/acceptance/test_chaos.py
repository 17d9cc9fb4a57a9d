"""The chaos suite: kill workers at random while 50 loops run; every loop finishes."""

from __future__ import annotations

import os

import pytest

from ..chaos import ChaosSettings, run_chaos

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(420)
def test_fifty_loops_survive_random_worker_kills(database_url, llm, tmp_path):
    from ..support_app import create_app

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


def _can_restart_postgres(database_url: str) -> bool:
    from ..chaos import postgres_restart_command

    # Only the local cluster, and only one we manage (never a shared server).
    return "127.0.0.1" in database_url and postgres_restart_command() is not None


@pytest.mark.timeout(420)
def test_loops_finish_across_a_postgres_restart(database_url, llm, tmp_path):
    if not _can_restart_postgres(database_url):
        pytest.skip("PostgreSQL cannot be restarted on this machine (no pg_ctlcluster cluster)")
    from ..support_app import create_app

    settings = ChaosSettings(loops=15, kill_workers=False, restart_postgres_after=2.0, seed=11,
                             workers=2, timeout=300)
    result = run_chaos(settings, database_url=database_url, emulator=llm, log_dir=tmp_path,
                       make_app=create_app)
    print("\n" + result.table())
    assert result.recoveries["postgres_restarts"] == 1
    assert result.problems == []
    assert result.statuses["completed"] == settings.loops
