"""Rate limits, enforced as real providers enforce them. This module owns the token
buckets (continuous refill), the limits set for the whole emulator (the API key) and
per model, the admission of a chat request (charged when admitted, settled to its real
usage when its answer ends), the 429 refusal and the rate-limit headers in each
dialect's shape, and the statistics a test or bench reads (:class:`RateLimitStats`).

Each limit is a bucket holding its per-minute amount and refilled at amount/60 per
second, so a full minute's worth may burst at start. An admitted request is charged 1
request, and tokens = its prompt's estimate + its output cap (``max_tokens`` and kin;
0 without one); ``input_tpm`` / ``output_tpm`` charge the two halves apart. When the
answer is produced, the token charge is settled to the usage it reports (a refund,
or a further charge: a bucket may go below zero). A request that does not fit every
bucket that applies to it is refused with 429 and consumes nothing; one larger than
a bucket's whole capacity is refused too ("Request too large"), without a
``Retry-After``, since no wait would make it fit.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgumentError
from .._local_server import Response
from . import gemini, registry
from .dialect import json_response
from .types import ANTHROPIC, GEMINI, OPENAI, OPENAI_RESPONSES

#: ``rate_limit()`` option -> the dimension it limits.
OPTIONS = {"rpm": "requests", "tpm": "tokens", "input_tpm": "input_tokens",
           "output_tpm": "output_tokens"}
_WORDS = {"requests": ("requests", "RPM"), "tokens": ("tokens", "TPM"),
          "input_tokens": ("input tokens", "ITPM"), "output_tokens": ("output tokens", "OTPM")}
_ORG = "org-llm-emulator"


class Bucket:
    """Holds up to ``capacity``; refilled continuously at ``capacity / 60`` per second."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated = now

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(float(self.capacity),
                             self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` fits (0 when it fits now)."""
        return max(0.0, (amount - self.level) / self.rate)

    def until_full(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)

    def remaining(self) -> int:
        return max(0, math.floor(self.level))


@dataclass
class Ticket:
    """An admitted request's charge, until its answer settles it."""

    dialect: str
    buckets: list[tuple[str, Bucket]]  # (dimension, bucket) of every limit that applies
    prompt: int
    cap: int
    settled: bool = False


@dataclass
class Refusal:
    """Why a request does not fit: the binding bucket, and the wait (None: never fits)."""

    dimension: str
    model: str | None
    bucket: Bucket
    requested: int
    wait: float | None


@dataclass(frozen=True)
class RateLimitStats:
    """What the emulator answered to chat requests, for tests and benches (times are
    ``time.monotonic()``, comparable with the caller's own)."""

    #: 429s sent to chat requests (by the rate limits, or by an injected fault).
    count_429: int
    #: (time, status) of each chat request's answer, in the order answered.
    requests: list[tuple[float, int]] = field(default_factory=list)
    #: (time, tokens) of each settled answer: its real usage, prompt + output.
    tokens: list[tuple[float, int]] = field(default_factory=list)

    def count_429_since(self, since: float) -> int:
        """429s answered at or after monotonic time ``since``."""
        return sum(1 for at, status in self.requests if status == 429 and at >= since)

    def tokens_per_minute(self, since: float, until: float | None = None) -> float:
        """Tokens settled in [since, until) (until: now), per minute of that window."""
        end = time.monotonic() if until is None else until
        if end <= since:
            return 0.0
        total = sum(tokens for at, tokens in self.tokens if since <= at < end)
        return total * 60.0 / (end - since)


def check_limits(options: dict[str, Any]) -> dict[str, int]:
    """``{dimension: limit}`` for ``rate_limit()``'s options; None values are dropped."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise InvalidArgumentError(
            f"unknown rate limit(s) {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    limits: dict[str, int] = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1 or None, got {value!r}")
        limits[OPTIONS[name]] = value
    return limits


class RateLimiter:
    """The limits of one emulator, its buckets and its statistics; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: scope (None: the whole emulator; else a model name) -> dimension -> bucket
        self._scopes: dict[str | None, dict[str, Bucket]] = {}
        self._answers: list[tuple[float, int]] = []
        self._tokens: list[tuple[float, int]] = []

    def set(self, limits: dict[str, int], model: str | None) -> None:
        """Replace ``model``'s limits (None: the emulator's) with full buckets; no limits
        clears them (for model None: every limit, the models' included)."""
        with self._lock:
            now = self._clock()
            if not limits:
                if model is None:
                    self._scopes.clear()
                else:
                    self._scopes.pop(model, None)
                return
            self._scopes[model] = {dim: Bucket(cap, now) for dim, cap in limits.items()}

    def reset(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._answers.clear()
            self._tokens.clear()

    def record(self, status: int) -> None:
        with self._lock:
            self._answers.append((self._clock(), status))

    def stats(self) -> RateLimitStats:
        with self._lock:
            return RateLimitStats(sum(1 for _, status in self._answers if status == 429),
                                  list(self._answers), list(self._tokens))

    # ---- the request path ----------------------------------------------------------

    def admit(self, dialect: str, model: str | None, prompt: int,
              cap: int) -> Ticket | Response:
        """Charge an arriving request, or the 429 that refuses it (nothing charged)."""
        charges = {"requests": 1, "tokens": prompt + cap, "input_tokens": prompt,
                   "output_tokens": cap}
        with self._lock:
            now = self._clock()
            scopes = self._applicable(model)
            refusal: Refusal | None = None
            for scope, buckets in scopes:
                for dim, bucket in buckets.items():
                    bucket.refill(now)
                    amount = charges[dim]
                    if amount > bucket.capacity:
                        refusal = Refusal(dim, scope or model, bucket, amount, None)
                        break
                    wait = bucket.wait(amount)
                    if wait > 0 and (refusal is None or (refusal.wait or 0) < wait):
                        refusal = Refusal(dim, scope or model, bucket, amount, wait)
                if refusal is not None and refusal.wait is None:
                    break
            applying = [(dim, bucket) for _, buckets in scopes
                        for dim, bucket in buckets.items()]
            if refusal is not None:
                return _refuse(dialect, refusal, _headers(dialect, applying, now))
            for dim, bucket in applying:
                bucket.level -= charges[dim]
            return Ticket(dialect, applying, prompt, cap)

    def finish(self, ticket: Ticket, response: Response, usage: tuple[int, int] | None,
               *, stream: bool) -> Response:
        """Settle ``ticket`` and add the rate-limit headers to ``response``.

        A streamed answer is settled when it ends (just before its last piece is
        written, or when the client hangs up), so its headers show the reservation, as
        a provider's do; any other answer is settled first. An answer without usage (an
        error) costs its request and no token."""
        spent = usage if response.status < 400 and usage is not None else (0, 0)
        if stream and response.status < 400:
            response.headers = {**self._ticket_headers(ticket), **response.headers}
            if response.pieces is None:
                self.settle(ticket, spent)
            else:
                response.pieces = _settle_at_end(
                    response.pieces, lambda: self.settle(ticket, spent))
            return response
        self.settle(ticket, spent)
        response.headers = {**self._ticket_headers(ticket), **response.headers}
        return response

    def settle(self, ticket: Ticket, spent: tuple[int, int]) -> None:
        prompt, output = spent
        deltas = {"tokens": prompt + output - ticket.prompt - ticket.cap,
                  "input_tokens": prompt - ticket.prompt, "output_tokens": output - ticket.cap}
        with self._lock:
            if ticket.settled:
                return
            ticket.settled = True
            now = self._clock()
            for dim, bucket in ticket.buckets:
                if dim in deltas:
                    bucket.refill(now)
                    bucket.level = min(float(bucket.capacity), bucket.level - deltas[dim])
            if prompt + output:
                self._tokens.append((now, prompt + output))

    def _ticket_headers(self, ticket: Ticket) -> dict[str, str]:
        with self._lock:
            return _headers(ticket.dialect, ticket.buckets, self._clock())

    def _applicable(self, model: str | None) -> list[tuple[str | None, dict[str, Bucket]]]:
        scopes: list[tuple[str | None, dict[str, Bucket]]] = []
        if None in self._scopes:
            scopes.append((None, self._scopes[None]))
        if model is not None and model in self._scopes:
            scopes.append((model, self._scopes[model]))
        return scopes


def _settle_at_end(pieces: Iterable[bytes], settle: Callable[[], None]) -> Iterator[bytes]:
    """``pieces``, calling ``settle`` before the last one goes out (or at the close of a
    stream cut short: the finally runs when the writer drops the iterator)."""
    try:
        iterator = iter(pieces)
        previous = next(iterator, None)
        if previous is None:
            return
        for piece in iterator:
            yield previous
            previous = piece
        settle()
        yield previous
    finally:
        settle()


# ---- the dialects' shapes --------------------------------------------------------------


def _binding(buckets: list[tuple[str, Bucket]], now: float) -> dict[str, Bucket]:
    """Per dimension, the most restrictive bucket (least remaining) among those that
    apply: what the headers report, as Anthropic documents for its own."""
    found: dict[str, Bucket] = {}
    for dim, bucket in buckets:
        bucket.refill(now)
        if dim not in found or bucket.level < found[dim].level:
            found[dim] = bucket
    return found


def _headers(dialect: str, buckets: list[tuple[str, Bucket]], now: float) -> dict[str, str]:
    """The rate-limit headers a chat response carries (none for Gemini, nor without limits)."""
    binding = _binding(buckets, now)
    headers: dict[str, str] = {}
    if dialect in (OPENAI, OPENAI_RESPONSES):
        for dim in ("requests", "tokens"):
            if dim in binding:
                bucket = binding[dim]
                headers[f"x-ratelimit-limit-{dim}"] = str(bucket.capacity)
                headers[f"x-ratelimit-remaining-{dim}"] = str(bucket.remaining())
                headers[f"x-ratelimit-reset-{dim}"] = go_duration(bucket.until_full())
    elif dialect == ANTHROPIC:
        wall = dt.datetime.now(dt.UTC)
        for dim, bucket in binding.items():
            name = dim.replace("_", "-")
            headers[f"anthropic-ratelimit-{name}-limit"] = str(bucket.capacity)
            headers[f"anthropic-ratelimit-{name}-remaining"] = str(bucket.remaining())
            headers[f"anthropic-ratelimit-{name}-reset"] = rfc3339(
                wall + dt.timedelta(seconds=bucket.until_full()))
    return headers


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's style, to the millisecond, rounded
    up): ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    millis = math.ceil(round(seconds * 1000, 6))
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def rfc3339(moment: dt.datetime) -> str:
    """A UTC time as Anthropic's ``-reset`` headers write it, rounded up to the second."""
    if moment.microsecond:
        moment = moment.replace(microsecond=0) + dt.timedelta(seconds=1)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _refuse(dialect: str, refusal: Refusal, headers: dict[str, str]) -> Response:
    """The 429 that refuses a request, in the dialect's shape."""
    bucket, wait = refusal.bucket, refusal.wait
    words, abbr = _WORDS[refusal.dimension]
    model = refusal.model or "the model"
    used = max(0, math.ceil(bucket.capacity - bucket.level))
    seconds = None if wait is None else max(1, math.ceil(round(wait, 6)))
    if dialect == GEMINI:
        metric = f"generativelanguage.googleapis.com/generate_content_{words.replace(' ', '_')}"
        message = ("You exceeded your current quota, please check your plan and billing "
                   f"details.\n* Quota exceeded for metric: {metric}, limit: "
                   f"{bucket.capacity}, model: {model}")
        if seconds is None:
            body = gemini.error_body(429, message + f"\nRequest too large: {refusal.requested} "
                                     f"{words} requested.")
        else:
            body = gemini.retry_info_body(429, f"{seconds}s",
                                          message + f"\nPlease retry in {wait:.3f}s.")
        return json_response(429, body)  # Gemini sends no rate-limit headers
    if seconds is not None:
        assert wait is not None
        headers = {**headers, "retry-after": str(seconds)}
        if dialect in (OPENAI, OPENAI_RESPONSES):
            headers["retry-after-ms"] = str(max(1, math.ceil(round(wait * 1000, 6))))
    if dialect == ANTHROPIC:
        if seconds is None:
            message = (f"This request would exceed your organization's rate limit of "
                       f"{bucket.capacity} {words} per minute for {model} even when unused: "
                       f"{refusal.requested} {words} requested. Please reduce the prompt "
                       "length or the maximum tokens requested.")
        else:
            message = (f"This request would exceed your organization's rate limit of "
                       f"{bucket.capacity} {words} per minute for {model}. You can see the "
                       "response headers for current usage. Please reduce the prompt length "
                       "or the maximum tokens requested, or try again later.")
        return registry.dialect_error(ANTHROPIC, 429, message, headers=headers)
    kind = "requests" if refusal.dimension == "requests" else "tokens"
    if seconds is None:
        message = (f"Request too large for {words} per min ({abbr}) on {model} in "
                   f"organization {_ORG}: Limit {bucket.capacity}, Requested "
                   f"{refusal.requested}. The input or output tokens must be reduced in "
                   "order to run successfully.")
    else:
        assert wait is not None
        message = (f"Rate limit reached for {words} per min ({abbr}) on {model} in "
                   f"organization {_ORG}: Limit {bucket.capacity}, Used {used}, Requested "
                   f"{refusal.requested}. Please try again in {go_duration(wait)}.")
    return registry.dialect_error(OPENAI, 429, message, type_=kind,
                                  code="rate_limit_exceeded", headers=headers)
