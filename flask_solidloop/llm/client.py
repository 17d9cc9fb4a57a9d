"""The one send path of an LLM turn: send, retry transient failures, keep a wire record.

Both entry points, :func:`post_json` here and :func:`.streaming.post_stream`,
hand :class:`Send` the exchange one attempt makes, and :meth:`Send.run` is the
one retry loop around it. How an attempt can fail is decided in one place too:
:func:`map_exceptions` turns httpx's exceptions into our ProviderError
subclasses, as httpx's own ``map_httpcore_exceptions`` does for httpcore's, and
says which failures may be repeated. Every ProviderError the send path raises
carries the request's :class:`WireRecord` in ``ProviderError.wire``.

Retry policy (SOLIDLOOP_LLM_RETRY_*): a response with a retryable status, or a
connection that never opened, is re-sent up to ``retries`` times. The wait is
the server's Retry-After (delta-seconds or HTTP-date) or ``retry-after-ms`` when
given, else exponential backoff, always capped by ``max_delay``, with full
jitter (:func:`jittered`): workers refused by one 429 do not come back in
lockstep. The server's wait stays a floor: jitter only ever adds to it. A read timeout
is never retried: the full timeout has passed and the request may have been
served. Waits poll ``should_abort`` so a pause or stop lands within a second.
A stream adds one rule: once content was handed over it is never repeated
(streaming.py sets that latch on the attempt; :func:`map_exceptions` obeys it).
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import os
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn, TypeVar

import httpx

from .. import jsontext
from ..errors import (
    AbortedError,
    ProviderAnswerError,
    ProviderConnectionLostError,
    ProviderError,
    ProviderHTTPError,
    ProviderResponseError,
    ProviderUnavailableError,
    SolidLoopError,
    TurnLimitError,
)
from ..urls import redact_url, redact_urls_in
from ..wire import WireRecord
from .dialect import CUT_STREAM_HINT
from .redact import redact_headers, redact_secrets

T = TypeVar("T")

NEVER_RETRY = {400, 401, 402, 403, 404, 413, 422}


@dataclass
class RetryPolicy:
    retries: int = 2
    base_delay: float = 1.0
    max_delay: float = 60.0
    statuses: tuple[int, ...] = (408, 409, 429, 500, 502, 503, 504, 529)
    #: Draws the jitter; give a seeded ``random.Random`` to get the same waits each run.
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    #: A 429/503/529 whose server wait (Retry-After) is longer than this is not
    #: slept through: the request fails with the wait on its error
    #: (``ProviderHTTPError.retry_after``) for the turn to be deferred. None: the
    #: wait is slept like any other (up to ``max_delay``).
    defer_after: float | None = None


#: A refusal whose wait a rate-limited turn defers instead of sleeping.
DEFERRABLE_STATUSES = (429, 503, 529)
#: The response headers that tell a provider's rate limits (kept on the wire record).
RATE_HEADER = re.compile(r"^(x-ratelimit-|anthropic-ratelimit-|retry-after)", re.I)


def rate_headers(headers: Any) -> dict[str, str]:
    """The rate-limit headers of a response, their names lower-cased."""
    return {k.lower(): v for k, v in headers.items() if RATE_HEADER.match(k)}


def retry_after_seconds(response: httpx.Response) -> float | None:
    millis = response.headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class PoolLimits:
    """The connection pool of one provider origin (scheme, host and port) in
    this process: at most ``max_connections`` open at once (requests beyond
    wait up to the request's pool timeout for one to free up), of which
    ``max_keepalive`` are kept open between requests."""

    max_connections: int = 100
    max_keepalive: int = 100

    def httpx_limits(self) -> httpx.Limits:
        return httpx.Limits(max_connections=self.max_connections,
                            max_keepalive_connections=min(self.max_keepalive,
                                                          self.max_connections))


#: The process's per-origin pool: set at worker boot (:func:`configure_pool`)
#: from SOLIDLOOP_LLM_MAX_CONNECTIONS, or the process's concurrency.
_pool_limits = PoolLimits()
_shared: dict[str, httpx.Client] = {}
_shared_lock = threading.Lock()
_shared_pid: int | None = None


def configure_pool(limits: PoolLimits) -> None:
    """Set the per-origin pool of the clients this process makes from now on
    (a worker sets it at boot, before any request)."""
    global _pool_limits
    with _shared_lock:
        _pool_limits = limits


def pool_limits() -> PoolLimits:
    return _pool_limits


def origin_of(url: str) -> str:
    """``scheme://host:port`` of a URL: the unit a connection pool serves."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.host}:{parsed.port or ''}"


def shared_client(url: str | None = None) -> httpx.Client:
    """One HTTP client per provider origin per process: building one costs
    ~50 ms of CPU (TLS setup) and a fresh client also pays a new TCP and TLS
    handshake on every turn. Each origin has a pool of its own
    (:class:`PoolLimits`), so one busy provider never takes another's
    connections. Timeouts are set per request, so one client serves every
    agent. A forked child gets clients of its own."""
    global _shared_pid
    key = origin_of(url) if url else ""
    with _shared_lock:
        if _shared_pid != os.getpid():
            _shared.clear()
            _shared_pid = os.getpid()
        client = _shared.get(key)
        if client is None:
            client = _shared[key] = httpx.Client(limits=_pool_limits.httpx_limits())
        return client


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """The exponential backoff ceiling for attempt N (base * 2**(N-1)), capped by
    max_delay. The wait actually taken is :func:`jittered` below it."""
    return min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1))


def jittered(policy: RetryPolicy, attempt: int, server_wait: float | None = None) -> float:
    """The wait before attempt N+1, with full jitter.

    Without a server-requested wait: uniform in ``[0, backoff]`` ("full jitter":
    many workers failed by the same 429 spread out instead of retrying together).
    With one (Retry-After, retry-after-ms, Gemini's RetryInfo), capped by
    ``max_delay``: uniform in ``[server_wait, min(max_delay, server_wait + backoff)]``,
    so the server's wait is a floor and the spread is the same backoff window.
    """
    ceiling = backoff_delay(policy, attempt)
    if server_wait is None:
        return policy.rng.uniform(0.0, ceiling)
    floor = min(policy.max_delay, server_wait)
    return policy.rng.uniform(floor, min(policy.max_delay, floor + ceiling))


def retry_delay(response: httpx.Response, body_text: str, attempt: int, policy: RetryPolicy,
                retry_after_from_body: Callable[[Any], float | None] | None = None) -> float | None:
    """The wait before the next attempt, or None when this response must not be retried.

    The server's own wait wins over backoff: Retry-After (seconds or HTTP-date),
    retry-after-ms, or a wait found in the error body (Gemini's RetryInfo), always
    capped by the policy's max_delay; it is a floor, jitter is added above it
    (:func:`jittered`).
    """
    status = response.status_code
    if status in NEVER_RETRY or status not in policy.statuses or attempt > policy.retries:
        return None
    return jittered(policy, attempt, server_wait(response, body_text, retry_after_from_body))


def server_wait(response: httpx.Response, body_text: str,
                retry_after_from_body: Callable[[Any], float | None] | None) -> float | None:
    """The wait the server asked for: Retry-After, retry-after-ms, or one in the
    error body (Gemini's RetryInfo); None when it named none."""
    wait = retry_after_seconds(response)
    if wait is None and retry_after_from_body is not None:
        try:
            wait = retry_after_from_body(json.loads(body_text))
        except (ValueError, TypeError):
            wait = None
    return wait


async def _sleep_async(seconds: float, should_abort: Callable[[], bool] | None) -> None:
    """:func:`_sleep` on an asyncio loop (``should_abort`` must not block)."""
    import asyncio

    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if should_abort is not None and should_abort():
            raise AbortedError("the loop was paused or stopped during a retry wait")
        await asyncio.sleep(min(remaining, 0.5))


def _sleep(seconds: float, should_abort: Callable[[], bool] | None) -> None:
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if should_abort is not None and should_abort():
            raise AbortedError("the loop was paused or stopped during a retry wait")
        time.sleep(min(remaining, 0.5))


@dataclass
class Attempt:
    """One try of a request while it runs: its wire-log entry and how far it got."""

    number: int
    stream: bool
    #: ``time.monotonic()`` when the attempt began.
    started: float = field(init=False)
    #: Events read so far (streams only).
    events: int = 0
    #: The latch (streams only): content went to the caller, so never repeat this attempt.
    handed: bool = False
    #: What the wire log keeps of this attempt (one of ``WireRecord.attempts``).
    entry: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.entry = {"attempt": self.number}
        if self.stream:
            self.entry["stream"] = True

    def elapsed_ms(self) -> float:
        elapsed = (time.monotonic() - self.started) * 1000
        # Streamed attempts have always been logged to a tenth of a millisecond.
        return round(elapsed, 1) if self.stream else elapsed

    def log(self, **fields: Any) -> None:
        """Put ``fields`` on the attempt's wire-log entry, with the time taken so far."""
        self.entry.update(fields, duration_ms=self.elapsed_ms())


class _Retry(SolidLoopError):  # a signal inside the send path, never raised out of it
    """This attempt failed in a way worth repeating after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.delay = delay


#: Payloads with more text than this are sent as a streamed body (Send.body).
STREAMED_BODY_CHARS = 256_000
def _body_pieces(payload: Any) -> Iterator[str]:
    """The body's JSON as httpx's ``json=`` writes it, in bounded pieces."""
    return jsontext.pieces(payload, separators=(",", ":"), allow_nan=False)


def text_size(value: Any) -> int:
    """Characters of the strings in ``value`` (a JSON-like tree)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(text_size(item) for item in value)
    return 0


@dataclass(frozen=True)
class TurnLimits:
    """An LLM turn's hard limits: ``timeout`` seconds of wall time for its
    requests, retries and streams included (ending at ``deadline``, a
    ``time.monotonic()`` value), and at most ``max_output_chars`` characters of
    answer (text, reasoning and tool-call arguments). None: no such limit."""

    timeout: float | None = None
    max_output_chars: int | None = None
    deadline: float | None = None

    @classmethod
    def starting_now(cls, timeout: float | None, max_output_chars: int | None) -> TurnLimits:
        deadline = time.monotonic() + timeout if timeout else None
        return cls(timeout, max_output_chars, deadline)

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def timeout_message(self) -> str:
        return (f"turn_timeout: the request ran past the turn's {self.timeout:g}s and was "
                "ended (what arrived is in the wire log; not sent again). Raise the agent's "
                "turn_timeout for a slow model, or ask for shorter answers")

    def length_message(self, chars: int) -> str:
        return (f"max_output_chars: the answer reached {chars} characters, past the turn's "
                f"{self.max_output_chars} and was ended (what arrived is in the wire log; "
                "not sent again). Raise the agent's max_output_chars, or set max_tokens so "
                "the provider stops first")


def request_record(url: str, payload: dict[str, Any], *, headers: dict[str, str],
                   secrets: list[str] | None) -> WireRecord:
    """The wire record of a request not sent yet: its URL without credentials,
    its headers and body with every secret removed. A turn puts it on record
    before sending (pipeline/llm_stack.py), then hands it to the send path
    (``record=``), which fills in the attempts and the response."""
    return WireRecord(url=redact_url(url), request_headers=redact_headers(headers),
                      request_body=redact_secrets(payload, secrets or []))


class Send:
    """One request through the send path: what to send, how to retry, its wire record."""

    def __init__(
        self, url: str, payload: dict[str, Any], *, headers: dict[str, str],
        params: dict[str, str] | None, read_timeout: float, connect_timeout: float,
        policy: RetryPolicy | None, secrets: list[str] | None,
        should_abort: Callable[[], bool] | None,
        client: httpx.Client | httpx.AsyncClient | None,
        retry_after_from_body: Callable[[Any], float | None] | None, stream: bool,
        limits: TurnLimits | None = None, record: WireRecord | None = None,
        pool_timeout: float | None = None,
    ) -> None:
        self.url = url
        self.limits = limits or TurnLimits()
        #: The URL as errors, logs and the wire log show it: no credentials.
        self.shown_url = redact_url(url)
        self.payload = payload
        self.headers = headers
        self.params = params
        self.read_timeout = read_timeout
        #: How long a request waits for a free connection of its origin's pool
        #: (SOLIDLOOP_LLM_POOL_TIMEOUT; the connect timeout when not given).
        self.pool_timeout = pool_timeout if pool_timeout is not None else connect_timeout
        self.timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout,
                                     write=read_timeout, pool=self.pool_timeout)
        self.policy = policy or RetryPolicy()
        self.secrets = secrets or []
        self.should_abort = should_abort
        #: An ``httpx.Client``; an ``httpx.AsyncClient`` for :meth:`run_async`.
        self.http: Any = client or shared_client(url)
        self.retry_after_from_body = retry_after_from_body
        self.stream = stream
        #: ``record``: made by :func:`request_record` for this same request.
        self.record = record if record is not None else request_record(
            url, payload, headers=headers, secrets=self.secrets)

    def redact(self, value: Any) -> Any:
        return redact_secrets(value, self.secrets)

    def body(self) -> dict[str, Any]:
        """The request body as httpx arguments: ``json=`` for an ordinary payload;
        for one of megabytes (a long history), its JSON encoded piece by piece
        with its Content-Length, so the body is never held whole a second and a
        third time (a JSON string, then its bytes). Fresh for each attempt."""
        if text_size(self.payload) < STREAMED_BODY_CHARS:
            return {"json": self.payload}
        length = sum(len(piece.encode()) for piece in _body_pieces(self.payload))
        content = (piece.encode() for piece in _body_pieces(self.payload))
        return {"content": content, "headers": {**self.headers, "Content-Length": str(length)}}

    def attempt_timeout(self, attempt: Attempt) -> httpx.Timeout:
        """The attempt's httpx timeouts: a read never waits past the turn's
        deadline. TurnLimitError when the deadline has passed already (a retry
        wait used it up)."""
        remaining = self.limits.remaining()
        if remaining is None:
            return self.timeout
        if remaining <= 0:
            attempt.log(error="turn_timeout before the attempt")
            self.fail(attempt)
            raise TurnLimitError("turn_timeout", self.limits.timeout_message())
        return httpx.Timeout(connect=min(self.timeout.connect or remaining, remaining),
                             read=min(self.read_timeout, remaining),
                             write=min(self.read_timeout, remaining),
                             pool=min(self.timeout.pool or remaining, remaining))

    def past_deadline(self) -> bool:
        remaining = self.limits.remaining()
        return remaining is not None and remaining <= 0.05

    def run(self, exchange: Callable[[Attempt], T]) -> T:
        """The one retry loop: call ``exchange`` once per attempt until it returns.

        An attempt ends in its result, in a wait and the next attempt (the
        policy allowed a repeat: see :meth:`reject` and :func:`map_exceptions`),
        or in a ProviderError, which leaves with the wire record in ``wire``.
        :meth:`run_async` is the same loop for an awaitable exchange.
        """
        started = time.monotonic()
        try:
            number = 0
            while True:
                number += 1
                attempt = self.begin(number)
                try:
                    with map_exceptions(self, attempt):
                        return exchange(attempt)
                except _Retry as retry:
                    _sleep(self.wait_before_retry(attempt, retry), self.should_abort)
        except ProviderError as exc:
            exc.wire = self.record  # the failed turn's wire log
            raise
        finally:
            self.record.duration_ms = (time.monotonic() - started) * 1000

    async def run_async(self, exchange: Callable[[Attempt], Awaitable[T]]) -> T:
        """:meth:`run` for an exchange on an asyncio loop (llm/aio.py): the same
        attempts, failure mapping and waits, the waits awaited."""
        started = time.monotonic()
        try:
            number = 0
            while True:
                number += 1
                attempt = self.begin(number)
                try:
                    with map_exceptions(self, attempt):
                        return await exchange(attempt)
                except _Retry as retry:
                    await _sleep_async(self.wait_before_retry(attempt, retry),
                                       self.should_abort)
        except ProviderError as exc:
            exc.wire = self.record
            raise
        finally:
            self.record.duration_ms = (time.monotonic() - started) * 1000

    def begin(self, number: int) -> Attempt:
        """Attempt ``number``, its entry on the wire record."""
        attempt = Attempt(number, self.stream)
        self.record.attempts.append(attempt.entry)
        return attempt

    def wait_before_retry(self, attempt: Attempt, retry: _Retry) -> float:
        """The wait before the next attempt, noted on this one. Never past the
        turn's deadline: the next attempt then fails on it at once
        (attempt_timeout)."""
        attempt.entry["retry_in_s"] = round(retry.delay, 3)
        remaining = self.limits.remaining()
        return retry.delay if remaining is None else min(retry.delay, max(remaining, 0.0))

    def reject(self, response: httpx.Response, body_text: str, attempt: Attempt) -> NoReturn:
        """A non-2xx response: repeated when :func:`retry_delay` allows it, else the
        turn fails with ProviderHTTPError (its body redacted)."""
        self.record.rate_headers = rate_headers(response.headers)
        if self.policy.defer_after is not None \
                and response.status_code in DEFERRABLE_STATUSES:
            wait = server_wait(response, body_text, self.retry_after_from_body)
            if wait is not None and wait > self.policy.defer_after:
                self.record.status = response.status_code
                self.record.response_body = self.redact(body_text[:20000])
                raise ProviderHTTPError(response.status_code, self.redact(body_text),
                                        self.shown_url, retry_after=wait)
        delay = retry_delay(response, body_text, attempt.number, self.policy,
                            self.retry_after_from_body)
        if delay is not None and self.policy.defer_after is not None \
                and response.status_code in DEFERRABLE_STATUSES:
            # A rate-limited key's short wait is slept, but the jitter above it
            # must not keep the thread past the inline wait either.
            delay = min(delay, self.policy.defer_after)
        if delay is not None:
            attempt.entry["body"] = self.redact(body_text[:2000])
            raise _Retry(delay)
        self.record.status = response.status_code
        self.record.response_body = self.redact(body_text[:20000])
        raise ProviderHTTPError(response.status_code, self.redact(body_text), self.shown_url)

    def fail(self, attempt: Attempt) -> None:
        """The attempt's failure is the request's outcome: keep its reason in the record."""
        self.record.error = attempt.entry["error"]


@contextlib.contextmanager
def map_exceptions(send: Send, attempt: Attempt) -> Iterator[None]:
    """How an attempt fails, in one place: re-raise what the exchange raised as
    the ProviderError subclass the turn fails with, or as a repeat of the attempt.

    ====================================  ==========================  =====================
    raised                                becomes                     repeated
    ====================================  ==========================  =====================
    ``httpx.ConnectError``,               ProviderError               yes, with backoff
    ``httpx.ConnectTimeout``              ("cannot connect")          (nothing was sent)
    ``httpx.PoolTimeout``                 ProviderUnavailableError    yes, with backoff
                                          ("no free connection")      (nothing was sent)
    any other ``httpx.TimeoutException``  ProviderError               never
    any other ``httpx.TransportError``    ProviderResponseError       streams only, before
                                          ("broke")                   content was handed
    ProviderResponseError (streams: an    itself                      the same, and never a
    error event, a malformed chunk)                                   ProviderAnswerError
    ====================================  ==========================  =====================

    Each failure is logged on the attempt's wire-log entry; a final one also
    becomes the record's ``error``. Everything else passes through unchanged.
    """
    try:
        yield
    except TurnLimitError:
        raise  # the exchange logged the attempt and the record already
    except httpx.PoolTimeout as exc:
        # Every connection of the origin's pool stayed busy: the request never
        # left this process, so it is repeated like a connection that never
        # opened; past the retries the provider counts as unavailable (the turn
        # is deferred, never failed on it).
        limits = _pool_limits
        attempt.log(error=f"pool timeout: no free connection within {send.pool_timeout:g}s")
        if send.past_deadline():
            send.fail(attempt)
            raise TurnLimitError("turn_timeout", send.limits.timeout_message()) from exc
        if attempt.number <= send.policy.retries:
            raise _Retry(jittered(send.policy, attempt.number)) from None
        send.fail(attempt)
        raise ProviderUnavailableError(
            f"no free connection to {origin_of(send.shown_url)} within {send.pool_timeout:g}s: "
            f"this process's {limits.max_connections} connections to it were all busy "
            "(nothing was sent). Raise SOLIDLOOP_LLM_MAX_CONNECTIONS or "
            "SOLIDLOOP_LLM_POOL_TIMEOUT") from exc
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        # The connection never opened: nothing was sent, so a retry is safe.
        attempt.log(error=f"connect failed: {exc}")
        if attempt.number <= send.policy.retries:
            raise _Retry(jittered(send.policy, attempt.number)) from None
        send.fail(attempt)
        raise ProviderUnavailableError(
            f"cannot connect to {send.shown_url}: {redact_urls_in(str(exc))}") from exc
    except httpx.TimeoutException as exc:
        # Never repeated: a read timeout means the whole timeout has passed, and the
        # provider may have done (and billed) the work.
        name = type(exc).__name__
        if send.past_deadline():
            attempt.log(error=f"turn_timeout ({name})", events=attempt.events)
            send.fail(attempt)
            raise TurnLimitError("turn_timeout", send.limits.timeout_message()) from exc
        if attempt.stream:
            attempt.log(error=f"{name}: no data for {send.read_timeout}s", events=attempt.events)
            message = (f"{name}: {send.shown_url} sent nothing for {send.read_timeout}s "
                       "(read_timeout is the silence allowed between reads; not retried)")
        else:
            attempt.log(error=f"{name}: {exc}")
            message = (f"{name} after {send.read_timeout}s waiting for {send.shown_url} "
                       "(read timeouts are not retried)")
        send.fail(attempt)
        raise ProviderError(message) from exc
    except httpx.TransportError as exc:
        if attempt.stream:
            _broken_stream(send, attempt, exc)
            raise ProviderConnectionLostError(
                f"the stream from {send.shown_url} broke after {attempt.events} events: "
                f"{exc}; if the server is llama-cpp-python: {CUT_STREAM_HINT}"
            ) from exc
        # The connection dropped while the request or response was in flight: the
        # provider may have served it, so it is not repeated; the loop fails with
        # a readable reason instead of an unexplained transport exception.
        attempt.log(error=f"{type(exc).__name__}: {exc}")
        send.fail(attempt)
        raise ProviderConnectionLostError(
            f"the connection to {send.shown_url} broke before the response was complete "
            f"({type(exc).__name__}: {exc}); not retried at once, as it may have been served"
        ) from exc
    except ProviderResponseError as exc:
        if attempt.stream:
            _broken_stream(send, attempt, exc)
        # Else a complete body that could not be used: sending it again would not help.
        raise


def _broken_stream(send: Send, attempt: Attempt,
                   exc: httpx.TransportError | ProviderResponseError) -> None:
    """A broken stream, a mid-stream error event, a malformed chunk: logged, and
    repeated (raises _Retry) like any transient failure until content was handed
    over (a second generation would be glued onto the first), unless a retry would
    only repeat the answer. Otherwise the failure becomes the request's outcome."""
    attempt.log(error=f"{type(exc).__name__}: {exc}", events=attempt.events,
                handed_content=attempt.handed)
    repeatable = not isinstance(exc, ProviderAnswerError)
    if repeatable and not attempt.handed and attempt.number <= send.policy.retries:
        raise _Retry(jittered(send.policy, attempt.number)) from None
    send.fail(attempt)


def post_json(
    url: str,
    payload: dict[str, Any],
    *,
    headers: dict[str, str],
    read_timeout: float,
    connect_timeout: float = 10.0,
    policy: RetryPolicy | None = None,
    secrets: list[str] | None = None,
    should_abort: Callable[[], bool] | None = None,
    client: httpx.Client | None = None,
    params: dict[str, str] | None = None,
    retry_after_from_body: Callable[[Any], float | None] | None = None,
    limits: TurnLimits | None = None,
    record: WireRecord | None = None,
    pool_timeout: float | None = None,
) -> tuple[Any, WireRecord]:
    """POST ``payload`` and return the parsed JSON body plus the wire record
    (``record`` when given: :func:`request_record` of this request).

    Raises ProviderHTTPError for a final non-2xx status and ProviderResponseError
    for a body that is not JSON; both carry what the user needs to act.
    """
    send = Send(url, payload, headers=headers, params=params, read_timeout=read_timeout,
                connect_timeout=connect_timeout, policy=policy, secrets=secrets,
                should_abort=should_abort, client=client,
                retry_after_from_body=retry_after_from_body, stream=False, limits=limits,
                record=record, pool_timeout=pool_timeout)
    return send.run(partial(_json_attempt, send)), send.record


async def post_json_async(url: str, payload: dict[str, Any], *, client: httpx.AsyncClient,
                          **options: Any) -> tuple[Any, WireRecord]:
    """:func:`post_json` on an asyncio loop, through ``client`` (llm/aio.py):
    the same arguments, retry loop, failure mapping and wire record.
    ``should_abort`` must not block (it is called on the loop)."""
    send = Send(url, payload, params=options.pop("params", None),
                connect_timeout=options.pop("connect_timeout", 10.0), client=client,
                policy=options.pop("policy", None), secrets=options.pop("secrets", None),
                should_abort=options.pop("should_abort", None),
                retry_after_from_body=options.pop("retry_after_from_body", None),
                stream=False, **options)

    async def attempt_once(attempt: Attempt) -> Any:
        response = await send.http.post(send.url, **{"headers": send.headers, **send.body()},
                                        params=send.params,
                                        timeout=send.attempt_timeout(attempt))
        return json_answer(send, attempt, response)

    return await send.run_async(attempt_once), send.record


def _json_attempt(send: Send, attempt: Attempt) -> Any:
    response = send.http.post(send.url, **{"headers": send.headers, **send.body()},
                              params=send.params, timeout=send.attempt_timeout(attempt))
    return json_answer(send, attempt, response)


def json_answer(send: Send, attempt: Attempt, response: httpx.Response) -> Any:
    """A whole (non-streamed) response, read: its JSON body, or the attempt's
    failure (a status to reject, a body that is not JSON). Shared by the
    thread and the asyncio exchange."""
    status = response.status_code
    attempt.log(status=status)
    if status >= 400:
        send.reject(response, response.text, attempt)
    send.record.status = status
    send.record.rate_headers = rate_headers(response.headers)
    try:
        body = response.json()
    except (json.JSONDecodeError, ValueError) as exc:
        send.record.response_body = send.redact(response.text[:20000])
        raise ProviderResponseError(
            f"HTTP {status} from {send.shown_url} with a body that is not JSON: "
            f"{response.text[:300]!r}"
        ) from exc
    send.record.response_body = send.redact(body)
    return body
