"""Bulk admin actions as jobs (loops/bulk.py), and the loop list's total and
keyset pages both ways, through Flask's test client against real PostgreSQL,
the walk run by the in-process drain: POST, 303, progress page; one token acts
once; selected rows only; the frozen set; a walk that dies resumes from its
cursor and acts on each loop once (writes counted by a trigger)."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import text

from flask_solidloop.loops import bulk, store
from flask_solidloop.models import BulkAction, Job, Loop
from flask_solidloop.testing import drain as run

from ..support.loop_writes import counted_loop_writes
from ..support.support_app import Assistant, solidloop

SAME = {"Sec-Fetch-Site": "same-origin"}
MAINTENANCE = ("solidloop_maintenance",)


@pytest.fixture
def client(app):
    app.register_blueprint(solidloop.admin_blueprint(
        authorize=lambda request: True, operator=lambda request: "ops@example"),
        url_prefix="/admin")
    return app.test_client()


@pytest.fixture
def writes(session):
    """Every UPDATE of a loop row, counted per loop by a PostgreSQL trigger."""
    yield from counted_loop_writes(session)


def paused(n: int, session) -> list[int]:
    ids = []
    for i in range(n):
        loop = Assistant.create(message=f"bulk {i}")
        session.execute(text("UPDATE solidloop_loops SET status = 'paused' WHERE id = :id"),
                        {"id": loop.id})
        ids.append(loop.id)
    # The setup's own writes are not the action's (the writes fixture counts those).
    session.execute(text("DO $$ BEGIN IF to_regclass('test_loop_writes') IS NOT NULL THEN "
                         "TRUNCATE test_loop_writes; END IF; END $$"))
    session.commit()
    return ids


def confirm(client, form: dict) -> tuple[str, dict]:
    page = client.post("/admin/loops/bulk", headers=SAME, data=form)
    assert page.status_code == 200, page.get_data(as_text=True)
    html = page.get_data(as_text=True)
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', html))
    return html, {**form, **fields}


def statuses(session, ids: list[int]) -> list[str]:
    session.expire_all()
    return [session.get(Loop, i).status for i in ids]


def test_confirmed_post_redirects_to_a_progress_page_the_job_fills(app, session, client):
    ids = paused(5, session)
    _, form = confirm(client, {"action": "stop", "status": "paused"})
    posted = client.post("/admin/loops/bulk", headers=SAME, data=form)
    assert posted.status_code == 303
    location = posted.headers["Location"]
    assert re.fullmatch(r"/admin/bulk/\d+", location)
    # nothing acted inside the POST: the row and its job are committed, queued
    assert statuses(session, ids) == ["paused"] * 5
    row = session.query(BulkAction).one()
    assert (row.status, row.total, row.done, row.requested_by) == ("queued", 5, 0, "ops@example")
    assert session.query(Job).filter(Job.actor_name == "solidloop.bulk_action").count() == 1
    progress = client.get(location).get_data(as_text=True)
    assert 'data-status="queued"' in progress and "hx-get" in progress  # it polls
    run(app, queues=MAINTENANCE)
    assert statuses(session, ids) == ["failed"] * 5
    fragment = client.get(location, headers={"HX-Request": "true"}).get_data(as_text=True)
    assert fragment.lstrip().startswith("<div id=\"bulk-progress\"")
    assert 'data-status="done"' in fragment and 'data-done="5"' in fragment
    assert "hx-get" not in fragment  # finished: the polling stops
    assert "<script>" not in client.get(location).get_data(as_text=True)  # no inline script


def test_the_same_token_twice_acts_once(app, session, client, writes):
    ids = paused(4, session)
    _, form = confirm(client, {"action": "stop", "status": "paused"})
    first = client.post("/admin/loops/bulk", headers=SAME, data=form)
    second = client.post("/admin/loops/bulk", headers=SAME, data=form)  # reload / double click
    assert first.status_code == second.status_code == 303
    assert first.headers["Location"] == second.headers["Location"]
    assert session.query(BulkAction).count() == 1
    run(app, queues=MAINTENANCE)
    third = client.post("/admin/loops/bulk", headers=SAME, data=form)  # after it finished
    assert third.headers["Location"] == first.headers["Location"]
    assert run(app, queues=MAINTENANCE) == 0
    assert writes() == {i: 1 for i in ids}
    assert statuses(session, ids) == ["failed"] * 4


def test_selected_rows_only(app, session, client):
    ids = paused(6, session)
    listing = client.get("/admin/loops?status=paused").get_data(as_text=True)
    assert all(f'name="loop" value="{i}" form="bulk"' in listing for i in ids)
    picked = [ids[1], ids[4]]
    assert 'name="selected_action" value="freeze"' in listing
    page = client.post("/admin/loops/bulk", headers=SAME,
                       data={"selected_action": "freeze", "status": "paused",
                             "loop": [str(i) for i in picked]})
    html = page.get_data(as_text=True)
    assert 'data-count="2"' in html
    token = re.search(r'name="token" value="(\w+)"', html).group(1)
    posted = client.post("/admin/loops/bulk", headers=SAME, data={
        "action": "freeze", "status": "paused", "scope": "selected", "token": token,
        "confirm": "1", "loop": [str(i) for i in picked]})
    assert posted.status_code == 303
    run(app, queues=MAINTENANCE)
    session.expire_all()
    assert [i for i in ids if session.get(Loop, i).frozen] == picked
    assert 'data-done="2"' in client.get(posted.headers["Location"]).get_data(as_text=True)
    # nothing ticked: refused, naming the fix
    none = client.post("/admin/loops/bulk", headers=SAME,
                       data={"selected_action": "freeze"})
    assert none.status_code == 400 and b"tick rows" in none.data


def test_the_set_is_frozen_at_confirmation(app, session, client):
    ids = paused(3, session)
    _, form = confirm(client, {"action": "stop", "status": "paused"})
    late = paused(2, session)  # created after the confirmation page
    client.post("/admin/loops/bulk", headers=SAME, data=form)
    run(app, queues=MAINTENANCE)
    assert statuses(session, ids) == ["failed"] * 3
    assert statuses(session, late) == ["paused"] * 2


class Killed(BaseException):
    """The worker dies here (not an Exception: nothing in the walk catches it)."""


def test_a_walk_that_dies_midway_resumes_from_its_cursor(app, session, client, writes,
                                                          monkeypatch):
    state = app.extensions["solidloop"]
    state.config = type(state.config).from_mapping({"SOLIDLOOP_ADMIN_BULK_BATCH": 4})
    ids = paused(10, session)
    _, form = confirm(client, {"action": "stop", "status": "paused"})
    client.post("/admin/loops/bulk", headers=SAME, data=form)
    bulk_id = session.query(BulkAction).one().id
    real_act = bulk.act
    acted: list[int] = []

    def dying(state, action, loop_id, options):
        if len(acted) == 6:
            # the transition committed for this loop, then the worker died
            real_act(state, action, loop_id, options)
            raise Killed
        acted.append(loop_id)
        return real_act(state, action, loop_id, options)

    monkeypatch.setattr(bulk, "act", dying)
    with pytest.raises(Killed), app.app_context():
        for _ in range(5):  # the chunks' jobs, run as a worker would, until it dies
            job = session.execute(text(
                "SELECT id FROM solidloop_jobs WHERE state = 'queued' AND "
                "actor_name = 'solidloop.bulk_action'")).scalar_one()
            session.execute(text("UPDATE solidloop_jobs SET state = 'done' WHERE id = :id"),
                            {"id": job})
            session.commit()
            bulk.walk(state, bulk_id, chunk=4)
    session.rollback()
    row = session.get(BulkAction, bulk_id)
    session.refresh(row)
    assert (row.status, row.done) == ("running", 7)  # the 7th loop's commit landed
    monkeypatch.setattr(bulk, "act", real_act)
    with app.app_context():  # the redelivered job
        bulk.walk(state, bulk_id, chunk=4)
    run(app, queues=MAINTENANCE)
    session.refresh(row)
    assert (row.status, row.done, row.skipped) == ("done", 10, 0)
    assert writes() == {i: 1 for i in ids}  # each loop written exactly once
    assert statuses(session, ids) == ["failed"] * 10


def test_skipped_loops_are_counted_and_unfreeze_counts_only_what_it_lifted(app, session,
                                                                        client):
    ids = paused(4, session)
    store.freeze(session, ids[0])
    _, form = confirm(client, {"action": "unfreeze", "status": "paused"})
    location = client.post("/admin/loops/bulk", headers=SAME, data=form).headers["Location"]
    run(app, queues=MAINTENANCE)
    page = client.get(location).get_data(as_text=True)
    assert 'data-done="1"' in page and 'data-skipped="3"' in page


def test_the_list_counts_exactly_or_estimates(app, session, client, monkeypatch):
    from flask_solidloop.loops import listing, queries

    paused(7, session)
    html = client.get("/admin/loops?status=paused").get_data(as_text=True)
    assert re.search(r'id="loop-total" data-count="7" data-exact="1">7 loop', html)
    # a filter no index serves: exact when the page's own scan saw every loop
    html = client.get("/admin/loops?status=paused&q=bulk").get_data(as_text=True)
    assert re.search(r'id="loop-total" data-count="7" data-exact="1">7 loop', html)
    # a set the planner expects to be huge is not counted
    monkeypatch.setattr(listing, "ESTIMATE_IS_ENOUGH", 0)
    assert not listing.count_or_estimate(session, queries.LoopSearch(statuses=("paused",)),
                                         budget_seconds=5).exact
    monkeypatch.undo()
    # A count that cannot finish within the budget (10 ms a row, a 5 ms budget):
    # the planner's estimate, labelled "about".
    session.execute(text(
        "CREATE OR REPLACE FUNCTION test_slow_row() RETURNS bool AS $$ "
        "BEGIN PERFORM pg_sleep(0.01); RETURN true; END $$ LANGUAGE plpgsql VOLATILE"))
    session.commit()
    original = listing._search_query
    monkeypatch.setattr(listing, "_search_query", lambda search, columns=None: original(
        search, columns).where(text("test_slow_row()")))
    search = queries.LoopSearch(statuses=("paused",))
    total = listing.count_or_estimate(session, search, budget_seconds=0.005)
    assert not total.exact and total.count >= 1
    # the cancelled count and its timeout stayed off the caller's session
    assert session.execute(text("SHOW statement_timeout")).scalar_one() == "0"
    assert listing.count_or_estimate(session, search, budget_seconds=5) == listing.Total(7, True)
    state = app.extensions["solidloop"]
    state.config = type(state.config).from_mapping({"SOLIDLOOP_ADMIN_COUNT_BUDGET": 0.005})
    html = client.get("/admin/loops?status=paused").get_data(as_text=True)
    assert re.search(r'id="loop-total" data-count="(\d+)" data-exact="0">about \1 loop', html)
    session.rollback()
    session.execute(text("DROP FUNCTION test_slow_row()"))
    session.commit()


@pytest.mark.parametrize("filters", ["status=paused", "status=paused&q=bulk"],
                         ids=["indexed", "scanned"])
def test_newer_and_older_pages(app, session, filters):
    app.register_blueprint(solidloop.admin_blueprint(authorize=lambda request: True,
                                                     page_size=3), url_prefix="/admin")
    c = app.test_client()
    ids = paused(8, session)  # newest first: ids[7] .. ids[0]
    def rows(html):
        return [int(i) for i in re.findall(r'<tr data-loop="(\d+)"', html)]
    first = c.get(f"/admin/loops?{filters}").get_data(as_text=True)
    assert rows(first) == ids[7:4:-1] and 'id="newer-page"' not in first
    older = re.search(r'id="next-page" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    second = c.get(older).get_data(as_text=True)
    assert rows(second) == ids[4:1:-1]
    newer = re.search(r'id="newer-page" href="([^"]+)"', second).group(1).replace("&amp;", "&")
    assert f"after={ids[4]}" in newer
    back = c.get(newer).get_data(as_text=True)
    assert rows(back) == ids[7:4:-1]
    assert 'id="newer-page"' not in back and 'id="next-page"' in back
    third = c.get(re.search(r'id="next-page" href="([^"]+)"', second).group(1)
                  .replace("&amp;", "&")).get_data(as_text=True)
    assert rows(third) == ids[1::-1] and 'id="next-page"' not in third
    up = c.get(re.search(r'id="newer-page" href="([^"]+)"', third).group(1)
               .replace("&amp;", "&")).get_data(as_text=True)
    assert rows(up) == ids[4:1:-1] and 'id="newer-page"' in up
