"""Host jobs against real ``flask solidloop worker`` subprocesses.

The app (tests/support/jobs_app.py) is built by a factory and declares its actor and
RQ-style functions at import. Shown here: a view's rollback leaves no job and
no effect while its commit runs each job exactly once; a worker SIGKILLed
mid-job has the job redelivered and finished; a job with Retry(max=2) runs
three times, lands in the failed registry, is requeued from the CLI and
finishes; a periodic job ticked by three worker processes runs once per
period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from flask_solidloop import Job, Retry

from ..support import jobs_app
from ..support.jobs_app import default
from ..support.support_app import DATABASE_URL_ENV

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
APP = "tests.support.jobs_app:create_app()"


def start_worker(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = str(ROOT) + os.pathsep + environment.get("PYTHONPATH", "")
    environment.update(env or {})
    assert environment.get(DATABASE_URL_ENV)
    handle = open(log, "ab")  # noqa: SIM115 - closed when the process is reaped
    return subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", APP, "solidloop", "worker", *args],
        cwd=ROOT, env=environment, stdout=handle, stderr=subprocess.STDOUT,
        start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until(check, *, timeout: float, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + timeout
    while True:
        jobs_app.db.session.rollback()
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"workers exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout}s\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


@pytest.fixture
def worker(japp, tmp_path):
    """One worker process on the host queues (none of solidloop's: it warns),
    with an extra task module."""
    log = tmp_path / "worker.log"
    proc = start_worker(log, "-p", "1", "-t", "2", "-Q", "default", "-Q", "host_jobs",
                        "-Q", "extra", "--module", "tests.support.jobs_tasks")
    yield proc, log
    stop(proc)


def test_rollback_leaves_nothing_and_commit_runs_each_job_once(japp, worker):
    proc, log = worker
    client = japp.test_client()
    assert client.post("/orders", data={"note": "never", "fail": "1"}).status_code == 409
    reply = client.post("/orders", data={"note": "kept"})
    assert reply.status_code == 201
    order = reply.json["order"]
    from ..support.jobs_tasks import extra_task

    extra_task.send("from --module")
    job = Job.fetch(reply.json["job"])
    wait_until(lambda: job.get_status() == "finished" and jobs_app.count("process_order")
               and jobs_app.count("extra_task"), timeout=30, proc=proc, log=log,
               what="the committed order's jobs")
    time.sleep(0.5)  # room for a duplicate delivery to show up, if there were one
    jobs_app.db.session.rollback()
    assert jobs_app.count("process_order") == 1 and jobs_app.count("process_order", order) == 1
    assert jobs_app.count("order") == 1 and jobs_app.count("order", order) == 1
    assert jobs_app.count("extra_task", "from --module") == 1
    orders = jobs_app.db.session.execute(text("SELECT count(*) FROM jobs_app_orders")).scalar()
    assert orders == 1
    assert "consumes none of solidloop's queues" in log.read_text()


def test_a_failing_job_retries_lands_in_the_failed_registry_and_the_cli_requeues_it(
        japp, worker):
    proc, log = worker
    job = default.enqueue(jobs_app.flaky, "cli", 3, retry=Retry(max=2))
    wait_until(lambda: job.get_status() == "failed", timeout=30, proc=proc, log=log,
               what="three failed attempts")
    assert jobs_app.count("flaky", "cli") == 3
    assert default.failed_job_registry.get_job_ids() == [job.id]
    result = japp.test_cli_runner().invoke(args=["solidloop", "jobs", "retry", job.id])
    assert result.exit_code == 0, result.output
    wait_until(lambda: job.get_status() == "finished", timeout=30, proc=proc, log=log,
               what="the requeued job")
    assert jobs_app.count("flaky", "cli") == 4
    assert job.return_value() == "succeeded on attempt 4"
    assert default.failed_job_registry.get_job_ids() == []


def test_a_worker_killed_mid_job_has_the_job_redelivered_and_finished(japp, tmp_path):
    log = tmp_path / "worker.log"
    # The first worker claims with a 2 s lease, stamped on the job's row, so the
    # second recovers the job soon after the kill. The second claims with a long
    # lease: on a loaded machine a late renewal of a short one would let the job
    # be claimed twice more. The job lasts 5 s, so the kill lands mid-job.
    config = {"SOLIDLOOP_TEST_APP_CONFIG": json.dumps({"SOLIDLOOP_JOB_LEASE": 2})}
    patient = {"SOLIDLOOP_TEST_APP_CONFIG": json.dumps({"SOLIDLOOP_JOB_LEASE": 10})}
    job = default.enqueue(jobs_app.slow, "kill", 5.0, session=jobs_app.db.session)
    jobs_app.db.session.commit()
    proc = start_worker(log, "-p", "1", "-t", "1", env=config)
    try:
        wait_until(lambda: jobs_app.count("slow_start", "kill") == 1, timeout=30, proc=proc,
                   log=log, what="the job's start")
        assert job.get_status() == "started"
        stop(proc, signal.SIGKILL)
        assert jobs_app.count("slow_done", "kill") == 0
        proc = start_worker(log, "-p", "1", "-t", "1", env=patient)
        wait_until(lambda: job.get_status() == "finished", timeout=40, proc=proc, log=log,
                   what="the redelivered job")
        assert jobs_app.count("slow_start", "kill") == 2
        assert jobs_app.count("slow_done", "kill") == 1
        assert "redelivered: its lease expired" in log.read_text()
    finally:
        stop(proc)


def test_a_periodic_job_runs_once_per_period_across_three_worker_processes(japp, tmp_path):
    log = tmp_path / "worker.log"
    proc = start_worker(log, "-p", "3", "-t", "1", env={"JOBS_APP_PERIODIC": "1"})

    def periods() -> Counter:
        keys = jobs_app.db.session.execute(
            text("SELECT key FROM jobs_app_effects WHERE kind = 'tick'")).scalars()
        return Counter(keys)  # the job ids, one per period: periodic:tick:<period start>

    def five_in_a_row() -> bool:
        times = sorted(datetime.fromisoformat(k.removeprefix("periodic:tick:"))
                       for k in periods())
        jobs_app.db.session.rollback()
        return any(times[i + 4] - times[i] == timedelta(seconds=4)
                   for i in range(len(times) - 4))

    try:
        # Under load a process may sleep through a period (not replayed, by
        # design): wait for an unbroken run of five, however many that takes.
        wait_until(five_in_a_row, timeout=60, proc=proc, log=log,
                   what="five consecutive periods of the periodic job")
    finally:
        stop(proc)
    jobs_app.db.session.rollback()
    seen = periods()
    assert all(n == 1 for n in seen.values()), seen  # one run per period, never two
    starts = sorted(key.removeprefix("periodic:tick:") for key in seen)
    times = [datetime.fromisoformat(s) for s in starts]
    # Five consecutive periods (a period every process slept through under load is
    # not replayed, by design, so look for the first unbroken run of five).
    first = next(i for i in range(len(times) - 4)
                 if times[i + 4] - times[i] == timedelta(seconds=4))
    jobs = jobs_app.db.session.execute(text(
        "SELECT count(*) FROM solidloop_host_jobs WHERE id LIKE 'periodic:tick:%' "
        "AND id >= :first AND id <= :last"),
        {"first": f"periodic:tick:{starts[first]}",
         "last": f"periodic:tick:{starts[first + 4]}"}).scalar()
    assert jobs == 5
    # all three processes were up and ticking meanwhile
    assert log.read_text().count("Worker process is ready for action.") == 3
