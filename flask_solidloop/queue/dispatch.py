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


@dataclass(frozen=True)
class Adopted:
    """A continuation this thread took over in the turn's own commit, with no job
    row: the tool call's lease (``lease_token``) or the loop's LLM claim (its
    new ``execution_token`` and lease) was written by that commit, so recovery
    follows the lease, as for any claimed job. Valid only once the store has
    confirmed the commit."""

    queue_name: str
    actor_name: str
    loop_id: int
    args: tuple[Any, ...]
    #: The tool call's lease (a tool call), or None (an LLM turn).
    lease_token: uuid.UUID | None = None
    #: An LLM turn's new execution token and the run's elapsed seconds at its claim.
    execution_token: uuid.UUID | None = None
    run_elapsed_seconds: float = 0.0
    #: ``(model, row)`` pairs the commit wrote and read back whole (``RETURNING
    #: *``): the step starts from them without reading them again.
    carried: tuple[tuple[Any, Any], ...] = ()
    #: An LLM turn's hidden ``processing`` shell, inserted by the same commit.
    shell_id: int | None = None
    #: An LLM turn's history (loops.queries.history), read by the same commit
    #: under the loop row lock; None when the turn reads it itself.
    history: list[Any] | None = None
    #: A tool call that is its message's only one (its outcome may be one
    #: statement: loops.store.checkpoint_and_answer_tool_call).
    sole_call: bool = False


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

    def capture(self, *, adopt: bool = False) -> None:
        """From now on, this thread's first continuation (a loop's tool call or
        next LLM turn, due now) is reserved for it: written due
        ``INLINE_RESERVATION_MS`` later, so no consumer claims it meanwhile (and
        without a NOTIFY), and kept for :meth:`take_captured`: the thread claims
        it right away, due or not. Should the thread die first, the job becomes
        due and a consumer's poll claims it.

        ``adopt``: the store may go further and take the continuation over in
        the turn's own commit, with no job at all (:meth:`can_adopt`)."""
        self._local.capturing = True
        self._local.captured = None
        self._local.adopting = adopt
        self._local.adopted = None
        self._local.confirmed = False

    def can_adopt(self) -> bool:
        """Whether the store may adopt this thread's next continuation: write its
        claim (a tool call's lease, the loop's LLM claim) into the commit that
        creates it, instead of a job (loops/store.py)."""
        local = self._local
        return bool(getattr(local, "capturing", False) and getattr(local, "adopting", False)
                    and local.captured is None and local.adopted is None)

    def adopt_tool_call(self, tool_call_id: int, execution_token: uuid.UUID, *,
                        loop_id: int, lease_token: uuid.UUID,
                        carried: tuple[tuple[Any, Any], ...] = (),
                        sole_call: bool = False) -> Adopted:
        actor = self.actors["tool_call"]
        return self._adopt(Adopted(actor.queue_name, actor.actor_name, loop_id,
                                   (tool_call_id, str(execution_token)),
                                   lease_token=lease_token, carried=carried,
                                   sole_call=sole_call))

    def adopt_llm_turn(self, loop_id: int, *, execution_token: uuid.UUID,
                       run_elapsed_seconds: float,
                       carried: tuple[tuple[Any, Any], ...] = (),
                       shell_id: int | None = None,
                       history: list[Any] | None = None) -> Adopted:
        actor = self.actors["llm_turn"]
        return self._adopt(Adopted(actor.queue_name, actor.actor_name, loop_id, (loop_id,),
                                   execution_token=execution_token,
                                   run_elapsed_seconds=run_elapsed_seconds, carried=carried,
                                   shell_id=shell_id, history=history))

    def _adopt(self, adopted: Adopted) -> Adopted:
        self._local.adopted = adopted
        self._local.confirmed = False
        return adopted

    def confirm(self, adopted: Adopted | None) -> None:
        """The store committed the transaction that wrote ``adopted``'s claim: from
        now on the thread owns it. An adoption never confirmed (its transaction
        rolled back, or its commit raised) is dropped by :meth:`take_captured`;
        a commit that raised but went through leaves a lease that the reaper
        heals when it lapses."""
        if adopted is not None and getattr(self._local, "adopted", None) is adopted:
            self._local.confirmed = True

    def take_captured(self) -> Successor | Adopted | None:
        """The captured or confirmed adopted continuation (once), and capturing stops."""
        local = self._local
        taken: Successor | Adopted | None = getattr(local, "captured", None)
        if taken is None and getattr(local, "confirmed", False):
            taken = local.adopted
        local.capturing = False
        local.captured = None
        local.adopting = False
        local.adopted = None
        local.confirmed = False
        return taken

    def _send(self, session: SessionLike, actor: dramatiq.Actor, args: tuple[Any, ...], *,
              loop_id: int | None = None, delay_ms: int | None = None,
              continuation: bool = True) -> None:
        options: dict[str, Any] = {"solidloop_loop_id": loop_id}
        if continuation and self.continuation_first:
            options["solidloop_continuation"] = True
        message = actor.message_with_options(args=args, **options)
        capture = (continuation and loop_id is not None and not delay_ms
                   and getattr(self._local, "capturing", False)
                   and self._local.captured is None
                   and getattr(self._local, "adopted", None) is None)
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
