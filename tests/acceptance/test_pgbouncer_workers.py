"""Real PgBouncer in transaction mode in front of real worker processes (decision 0028).

Debian's ``/usr/sbin/pgbouncer`` runs as a subprocess with its own ini
(tests/support/pgbouncer.py), in front of the test database on the shared
server. The documented deployment (the app's engine through the pooler with
``prepare_threshold=None``, ``SOLIDLOOP_DATABASE_URL`` direct) runs loops to
completion with no prepared-statement error; the misconfigured ones make
every worker refuse to start with one line naming the fix; and the probe
tells PgBouncer's three modes from a direct connection.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import psycopg
import pytest

from flask_solidloop.pooler import probe_pooling
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.state import get_state

from ..support import pgbouncer as pgb
from ..support.support_app import Assistant
from .test_e2e_workers import (
    assert_completed_once,
    kill_group,
    script_tool_round_trip,
    spawn_workers,
)

pytestmark = pytest.mark.e2e

if not pgb.available():
    if os.environ.get("CI"):
        raise RuntimeError(f"{pgb.PGBOUNCER} is missing: scripts/setup.sh --tests installs "
                           "Debian's pgbouncer")
    pytest.skip(f"{pgb.PGBOUNCER} not installed (apt-get install pgbouncer)",
                allow_module_level=True)

#: What psycopg raises when a statement prepared on one server connection is
#: used, or prepared again, on another (and PgBouncer's protocol complaints).
PREPARED_ERRORS = re.compile(r"InvalidSqlStatementName|DuplicatePreparedStatement|"
                             r"ProtocolViolation|prepared statement", re.IGNORECASE)
WORKER = [sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
          "--processes", "2", "--threads", "4"]
NO_PREPARING = {"pool_pre_ping": True, "connect_args": {"prepare_threshold": None}}


@pytest.fixture(scope="module")
def bouncer():
    with pgb.pgbouncer(pool_mode="transaction") as running:
        yield running


def database_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


def worker_config(monkeypatch, config: dict) -> None:
    """The worker subprocesses' app settings (tests/support/support_app.py reads them)."""
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(config))


def refusal(proc, log: Path) -> str:
    """The one line a refusing worker fleet logs, after it exited with code 3."""
    try:
        code = proc.wait(timeout=90)
    except Exception:
        kill_group(proc)
        pytest.fail(f"the workers did not refuse to start:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert code == 3, text[-3000:]
    lines = [line for line in text.splitlines() if "worker refuses to start" in line]
    assert lines, text[-3000:]
    return lines[0]


def xacts(bouncer, database: str) -> int:
    """Transactions PgBouncer has carried for ``database`` so far."""
    return sum(int(row["total_xact_count"]) for row in bouncer.show("STATS")
               if row["database"] == database)


def test_the_documented_split_runs_loops_through_pgbouncer(database_url, llm, bouncer,
                                                           monkeypatch, tmp_path):
    from ..support.support_app import create_app

    name = database_name(database_url)
    pooled = bouncer.url(name)
    config = {"SQLALCHEMY_DATABASE_URI": pooled, "SOLIDLOOP_DATABASE_URL": database_url,
              "SQLALCHEMY_ENGINE_OPTIONS": NO_PREPARING}
    llm.reset()
    script_tool_round_trip(llm)
    worker_config(monkeypatch, config)
    app = create_app(**config)
    log = tmp_path / "workers.log"
    proc = spawn_workers(WORKER, log=log)
    try:
        with app.app_context():
            session = app.extensions["sqlalchemy"].session
            # A host job bound to the pooled session is accepted by the broker,
            # whose own URL is the direct one.
            get_state().broker.check_session(session)
            before = xacts(bouncer, name)
            # The web side starts its loops through the pooler too.
            loop_ids = [Assistant.start(message=f"add please #{i}").id for i in range(16)]
            session.remove()
            deadline = time.monotonic() + 120
            with psycopg.connect(libpq_url(database_url), autocommit=True) as direct:
                while True:
                    live = direct.execute(
                        "SELECT count(*) FROM solidloop_loops WHERE id = ANY(%s) AND status "
                        "NOT IN ('completed', 'failed', 'paused')", (loop_ids,)).fetchone()[0]
                    if live == 0:
                        break
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"{live} loops unfinished (workers exit code "
                                    f"{proc.poll()}):\n{log.read_text()[-4000:]}")
                    time.sleep(0.2)
            carried = xacts(bouncer, name) - before
            assert_completed_once(session, loop_ids)
            session.remove()
    finally:
        kill_group(proc)
        app.extensions["solidloop"].stop_renewer()
        app.extensions["solidloop"].broker.close()
        with app.app_context():
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
    text = log.read_text()
    assert not PREPARED_ERRORS.findall(text), text[-4000:]
    assert "worker refuses to start" not in text
    # The turns went through the pooler: each loop's start, two LLM turns and
    # two tool calls commit there at least once each.
    assert carried >= 5 * len(loop_ids), carried


@pytest.mark.parametrize("direct_too", [False, True], ids=["unset", "pooled"])
def test_a_pooled_session_url_for_the_workers_refuses_to_start(database_url, llm, bouncer,
                                                                monkeypatch, tmp_path,
                                                                direct_too):
    pooled = bouncer.url(database_name(database_url))
    config = {"SQLALCHEMY_DATABASE_URI": pooled, "SQLALCHEMY_ENGINE_OPTIONS": NO_PREPARING}
    if direct_too:
        config["SOLIDLOOP_DATABASE_URL"] = pooled
    worker_config(monkeypatch, config)
    log = tmp_path / "workers.log"
    line = refusal(spawn_workers(WORKER, log=log), log)
    if direct_too:
        assert "SOLIDLOOP_DATABASE_URL (postgresql+psycopg://postgres@127.0.0.1:" in line
        assert "point SOLIDLOOP_DATABASE_URL at PostgreSQL directly" in line
    else:
        assert "SQLALCHEMY_DATABASE_URI (postgresql+psycopg://postgres@127.0.0.1:" in line
        assert "set SOLIDLOOP_DATABASE_URL to a URL that reaches PostgreSQL directly" in line
    assert "transaction-mode pooler" in line and "docs/guides/pgbouncer.md" in line


def test_preparing_behind_the_pooler_refuses_to_start(database_url, llm, bouncer,
                                                      monkeypatch, tmp_path):
    pooled = bouncer.url(database_name(database_url))
    worker_config(monkeypatch, {"SQLALCHEMY_DATABASE_URI": pooled,
                                "SOLIDLOOP_DATABASE_URL": database_url})
    log = tmp_path / "workers.log"
    line = refusal(spawn_workers(WORKER, log=log), log)
    assert "SQLALCHEMY_DATABASE_URI (postgresql+psycopg://postgres@127.0.0.1:" in line
    assert "psycopg prepares statements" in line
    assert '{"connect_args": {"prepare_threshold": None}}' in line


def test_the_check_can_be_turned_off(database_url, llm, bouncer, monkeypatch, tmp_path):
    """SOLIDLOOP_POOLER_CHECK = False (PgBouncer >= 1.21 with max_prepared_statements,
    which the check cannot see): the same fleet starts."""
    pooled = bouncer.url(database_name(database_url))
    worker_config(monkeypatch, {"SQLALCHEMY_DATABASE_URI": pooled,
                                "SOLIDLOOP_DATABASE_URL": database_url,
                                "SOLIDLOOP_POOLER_CHECK": False})
    log = tmp_path / "workers.log"
    proc = spawn_workers(WORKER, log=log)
    try:
        deadline = time.monotonic() + 90
        while log.read_text().count("is ready for action") < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        kill_group(proc)
    assert "worker refuses to start" not in log.read_text()


@pytest.mark.parametrize("mode", ["transaction", "statement", "session", "direct"])
def test_the_probe_tells_transaction_pooling_from_sessions(database_url, mode):
    """Twenty probes each, with PgBouncer's two server orders: only the modes
    that lose session state are reported, and a direct connection never is."""
    name = database_name(database_url)
    if mode == "direct":
        probes = [probe_pooling(database_url) for _ in range(20)]
        assert not any(p.pooled or p.transaction_pooled for p in probes)
        return
    for order in ("", "server_round_robin = 1\n"):
        with pgb.pgbouncer(pool_mode=mode, extra=order) as running:
            probes = [probe_pooling(running.url(name)) for _ in range(20)]
        assert all(p.pooled for p in probes)
        assert [p.transaction_pooled for p in probes] == [mode != "session"] * 20, probes


@pytest.mark.parametrize("where", ["pooled, preparing", "pooled, not preparing", "direct"])
def test_a_web_process_logs_one_line_when_its_engine_prepares_behind_the_pooler(
        database_url, llm, bouncer, caplog, monkeypatch, where):
    """init_app never connects; the engine's first connection checks, and only logs."""
    from sqlalchemy import text

    from flask_solidloop import pooler

    from ..support.support_app import create_app

    monkeypatch.setattr(pooler, "worker_checks", False)  # an earlier in-process worker boot
    url = database_url if where == "direct" else bouncer.url(database_name(database_url))
    options = NO_PREPARING if where == "pooled, not preparing" else {"pool_pre_ping": True}
    app = create_app(SQLALCHEMY_DATABASE_URI=url, SOLIDLOOP_DATABASE_URL=database_url,
                     SQLALCHEMY_ENGINE_OPTIONS=options)
    caplog.set_level("ERROR", logger="flask_solidloop.pooler")
    try:
        with app.app_context():
            session = app.extensions["sqlalchemy"].session
            for _ in range(3):  # one line, however many connections follow
                assert session.execute(text("SELECT 1")).scalar() == 1
                session.remove()
                app.extensions["sqlalchemy"].engine.pool.dispose()
    finally:
        app.extensions["solidloop"].broker.close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()
    lines = [r.getMessage() for r in caplog.records if r.name == "flask_solidloop.pooler"]
    if where == "pooled, preparing":
        assert len(lines) == 1, lines
        assert lines[0].startswith("flask-solidloop: SQLALCHEMY_DATABASE_URI (")
        assert '{"connect_args": {"prepare_threshold": None}}' in lines[0]
    else:
        assert lines == []
