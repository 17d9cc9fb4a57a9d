"""The chaos suite: kill workers at random while 50 loops run; every loop finishes."""

from __future__ import annotations

import os

import pytest

from ..support.chaos import ChaosSettings, run_chaos

pytestmark = pytest.mark.e2e


# No wall-clock limit: run_chaos fails when nothing progressed for
# settings.stall_timeout seconds, so a loaded machine is slower, never red, and a
# stuck run still ends (progress is bounded: each loop has a fixed number of steps).
@pytest.mark.timeout(0)
def test_fifty_loops_survive_random_worker_kills(database_url, llm, tmp_path):
    from ..support.support_app import create_app

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


@pytest.mark.timeout(0)
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_loops_finish_across_a_postgres_restart(llm, tmp_path, monkeypatch, mode):
    """On a throwaway cluster of its own (never the shared one): a fast restart
    cuts every session; an immediate one is a crash, recovered from the WAL."""
    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    from ..support import pg_cluster
    from ..support.support_app import DATABASE_URL_ENV, create_app

    if not pg_cluster.available():
        pytest.skip("no PostgreSQL server programs to run a throwaway cluster")
    settings = ChaosSettings(loops=15, kill_workers=False, restart_postgres_after=2.0, seed=11,
                             workers=2, stall_timeout=120, restart_modes=(mode,))
    with pg_cluster.throwaway_cluster() as cluster:
        url = cluster.url("solidloop_chaos")
        ensure_database(url)
        upgrade(url)
        monkeypatch.setenv(DATABASE_URL_ENV, url)
        result = run_chaos(settings, database_url=url, emulator=llm, log_dir=tmp_path,
                           make_app=create_app, restart=cluster.restart)
    print("\n" + result.table())
    assert result.recoveries["postgres_restarts"] == 1
    assert result.problems == []
    assert result.statuses["completed"] == settings.loops


@pytest.mark.timeout(0)
def test_loops_finish_under_kills_freezes_and_restarts(llm, tmp_path, monkeypatch):
    """Every fault at once, on a throwaway cluster: SIGKILLs, SIGSTOP freezes
    longer and shorter than the lease, and PostgreSQL restarts, fast and
    immediate in turn. The contract holds; each duplicate side effect is put
    down to the fault behind it (bench/chaos.py runs this at 1,000+ loops)."""
    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    from ..support import pg_cluster
    from ..support.support_app import DATABASE_URL_ENV, create_app

    if not pg_cluster.available():
        pytest.skip("no PostgreSQL server programs to run a throwaway cluster")
    settings = ChaosSettings(loops=24, seed=5, workers=3, kill_min=2.0, kill_max=4.0,
                             freeze_every=(2.0, 4.0), freeze_for=(1.0, 6.0),
                             restart_every=5.0, stall_timeout=120)
    with pg_cluster.throwaway_cluster() as cluster:
        url = cluster.url("solidloop_chaos")
        ensure_database(url)
        upgrade(url)
        monkeypatch.setenv(DATABASE_URL_ENV, url)
        result = run_chaos(settings, database_url=url, emulator=llm, log_dir=tmp_path,
                           make_app=create_app, restart=cluster.restart)
    print("\n" + result.table())
    assert result.problems == []
    assert result.statuses["completed"] == settings.loops
    assert result.tool_calls == settings.loops * settings.turns * settings.tools_per_turn
    assert result.kills >= 1 and result.freezes >= 1
    assert sum(n for case, n in result.recoveries.items()
               if case.startswith("postgres_restarts")) >= 1


def test_the_user_chaos_fixture_runs_an_agent_under_kills(solidloop_chaos, llm, app):
    """flask_solidloop.testing's chaos fixture, as a user would call it, on the
    support app's chaos agent: real workers, random SIGKILLs, the contract checked."""
    import json
    import random

    from ..support.chaos import ChaosSettings, chaos_reply, is_chaos, prepare_effects_table
    from ..support.support_app import ChaosAgent

    # Small on purpose (the 50-loop run above is the thorough one): 4 loops of one
    # tool turn, two kills, is enough to prove the fixture kills and verifies.
    settings = ChaosSettings(turns=1, tools_per_turn=2, llm_latency=0.3)
    llm.script(is_chaos, chaos_reply(settings, random.Random(3)))
    prepare_effects_table(app.config["SQLALCHEMY_DATABASE_URI"])
    report = solidloop_chaos(
        "tests.support.support_app:create_app()",
        lambda: [ChaosAgent.start(message=f"user chaos {i}").id for i in range(4)],
        workers=2, kill_min=1.5, kill_max=2.5, min_kills=2, seed=5,
        env={"SOLIDLOOP_TEST_APP_CONFIG": json.dumps(settings.app_config()),
             "SOLIDLOOP_CHAOS_READ_TIMEOUT": str(settings.read_timeout)})
    assert report.kills >= 2 and report.problems == []
    assert report.statuses == {"completed": 4}
