"""Enqueue solidloop's own jobs inside the caller's transaction.

Every successor job is written on the session that holds the state change, so
both commit together (invariant 1). Nothing here commits, and nothing here
decides whether a step becomes a job: the store writes a job only for a step
its commit did not claim for its own thread (loops/store/adopted.py).
"""

from __future__ import annotations

import uuid
from typing import Any

import dramatiq

from .._typing import SessionLike
from ..telemetry import tracing
from .broker import PostgresBroker


class Dispatcher:
    """Typed enqueue helpers over the three solidloop actors."""

    def __init__(self, broker: PostgresBroker, actors: dict[str, dramatiq.Actor], *,
                 continuation_first: bool = False) -> None:
        self.broker = broker
        self.actors = actors
        #: Mark the continuations of started loops, which workers claim first.
        self.continuation_first = continuation_first

    def _send(self, session: SessionLike, actor: dramatiq.Actor, args: tuple[Any, ...], *,
              loop_id: int | None = None, delay_ms: int | None = None,
              continuation: bool = True) -> None:
        options: dict[str, Any] = {"solidloop_loop_id": loop_id}
        # The loop run's trace context, so the job's span joins the run's trace.
        traceparent = tracing.carried()
        if traceparent is not None:
            options["traceparent"] = traceparent
        if continuation and self.continuation_first:
            options["solidloop_continuation"] = True
        message = actor.message_with_options(args=args, **options)
        self.broker.enqueue(message, delay=delay_ms, connection=session)

    def llm_turn(self, session: SessionLike, loop_id: int, *, delay_ms: int | None = None,
                 first: bool = False) -> None:
        """The loop's next LLM turn; ``first`` for a new loop's first one (claimed after
        the continuations of started loops, when continuation-first is on)."""
        self._send(session, self.actors["llm_turn"], (loop_id,), loop_id=loop_id,
                   delay_ms=delay_ms, continuation=not first)

    def first_llm_turns(self, session: SessionLike, loop_ids: list[int], *,
                        traceparents: list[str] | None = None) -> int:
        """The first LLM turns of many new loops, in one statement with one NOTIFY
        (Agent.start_many); the same jobs :meth:`llm_turn` writes with ``first``
        (each carrying its loop's ``traceparents`` when tracing is on)."""
        actor = self.actors["llm_turn"]
        messages = [actor.message_with_options(
            args=(loop_id,), solidloop_loop_id=loop_id,
            **({"traceparent": traceparents[n]} if traceparents else {}))  # type: ignore[arg-type]
            for n, loop_id in enumerate(loop_ids)]
        return self.broker.enqueue_many(messages, connection=session)

    def tool_call(
        self,
        session: SessionLike,
        tool_call_id: int,
        execution_token: uuid.UUID,
        *,
        loop_id: int,
        reaper_lease_token: uuid.UUID | None = None,
        delay_ms: int | None = None,
    ) -> None:
        args: tuple[Any, ...] = (tool_call_id, str(execution_token))
        if reaper_lease_token is not None:
            args = (*args, str(reaper_lease_token))
        self._send(session, self.actors["tool_call"], args, loop_id=loop_id, delay_ms=delay_ms)

    def wait_timeout(self, session: SessionLike, tool_call_id: int, *, loop_id: int,
                     delay_ms: int) -> None:
        """The timeout of a call's wait, due ``delay_ms`` from now (the database's)."""
        self._send(session, self.actors["wait_timeout"], (tool_call_id,), loop_id=loop_id,
                   delay_ms=delay_ms, continuation=False)

    def maintenance(self, session: SessionLike, task: str) -> None:
        self._send(session, self.actors["maintenance"], (task,), continuation=False)

    def bulk_action(self, session: SessionLike, bulk_id: int) -> None:
        """The next chunk of a bulk action's walk (loops/bulk.py)."""
        self._send(session, self.actors["bulk_action"], (bulk_id,), continuation=False)
