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
    ("force stopped: stopped by an operator in the admin", "operator"),
    ("LimitExceededError: max_steps 3 reached", "limit"),
    ("something odd", "agent"), (None, "agent"),
])
def test_failure_classes_tell_infra_from_agent(error, cls):
    assert classify_failure(error) == cls
