"""The host's queues in one process: ``drain()`` runs every declared queue by
default, every broker declares ``default``, an enqueue on a queue no live
worker consumes is warned about once, and ``flask solidloop jobs`` flags the
jobs waiting on such a queue. tests/acceptance/test_host_queues.py shows the
same against real worker processes.

"Live worker" is the worker registry's: a row registered by the registry
middleware itself (its ``start``/``stop``, the code every worker process runs),
so these tests flip a real row between live and stopped.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from flask_solidloop import SolidLoop
from flask_solidloop.config import QUEUE_DEFAULT, QUEUE_MAINTENANCE, QUEUES
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.queue.middleware import (
    UnconsumedQueueWarningMiddleware,
    WorkerRegistryMiddleware,
)
from flask_solidloop.state import get_state
from flask_solidloop.testing import drain

from ..support import jobs_app
from ..support.jobs_app import default, reports

WARNING = "no live worker consumes queue"


@pytest.fixture
def live_worker(japp):
    """``live_worker(queues)``: registers this process in the worker registry as
    a live worker consuming ``queues``; stopped (``stopped_at``) at teardown."""
    registries = []

    def register(*queues: str) -> WorkerRegistryMiddleware:
        config = get_state(japp).config
        registry = WorkerRegistryMiddleware(libpq_url(get_state(japp).database_url),
                                            interval=config.worker_heartbeat,
                                            retention=config.worker_retention)
        registry.start(queues=list(queues), threads=1)
        registries.append(registry)
        return registry

    yield register
    for registry in registries:
        registry.stop()


def warning_middleware(app) -> UnconsumedQueueWarningMiddleware:
    return next(m for m in get_state(app).broker.middleware
                if isinstance(m, UnconsumedQueueWarningMiddleware))


def warnings_about(caplog, queue: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"{WARNING} {queue!r}" in r.getMessage()]


# -- drain() ------------------------------------------------------------------------------

def test_drain_runs_every_declared_queue_by_default(japp):
    jobs_app.process_order.send(1)                    # @solidloop.actor, queue host_jobs
    jobs_app.add.send(2, 3)                           # @solidloop.actor, queue default
    default.enqueue(jobs_app.record, "rq-default", 1)
    reports.enqueue(jobs_app.record, "rq-reports", 2)
    late = jobs_app.solidloop.queue(f"late_{uuid.uuid4().hex[:8]}")  # after init_app
    late.enqueue(jobs_app.record, "rq-late", 3)

    assert drain(japp) == 5
    assert jobs_app.count("process_order", "missing:1") == 1
    assert [jobs_app.count("rq-" + q) for q in ("default", "reports", "late")] == [1, 1, 1]
    assert len(default) == len(reports) == len(late) == 0


def test_drain_still_stops_at_the_queues_it_is_given(japp):
    default.enqueue(jobs_app.record, "named", 1)
    reports.enqueue(jobs_app.record, "not named", 2)
    assert drain(japp, queues=("reports",)) == 1
    assert (jobs_app.count("named"), jobs_app.count("not named")) == (0, 1)
    assert drain(japp) == 1 and jobs_app.count("named") == 1


def test_every_broker_declares_default_with_nothing_declared_at_import(database_url):
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url
    db = SQLAlchemy(app)
    SolidLoop(app, db=db)
    try:
        declared = list(get_state(app).broker.queues)
        # solidloop's own first: drain() claims in this order.
        assert declared == [*QUEUES, QUEUE_DEFAULT]
    finally:
        get_state(app).broker.close()
        with app.app_context():
            db.engine.dispose()


# -- the warning at enqueue -----------------------------------------------------------------

def test_an_enqueue_on_an_unconsumed_queue_warns_once_with_one_registry_read(japp, caplog):
    caplog.set_level(logging.WARNING, logger="flask_solidloop.jobs")
    middleware = warning_middleware(japp)
    for n in range(3):
        default.enqueue(jobs_app.record, "k", n)                       # RQ-style
        jobs_app.process_order.send_with_options(args=(n,),            # an actor, in a
                                                 session=jobs_app.db.session)  # transaction
    jobs_app.db.session.commit()

    assert len(warnings_about(caplog, "default")) == 1
    assert len(warnings_about(caplog, "host_jobs")) == 1
    [message] = warnings_about(caplog, "default")
    assert "flask solidloop worker" in message and "solidloop.queue('default')" in message
    assert middleware.reads == 1          # six enqueues, one read of the registry
    assert len(default) == 3              # a warning, never a refused job


def test_a_queue_a_live_worker_consumes_is_not_warned_about(japp, live_worker, caplog):
    caplog.set_level(logging.WARNING, logger="flask_solidloop.jobs")
    worker = live_worker("reports", *QUEUES)
    reports.enqueue(jobs_app.record, "consumed", 1)
    assert warnings_about(caplog, "reports") == []

    # The worker stops; the next read of the registry (refresh 0: at once) sees it.
    worker.stop()
    warning_middleware(japp).refresh = 0
    reports.enqueue(jobs_app.record, "unconsumed", 2)
    reports.enqueue(jobs_app.record, "unconsumed", 3)
    assert len(warnings_about(caplog, "reports")) == 1


def test_solidloops_own_queues_are_not_checked(japp, caplog):
    caplog.set_level(logging.WARNING, logger="flask_solidloop.jobs")
    get_state(japp).broker.actors["solidloop.maintenance"].send("reap")
    assert warnings_about(caplog, QUEUE_MAINTENANCE) == []
    assert warning_middleware(japp).reads == 0


# -- flask solidloop jobs -----------------------------------------------------------------

def test_jobs_command_flags_jobs_waiting_on_a_queue_no_live_worker_consumes(japp, live_worker):
    live_worker(QUEUE_DEFAULT, *QUEUES)
    consumed = default.enqueue(jobs_app.record, "consumed", 1)
    waiting = reports.enqueue(jobs_app.record, "waiting", 2)
    reports.enqueue(jobs_app.record, "waiting", 3)

    result = japp.test_cli_runner().invoke(args=["solidloop", "jobs"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    [waiting_line] = [line for line in lines if line.endswith(waiting.id)]
    [consumed_line] = [line for line in lines if line.endswith(consumed.id)]
    assert " reports* " in waiting_line and " queued " in waiting_line
    assert " default " in consumed_line and "*" not in consumed_line
    assert lines[-1].startswith("* waiting on a queue no live worker consumes: reports (2).")
    assert "-Q reports" in lines[-1]

    # Once run, a job waits no more: nothing is flagged.
    assert drain(japp) == 3
    done = japp.test_cli_runner().invoke(args=["solidloop", "jobs"])
    assert "*" not in done.output
