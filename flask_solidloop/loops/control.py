"""Host commands on a loop: pause, stop, force stop, freeze, unfreeze, observe,
resume, send_message (a conversation's next user message), fork and replay
(a new loop from its history), and the decisions on its waiting tool calls
(approve, deny, complete_call). The Agent facade, the CLI, the admin and the
MCP server all call these; each is one locked transaction in loops/store/.

Every command takes the app's state and an optional session (the app's
``db.session`` by default) and returns True when it changed the loop, False
when the loop was not in a state the command applies to. A decision returns
what landed (``store.Decision``) or raises ``DecisionConflictError``; it
commits on the app's session, or, given ``session=``, joins that session's
transaction and leaves the commit to the caller (a rollback then undoes it
and the job it implies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .. import signals
from .._typing import SessionLike
from ..errors import InvalidArgumentError
from ..mcp.toolset import ToolResult
from ..models import RESUMABLE_STATUSES, Loop, ToolCall
from ..state import SolidLoopState
from . import pending, queries, store


def _session(state: SolidLoopState, session: SessionLike | None) -> SessionLike:
    return session if session is not None else state.db.session


@contextlib.contextmanager
def _host_write(state: SolidLoopState, session: SessionLike | None,
                commit: bool) -> Iterator[SessionLike]:
    """The session a host command writes on: ``session``, or the app's. On an
    error the app's own session is rolled back (a caller's transaction is the
    caller's to end); on success it commits when ``commit``."""
    target = _session(state, session)
    try:
        yield target
    except BaseException:
        if session is None:
            target.rollback()
        raise
    if commit:
        target.commit()


def pause(state: SolidLoopState, loop_id: int, *, session: SessionLike | None = None) -> bool:
    """Pause a queued or running loop; jobs of the old generation no-op."""
    return store.pause(_session(state, session), loop_id)


def stop(state: SolidLoopState, loop_id: int, *, reason: str,
         session: SessionLike | None = None) -> bool:
    """Fail a live, paused or init loop with ``reason``."""
    return store.stop(_session(state, session), loop_id, reason=reason,
                      ends=store.loop_ends(state))


def force_stop(state: SolidLoopState, loop_id: int, *, reason: str,
               session: SessionLike | None = None) -> bool:
    """Stop now: fail the loop, cancel its queued jobs, revoke its tool leases.

    In-flight work of the old generation finds the fence closed and writes
    nothing; its external effects may still complete (at-least-once).
    """
    return store.force_stop(state, _session(state, session), loop_id, reason=reason,
                            ends=store.loop_ends(state))


def freeze(state: SolidLoopState, loop_id: int, *, session: SessionLike | None = None) -> bool:
    """Pause a loop (if live) and lock it: resume refuses until unfreeze."""
    return store.freeze(_session(state, session), loop_id)


def unfreeze(state: SolidLoopState, loop_id: int, *,
             session: SessionLike | None = None) -> bool:
    """Lift a freeze; the loop stays where it is (usually paused) until resumed."""
    return store.unfreeze(_session(state, session), loop_id)


def applicable(loop: Loop) -> tuple[str, ...]:
    """The commands above that would change ``loop`` now (pause, resume, stop,
    force_stop, freeze, unfreeze, observe, unobserve), from the store's own
    transitions: what the admin offers."""
    return store.applicable(loop.status, frozen=bool(loop.frozen),
                            observed=bool(loop.observed))


def observe(state: SolidLoopState, loop_id: int, observed: bool = True, *,
            session: SessionLike | None = None) -> bool:
    """Mark a loop as watched live (the admin streams observed loops)."""
    return store.set_observed(_session(state, session), loop_id, observed)


def pin(state: SolidLoopState, loop_id: int, message_id: int, pinned: bool = True, *,
        session: SessionLike | None = None, commit: bool = True) -> None:
    """Pin (or unpin) one of the loop's user messages: compaction never
    summarises a pinned message away (docs/guides/conversations.md).
    Committed unless ``commit=False``. InvalidArgumentError, naming the fix,
    for a message that cannot be pinned."""
    if isinstance(message_id, bool) or not isinstance(message_id, int):
        raise InvalidArgumentError(f"message_id must be a message id (an int), got "
                                   f"{message_id!r}")
    with _host_write(state, session, commit) as target:
        store.pin_message(target, loop_id, message_id, bool(pinned))


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
           session: SessionLike | None = None,
           budget: Mapping[str, float] | None = None) -> bool:
    """Re-enter the loop when its status is in ``from_`` (see store.resume);
    ``budget`` raises its limits first."""
    from ..limit_spec import parse_budget

    allowed = check_resumable(from_)
    limits = parse_budget(budget, where="resume(budget=...)")

    def sequential(loop_id: int) -> bool:
        loop = queries.get_loop(_session(state, session), loop_id)
        assert loop is not None  # locked by the resume that asks
        return bool(state.agent_for(loop.agent_name, loop).option("sequential_tool_calls"))

    return store.resume(state, _session(state, session), loop_id, allowed, message=message,
                        sequential=sequential, budget=limits)


def check_policy(value: object, *, where: str) -> str:
    """``value`` if it is an ``on_new_message`` policy; a one-line
    InvalidArgumentError naming the choices otherwise (``where``: the agent)."""
    if not isinstance(value, str) or value not in store.POLICIES:
        raise InvalidArgumentError(
            f"{where}: on_new_message must be one of "
            f"{', '.join(map(repr, store.POLICIES))}, got {value!r}")
    return value


def send_message(state: SolidLoopState, loop_id: int, message: str, *,
                 session: SessionLike | None = None) -> store.SentMessage:
    """A follow-up user message in the loop's conversation, handled by its
    agent's ``on_new_message`` policy (store/conversation.py); commits."""
    if not isinstance(message, str) or not message.strip():
        raise InvalidArgumentError("message must be a non-empty string")
    target = _session(state, session)
    loop = queries.get_loop(target, loop_id)
    if loop is None:
        raise InvalidArgumentError(f"there is no loop {loop_id}")
    agent = state.agent_for(loop.agent_name, loop)
    policy = check_policy(agent.option("on_new_message"),
                                where=f"agent {loop.agent_name!r}")

    def sequential(loop_id: int) -> bool:
        return bool(agent.option("sequential_tool_calls"))

    return store.send_message(state, target, loop_id, message, policy=policy,
                              sequential=sequential)


# -- forks ------------------------------------------------------------------------------


def fork(state: SolidLoopState, loop_id: int, at_message_id: int | None, *,
         message: str | None = None, llm: Mapping[str, Any] | None = None,
         session: SessionLike | None = None, commit: bool = True) -> Loop:
    """A new loop with ``loop_id``'s history up to ``at_message_id`` (None: its
    first user message), tool calls kept with their results (store/forks.py
    says where a fork point inside a tool phase falls), ``message`` in place
    of its last user message when given, ``llm`` (provider settings, e.g.
    ``{"model": ...}``) over its agent's for the new loop only; queued with
    its first job, in one transaction, committed unless ``commit=False``.
    InvalidArgumentError, naming the fix, for a loop, message or setting that
    cannot be used."""
    if at_message_id is not None and (isinstance(at_message_id, bool)
                                      or not isinstance(at_message_id, int)):
        raise InvalidArgumentError(f"at_message_id must be a message id (an int), got "
                                   f"{at_message_id!r}")
    if message is not None and (not isinstance(message, str) or not message.strip()):
        raise InvalidArgumentError("message must be a non-empty string, or None to keep the "
                                   "last user message")
    if llm is not None and not isinstance(llm, Mapping):
        raise InvalidArgumentError(f"llm must be a dict of provider settings, e.g. "
                                   f"{{'model': 'gpt-4o-mini'}}; got {type(llm).__name__}")
    with _host_write(state, session, commit) as target:
        loop = queries.get_loop(target, loop_id)
        if loop is None:
            raise InvalidArgumentError(f"there is no loop {loop_id}: fork an existing loop "
                                       "(`flask solidloop list` shows them)")
        # The fork runs the original's agent; a setting it cannot use fails here,
        # not in the fork's first turn.
        check_llm_override(state, loop, dict(llm) if llm else None)
        forked = store.fork_loop(state, target, loop_id, at_message_id, message=message,
                                 llm_override=dict(llm) if llm else None)
    return forked.loop


def check_llm_override(state: SolidLoopState, loop: Loop,
                       llm: dict[str, Any] | None) -> None:
    """Whether ``loop``'s agent is still a valid agent with ``llm`` over its
    provider settings (and over the loop's own); InvalidArgumentError naming
    the problem otherwise (an unregistered agent, a setting it rejects)."""
    from ..errors import SolidLoopError
    from ..llm.types import ProviderSettings

    secret = sorted({"api_key", "headers"} & set(llm or {}))
    if secret:
        # The override is stored with the loop; secrets never reach the database.
        raise InvalidArgumentError(
            f"llm {', '.join(secret)} cannot be set for one loop: the override is stored with "
            "it, and these may hold secrets; name the key's variable with api_key_env")
    try:
        agent = state.agent_for(loop.agent_name, loop)
        agent.validate()
        if llm:
            ProviderSettings.from_dict({**(agent.option("llm") or {}),
                                        **(loop.llm_override or {}), **llm},
                                       agent=loop.agent_name)
    except SolidLoopError as exc:
        raise InvalidArgumentError(f"cannot fork loop {loop.id}: {exc}") from None


def replay(state: SolidLoopState, loop_id: int, *, model: str,
           session: SessionLike | None = None, commit: bool = True) -> Loop:
    """A fork of ``loop_id`` at its first user message, run against ``model``
    (for comparing models on the same start): see :func:`fork`."""
    if not isinstance(model, str) or not model.strip():
        raise InvalidArgumentError("model must be a non-empty model name, e.g. 'gpt-4o-mini'")
    return fork(state, loop_id, None, llm={"model": model.strip()}, session=session,
                commit=commit)


# -- decisions on waiting tool calls ----------------------------------------------------


def pending_calls(state: SolidLoopState, *, loop_id: int | None = None,
                  agent: str | None = None, waits_for: str | None = None, limit: int = 200,
                  session: SessionLike | None = None) -> list[ToolCall]:
    """The tool calls that await a decision (``waits_for="approval"``) or a
    result (``"result"``), or both, oldest first; of one loop, or of every
    loop (of ``agent``)."""
    if waits_for not in (None, store.APPROVAL, store.RESULT):
        raise InvalidArgumentError(f"waits_for must be 'approval', 'result' or None; "
                                   f"got {waits_for!r}")
    return pending.awaiting_calls(_session(state, session), loop_id=loop_id, agent=agent,
                                  waits_for=waits_for, limit=limit)


def approve(state: SolidLoopState, tool_call_id: int, *, by: str | None = None,
            arguments: dict[str, Any] | None = None, loop_id: int | None = None,
            session: SessionLike | None = None) -> store.Decision:
    """Approve a call that awaits an approval: its tool runs (with ``arguments``,
    edited, when given; the model's are kept beside them)."""
    if arguments is not None and not isinstance(arguments, dict):
        raise InvalidArgumentError(
            f"arguments must be a dict (the tool's arguments as a JSON object); "
            f"got {type(arguments).__name__}")
    return _decide(state, tool_call_id, loop_id, session, waits_for=store.APPROVAL,
                   decision=store.APPROVED, by=by, arguments=arguments)


def deny(state: SolidLoopState, tool_call_id: int, *, reason: str, by: str | None = None,
         loop_id: int | None = None, session: SessionLike | None = None) -> store.Decision:
    """Deny a call that awaits an approval: the tool never runs, and the model
    reads ``reason`` as the call's error result."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidArgumentError("reason must be a non-empty string: the model reads it "
                                   "as the call's result")
    return _decide(state, tool_call_id, loop_id, session, waits_for=store.APPROVAL,
                   decision=store.DENIED, by=by, reason=reason,
                   result=store.denial(reason, by))


def complete_call(state: SolidLoopState, tool_call_id: int, result: Any, *,
                  is_error: bool = False, by: str | None = None, loop_id: int | None = None,
                  session: SessionLike | None = None) -> store.Decision:
    """Supply the result of a deferred call: text, an MCP ``CallToolResult``
    dict or a ToolResult (``is_error``: the model reads it as an error)."""
    supplied: ToolResult = store.supplied(result, is_error=is_error)
    return _decide(state, tool_call_id, loop_id, session, waits_for=store.RESULT,
                   decision=store.COMPLETED, by=by, result=supplied)


def _decide(state: SolidLoopState, tool_call_id: int, loop_id: int | None,
            session: SessionLike | None, **decision: Any) -> store.Decision:
    """One decision: in its own commit on the app's session, or joined to the
    caller's ``session``; its signal is sent when that commits."""
    with _host_write(state, session, commit=session is None) as target:
        call, loop = queries.get_tool_call_and_loop(target, tool_call_id)
        if call is None or loop is None:
            raise InvalidArgumentError(f"there is no tool call {tool_call_id}")
        if loop_id is not None and call.loop_id != loop_id:
            raise InvalidArgumentError(
                f"tool call {tool_call_id} belongs to loop {call.loop_id}, not loop {loop_id}")
        agent = state.agent_for(loop.agent_name, loop)
        decided = store.decide(state, target, tool_call_id,
                               sequential=bool(agent.option("sequential_tool_calls")),
                               **decision)
        signals.send_after_commit(target, signals.tool_call_decided, loop_id=decided.loop_id,
                                  tool_call_id=tool_call_id, decision=decided.decision,
                                  by=decision.get("by"))
    return decided
