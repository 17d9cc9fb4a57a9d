"""Formatting the admin renders with: one money formatter, budget amounts,
durations, safe URLs.

Everything the templates show passes through these filters (registered on the
blueprint's Jinja environment by ``blueprint.py``), so a cost reads the same on
the dashboard, the list and the loop page, and a URL from the host is checked
in one place.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from decimal import Decimal
from typing import Any


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
    return "\u2013" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


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
