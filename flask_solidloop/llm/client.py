"""The HTTP side of an LLM turn: send, retry transient failures, keep a wire record.

Retry policy (SOLIDLOOP_LLM_RETRY_*): a response with a retryable status, or a
connection that never opened, is re-sent up to ``retries`` times. The wait is
the server's Retry-After (delta-seconds or HTTP-date) or ``retry-after-ms`` when
given, else exponential backoff, always capped by ``max_delay``. A read timeout
is never retried: the full timeout has passed and the request may have been
served. Waits poll ``should_abort`` so a pause or stop lands within a second.
"""

from __future__ import annotations

import email.utils
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..errors import ProviderError, ProviderHTTPError, ProviderResponseError
from .redact import redact_headers, redact_secrets

NEVER_RETRY = {400, 401, 402, 403, 404, 413, 422}


@dataclass
class RetryPolicy:
    retries: int = 2
    base_delay: float = 1.0
    max_delay: float = 60.0
    statuses: tuple[int, ...] = (408, 409, 429, 500, 502, 503, 504, 529)


@dataclass
class WireRecord:
    """What the wire log keeps of one turn: redacted request, response, attempts, timings."""

    url: str
    request_headers: dict[str, str]
    request_body: Any
    attempts: list[dict[str, Any]] = field(default_factory=list)
    status: int | None = None
    response_body: Any = None
    duration_ms: float | None = None
    error: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "request": {"headers": self.request_headers, "body": self.request_body},
            "response": {"status": self.status, "body": self.response_body},
            "attempts": self.attempts,
            "duration_ms": self.duration_ms,
            "error": self.error,
        }


class AbortedError(ProviderError):
    """The turn was paused or stopped while waiting to retry."""


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


_shared: httpx.Client | None = None
_shared_lock = threading.Lock()
_shared_pid: int | None = None


def shared_client() -> httpx.Client:
    """One HTTP client per process: building one costs ~50 ms of CPU (TLS setup)
    and a fresh client also pays a new TCP and TLS handshake on every turn.
    Timeouts are set per request, so one client serves every agent. A forked
    child gets a client of its own."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared = httpx.Client(limits=httpx.Limits(max_connections=100,
                                                       max_keepalive_connections=20))
            _shared_pid = os.getpid()
        return _shared


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Exponential backoff for attempt N (base * 2**(N-1)), capped by max_delay."""
    return min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1))


def retry_delay(response: httpx.Response, body_text: str, attempt: int, policy: RetryPolicy,
                retry_after_from_body: Callable[[Any], float | None] | None = None) -> float | None:
    """The wait before the next attempt, or None when this response must not be retried.

    The server's own wait wins over backoff: Retry-After (seconds or HTTP-date),
    retry-after-ms, or a wait found in the error body (Gemini's RetryInfo), always
    capped by the policy's max_delay.
    """
    status = response.status_code
    if status in NEVER_RETRY or status not in policy.statuses or attempt > policy.retries:
        return None
    server_wait = retry_after_seconds(response)
    if server_wait is None and retry_after_from_body is not None:
        try:
            server_wait = retry_after_from_body(json.loads(body_text))
        except (ValueError, TypeError):
            server_wait = None
    if server_wait is None:
        return backoff_delay(policy, attempt)
    return min(policy.max_delay, server_wait)


def _sleep(seconds: float, should_abort: Callable[[], bool] | None) -> None:
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if should_abort is not None and should_abort():
            raise AbortedError("the loop was paused or stopped during a retry wait")
        time.sleep(min(remaining, 0.5))


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
) -> tuple[Any, WireRecord]:
    """POST ``payload`` and return the parsed JSON body plus the wire record.

    Raises ProviderHTTPError for a final non-2xx status and ProviderResponseError
    for a body that is not JSON; both carry what the user needs to act.
    """
    policy = policy or RetryPolicy()
    secrets = secrets or []
    record = WireRecord(
        url=url,
        request_headers=redact_headers(headers),
        request_body=redact_secrets(payload, secrets),
    )
    timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout,
                            pool=connect_timeout)
    http = client or shared_client()
    started = time.monotonic()
    try:
        return _send(http, url, payload, headers, timeout, read_timeout, policy, secrets,
                     should_abort, record, params, retry_after_from_body)
    except ProviderError as exc:
        exc.wire = record  # type: ignore[attr-defined]  # the failed turn's wire log
        raise
    finally:
        record.duration_ms = (time.monotonic() - started) * 1000


def _send(
    http: httpx.Client,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    timeout: httpx.Timeout,
    read_timeout: float,
    policy: RetryPolicy,
    secrets: list[str],
    should_abort: Callable[[], bool] | None,
    record: WireRecord,
    params: dict[str, str] | None = None,
    retry_after_from_body: Callable[[Any], float | None] | None = None,
) -> tuple[Any, WireRecord]:
    attempt = 0
    while True:
        attempt += 1
        attempt_started = time.monotonic()
        entry: dict[str, Any] = {"attempt": attempt}
        record.attempts.append(entry)
        try:
            response = http.post(url, json=payload, headers=headers, params=params,
                                 timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # The connection never opened: nothing was sent, so a retry is safe.
            entry.update(error=f"connect failed: {exc}",
                         duration_ms=(time.monotonic() - attempt_started) * 1000)
            if attempt <= policy.retries:
                delay = backoff_delay(policy, attempt)
                entry["retry_in_s"] = delay
                _sleep(delay, should_abort)
                continue
            record.error = entry["error"]
            raise ProviderError(f"cannot connect to {url}: {exc}") from exc
        except httpx.TimeoutException as exc:
            entry.update(error=f"{type(exc).__name__}: {exc}",
                         duration_ms=(time.monotonic() - attempt_started) * 1000)
            record.error = entry["error"]
            raise ProviderError(
                f"{type(exc).__name__} after {read_timeout}s waiting for {url} "
                "(read timeouts are not retried)"
            ) from exc
        except httpx.TransportError as exc:
            # The connection dropped while the request or response was in flight: the
            # provider may have served it, so it is not repeated; the loop fails with
            # a readable reason instead of an unexplained transport exception.
            entry.update(error=f"{type(exc).__name__}: {exc}",
                         duration_ms=(time.monotonic() - attempt_started) * 1000)
            record.error = entry["error"]
            raise ProviderResponseError(
                f"the connection to {url} broke before the response was complete "
                f"({type(exc).__name__}: {exc}); not retried, as it may have been served"
            ) from exc
        entry.update(status=response.status_code,
                     duration_ms=(time.monotonic() - attempt_started) * 1000)
        status = response.status_code
        if status >= 400:
            wait = retry_delay(response, response.text, attempt, policy, retry_after_from_body)
            if wait is not None:
                entry.update(retry_in_s=wait, body=redact_secrets(response.text[:2000], secrets))
                _sleep(wait, should_abort)
                continue
            record.status = status
            record.response_body = redact_secrets(response.text[:20000], secrets)
            raise ProviderHTTPError(status, redact_secrets(response.text, secrets), url)
        record.status = status
        try:
            body = response.json()
        except (json.JSONDecodeError, ValueError) as exc:
            record.response_body = redact_secrets(response.text[:20000], secrets)
            raise ProviderResponseError(
                f"HTTP {status} from {url} with a body that is not JSON: "
                f"{response.text[:300]!r}"
            ) from exc
        record.response_body = redact_secrets(body, secrets)
        return body, record
