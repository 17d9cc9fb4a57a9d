"""Formatting the admin renders with: one money formatter, budget amounts,
durations, times (relative, with the absolute UTC time on hover), safe URLs.

Everything the templates show passes through these filters (registered on the
blueprint's Jinja environment by ``blueprint.py``), so a cost reads the same on
the dashboard, the list and the loop page, and a URL from the host is checked
in one place.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from markupsafe import Markup, escape


def money(amount: Any) -> str:
    """A cost in dollars with 2 decimals, more when 2 would lose a sub-cent amount.

    1.2345 -> $1.23, 0.0248 -> $0.025, 0.00029 -> $0.00029, 0 -> $0.00,
    -0.005 -> -$0.0050, None -> "\u2013" (unpriced).
    """
    if amount is None:
        return "\u2013"
    value = Decimal(str(amount))
    if value == 0:
        return "$0.00"
    magnitude = abs(value)
    precision = 2
    if magnitude < Decimal("0.1") and magnitude != round(magnitude, 2):
        precision = min(math.floor(-math.log10(float(magnitude))) + 2, 8)
    sign = "-" if value < 0 else ""
    return f"{sign}${magnitude:,.{precision}f}"


def amount(key: str, value: Any) -> str:
    """A budget limit's amount: a cost as :func:`money`, a count with thousands
    separators (``12,345``)."""
    if key == "cost_usd":
        return money(value)
    return f"{float(value or 0):,.0f}"


def duration_ms(value: Any) -> str:
    if value is None:
        return "\u2013"
    ms = float(value)
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def seconds(value: Any) -> str:
    """A span of seconds the way the CLI prints it: ``45s``, ``12m``, ``3h``, ``2d``."""
    whole = max(0, int(float(value or 0)))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if whole >= size:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def span(value: Any) -> str:
    """A span of seconds in words: ``0.4 s``, ``12 s``, ``3 min``, ``2 h``, ``5 d``."""
    secs = max(0.0, float(value or 0))
    if secs < 10:
        return f"{secs:.1f} s"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if secs >= size:
            return f"{int(secs // size)} {unit}"
    return f"{int(secs)} s"


def period(value: Any) -> str:
    """A rate limit's period: ``per min``, ``per s``, ``per 90 s``."""
    secs = float(value or 0)
    return {60.0: "per min", 1.0: "per s", 3600.0: "per h"}.get(secs, f"per {secs:g} s")


def ago(value: Any) -> str:
    """How long ago, from a span of seconds: ``just now``, ``12 s ago``, ``3 min ago``."""
    if value is None:
        return "never"
    return "just now" if float(value) < 1 else f"{span(value)} ago"


def when(value: datetime | None) -> str:
    """An absolute time in UTC, labelled: ``2026-12-04 03:12:09 UTC``."""
    if value is None:
        return "\u2013"
    return _utc(value).strftime("%Y-%m-%d %H:%M:%S UTC")


def _utc(value: datetime) -> datetime:
    # Stored times are timestamptz; a naive one (a test's, a host's) is UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def iso(value: datetime | None) -> str:
    """A ``<time datetime>`` value in UTC (``2026-12-04T03:12:09Z``); empty for none."""
    return "" if value is None else _utc(value).strftime("%Y-%m-%dT%H:%M:%SZ")


def relative(value: datetime, now: datetime | None = None) -> str:
    """``value`` against ``now`` in words: ``3 min ago``, ``in 12 s``, ``just now``."""
    delta = ((now or datetime.now(UTC)) - _utc(value)).total_seconds()
    if abs(delta) < 1:
        return "just now"
    return f"{span(delta)} ago" if delta > 0 else f"in {span(-delta)}"


def at(value: datetime | None, now: datetime | None = None) -> Markup:
    """A time as every admin page shows one: relative (``3 min ago``), with
    the absolute UTC time in its ``title`` and a machine-readable
    ``<time datetime>``; a dash for none."""
    if value is None:
        return Markup("\u2013")
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        iso(value), when(value), escape(relative(value, now)))


def pretty_json(value: Any) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


_SCHEME = re.compile(r"^https?://[^/\\\s]", re.IGNORECASE)


def safe_url(url: Any) -> str | None:
    """``url`` if a browser would follow it to this site's path or an http(s)
    site, else None: ``javascript:``, ``data:``, ``//host`` and ``/\\host`` (which
    browsers read as ``//host``) are refused, as is anything with whitespace or
    control characters that could hide a scheme."""
    if not isinstance(url, str):
        return None
    url = url.strip()
    if not url or any(ord(c) < 0x21 or c == "\x7f" for c in url):
        return None
    if url.startswith("/") and not url.startswith(("//", "/\\")):
        return url
    if _SCHEME.match(url):
        return url
    return None
