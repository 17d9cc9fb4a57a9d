"""The claim book: what this worker process has claimed, and how much more it may.

One :class:`ClaimBook` per broker per process, shared by all its consumers
(one per queue). It owns two rules (docs/decisions/0029-fleet.md):

* **A process claims no more jobs than it has threads to run them.** Each
  consumer reserves room in the book before it claims, and the book's room is
  the worker's thread count less the jobs claimed and not yet acknowledged
  (queued in the process, or running). A job claimed by a process is therefore
  started at once, never parked behind others in its work queue while other
  processes idle. Before a dramatiq worker boots (a bare consumer in a test, a
  drain) the book has no capacity and only the consumer's prefetch limits it.
* **A claim that was not started in time lapses.** Only *started* jobs have
  their leases renewed. A job claimed and not started within
  :func:`start_bound` of its claim (its worker threads wedged, the process
  frozen) lets its lease run out, so the reaper or any consumer recovers it
  and another process runs it within one job lease. If this process then
  reaches it after all, :meth:`ClaimBook.start` says so and the job is handed
  back (compare-and-set on its lease token) instead of run a second time.

:class:`ClaimBookMiddleware`, the broker's first middleware, sizes the book
to the worker at boot and starts each claim as its job starts (no other
middleware has begun the message by then).

The clock is this process's monotonic clock, read *before* the claim
statement was sent: the database's lease started no earlier, so a job started
within the bound on this clock is still leased in the database.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq

from ..errors import ClaimLapsedError


def start_bound(job_lease: float) -> float:
    """Seconds after its claim within which a job may still start here: half
    the job lease, so the consumer's renewal (every third of it) lands before
    the lease can run out."""
    return job_lease / 2


@dataclass
class Claim:
    job_id: int
    lease_token: uuid.UUID
    #: Monotonic time read just before the claim statement was sent.
    claimed_at: float
    started: bool = False
    lapsed: bool = False


@dataclass
class ClaimBook:
    """This process's claims. Thread-safe; every method is short."""

    job_lease: float
    #: Worker threads of this process (set at worker boot); None: no limit.
    capacity: int | None = None
    _claims: dict[int, Claim] = field(default_factory=dict)
    #: Room reserved by consumers whose claim statement is in flight.
    _reserved: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        #: Notified whenever room appears (a claim released or a reservation returned).
        self.room_freed = threading.Condition(self._lock)

    # -- claiming -------------------------------------------------------------------

    def reserve(self, wanted: int) -> int:
        """Reserve room for up to ``wanted`` claims; return how many (maybe 0).
        Pair with :meth:`settle` once the claim statement returned."""
        with self._lock:
            granted = wanted if self.capacity is None else max(
                0, min(wanted, self.capacity - len(self._claims) - self._reserved))
            self._reserved += granted
            return granted

    def settle(self, reserved: int, claims: list[Claim]) -> None:
        """Record what a claim for ``reserved`` rows returned."""
        with self._lock:
            self._reserved -= reserved
            for claim in claims:
                self._claims[claim.job_id] = claim
            if len(claims) < reserved:
                self.room_freed.notify_all()

    def has_room(self) -> bool:
        with self._lock:
            return self.capacity is None or \
                len(self._claims) + self._reserved < self.capacity

    def wait_for_room(self, timeout: float, *, also: Callable[[], bool] = lambda: True) -> bool:
        """Block until there is room for a claim and ``also()`` holds (a
        consumer's own prefetch limit; checked whenever room is freed), or
        ``timeout`` passes. True when both hold."""
        with self._lock:
            return self.room_freed.wait_for(
                lambda: (self.capacity is None
                         or len(self._claims) + self._reserved < self.capacity) and also(),
                timeout)

    # -- running --------------------------------------------------------------------

    def start(self, job_id: int, lease_token: uuid.UUID) -> Claim | None:
        """Mark a claim started, just before its actor runs. Raises
        ClaimLapsedError when it was claimed longer than :func:`start_bound`
        ago: its lease was not renewed meanwhile, so it may run elsewhere.
        Returns the claim (None: not claimed through this book)."""
        with self._lock:
            claim = self._claims.get(job_id)
            if claim is None or claim.lease_token != lease_token:
                return None
            if time.monotonic() - claim.claimed_at >= start_bound(self.job_lease):
                claim.lapsed = True
                raise ClaimLapsedError(
                    f"job {job_id} was claimed {time.monotonic() - claim.claimed_at:.1f}s ago "
                    f"and not started within {start_bound(self.job_lease):.1f}s (half its "
                    "lease): its claim has lapsed and it is handed back, not run here")
            claim.started = True
            return claim

    def started(self, job_ids: list[int]) -> list[int]:
        """Of ``job_ids``, those started here: the ones whose leases to renew."""
        with self._lock:
            return [job_id for job_id in job_ids
                    if (claim := self._claims.get(job_id)) is not None and claim.started]

    def lapsed(self, job_id: int) -> bool:
        with self._lock:
            claim = self._claims.get(job_id)
            return claim is not None and claim.lapsed

    def release(self, job_id: int) -> None:
        """The job was acknowledged, failed or handed back: its room is free."""
        with self._lock:
            if self._claims.pop(job_id, None) is not None:
                self.room_freed.notify_all()


class ClaimBookMiddleware(dramatiq.Middleware):
    """Sets the claim book's capacity at boot and starts claims as their jobs start."""

    def __init__(self, book: ClaimBook) -> None:
        self.book = book

    def before_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        # Before the worker adds its consumers: their first claim sees the limit.
        self.book.capacity = max(1, int(getattr(worker, "worker_threads", 1)))

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        job_id = getattr(message, "job_id", None)
        token = getattr(message, "lease_token", None)
        if job_id is not None and token is not None:
            self.book.start(job_id, token)
