"""The admin's pure helpers: one money formatter, safe URLs, failure classes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from flask_solidloop.admin.format import money, safe_url
from flask_solidloop.loops.queries import classify_failure


@pytest.mark.parametrize(("amount", "shown"), [
    (1.2345, "$1.23"), (0.0248, "$0.025"), (0.00029, "$0.00029"), (0, "$0.00"),
    (-0.005, "-$0.0050"), (Decimal("0.09"), "$0.09"), (Decimal("0.00000012"), "$0.00000012"),
    (1234.5, "$1,234.50"), (None, "\u2013"),
])
def test_money_never_shows_a_sub_cent_cost_as_zero(amount, shown):
    assert money(amount) == shown


@pytest.mark.parametrize(("url", "safe"), [
    ("/users/1", "/users/1"), ("https://crm.example/u/1", "https://crm.example/u/1"),
    ("HTTP://x.example", "HTTP://x.example"), ("javascript:alert(1)", None),
    (" JavaScript:alert(1)", None), ("//evil.example/x", None), ("/\\evil.example", None),
    ("data:text/html,<script>", None), ("java\nscript:alert(1)", None), ("", None),
    (None, None), ("users/1", None), ("https:///evil", None),
])
def test_safe_url_allows_only_relative_and_http_links(url, safe):
    assert safe_url(url) == safe


@pytest.mark.parametrize(("error", "cls"), [
    ("ProviderHTTPError: HTTP 503 from https://api.example", "infra:http"),
    ("ProviderError: read timed out after 10 s", "infra:timeout"),
    ("McpTransportError: connection refused", "infra:connect"),
    ("ProviderResponseError: could not parse the body", "infra:parse"),
    ("TypeError: unsupported operand; the timeout was None", "agent"),
    ("KeyError: 'x'", "agent"),
    ("InvalidArgumentError: the timeout must be a number", "agent"),
    ("SetupError: set FLASK_APP; the connect timeout is fine", "agent"),
    ("force stopped: stopped by an operator in the admin", "operator"),
    ("LimitExceededError: max_steps 3 reached", "limit"),
    ("something odd", "agent"), (None, "agent"),
])
def test_failure_classes_tell_infra_from_agent(error, cls):
    assert classify_failure(error) == cls


@pytest.mark.parametrize(("seconds", "shown"), [
    (None, "never"), (0.2, "just now"), (4.25, "4.2 s ago"), (42, "42 s ago"),
    (180, "3 min ago"), (7300, "2 h ago"), (3 * 86400, "3 d ago"), (-1, "just now"),
])
def test_ago_reads_like_a_person_would_say_it(seconds, shown):
    from flask_solidloop.admin.format import ago

    assert ago(seconds) == shown


def test_a_reap_is_stale_after_five_reaper_intervals_and_never_sooner_than_ten_seconds():
    from datetime import UTC, datetime, timedelta

    from flask_solidloop.admin import passes
    from flask_solidloop.config import Config
    from flask_solidloop.models import MaintenanceRun

    now = datetime(2027, 1, 1, tzinfo=UTC)

    def run(age: float) -> MaintenanceRun:
        return MaintenanceRun(task="reap", last_finished_at=now - timedelta(seconds=age),
                              last_ok=True, holder="h:1", total=0, counts={}, duration_ms=1)

    every_2 = Config.from_mapping({"SOLIDLOOP_REAPER_INTERVAL": 2})
    every_60 = Config.from_mapping({"SOLIDLOOP_REAPER_INTERVAL": 60})
    every_half = Config.from_mapping({"SOLIDLOOP_REAPER_INTERVAL": 0.5})
    off = Config.from_mapping({"SOLIDLOOP_REAPER_INTERVAL": 0})
    assert passes.reap_status(run(9), now, every_2).warning is None
    assert "no worker has reaped for 11 s" in passes.reap_status(run(11), now, every_2).warning
    assert passes.reap_status(run(299), now, every_60).warning is None
    assert passes.reap_status(run(301), now, every_60).warning is not None
    assert passes.reap_status(run(9), now, every_half).warning is None  # the 10 s floor
    assert "yet" in passes.reap_status(None, now, every_2).warning
    assert passes.reap_status(run(200), now, off).warning is None
    assert passes.reap_status(run(200), now, off).note is not None
    assert "SOLIDLOOP_REAPER_INTERVAL=0" in passes.reap_status(run(400), now, off).warning
    assert "SOLIDLOOP_REAPER_INTERVAL=0" in passes.reap_status(None, now, off).warning
    # Workers run the janitor by default, every 5 min: stale after 5 x 5 min. With
    # SOLIDLOOP_JANITOR_INTERVAL=0 someone else prunes, on a schedule we cannot know.
    no_janitor = Config.from_mapping({"SOLIDLOOP_JANITOR_INTERVAL": 0})
    every_minute = Config.from_mapping({"SOLIDLOOP_JANITOR_INTERVAL": 60})
    prune = run(26 * 60)
    prune.task = "prune"
    assert passes.prune_status(prune, now, no_janitor).warning is None
    assert "SOLIDLOOP_JANITOR_INTERVAL=0" in passes.prune_status(prune, now, no_janitor).note
    assert "26 min" in passes.prune_status(prune, now, every_2).warning
    assert passes.prune_status(run(24 * 60), now, every_2).warning is None
    assert "6 min" in passes.prune_status(run(6 * 60), now, every_minute).warning
    assert passes.prune_status(None, now, every_2).warning is None
