"""Host commands on a loop: pause, stop, force stop, freeze, unfreeze, observe and
resume. The Agent facade, the CLI, the admin and the MCP server all call
these; each is one locked transaction in loops/store/commands.py.

Every function takes the app's state and an optional session (the app's
``db.session`` by default) and returns True when it changed the loop, False
when the loop was not in a state the command applies to.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._typing import SessionLike
from ..errors import InvalidArgumentError
from ..models import RESUMABLE_STATUSES
from ..state import SolidLoopState
from . import queries, store


def _session(state: SolidLoopState, session: SessionLike | None) -> SessionLike:
    return session if session is not None else state.db.session


def pause(state: SolidLoopState, loop_id: int, *, session: SessionLike | None = None) -> bool:
    """Pause a queued or running loop; jobs of the old generation no-op."""
    return store.pause(_session(state, session), loop_id)


def stop(state: SolidLoopState, loop_id: int, *, reason: str,
         session: SessionLike | None = None) -> bool:
    """Fail a live, paused or init loop with ``reason``."""
    return store.stop(_session(state, session), loop_id, reason=reason)


def force_stop(state: SolidLoopState, loop_id: int, *, reason: str,
               session: SessionLike | None = None) -> bool:
    """Stop now: fail the loop, cancel its queued jobs, revoke its tool leases.

    In-flight work of the old generation finds the fence closed and writes
    nothing; its external effects may still complete (at-least-once).
    """
    return store.force_stop(state, _session(state, session), loop_id, reason=reason)


def freeze(state: SolidLoopState, loop_id: int, *, session: SessionLike | None = None) -> bool:
    """Pause a loop (if live) and lock it: resume refuses until unfreeze."""
    return store.freeze(_session(state, session), loop_id)


def unfreeze(state: SolidLoopState, loop_id: int, *,
             session: SessionLike | None = None) -> bool:
    """Lift a freeze; the loop stays where it is (usually paused) until resumed."""
    return store.unfreeze(_session(state, session), loop_id)


def observe(state: SolidLoopState, loop_id: int, observed: bool = True, *,
            session: SessionLike | None = None) -> bool:
    """Mark a loop as watched live (the admin streams observed loops)."""
    return store.set_observed(_session(state, session), loop_id, observed)


def check_resumable(from_: str | Iterable[str]) -> tuple[str, ...]:
    """The statuses of ``from_``; InvalidArgumentError (a ValueError) for a
    status that can never be resumed."""
    allowed = (from_,) if isinstance(from_, str) else tuple(from_)
    bad = [s for s in allowed if s not in RESUMABLE_STATUSES]
    if bad:
        raise InvalidArgumentError(
            f"status(es) {', '.join(map(repr, bad))} can never be resumed; "
            f"resumable statuses: {', '.join(RESUMABLE_STATUSES)}"
        )
    return allowed


def resume(state: SolidLoopState, loop_id: int, *,
           from_: str | Iterable[str] = RESUMABLE_STATUSES, message: str | None = None,
           session: SessionLike | None = None) -> bool:
    """Re-enter the loop when its status is in ``from_`` (see store.resume)."""
    allowed = check_resumable(from_)

    def sequential(loop_id: int) -> bool:
        loop = queries.get_loop(_session(state, session), loop_id)
        assert loop is not None  # locked by the resume that asks
        return bool(state.agent_for(loop.agent_name, loop).option("sequential_tool_calls"))

    return store.resume(state, _session(state, session), loop_id, allowed, message=message,
                        sequential=sequential)
