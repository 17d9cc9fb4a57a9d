"""What ``dramatiq flask_solidloop.worker`` runs: load the app, bind its broker.

Loads the Flask app named by ``FLASK_APP`` (the same value ``flask --app``
takes, factories included) so init_app runs and declares the actors, checks
the database (its schema, and that no transaction-mode pooler sits where it
would break the worker: :func:`check_pooling`, decision 0028), then makes
the app's Postgres broker dramatiq's global broker, which the dramatiq CLI uses.
init_app itself never touches the global broker, so a host's own dramatiq
setup is left alone everywhere but in these worker processes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass

import dramatiq
import psycopg
from flask import Flask
from flask.cli import ScriptInfo
from sqlalchemy.exc import SQLAlchemyError

from .. import pooler
from ..config import Config
from ..database import check_schema
from ..errors import DatabaseUnavailableError, NotInitializedError, SetupError
from ..pipeline import tool_threads
from ..pooler import pooling_problem, probe_pooling
from ..queue.broker import PostgresBroker
from ..state import EXTENSION_KEY, get_state
from ..urls import libpq_url, redact_url

#: Loggers that flood a ``dramatiq --verbose`` log with wire-level DEBUG lines
#: (each HTTP read, each HTTP/2 frame, each migration plugin); held at INFO
#: unless SOLIDLOOP_HTTP_DEBUG=1 asks for them.
QUIET_LOGGERS = ("httpcore", "httpx", "httpx2", "hpack", "h2", "h11", "anyio", "mcp",
                 "asyncio", "urllib3", "alembic")
#: Of those, the ones held at WARNING: the HTTP clients log every request at
#: INFO (a line per LLM turn and per remote tool call, which the job log and
#: the wire log already record), and alembic each migration plugin.
WARNING_ONLY = ("httpx", "httpx2", "alembic")
HTTP_DEBUG_ENV = "SOLIDLOOP_HTTP_DEBUG"


def quiet_noisy_loggers() -> None:
    """Keep the worker's log about our jobs, not about the HTTP clients' requests
    and reads (a logger the host set to a level of its own is left alone)."""
    if os.environ.get(HTTP_DEBUG_ENV):
        return
    for name in QUIET_LOGGERS:
        noisy = logging.getLogger(name)
        if noisy.level in (logging.NOTSET, logging.DEBUG):
            noisy.setLevel(logging.WARNING if name in WARNING_ONLY else logging.INFO)


def load_worker_app() -> tuple[Flask, PostgresBroker]:
    """Load the app of ``FLASK_APP`` and make its broker dramatiq's global one."""
    quiet_noisy_loggers()
    import_path = os.environ.get("FLASK_APP")
    if not import_path:
        raise SetupError(
            "set FLASK_APP to your app (e.g. FLASK_APP=myapp or FLASK_APP='myapp:create_app()') "
            "before running `dramatiq flask_solidloop.worker`"
        )
    pooler.worker_checks = True  # check_pooling below, not the engine's first connect
    app = ScriptInfo(app_import_path=import_path).load_app()
    if EXTENSION_KEY not in app.extensions:
        raise NotInitializedError(f"the app loaded from FLASK_APP={import_path!r} does not "
                           "initialise flask-solidloop (SolidLoop(app, db) or init_app)")
    state = get_state(app)
    try:
        wait_for_database(state.database_url)
    except DatabaseUnavailableError as exc:
        # Refuse to start: a worker on a never-migrated database would only log
        # UndefinedTable tracebacks. One line, and dramatiq's "broker connection
        # failed" exit code, so its master stops the other processes too.
        logging.getLogger("flask_solidloop.worker").error("worker refuses to start: %s", exc)
        sys.exit(RET_CONNECT)
    problem = check_pooling(app)
    if problem:
        # The same refusal for a deployment a transaction pooler would break
        # (decision 0028): a line naming the setting, not loops failing later.
        logging.getLogger("flask_solidloop.worker").error("worker refuses to start: %s", problem)
        sys.exit(RET_CONNECT)
    broker = state.broker
    dramatiq.set_broker(broker)
    threads = tool_threads.pool()
    threads.quarantine_limit = state.config.tool_quarantine_limit
    threads.on_limit = restart_worker_processes
    return app, broker


def check_pooling(app: Flask) -> str | None:
    """Why this app's workers must not start behind a transaction-mode pooler
    (one line naming the fix), or None (decision 0028). Probes
    SOLIDLOOP_DATABASE_URL (default SQLALCHEMY_DATABASE_URI), and
    SQLALCHEMY_DATABASE_URI when it differs and its engine prepares
    statements; SOLIDLOOP_POOLER_CHECK = False skips it. A URL the probe
    cannot reach is not a refusal here: its connections fail on their own."""
    state = get_state(app)
    if not state.config.pooler_check:
        return None
    log = logging.getLogger("flask_solidloop.worker")
    session_url = str(app.config["SQLALCHEMY_DATABASE_URI"])
    direct_url = state.database_url
    try:
        with app.app_context(), state.db.engine.connect() as connection:
            driver = connection.connection.driver_connection
            prepares = getattr(driver, "prepare_threshold", None) is not None
        direct_probe = probe_pooling(direct_url)
        session_probe = direct_probe
        if prepares and libpq_url(session_url) != libpq_url(direct_url):
            session_probe = probe_pooling(session_url)
    except (psycopg.Error, SQLAlchemyError) as exc:
        log.warning("could not check for a transaction-mode pooler in front of "
                    "PostgreSQL (%s); starting anyway", " ".join(str(exc).split()))
        return None
    for url, probe in {direct_url: direct_probe, session_url: session_probe}.items():
        if probe.pooled and not probe.transaction_pooled:
            log.info("%s goes through a connection pooler that keeps sessions "
                     "(session mode): fine", redact_url(url))
    return pooling_problem(
        session_url=session_url, session_probe=session_probe, session_prepares=prepares,
        direct_url=str(state.config.database_url) if state.config.database_url else None,
        direct_probe=direct_probe)


#: How long a worker waits at boot for a PostgreSQL that is not answering yet
#: (restarting, recovering, starting with the fleet) before it refuses to start.
BOOT_WAIT_SECONDS = 60.0
#: What a server says while it cannot take connections for now: it may come back.
_NOT_YET = ("connection refused", "starting up", "shutting down", "in recovery",
            "not yet accepting connections", "server closed the connection",
            "terminating connection", "timeout expired", "could not receive data",
            "no such file or directory", "could not connect to server")


def wait_for_database(url: str, *, wait: float = BOOT_WAIT_SECONDS) -> None:
    """``check_schema(url)``, waiting up to ``wait`` seconds while the server
    cannot take connections for now (a restart, a crash recovery, a fleet
    that boots with its database): a worker started in such a moment would
    otherwise exit, and no loop fault that passes may cost the fleet a
    worker. A database that refuses for good (wrong credentials, a missing
    or unmigrated database) raises at once."""
    log = logging.getLogger("flask_solidloop.worker")
    deadline = time.monotonic() + wait
    noted = 0.0
    while True:
        try:
            check_schema(url)
            return
        except DatabaseUnavailableError as exc:
            reason = str(exc.__cause__ or "").lower()
            if exc.__cause__ is None or not any(sign in reason for sign in _NOT_YET) \
                    or time.monotonic() >= deadline:
                raise
            if time.monotonic() >= noted:
                log.warning("PostgreSQL is not taking connections yet (%s); the worker waits "
                            "up to %gs for it", exc, wait)
                noted = time.monotonic() + 5
            time.sleep(0.5)


def restart_worker_processes(quarantined: int) -> None:
    """Too many abandoned tool threads hold this process's resources: ask the
    dramatiq master to restart its worker processes (SIGHUP: each stops
    gracefully, handing its turns back, and the master starts them again)."""
    log = logging.getLogger("flask_solidloop.worker")
    if multiprocessing.parent_process() is None:
        log.error("%d abandoned tool threads in this process (SOLIDLOOP_TOOL_QUARANTINE_LIMIT); "
                  "it runs under no dramatiq master to restart it: restart it to reclaim them",
                  quarantined)
        return
    log.error("%d abandoned tool threads in this process (SOLIDLOOP_TOOL_QUARANTINE_LIMIT): "
              "asking dramatiq to restart its worker processes to reclaim them", quarantined)
    os.kill(os.getppid(), signal.SIGHUP)


#: The broker's pool: claims, acknowledgements, job renewals, heartbeats and
#: the maintenance leaders' checks (queue/broker.py opens it with max_size 4).
BROKER_POOL_MAX = 4


@dataclass(frozen=True)
class ConnectionNeed:
    """One line of a worker process's connection budget."""

    what: str
    count: int


def connection_budget(config: Config, *, threads: int) -> list[ConnectionNeed]:
    """The PostgreSQL connections one worker process may hold at most, by use
    (docs/guides/workers.md, "Database connections"): what ``flask solidloop
    worker --dry-run`` prints, and what the fleet's sizing is checked against."""
    needs = [ConnectionNeed("SQLAlchemy pool (pool_size + max_overflow): worker threads + 1",
                            threads + 1)]
    if config.llm_io == "async":
        needs.append(ConnectionNeed("async LLM I/O: commit threads + the owners' check "
                                    "(from the SQLAlchemy pool: add them to it)",
                                    config.llm_io_commit_threads + 1))
    needs += [
        ConnectionNeed("lease renewer (solidloop-lease-renewer), while anything is leased", 1),
        ConnectionNeed("queue listener (solidloop-listener), LISTEN for every queue", 1),
        ConnectionNeed("broker pool: claims, acks, renewals, heartbeats, leader checks",
                       BROKER_POOL_MAX),
    ]
    return needs


#: dramatiq's exit code for "broker connection failed during worker startup".
RET_CONNECT = 3


def worker_command(
    *,
    processes: int,
    threads: int,
    queues: tuple[str, ...],
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The dramatiq command line that runs workers for an app."""
    cmd = [sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
           "--processes", str(processes), "--threads", str(threads)]
    if queues:
        cmd += ["--queues", *queues]
    return [*cmd, *extra]


def worker_env(app_import_path: str | None) -> dict[str, str]:
    """The environment of worker processes: ours, with ``FLASK_APP`` set.

    ValueError, naming the fix, when there is no app to tell them about.
    """
    env = dict(os.environ)
    # dramatiq restarts its worker processes (SIGHUP, which a worker sends its
    # master past SOLIDLOOP_TOOL_QUARANTINE_LIMIT) by exec-ing "python -m
    # dramatiq" found on PATH: this interpreter's directory first, so the
    # restart finds the same interpreter and its virtualenv.
    bin_dir = os.path.dirname(sys.executable)
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join(filter(None, [bin_dir, env.get("PATH")]))
    if app_import_path:
        env["FLASK_APP"] = app_import_path
    if not env.get("FLASK_APP"):
        raise SetupError(
            "cannot tell workers which app to load: run with `flask --app yourapp solidloop "
            "worker` or set FLASK_APP"
        )
    return env
