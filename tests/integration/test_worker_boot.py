"""A worker that boots while PostgreSQL cannot take connections waits for it
(runtime/worker.py, ``wait_for_database``) instead of exiting; one whose
database refuses for good (missing, unmigrated) still refuses at once. On a
throwaway cluster of its own, stopped and started again: never the shared one."""

from __future__ import annotations

import threading

import pytest

from flask_solidloop.errors import DatabaseUnavailableError
from flask_solidloop.runtime.worker import wait_for_database

from ..support import pg_cluster


def test_a_worker_waits_for_a_database_that_is_not_up_yet(caplog):
    from flask_solidloop.database import ensure_database
    from flask_solidloop.migrations import upgrade

    if not pg_cluster.available():
        pytest.skip("no PostgreSQL server programs to run a throwaway cluster")
    with pg_cluster.throwaway_cluster() as cluster:
        url = cluster.url("solidloop_boot")
        ensure_database(url)
        upgrade(url)
        cluster.stop_server()
        outcome: list[object] = []
        waiter = threading.Thread(target=lambda: outcome.append(
            _run(lambda: wait_for_database(url, wait=120))))
        waiter.start()
        # The worker is waiting (it said so) while the server is down ...
        deadline_hit = not _logged(caplog, "PostgreSQL is not taking connections yet", 60)
        assert not deadline_hit and waiter.is_alive()
        # ... and boots once the server is back.
        cluster.start_server()
        waiter.join(120)
        assert outcome == [None]


def test_a_database_that_refuses_for_good_is_refused_at_once(database_url):
    missing = database_url.rsplit("/", 1)[0] + "/solidloop_no_such_database"
    # A 600 s wait would outlast the test's timeout: it raises at once instead.
    with pytest.raises(DatabaseUnavailableError, match="does not exist"):
        wait_for_database(missing, wait=600)


def _run(call):
    try:
        return call()
    except Exception as exc:  # handed to the test's assertion
        return exc


def _logged(caplog, text, seconds):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if text in caplog.text:
            return True
        time.sleep(0.1)
    return False
