"""An app-factory app with host jobs, for the jobs tests and their worker subprocesses.

Everything is declared at import time, before any app exists: a lazy actor, an
RQ-style queue and its functions, and (when ``JOBS_APP_PERIODIC`` is set) a
periodic job. ``create_app()`` builds the app; a view writes a row and
enqueues its jobs in the same transaction. Workers load it with
``FLASK_APP='tests.support.jobs_app:create_app()'``.

Jobs record what they did in ``jobs_app_effects``: ``effect()`` writes through
the job's own ``db.session`` (committed with the job's work), ``external()``
on a separate autocommit connection (like a call to another system, which a
rollback cannot undo).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import psycopg
from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import func, select

from flask_solidloop import SolidLoop
from flask_solidloop.jobs import get_current_job
from flask_solidloop.queue.broker import libpq_url

from .support_app import DATABASE_URL_ENV, DEFAULT_DATABASE_URL

db = SQLAlchemy()
solidloop = SolidLoop()
default = solidloop.queue("default")
reports = solidloop.queue("reports")


class Order(db.Model):  # type: ignore[name-defined]
    __tablename__ = "jobs_app_orders"
    id = db.Column(db.BigInteger, primary_key=True)
    note = db.Column(db.Text, nullable=False)


class Effect(db.Model):  # type: ignore[name-defined]
    __tablename__ = "jobs_app_effects"
    id = db.Column(db.BigInteger, primary_key=True)
    kind = db.Column(db.String(50), nullable=False)
    key = db.Column(db.Text, nullable=False)
    pid = db.Column(db.Integer, nullable=False)


HOST_TABLES = ("jobs_app_orders", "jobs_app_effects")


def database_url() -> str:
    return os.environ.get(DATABASE_URL_ENV, DEFAULT_DATABASE_URL)


def effect(kind: str, key: object) -> None:
    db.session.add(Effect(kind=kind, key=str(key), pid=os.getpid()))
    db.session.commit()


def external(kind: str, key: object) -> int:
    """Write an effect outside any transaction of ours; return how many of its kind and key."""
    with psycopg.connect(libpq_url(database_url()), autocommit=True) as conn:
        conn.execute("INSERT INTO jobs_app_effects (kind, key, pid) VALUES (%s, %s, %s)",
                     (kind, str(key), os.getpid()))
        row = conn.execute("SELECT count(*) FROM jobs_app_effects WHERE kind = %s AND key = %s",
                           (kind, str(key))).fetchone()
    return int(row[0]) if row else 0


def count(kind: str, key: object | None = None) -> int:
    query = select(func.count()).select_from(Effect).where(Effect.kind == kind)
    if key is not None:
        query = query.where(Effect.key == str(key))
    return int(db.session.scalar(query) or 0)


# -- declared at import: a lazy actor and RQ-style functions ------------------------

@solidloop.actor(queue_name="host_jobs", max_retries=0)
def process_order(order_id: int) -> None:
    order = db.session.get(Order, order_id)
    effect("process_order", order.id if order else f"missing:{order_id}")


@solidloop.actor(store_results=True)
def add(a: int, b: int) -> int:
    return a + b


@solidloop.actor(queue_name="host_jobs")
def echo_types(value: object) -> None:
    effect("echo_types", type(value).__name__)


def record(kind: str, key: object) -> dict:
    effect(kind, key)
    return {"kind": kind, "key": key}


def flaky(key: str, fail_times: int) -> str:
    """Fail the first ``fail_times`` attempts (attempts are counted outside any transaction)."""
    attempt = external("flaky", key)
    if attempt <= fail_times:
        raise RuntimeError(f"flaky attempt {attempt} of {key}")
    return f"succeeded on attempt {attempt}"


def slow(key: str, seconds: float) -> str:
    """Mark the start outside any transaction, wait, then record the finish."""
    external("slow_start", key)
    time.sleep(seconds)
    effect("slow_done", key)
    return "done"


def progress(key: str) -> str:
    job = get_current_job()
    assert job is not None
    job.meta["step"] = "halfway"
    job.save_meta()
    effect("progress", key)
    return job.id


if os.environ.get("JOBS_APP_PERIODIC"):
    @solidloop.periodic(every=timedelta(seconds=1), name="tick")
    def tick() -> None:
        job = get_current_job()
        external("tick", job.id if job else "?")


# -- the app factory ------------------------------------------------------------------

def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url()
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_pre_ping": True}
    app.config.update(json.loads(os.environ.get("SOLIDLOOP_TEST_APP_CONFIG", "{}")))
    app.config.update(config or {})
    db.init_app(app)
    solidloop.init_app(app, db=db)

    @app.post("/orders")
    def create_order():
        order = Order(note=request.form.get("note", ""))
        db.session.add(order)
        db.session.flush()
        process_order.send_with_options(args=(order.id,), session=db.session)
        job = default.enqueue(record, "order", order.id, session=db.session)
        if request.form.get("fail"):
            db.session.rollback()
            return jsonify(error="rolled back"), 409
        db.session.commit()
        return jsonify(order=order.id, job=job.id), 201

    return app
