"""Host jobs in one process: lazy actors, the RQ-style API, results, periodic
claims, bad input, the CLI. Jobs run through the in-process drain (the same
claim SQL and broker middleware as a worker); tests/acceptance/test_host_jobs.py
repeats the important ones against real worker subprocesses."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import dramatiq
import psycopg
import pytest
from dramatiq.encoder import JSONEncoder, PickleEncoder
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from flask_solidloop import (
    InvalidJobError,
    Job,
    JobEncodeError,
    NoSuchJobError,
    Retry,
    SolidLoop,
)
from flask_solidloop.errors import NotInitializedError
from flask_solidloop.jobs.periodic import Scheduler
from flask_solidloop.maintenance.janitor import prune
from flask_solidloop.queue.broker import libpq_url
from flask_solidloop.state import get_state
from flask_solidloop.testing import drain as run_drain

from ..support import jobs_app
from ..support.jobs_app import default, reports

QUEUES = ("default", "reports", "host_jobs")


def drain(app, **kw):
    kw.setdefault("queues", QUEUES)
    return run_drain(app, **kw)


def rows(app, query, *params):
    with psycopg.connect(libpq_url(get_state(app).database_url), autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def job_rows(app):
    return rows(app, "SELECT queue_name, actor_name, state FROM solidloop_jobs "
                     "WHERE queue_name NOT LIKE 'solidloop%%' ORDER BY id")


# -- lazy actors ------------------------------------------------------------------------

def test_an_actor_declared_at_import_binds_when_init_app_runs(japp):
    broker = get_state(japp).broker
    assert jobs_app.process_order.broker is broker
    assert broker.get_actor("process_order").fn is jobs_app.process_order.fn
    assert {"host_jobs", "default", "reports"} <= set(broker.get_declared_queues())
    jobs_app.process_order.send(7)  # its own committed transaction, as in dramatiq
    assert job_rows(japp) == [("host_jobs", "process_order", "queued")]
    assert drain(japp) == 1
    assert jobs_app.count("process_order", "missing:7") == 1


def test_actors_work_with_several_apps_and_late_declarations(japp):
    other = jobs_app.create_app()
    try:
        with other.app_context():
            assert jobs_app.process_order.broker is get_state(other).broker
        assert jobs_app.process_order.broker is get_state(japp).broker
        extension = SolidLoop()

        def late(x):
            return x

        app = Flask("late")
        app.config["SQLALCHEMY_DATABASE_URI"] = get_state(japp).database_url
        db = SQLAlchemy(app)
        with pytest.raises(NotInitializedError, match="did you forget init_app"):
            extension.actor(late).send(1)
        extension.init_app(app, db=db)
        actor = extension.actor(late)  # declared after init_app: bound at once
        assert get_state(app).broker.get_actor("late").fn is late
        with app.app_context():
            assert actor.broker is get_state(app).broker
        get_state(app).broker.close()
    finally:
        get_state(other).broker.close()
    # outside the context of an app it is bound to, with two apps, it cannot guess
    from flask_solidloop.jobs import JobRegistry

    registry = JobRegistry()
    registry._apps.add(japp)
    registry._apps.add(other)
    with Flask("bystander").app_context(), pytest.raises(NotInitializedError,
                                                          match="bound to 2 apps"):
        registry.broker_for("actor 'x'")


def test_a_view_writes_a_row_and_its_jobs_in_one_transaction(japp):
    client = japp.test_client()
    listener = psycopg.connect(libpq_url(get_state(japp).database_url), autocommit=True)
    listener.execute("LISTEN solidloop_q_default")
    try:
        assert client.post("/orders", data={"note": "no", "fail": "1"}).status_code == 409
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
        assert rows(japp, "SELECT count(*) FROM jobs_app_orders") == [(0,)]
        assert job_rows(japp) == []
        assert rows(japp, "SELECT count(*) FROM solidloop_host_jobs") == [(0,)]
        reply = client.post("/orders", data={"note": "yes"})
        assert reply.status_code == 201
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
    finally:
        listener.close()
    assert sorted(job_rows(japp)) == [("default", "solidloop.job", "queued"),
                                      ("host_jobs", "process_order", "queued")]
    assert drain(japp) == 2
    order = reply.json["order"]
    assert jobs_app.count("process_order", order) == 1 and jobs_app.count("order", order) == 1
    job = Job.fetch(reply.json["job"])
    assert job.get_status() == "finished"
    assert job.return_value() == {"kind": "order", "key": order}


def test_unknown_options_raise_and_name_the_known_ones(japp):
    with pytest.raises(InvalidJobError, match=r"known options:.*session") as info:
        jobs_app.process_order.send_with_options(args=(1,), max_retry=2)
    assert "did you mean max_retries" in str(info.value)
    with pytest.raises(InvalidJobError, match=r"pass session=db\.session"):
        jobs_app.process_order.send_with_options(args=(1,), connection=jobs_app.db.session)
    with pytest.raises(InvalidJobError, match=r"unknown option.*time_limt"):
        jobs_app.solidloop.actor(time_limt=5)
    # a plain dramatiq actor on our broker gets the same session= and the same refusal
    plain = dramatiq.Actor(lambda: None, broker=get_state(japp).broker, actor_name="plain",
                           queue_name="default", priority=0, options={})
    with pytest.raises(InvalidJobError, match=r"pass session=db\.session"):
        plain.send_with_options(connection=jobs_app.db.session)
    plain.send_with_options(session=jobs_app.db.session)
    jobs_app.db.session.rollback()
    assert job_rows(japp) == []
    assert rows(japp, "SELECT count(*) FROM solidloop_jobs") == [(0,)]


class DateEncoder(JSONEncoder):
    """A host's encoder: datetimes travel as tagged strings and come back as datetimes."""

    def encode(self, data):
        return json.dumps(data, default=self._default).encode()

    @staticmethod
    def _default(value):
        if isinstance(value, datetime):
            return {"__datetime__": value.isoformat()}
        raise TypeError(f"cannot encode {type(value).__name__}")

    def decode(self, data):
        def hook(obj):
            if set(obj) == {"__datetime__"}:
                return datetime.fromisoformat(obj["__datetime__"])
            return obj

        return json.loads(data, object_hook=hook)


def test_messages_go_through_the_host_encoder_and_bad_arguments_raise_at_send(japp):
    when = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    with pytest.raises(JobEncodeError, match="could not encode its arguments"):
        jobs_app.echo_types.send(when)
    with pytest.raises(JobEncodeError, match="could not encode"):
        default.enqueue(jobs_app.record, "when", when)
    assert job_rows(japp) == [] and rows(japp, "SELECT count(*) FROM solidloop_host_jobs") == [(0,)]
    previous = dramatiq.get_encoder()
    try:
        dramatiq.set_encoder(DateEncoder())
        jobs_app.echo_types.send(when)
        # The broker's consumer (what a worker claims through) decodes with the encoder.
        consumer = get_state(japp).broker.consume("host_jobs", prefetch=1, timeout=1000)
        try:
            message = next(consumer)
            assert message is not None and message.args == (when,)
            consumer.ack(message)
        finally:
            consumer.close()
        dramatiq.set_encoder(PickleEncoder())
        with pytest.raises(JobEncodeError, match="does not produce JSON"):
            jobs_app.echo_types.send(1)
    finally:
        dramatiq.set_encoder(previous)


def test_session_must_be_a_session_of_the_apps_database(japp):
    with pytest.raises(InvalidJobError, match=r"must be a SQLAlchemy session.*got str"):
        jobs_app.process_order.send_with_options(args=(1,), session="db.session")
    elsewhere = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/some_other_db")
    try:
        with Session(elsewhere) as other, pytest.raises(InvalidJobError,
                                                         match="not to this app's job database"):
            default.enqueue(jobs_app.record, "x", 1, session=other)
    finally:
        elsewhere.dispose()


@pytest.mark.parametrize(("name", "fragment"), [
    ("bad name", "is invalid"), ("9lives", "is invalid"), ("solidloop_mine", "is reserved"),
    ("q" * 60, "too long"),
])
def test_queue_names_follow_the_rule(japp, name, fragment):
    with pytest.raises(InvalidJobError, match=fragment):
        jobs_app.solidloop.queue(name)


# -- the RQ-style API ---------------------------------------------------------------------

def nested_holder():
    def inner():
        return None

    return inner


def test_enqueue_rejects_what_a_worker_could_not_import_or_schedule(japp):
    with pytest.raises(InvalidJobError, match="lambda"):
        default.enqueue(lambda: None)
    with pytest.raises(InvalidJobError, match="nested function"):
        default.enqueue(nested_holder())
    with pytest.raises(InvalidJobError, match="naive datetime"):
        default.enqueue_at(datetime(2030, 1, 1), jobs_app.record, "k", 1)
    with pytest.raises(InvalidJobError, match="depends_on= is not supported"):
        default.enqueue(jobs_app.record, "k", 1, depends_on="other")
    with pytest.raises(InvalidJobError, match="pass Retry"):
        default.enqueue(jobs_app.record, "k", 1, retry=3)
    default.enqueue(jobs_app.record, "k", 1, job_id="taken")
    with pytest.raises(InvalidJobError, match="'taken' already exists"):
        default.enqueue(jobs_app.record, "k", 2, job_id="taken")
    with pytest.raises(NoSuchJobError):
        Job.fetch("never-enqueued")


def test_rq_calls_and_statuses(japp):
    job = default.enqueue(jobs_app.record, "a", 1, meta={"who": "test"}, job_timeout="5m")
    call = reports.enqueue_call(func=jobs_app.record, args=("b",), kwargs={"key": 2},
                                job_id="report-2", description="the second report")
    later = default.enqueue_in(timedelta(hours=1), jobs_app.record, "c", 3)
    at = default.enqueue_at(datetime.now(UTC) + timedelta(hours=2), "tests.support.jobs_app.record",
                            "d", 4)
    assert job.get_status() == "queued" and later.get_status() == "scheduled"
    assert at.get_status() == "scheduled" and at.func_name == "tests.support.jobs_app:record"
    assert Job.fetch("report-2").description == "the second report"
    assert job.meta == {"who": "test"}
    assert job.description == "tests.support.jobs_app.record('a', 1)"
    assert default.count == 3 and len(reports) == 1
    assert drain(japp) == 2  # the two due ones
    assert job.return_value() == {"kind": "a", "key": 1}
    assert call.get_status() == "finished" and call.args == ["b"] and call.kwargs == {"key": 2}
    assert job.started_at is not None and job.ended_at is not None
    assert later.cancel() is True and later.get_status() == "canceled"
    assert later.cancel() is False


def test_retry_failed_registry_and_requeue(japp):
    job = default.enqueue(jobs_app.flaky, "r", 3, retry=Retry(max=2))
    drain(japp, raise_errors=False)
    assert jobs_app.count("flaky", "r") == 3
    assert job.get_status() == "failed" and "flaky attempt 3 of r" in job.exc_info
    registry = default.failed_job_registry
    assert registry.get_job_ids() == [job.id] and job in registry
    registry.requeue(job.id)
    assert job.get_status() == "queued" and len(registry) == 0
    drain(japp)
    assert job.get_status() == "finished" and job.return_value() == "succeeded on attempt 4"
    assert jobs_app.count("flaky", "r") == 4


def test_retry_intervals_schedule_the_next_attempt(japp):
    job = default.enqueue(jobs_app.flaky, "i", 5, retry=Retry(max=2, interval=[60, 120]))
    drain(japp, raise_errors=False)
    assert job.get_status() == "scheduled" and "flaky attempt 1" in job.exc_info
    (eta,) = rows(japp, "SELECT EXTRACT(EPOCH FROM eta - now()) FROM solidloop_jobs "
                        "WHERE state = 'queued'")[0]
    assert 30 < eta <= 60


def test_a_function_the_worker_cannot_import_fails_once_with_its_path(japp):
    job = default.enqueue("tests.nowhere.missing", retry=Retry(max=3))
    drain(japp, raise_errors=False)
    assert job.get_status() == "failed"
    assert "cannot import the job function 'tests.nowhere:missing'" in job.exc_info
    assert rows(japp, "SELECT count(*) FROM solidloop_jobs WHERE actor_name = 'solidloop.job'"
                ) == [(1,)]


def test_enqueue_with_a_session_joins_its_transaction(japp):
    session = jobs_app.db.session
    default.enqueue(jobs_app.record, "tx", 1, session=session)
    session.rollback()
    assert job_rows(japp) == [] and rows(japp, "SELECT count(*) FROM solidloop_host_jobs") == [(0,)]
    job = default.enqueue(jobs_app.record, "tx", 2, session=session)
    session.commit()
    assert drain(japp) == 1 and job.get_status() == "finished"


def test_current_job_meta_and_results_ttl_pruned_by_the_janitor(japp):
    job = default.enqueue(jobs_app.progress, "p", result_ttl=0)
    kept = default.enqueue(jobs_app.record, "kept", 1, result_ttl=-1)
    drain(japp)
    assert job.get_status() == "finished" and job.meta == {"step": "halfway"}
    assert job.return_value() == job.id
    report = prune(get_state(japp))
    assert report.host_jobs == 1
    with pytest.raises(NoSuchJobError):
        job.refresh()
    assert kept.get_status() == "finished"


def test_store_results_actors_use_the_postgres_results_backend(japp):
    message = jobs_app.add.send(2, 3)
    drain(japp)
    backend = jobs_app.solidloop.results_backend()
    assert message.get_result(backend=backend) == 5
    assert rows(japp, "SELECT count(*) FROM solidloop_results") == [(1,)]


# -- periodic -----------------------------------------------------------------------------

def test_one_job_per_period_across_processes_and_no_burst_after_downtime(japp):
    extension = SolidLoop()
    extension.periodic(every=timedelta(seconds=10), name="every10")(jobs_app.record)
    broker = get_state(japp).broker
    broker.declare_queue("default")
    ticks = [Scheduler(broker, extension.jobs.schedules) for _ in range(3)]
    start = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
    for period in range(5):
        for step in (0.5, 3.0, 9.5):  # every "process" ticks several times a period
            for scheduler in ticks:
                scheduler.tick(start + timedelta(seconds=10 * period + step))
    ids = [r[0] for r in rows(japp, "SELECT id FROM solidloop_host_jobs ORDER BY id")]
    assert len(ids) == 5 and len(set(ids)) == 5
    # twenty periods of downtime: one job for the current period, not twenty
    for scheduler in ticks:
        scheduler.tick(start + timedelta(seconds=250))
    assert rows(japp, "SELECT count(*) FROM solidloop_host_jobs") == [(6,)]
    # a cron schedule first seen mid-period waits for its next period
    extension.periodic("0 0 * * *", name="daily")(jobs_app.record)
    assert ticks[0].tick(start) > 0
    assert rows(japp, "SELECT count(*) FROM solidloop_host_jobs WHERE id LIKE 'periodic:daily%%'"
                ) == [(0,)]


def test_periodic_rejects_bad_schedules(japp):
    with pytest.raises(InvalidJobError, match="not a cron expression"):
        jobs_app.solidloop.periodic("every five minutes")(jobs_app.record)
    with pytest.raises(InvalidJobError, match="not both"):
        jobs_app.solidloop.periodic("* * * * *", every=5)(jobs_app.record)


# -- the CLI ---------------------------------------------------------------------------------

def test_jobs_commands_list_retry_and_cancel(japp):
    runner = japp.test_cli_runner()
    failed = default.enqueue(jobs_app.flaky, "cli", 1)
    waiting = default.enqueue_in(timedelta(hours=1), jobs_app.record, "w", 1)
    drain(japp, raise_errors=False)
    listing = runner.invoke(args=["solidloop", "jobs", "--state", "failed"])
    assert listing.exit_code == 0, listing.output
    assert failed.id in listing.output and "flaky attempt 1 of cli" in listing.output
    assert waiting.id not in listing.output
    result = runner.invoke(args=["solidloop", "jobs", "retry", failed.id])
    assert result.exit_code == 0 and "requeued" in result.output
    again = runner.invoke(args=["solidloop", "jobs", "retry", failed.id])
    assert again.exit_code == 1 and "has not failed" in again.output
    drain(japp)
    assert failed.get_status() == "finished"
    result = runner.invoke(args=["solidloop", "jobs", "cancel", waiting.id])
    assert result.exit_code == 0 and waiting.get_status() == "canceled"
    bad = runner.invoke(args=["solidloop", "jobs", "--state", "sleeping"])
    assert bad.exit_code == 1 and "unknown job state 'sleeping'" in bad.output
    usage = runner.invoke(args=["solidloop", "jobs", "retry"])
    assert usage.exit_code == 2 and "JOB_ID or --failed" in usage.output
    # --failed requeues dead rows of host queues, by row id too
    jobs_app.process_order.send_with_options(args=("not-an-int",), max_retries=0)
    drain(japp, raise_errors=False)
    row_id = rows(japp, "SELECT id FROM solidloop_jobs WHERE state = 'dead'")[0][0]
    assert str(row_id) in runner.invoke(args=["solidloop", "jobs", "--state", "dead"]).output
    result = runner.invoke(args=["solidloop", "jobs", "retry", "--failed"])
    assert result.exit_code == 0 and "requeued 1 failed job(s)" in result.output


def test_worker_rejects_a_bad_queue_name(japp):
    result = japp.test_cli_runner().invoke(args=["solidloop", "worker", "-Q", "no spaces"])
    assert result.exit_code == 2 and "is invalid" in result.output
