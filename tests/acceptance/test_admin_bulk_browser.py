"""Bulk admin actions as jobs, in real headless Chromium against a real
gunicorn, walked by real ``flask solidloop worker`` processes: a thousand
loops stopped from the browser show their progress live, a double submit and
a replayed POST act once, and a worker SIGKILLed mid-walk leaves a walk that
a new worker finishes, each loop written exactly once (every UPDATE of a loop
row counted by a PostgreSQL trigger)."""

from __future__ import annotations

import json
import re
import signal
import sys
import time

import pytest
from sqlalchemy import text

from flask_solidloop.models import BulkAction

from ..support.loop_writes import counted_loop_writes
from ..support.support_app import Assistant
from .test_admin_browser import (  # noqa: F401 - browser and page are fixtures
    APP_CONFIG,
    browser,
    free_port,
    page,
    wait_http,
)
from .test_e2e_workers import kill_group, spawn_workers

pytestmark = pytest.mark.e2e
LOOPS = 1000
#: Short leases: a SIGKILLed worker's job returns to the queue within seconds.
BULK_CONFIG = {**APP_CONFIG, "SOLIDLOOP_LIVENESS_TTL": 3.0, "SOLIDLOOP_REAPER_INTERVAL": 0.5,
               "SOLIDLOOP_ADMIN_BULK_BATCH": 50}
WORKER = [sys.executable, "-m", "flask", "--app", "tests.support.admin_app:create_app()",
          "solidloop", "worker", "--processes", "1", "--threads", "2"]


@pytest.fixture
def stack(app, llm, tmp_path, monkeypatch):
    """gunicorn (1 process, 4 threads) + one worker process; ``respawn`` kills
    the worker with SIGKILL and starts another."""
    monkeypatch.setenv("SOLIDLOOP_TEST_APP_CONFIG", json.dumps(BULK_CONFIG))
    port = free_port()
    web_log = tmp_path / "gunicorn.log"
    web = spawn_workers([sys.executable, "-m", "gunicorn", "-k", "gthread", "-w", "1",
                         "--threads", "4", "-b", f"127.0.0.1:{port}", "--timeout", "30",
                         "tests.support.admin_app:create_app()"], log=web_log)
    workers = [spawn_workers(WORKER, log=tmp_path / "worker-0.log")]

    def respawn() -> None:
        kill_group(workers[-1], signal.SIGKILL)
        workers.append(spawn_workers(WORKER, log=tmp_path / f"worker-{len(workers)}.log"))

    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/admin/", web, web_log)
        yield base, respawn
    finally:
        for proc in workers:
            kill_group(proc)
        kill_group(web)


@pytest.fixture
def writes(session):
    """Every UPDATE of a loop row, counted per loop by a trigger that also takes
    3 ms (a slow disk): the walk lasts seconds, long enough to watch and to kill."""
    yield from counted_loop_writes(session, delay=0.003)


def paused_loops(session, n: int) -> list[int]:
    """``n`` paused loops, made before the write counter starts counting."""
    ids = [Assistant.create(message=f"bulk {i}").id for i in range(n)]
    session.execute(text("UPDATE solidloop_loops SET status = 'paused' WHERE id = ANY(:ids)"),
                    {"ids": ids})
    session.execute(text("TRUNCATE test_loop_writes"))
    session.commit()
    return ids


def progress(tab) -> dict[str, str | None]:
    box = tab.locator("#bulk-progress")
    return {key: box.get_attribute(f"data-{key}") for key in ("status", "done", "total")}


def bulk_row(session) -> BulkAction:
    session.rollback()
    session.expire_all()
    return session.query(BulkAction).one()


def wait_until(check, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def confirm_stop_of_every_paused_loop(tab, base: str) -> dict[str, list[str]]:
    """From the list to the confirmation page; the confirmation form's fields."""
    tab.goto(base + "/admin/loops?status=paused")
    total = tab.locator("#loop-total")
    assert total.get_attribute("data-count") == str(LOOPS)
    assert total.get_attribute("data-exact") == "1"
    tab.click('#bulk button[name="action"][value="stop"]')
    assert tab.locator("#bulk-count").get_attribute("data-count") == str(LOOPS)
    fields: dict[str, list[str]] = {}
    for field in tab.locator("#bulk-confirm input[type=hidden]").all():
        fields.setdefault(field.get_attribute("name") or "", []).append(
            field.get_attribute("value") or "")
    return fields


def test_a_thousand_loops_show_progress_and_a_double_submit_or_replay_acts_once(
        app, session, stack, page, writes):  # noqa: F811 - the imported fixtures
    base, _ = stack
    failed = []
    page.on("response", lambda r: r.status >= 400 and not r.url.endswith("/favicon.ico")
            and failed.append(f"{r.status} {r.url}"))
    ids = paused_loops(session, LOOPS)
    fields = confirm_stop_of_every_paused_loop(page, base)
    page.dblclick("#bulk-go")  # a double click: one submission
    page.wait_for_url(re.compile(r"/admin/bulk/\d+$"), timeout=30_000)
    progress_url = page.url
    assert page.locator("#bulk-go").count() == 0
    # the page follows the walk: done counts seen rising before the end
    seen = set()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = progress(page)
        seen.add(int(now["done"] or 0))
        if now["status"] == "done":
            break
        page.wait_for_timeout(200)
    assert progress(page) == {"status": "done", "done": str(LOOPS), "total": str(LOOPS)}
    assert any(0 < n < LOOPS for n in seen), sorted(seen)
    assert "1000 changed, 0 skipped" in page.locator("#bulk-result").inner_text()
    # a reload of the progress page, and the confirmation's POST replayed with
    # its token (what a reload of the POST or a second tab sends): the same action
    page.reload()
    replay = page.request.post(base + "/admin/loops/bulk", form={
        k: v[0] for k, v in fields.items()} | {"confirm": "1"},
        headers={"Sec-Fetch-Site": "same-origin"})
    assert replay.ok and replay.url == progress_url
    time.sleep(2)  # a second walk, were one queued, would have started by now
    row = bulk_row(session)
    assert (row.status, row.done, row.skipped) == ("done", LOOPS, 0)
    assert writes() == {i: 1 for i in ids}  # every loop written exactly once
    assert failed == [] and page.dialogs == []  # every poll answered


def test_a_worker_killed_mid_walk_leaves_a_walk_another_worker_finishes(
        app, session, stack, page, writes):  # noqa: F811 - the imported fixtures
    base, respawn = stack
    ids = paused_loops(session, LOOPS)
    confirm_stop_of_every_paused_loop(page, base)
    page.click("#bulk-go")
    page.wait_for_url(re.compile(r"/admin/bulk/\d+$"), timeout=30_000)
    wait_until(lambda: bulk_row(session).done >= 150, "the walk to pass 150 loops")
    respawn()  # SIGKILL, mid-walk
    at_kill = bulk_row(session)
    assert at_kill.status == "running" and at_kill.done < LOOPS
    wait_until(lambda: bulk_row(session).status == "done", "the new worker to finish")
    row = bulk_row(session)
    assert (row.done, row.skipped, row.total) == (LOOPS, 0, LOOPS)
    assert writes() == {i: 1 for i in ids}  # none twice, none missed
    page.wait_for_selector('#bulk-progress[data-status="done"]', timeout=60_000)
    assert progress(page)["done"] == str(LOOPS)
