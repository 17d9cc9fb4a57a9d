"""The errors a newcomer meets on the command line are one line each, naming what
was wrong and the command that fixes it (issue 13): a never-migrated, outdated,
unreachable or missing database, a configuration error (exit 2), and a worker
command that can be copied. (Retention and ``prune --dry-run``: test_retention.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import psycopg
import pytest
from click.testing import CliRunner
from flask import Flask
from flask.cli import ScriptInfo
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import SolidLoop
from flask_solidloop.cli import solidloop_cli
from flask_solidloop.database import ensure_database
from flask_solidloop.urls import libpq_url

from ..conftest import drop_database

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _app(url: str, **config) -> Flask:
    app = Flask(f"cli_errors_{uuid.uuid4().hex[:6]}")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    app.config.update(config)
    SolidLoop(app, SQLAlchemy(app))
    return app


def _with_password(url: str, password: str = "hunter2") -> str:
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user.split(':')[0]}:{password}@{host}"


@pytest.fixture
def empty_database(database_url):
    """A database of its own that was never migrated."""
    url = f"{database_url}_empty"
    ensure_database(url)
    yield _with_password(url)
    drop_database(url)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


COMMANDS = [["status", "1"], ["start", "assistant", "hi"], ["list"], ["workers"], ["reap"],
            ["prune"], ["jobs"], ["worker", "-p", "1"]]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_never_migrated_database_is_one_line_naming_the_command(empty_database, args):
    result = _app(empty_database).test_cli_runner().invoke(args=["solidloop", *args])
    assert result.exit_code == 1
    line = _one_line(result)
    assert "the solidloop tables are missing in" in line
    assert "hunter2" not in line and ":***@" in line
    assert empty_database.rsplit("/", 1)[-1] in line
    assert "run `flask solidloop db upgrade`" in line


def test_outdated_database_names_both_revisions(empty_database):
    from flask_solidloop.migrations import head_revision, upgrade

    upgrade(empty_database, "0001")
    result = _app(empty_database).test_cli_runner().invoke(args=["solidloop", "status", "1"])
    assert result.exit_code == 1
    line = _one_line(result)
    assert f"are at revision 0001, this version of flask-solidloop needs {head_revision()}" \
        in line
    assert "flask solidloop db upgrade" in line


@pytest.mark.parametrize("args", [["status", "1"], ["start", "assistant", "hi"],
                                  ["db", "current"], ["db", "upgrade"], ["reap"],
                                  ["reap", "--every", "5"], ["list"]],
                         ids=lambda a: "-".join(a))
def test_unreachable_database_is_one_line_naming_the_url(args):
    url = f"postgresql+psycopg://u:pw@127.0.0.1:{_free_port()}/nowhere"
    result = _app(url).test_cli_runner().invoke(args=["solidloop", *args])
    assert result.exit_code == 1
    line = _one_line(result)
    assert line.startswith("Error: cannot connect to PostgreSQL at postgresql+psycopg://u:***@")
    assert "pw" not in line.replace("postgresql+psycopg", "")


def test_traceback_flag_shows_the_details():
    url = f"postgresql+psycopg://u:pw@127.0.0.1:{_free_port()}/nowhere"
    result = _app(url).test_cli_runner().invoke(args=["solidloop", "--traceback", "status", "1"])
    assert result.exit_code == 1
    assert result.exception is not None  # raised, not summarised


def test_missing_database_suggests_create_database_and_upgrade_says_it_created_it(
        database_url):
    url = f"{database_url}_missing"
    drop_database(url)
    app = _app(url)
    runner = app.test_cli_runner()
    try:
        line = _one_line(runner.invoke(args=["solidloop", "status", "1"]))
        assert "does not exist; create it with " \
               "`flask solidloop db upgrade --create-database`" in line
        created = runner.invoke(args=["solidloop", "db", "upgrade", "--create-database"])
        assert created.exit_code == 0, created.output
        assert f"created database {url.rsplit('/', 1)[-1]!r}" in created.output
        again = runner.invoke(args=["solidloop", "db", "upgrade", "--create-database"])
        assert "already exists" in again.output
    finally:
        with app.app_context():
            for engine in app.extensions["sqlalchemy"].engines.values():
                engine.dispose()
        drop_database(url)


@pytest.mark.parametrize("config", [
    {"SOLIDLOOP_REAPER_INTERVALL": 5},
    {"SQLALCHEMY_DATABASE_URI": "sqlite:///solidloop-not-here.db"},
], ids=["typo", "not-postgresql"])
def test_configuration_error_is_the_message_alone_with_exit_2(config):
    def factory() -> Flask:
        return _app(config.get("SQLALCHEMY_DATABASE_URI", "postgresql+psycopg://x@h/db"),
                    **{k: v for k, v in config.items() if k.startswith("SOLIDLOOP_")})

    result = CliRunner().invoke(solidloop_cli, ["status", "1"],
                                obj=ScriptInfo(create_app=factory))
    assert result.exit_code == 2
    line = _one_line(result)
    assert line.startswith("Error: ") and ("is invalid" in line or "unknown" in line)


def test_configuration_error_through_flask_cli_entry_point(tmp_path):
    """The group is a flask.commands plugin: it exists although the app failed to load."""
    (tmp_path / "badapp.py").write_text(
        "from flask import Flask\nfrom flask_sqlalchemy import SQLAlchemy\n"
        "from flask_solidloop import SolidLoop\n"
        "app = Flask(__name__)\n"
        "app.config['SQLALCHEMY_DATABASE_URI'] = 'sqlite:///solidloop-not-here.db'\n"
        "SolidLoop(app, SQLAlchemy(app))\n")
    flask = os.path.join(os.path.dirname(sys.executable), "flask")
    done = subprocess.run([flask, "--app", "badapp", "solidloop", "status", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "postgresql+psycopg://" in lines[0] and "Traceback" not in done.stderr


def test_worker_prints_a_command_that_can_be_copied(database_url, tmp_path):
    """The printed line runs as it is in a shell: here with --help, so it exits at once."""
    flask = os.path.join(os.path.dirname(sys.executable), "flask")
    env = {**os.environ, "SOLIDLOOP_TEST_DATABASE_URL": database_url, "PYTHONPATH": REPO}
    done = subprocess.run([flask, "--app", "tests.support.support_app:create_app", "solidloop",
                           "worker", "-p", "1", "-t", "1", "--", "--help"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    line = next(x for x in done.stderr.splitlines() if x.startswith("starting: "))
    command = line.removeprefix("starting: ")
    assert sys.executable in command and "-m dramatiq flask_solidloop.worker" in command
    rerun = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stderr
    assert "usage: dramatiq" in rerun.stdout


def test_plain_dramatiq_worker_refuses_a_never_migrated_database(empty_database):
    env = {**os.environ, "FLASK_APP": "tests.support.support_app:create_app",
           "SOLIDLOOP_TEST_DATABASE_URL": empty_database, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                           "-p", "1", "-t", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 3
    refusals = [x for x in done.stderr.splitlines() if "worker refuses to start" in x]
    assert len(refusals) == 1 and "flask solidloop db upgrade" in refusals[0]
    assert "UndefinedTable" not in done.stderr and "Traceback" not in done.stderr
    with psycopg.connect(libpq_url(empty_database)) as conn:
        assert conn.execute("SELECT to_regclass('solidloop_jobs')").fetchone() == (None,)
