"""Enqueue solidloop's own jobs inside the caller's transaction.

Every successor job is written on the session that holds the state change, so
both commit together (invariant 1). Nothing here commits.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

import dramatiq

from .._typing import SessionLike
from .broker import PostgresBroker

#: How long a continuation stays reserved for the thread that enqueued it (see
#: Dispatcher.capture): at least the consumers' poll interval, so a reserved job
#: never makes an idle consumer wake up early; short, because it is also how
#: late a consumer takes over from a thread that died before its claim.
INLINE_RESERVATION_MS = 2000


@dataclass(frozen=True)
class Successor:
    """A continuation enqueued without its wake-up, for this thread to run."""

    queue_name: str
    actor_name: str
    message_id: str
    loop_id: int
    args: tuple[Any, ...]


class Dispatcher:
    """Typed enqueue helpers over the three solidloop actors."""

    def __init__(self, broker: PostgresBroker, actors: dict[str, dramatiq.Actor], *,
                 continuation_first: bool = False) -> None:
        self.broker = broker
        self.actors = actors
        #: Mark the continuations of started loops, which workers claim first.
        self.continuation_first = continuation_first
        self._local = threading.local()

    # -- inline continuation (runtime/inline.py) ------------------------------

    def capture(self) -> None:
        """From now on, this thread's first continuation (a loop's tool call or
        next LLM turn, due now) is reserved for it: written due
        ``INLINE_RESERVATION_MS`` later, so no consumer claims it meanwhile (and
        without a NOTIFY), and kept for :meth:`take_captured`: the thread claims
        it right away, due or not. Should the thread die first, the job becomes
        due and a consumer's poll claims it."""
        self._local.capturing = True
        self._local.captured = None

    def take_captured(self) -> Successor | None:
        """The captured continuation (once), and capturing stops."""
        captured = getattr(self._local, "captured", None)
        self._local.capturing = False
        self._local.captured = None
        return captured

    def _send(self, session: SessionLike, actor: dramatiq.Actor, args: tuple[Any, ...], *,
              loop_id: int | None = None, delay_ms: int | None = None,
              continuation: bool = True) -> None:
        options: dict[str, Any] = {"solidloop_loop_id": loop_id}
        if continuation and self.continuation_first:
            options["solidloop_continuation"] = True
        message = actor.message_with_options(args=args, **options)
        capture = (continuation and loop_id is not None and not delay_ms
                   and getattr(self._local, "capturing", False)
                   and self._local.captured is None)
        if capture:
            delay_ms = INLINE_RESERVATION_MS
        self.broker.enqueue(message, delay=delay_ms, connection=session)
        if capture:
            assert loop_id is not None
            self._local.captured = Successor(message.queue_name, message.actor_name,
                                             message.message_id, loop_id, tuple(args))

    def llm_turn(self, session: SessionLike, loop_id: int, *, delay_ms: int | None = None,
                 first: bool = False) -> None:
        """The loop's next LLM turn; ``first`` for a new loop's first one (claimed after
        the continuations of started loops, when continuation-first is on)."""
        self._send(session, self.actors["llm_turn"], (loop_id,), loop_id=loop_id,
                   delay_ms=delay_ms, continuation=not first)

    def tool_call(
        self,
        session: SessionLike,
        tool_call_id: int,
        execution_token: uuid.UUID,
        *,
        loop_id: int,
        reaper_lease_token: uuid.UUID | None = None,
    ) -> None:
        args: tuple[Any, ...] = (tool_call_id, str(execution_token))
        if reaper_lease_token is not None:
            args = (*args, str(reaper_lease_token))
        self._send(session, self.actors["tool_call"], args, loop_id=loop_id)

    def maintenance(self, session: SessionLike, task: str) -> None:
        self._send(session, self.actors["maintenance"], (task,), continuation=False)
