"""A turn's admission: the budgets and rate limits that apply to one LLM request,
checked before it is sent and settled after its answer.

The pipeline asks, in order: :func:`limits_for` (in memory: what applies to
this loop; None when nothing does, and then nothing below runs), then
:func:`check_loop` before rendering (the loop's own budget: a reached limit
pauses the loop; near it, the note the model reads; a tree's: a loop's
budget counts its child agents' spend, and a child's turn is checked against
each budgeted ancestor's too), then :func:`admit` with
the rendered payload (the subject's ledger and the rate buckets reserve the
estimate; the wait says when the turn's slot is), and :func:`settle` or
:func:`release` once the answer (or its failure) is known. A turn deferred to
its slot keeps its reservation on the loop (``capacity_slot``), valid for its
LLM step, and goes without reserving again when its job comes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .._typing import SessionLike
from ..errors import BudgetExceededError, SolidLoopError
from ..limit_spec import SubjectBudget, parse_subject_budget
from ..llm import pricing
from ..llm.estimate import Estimate, estimate
from ..llm.types import Usage
from ..loops import store
from ..state import SolidLoopState
from . import budgets, rates

#: A held slot is used when its job comes no later than :data:`SLOT_LATE` past
#: it, and a request is sent on a slot no later than that past it (else it
#: reserves again: :func:`reserve_again`). A request sent later than its slot is
#: not covered by it: the buckets drained its amounts from the slot on, so
#: requests whose slots passed while no worker ran them (a fleet restarting, a
#: loop paused) would all go at once, past the provider's burst. A job that
#: comes before its slot waits out the rest, never sending early: a delayed job
#: falls due by its transaction's start, a few milliseconds before the slot the
#: reservation computed, and the worker's clock may be behind the database's.
#: A wait up to :data:`SLOT_EARLY` is slept inline whatever
#: SOLIDLOOP_RATE_LIMIT_INLINE_WAIT says (deferring again would cost more).
SLOT_EARLY = 0.25
SLOT_LATE = 0.1

_RESUME_HINT = "resume(budget=...) raises it and continues"


@dataclass
class TurnLimits:
    """What limits one loop's LLM requests."""

    loop_limits: dict[str, float]
    warning: float
    subject: str | None
    subject_budget: SubjectBudget | None
    #: An operator released the loop from its subject's budget and its
    #: ancestors' (resume(budget=)).
    exempt: bool
    rate_keys: tuple[str, ...]


@dataclass
class Admitted:
    """A request's reservations, to settle after its answer."""

    estimate: Estimate
    estimated_cost: Decimal
    reservation: rates.Reservation | None = None
    spend_id: int | None = None
    #: Seconds until the request may go (0: now).
    wait: float = 0.0
    #: The subject's soft warning, when its window is nearly spent.
    note: str | None = None
    #: The reservation came from a deferred turn's slot.
    held: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def slot(self, step: int) -> dict[str, Any] | None:
        """What the loop keeps while the turn is deferred to its slot (None when
        the turn holds no reservation: it reserves when its job comes)."""
        if self.reservation is None and self.spend_id is None:
            return None
        return {"step": step, "due": time.time() + self.wait, "spend_id": self.spend_id,
                **(self.reservation.to_json() if self.reservation else {})}


def subject_budget(state: SolidLoopState, subject_type: str | None,
                   subject_id: str | None) -> SubjectBudget | None:
    """The subject's budget: the host's hook, else SOLIDLOOP_SUBJECT_BUDGET."""
    hook = state.extension.subject_budget_hook
    if hook is None:
        return state.config.subject_budget  # type: ignore[no-any-return]
    return parse_subject_budget(hook(subject_type, subject_id),
                                where=f"subject_budget({subject_type!r}, {subject_id!r})")


def limits_for(state: SolidLoopState, agent: Any, loop: Any, settings: Any) -> TurnLimits | None:
    """What applies to this loop's next request, or None when nothing does."""
    loop_limits = budgets.effective(agent.budget_limits(), loop.budget)
    subject = budgets.subject_name(loop.subject_type, loop.subject_id)
    by_subject = subject_budget(state, loop.subject_type, loop.subject_id) \
        if subject is not None else None
    keys = rates.llm_keys(state.config.rate_limits, settings.base_url, settings.model,
                          agent.option("rate_limit_key"))
    # A child agent's turn counts against every ancestor's budget too
    # (check_loop), so a loop with a parent has limits to check even when it
    # has none of its own; a plain loop without any reads nothing more.
    if not loop_limits and by_subject is None and not keys and loop.parent_loop_id is None:
        return None
    exempt = bool((loop.budget or {}).get("over_subject"))
    return TurnLimits(loop_limits, float(agent.option("budget_warning")), subject,
                      by_subject, exempt, keys)


def check_loop(session: SessionLike, limits: TurnLimits, loop: Any,
               state: SolidLoopState) -> str | None:
    """The loop's budget before its request, counted over its tree (itself and
    its child agents, recursively), and each budgeted ancestor's over that
    ancestor's tree: BudgetExceededError when a limit is reached, else the note
    the model reads when one is nearly spent. One read (limits/sql.TREE_SPEND),
    only for a loop with a budget of its own or a parent (``state`` resolves
    the ancestors' agents)."""
    if not limits.loop_limits and loop.parent_loop_id is None:
        return None
    tree = budgets.tree_spend(session, loop.id)
    own, ancestors = tree[0], tree[1:]
    note = None
    if limits.loop_limits:
        # Without children the loop's own row is its spend (and reads as before).
        counted = " by it and its child agents" if own.loops > 1 else ""
        share = budgets.check(limits.loop_limits, own.spent, whose="the loop's",
                              hint=_RESUME_HINT, counted=counted)
        if share >= limits.warning:
            note = budgets.note(limits.loop_limits, own.spent, whose="this task's")
    # An operator who resumed this loop with a budget decided its spend: its
    # ancestors' budgets, like its subject's, no longer stop it.
    if limits.exempt:
        return note
    for above in ancestors:
        try:
            agent: Any = state.agent_for(above.agent_name)
            agent_limits = agent.budget_limits()
        except SolidLoopError:  # an agent no longer registered has no budget option
            agent_limits = {}
        above_limits = budgets.effective(agent_limits, above.budget)
        if not above_limits:
            continue
        share = budgets.check(
            above_limits, above.spent, whose=f"ancestor loop {above.loop_id}'s",
            counted=" by it and its child agents",
            hint=f"resume(budget=...) on this loop lets it go on past it, or stop it to "
                 f"answer loop {above.loop_id}'s call (which then checks its own budget)")
        if share >= limits.warning and note is None:
            note = budgets.note(above_limits, above.spent, whose="this task's")
    return note


def _held(session: SessionLike, loop: Any, token: Any) -> dict[str, Any] | None:
    """The reservation a deferred turn of this LLM step holds, taken (once: a
    turn that dies after taking it reserves again when it runs again). A slot
    past (the loop was paused, or no worker ran its job in time:
    :data:`SLOT_LATE`) is dropped: its ledger row goes back to zero (nothing
    was billed), and the turn reserves again."""
    if not loop.capacity_slot or loop.capacity_slot.get("step") != loop.step_count:
        return None
    slot = store.take_capacity_slot(session, loop.id, token)
    if not slot or slot.get("step") != loop.step_count:
        return None
    now = time.time()
    due = float(slot.get("due") or 0)
    if now <= due + SLOT_LATE:
        return slot  # type: ignore[no-any-return]
    if slot.get("spend_id") is not None:
        budgets.settle_subject(session, int(slot["spend_id"]), cost=None, tokens=0,
                               tool_calls=0, billed=False)
    return None


def admit(state: SolidLoopState, session: SessionLike, limits: TurnLimits, loop: Any,
          payload: dict[str, Any], model: str | None, token: Any) -> Admitted:
    """Reserve the request's estimate on the subject's ledger and the rate buckets
    (or take the reservation a deferred turn holds). BudgetExceededError when
    the subject's budget is reached; ``wait`` > 0 when the rate limits want the
    request later."""
    config = state.config
    guess = estimate(payload, default_output=config.default_output_estimate)
    admitted = Admitted(guess, guess.cost(config.prices.get(model or "")))
    held = _held(session, loop, token)
    if held is not None:
        admitted.held = True
        # Early (its job fell due by its transaction's start, or a worker's
        # clock is behind the database's): the turn waits out the rest.
        admitted.wait = max(float(held.get("due") or 0) - time.time(), 0.0)
        admitted.spend_id = held.get("spend_id")
        keys = tuple(k for k in held.get("keys", ()) if k in config.rate_limits)
        if keys:
            table = config.rate_limits
            buckets = tuple(b for key in keys for b in (*table[key], rates._key_row(key)))
            amounts = tuple(float(a) for a in held.get("amounts", ()))
            if len(amounts) == len(buckets):
                admitted.reservation = rates.Reservation(buckets, amounts, 0.0, keys)
                return admitted
    if admitted.spend_id is None and limits.subject is not None \
            and limits.subject_budget is not None:
        hold = budgets.reserve_subject(
            session, limits.subject, limits.subject_budget, loop_id=loop.id,
            cost=admitted.estimated_cost, tokens=guess.tokens, exempt=limits.exempt)
        budget = limits.subject_budget
        if hold.spend_id is None:
            window = f"{budget.window / 3600:g} h" if budget.window >= 3600 \
                else f"{budget.window:g} s"
            budgets.check(budget.limits, hold.spent,
                          whose=f"subject {limits.subject}'s {window}",
                          hint="resume(budget=...) lets this loop go on past it",
                          counted=" spent and reserved")
            raise BudgetExceededError(f"subject {limits.subject}'s budget is spent; "
                                      f"{_RESUME_HINT}")
        admitted.spend_id = hold.spend_id
        share = max((hold.spent.get(k, 0.0) / v for k, v in budget.limits.items()),
                    default=0.0)
        if share >= limits.warning and not limits.exempt:
            admitted.note = budgets.note(budget.limits, hold.spent, whose="your account's")
    if limits.rate_keys:
        _reserve_rates(state, session, admitted, limits.rate_keys, float(guess.tokens))
    return admitted


def _reserve_rates(state: SolidLoopState, session: SessionLike, admitted: Admitted,
                   keys: tuple[str, ...], tokens: float) -> None:
    """Reserve on the rate buckets of ``keys``: ``admitted`` gets the wait and,
    when the slot is within the horizon, the reservation."""
    config = state.config
    reservation = rates.reserve(
        session, config.rate_limits, keys, tokens=tokens,
        inline_wait=config.rate_limit_inline_wait, horizon=config.rate_limit_horizon)
    admitted.wait = reservation.wait
    admitted.reservation = None
    if reservation.held:
        admitted.reservation = reservation
    else:
        # Beyond the horizon nothing is reserved: the turn comes back when
        # its slot would be within it (sooner if settlements give capacity
        # back meanwhile), spread over the second half of the horizon so
        # that the turns turned away together do not all come back
        # together, nor so often that they crowd the queue.
        horizon = config.rate_limit_horizon
        admitted.wait = max(reservation.wait - horizon, 0.0) \
            + random.uniform(horizon / 2, horizon)
        admitted.wait = max(admitted.wait, config.rate_limit_inline_wait + 0.01)


def reserve_again(state: SolidLoopState, session: SessionLike, admitted: Admitted) -> None:
    """The request's slot passed before it could be sent (more than
    :data:`SLOT_LATE`: a fresh process building its HTTP client, a slow write,
    a thread the machine ran late): it reserves on its keys again, and
    ``admitted`` gets the new wait and reservation (the subject's ledger row
    stays). The stale reservation is not given back. The buckets drained
    its amounts from its slot on and let later turns go on that; sent now,
    the request would reach the provider together with them, and giving its
    amounts back would leave the same hole. A late request costs its keys one
    request's capacity for a period."""
    reservation = admitted.reservation
    assert reservation is not None
    keys = tuple(k for k in reservation.keys if k in state.config.rate_limits)
    tokens = next((a for b, a in zip(reservation.buckets, reservation.amounts, strict=True)
                   if b.tokens), 0.0)
    admitted.held = False
    _reserve_rates(state, session, admitted, keys, tokens)


def settle(session: SessionLike, admitted: Admitted, *, usage: Usage | None,
           prices: Mapping[str, Decimal] | None, tool_calls: int,
           headers: Mapping[str, str] | None) -> None:
    """The answer came: the reservations hold the real usage from now on (the
    estimate stays where the provider reported none)."""
    tokens = float(usage.input_tokens + usage.output_tokens) if usage is not None else None
    if admitted.reservation is not None:
        rates.settle(session, admitted.reservation,
                     tokens=tokens if tokens is not None else float(admitted.estimate.tokens),
                     headers=headers)
    if admitted.spend_id is not None:
        cost = pricing.cost(usage, dict(prices) if prices is not None else None)
        budgets.settle_subject(
            session, admitted.spend_id,
            cost=cost if usage is not None else admitted.estimated_cost,
            tokens=int(tokens) if tokens is not None else admitted.estimate.tokens,
            tool_calls=tool_calls)


def release(session: SessionLike, admitted: Admitted) -> None:
    """The request was refused or failed before the provider billed it: the tokens
    reserved go back (the request stays counted), the ledger row to zero."""
    if admitted.reservation is not None:
        rates.settle(session, admitted.reservation, tokens=0.0)
    if admitted.spend_id is not None:
        budgets.settle_subject(session, admitted.spend_id, cost=None, tokens=0, tool_calls=0,
                               billed=False)
