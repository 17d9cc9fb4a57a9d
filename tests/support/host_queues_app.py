"""An app whose queues are named only inside views, as a new RQ user writes them.

Nothing here declares a queue at import: the views call
``solidloop.queue("default")`` and ``solidloop.queue("named_in_a_view")`` in
the request, the way ``Queue("default")`` is created in an RQ app. So a worker
process, which imports this module but never runs a view, declares neither
queue itself; it consumes ``default`` only because every broker declares it.
Workers load it with ``FLASK_APP='tests.support.host_queues_app:create_app()'``.

:func:`countdown` is a chain of RQ-style jobs on the support app's ``default``
queue, for the chaos fixture's test: each link records itself and enqueues the
next, so the chain outlives the loops it starts beside.
"""

from __future__ import annotations

import contextlib
import os
import time

import psycopg
from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import InvalidJobError, SolidLoop
from flask_solidloop.queue.broker import libpq_url

from .support_app import DATABASE_URL_ENV, DEFAULT_DATABASE_URL

db = SQLAlchemy()
solidloop = SolidLoop()

#: What the jobs did, written outside any transaction of theirs (so a test sees
#: each run, and a redelivered link is recorded once by its primary key).
EFFECTS_DDL = ("CREATE TABLE IF NOT EXISTS host_queue_effects "
               "(key text PRIMARY KEY, pid integer NOT NULL)")
VIEW_QUEUE = "named_in_a_view"


def database_url() -> str:
    return os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL)


def record(key: str) -> str:
    """The job: record ``key`` once (a redelivery changes nothing)."""
    with psycopg.connect(libpq_url(database_url()), autocommit=True) as conn:
        conn.execute("INSERT INTO host_queue_effects (key, pid) VALUES (%s, %s) "
                     "ON CONFLICT (key) DO NOTHING", (key, os.getpid()))
    return key


def countdown(chain: str, left: int, pause: float) -> None:
    """One link of a chain: wait, record ``chain:left``, enqueue the next link.

    The next link's job id is fixed, so a link delivered twice (its worker was
    killed after the enqueue) finds the id taken and adds no second chain.
    """
    from .support_app import solidloop as support_solidloop

    time.sleep(pause)
    record(f"{chain}:{left}")
    if left > 0:
        # A taken id: this link ran before its worker died, and the next one exists.
        with contextlib.suppress(InvalidJobError):
            support_solidloop.queue("default").enqueue(
                countdown, chain, left - 1, pause, job_id=f"{chain}-{left - 1}")


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url()
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_pre_ping": True}
    # Two-second heartbeats: a test sees a started worker as live sooner.
    app.config["SOLIDLOOP_WORKER_HEARTBEAT"] = 2.0
    db.init_app(app)
    solidloop.init_app(app, db=db)

    @app.post("/reports")
    def create_report():
        # RQ's `Queue("default").enqueue(...)`, written in the view.
        job = solidloop.queue("default").enqueue(record, request.form["key"],
                                                 session=db.session)
        db.session.commit()
        return jsonify(job=job.id), 201

    @app.post("/elsewhere")
    def enqueue_elsewhere():
        job = solidloop.queue(VIEW_QUEUE).enqueue(record, request.form["key"],
                                                  session=db.session)
        db.session.commit()
        return jsonify(job=job.id), 201

    return app
