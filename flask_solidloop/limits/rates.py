"""Rate limits shared by every worker through PostgreSQL: which keys a request
or a tool call falls under, and the reservation, settlement and block on their
buckets (limits/sql.py). A turn reserves its estimate before its request; when
the amounts do not fit it still reserves, and learns its slot: the seconds
until they have drained (it is deferred to it, holding nothing). After the
answer the reservation is settled to the real usage, and the provider's
remaining-capacity headers raise the levels where the provider counted more.
"""

from __future__ import annotations

import email.utils
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .._typing import SessionLike
from ..limit_spec import KEY_ROW, TOOL_PREFIX, Bucket
from ..loops.store.transaction import commit_keeping_objects, run_alone
from . import sql


def origin_of(base_url: str) -> str:
    """``scheme://host[:port]`` of a provider's base URL, without userinfo."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}"


def llm_keys(table: Mapping[str, tuple[Bucket, ...]], base_url: str, model: str | None,
             rate_limit_key: str | None = None) -> tuple[str, ...]:
    """The configured keys a request to ``model`` at ``base_url`` falls under:
    ``"<origin> <model>"`` and ``"<origin>"`` (``rate_limit_key`` in place of the
    origin when the agent names one), those present in ``table``."""
    if not table:
        return ()
    prefix = rate_limit_key or origin_of(base_url)
    names = (f"{prefix} {model}", prefix) if model else (prefix,)
    return tuple(name for name in names if name in table)


def tool_key(table: Mapping[str, tuple[Bucket, ...]], name: str | None) -> str | None:
    """The configured key of a tool's ``rate_limit`` name, if any."""
    if not name:
        return None
    key = f"{TOOL_PREFIX}{name}"
    return key if key in table else None


@dataclass
class Reservation:
    """What a turn reserved on which buckets, to settle after its request."""

    buckets: tuple[Bucket, ...]
    amounts: tuple[float, ...]
    #: Seconds from the reservation until the slot (0: it may go at once).
    wait: float = 0.0
    keys: tuple[str, ...] = ()
    #: Whether the amounts were added (the wait was within the horizon).
    held: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "amounts": list(self.amounts)}


_ensured: set[tuple[str, str]] = set()
_ensured_lock = threading.Lock()


def _ensure(session: SessionLike, rows: Iterable[tuple[str, str]]) -> None:
    """Create the bucket rows this process has not created yet (once per process)."""
    missing = [row for row in rows if row not in _ensured]
    if not missing:
        return
    _, alone = run_alone(session, sql.ENSURE_BUCKETS, {
        "keys": [k for k, _ in missing], "dimensions": [d for _, d in missing]}, sole=True)
    if not alone:
        commit_keeping_objects(session)
    with _ensured_lock:
        _ensured.update(missing)


def forget_ensured() -> None:
    """Tests that drop the tables: the rows must be created again."""
    with _ensured_lock:
        _ensured.clear()


def _key_row(key: str) -> Bucket:
    return Bucket(key, KEY_ROW, 0.0, 1.0, False)


def reserve(session: SessionLike, table: Mapping[str, tuple[Bucket, ...]],
            keys: tuple[str, ...], *, tokens: float, inline_wait: float,
            horizon: float | None = None) -> Reservation:
    """Reserve one request (or call) and ``tokens`` on every bucket of ``keys``,
    in one statement. ``wait`` says when its slot is (0 now), the longest of
    the buckets' drain times and any block. The reservation holds (``held``)
    when the wait is at most ``horizon`` (an LLM turn deferred to its slot
    keeps it on its loop; None: ``inline_wait``, as for a tool call, which
    reserves again when it comes back); beyond it nothing is reserved."""
    horizon = inline_wait if horizon is None else horizon
    buckets = tuple(b for key in keys for b in (*table[key], _key_row(key)))
    amounts = tuple(0.0 if b.dimension == KEY_ROW else (tokens if b.tokens else 1.0)
                    for b in buckets)
    rows = [(b.key, b.dimension) for b in buckets]
    _ensure(session, rows)
    params = {
        "keys": [b.key for b in buckets], "dimensions": [b.dimension for b in buckets],
        "capacities": [b.capacity for b in buckets], "periods": [b.period for b in buckets],
        "amounts": list(amounts), "inline_wait": inline_wait, "horizon": horizon}
    row, alone = run_alone(session, sql.RESERVE, params, sole=True)
    if not alone:
        commit_keeping_objects(session)
    if row is None or (row["moved"] < len(buckets) and float(row["wait"]) <= horizon):
        # A row this process created is gone (a table emptied under it): make
        # them again, and reserve on all of them.
        with _ensured_lock:
            _ensured.difference_update(rows)
        _ensure(session, rows)
        row, alone = run_alone(session, sql.RESERVE, params, sole=True)
        if not alone:
            commit_keeping_objects(session)
    wait = float(row["wait"]) if row is not None else 0.0
    return Reservation(buckets, amounts, wait, keys, held=wait <= horizon)


def settle(session: SessionLike, reservation: Reservation, *, tokens: float | None,
           headers: Mapping[str, str] | None = None) -> None:
    """The request is answered (``tokens``: its real usage; None when it was
    refused or failed unbilled: the tokens reserved are given back). Raises a
    bucket's level where the provider's headers report less room than ours."""
    rows = [(b, amount) for b, amount in zip(reservation.buckets, reservation.amounts, strict=True)
            if b.dimension != KEY_ROW]
    if not rows:
        return
    remaining = remaining_from_headers(headers or {})
    deltas, floors = [], []
    for bucket, amount in rows:
        deltas.append(((tokens or 0.0) - amount) if bucket.tokens else 0.0)
        left = remaining.get(bucket.dimension)
        floors.append(bucket.capacity - left if left is not None else None)
    _, alone = run_alone(session, sql.SETTLE, {
        "keys": [b.key for b, _ in rows], "dimensions": [b.dimension for b, _ in rows],
        "capacities": [b.capacity for b, _ in rows], "periods": [b.period for b, _ in rows],
        "deltas": deltas, "floors": floors}, sole=True)
    if not alone:
        commit_keeping_objects(session)


def block(session: SessionLike, keys: tuple[str, ...], seconds: float) -> None:
    """The provider refused with a wait: every worker stays off ``keys`` that long."""
    if not keys:
        return
    _, alone = run_alone(session, sql.BLOCK, {"keys": list(keys), "seconds": seconds},
                         sole=True)
    if not alone:
        commit_keeping_objects(session)


# The providers' remaining-capacity headers, by the bucket dimension they tell.
_REMAINING = {
    "x-ratelimit-remaining-requests": "requests",
    "x-ratelimit-remaining-tokens": "tokens",
    "anthropic-ratelimit-requests-remaining": "requests",
    "anthropic-ratelimit-tokens-remaining": "tokens",
}


def remaining_from_headers(headers: Mapping[str, str]) -> dict[str, float]:
    """What the provider says is left, by dimension (OpenAI's and Anthropic's)."""
    left: dict[str, float] = {}
    for name, dimension in _REMAINING.items():
        value = headers.get(name)
        if value is None:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            left[dimension] = min(number, left.get(dimension, number))
    return left


def parse_reset(value: str) -> float | None:
    """Seconds until a ``-reset`` header's moment: OpenAI's ``6m0s`` / ``20ms``
    durations, Anthropic's RFC 3339 times."""
    value = value.strip()
    total, matched = 0.0, False
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value):
        matched = True
        total += float(amount) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]
    if matched:
        return total
    try:
        from datetime import datetime

        return max(0.0, datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
                   - time.time())
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


@dataclass
class KeyState:
    """A key's buckets as they stand (the CLI and the admin)."""

    key: str
    blocked_for: float | None = None
    deferrals: int = 0
    refusals: int = 0
    levels: dict[str, float] = field(default_factory=dict)
