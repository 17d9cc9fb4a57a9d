"""Budgets: what a loop, and a subject over a rolling window, may spend.

A loop's limits are its agent's ``budget`` option updated by the loop's own
(``start(budget=)``, ``resume(budget=)``); its spend is what its row sums
(cost, tokens, LLM turns) and its tool calls. A subject's limits come from
``solidloop.subject_budget(fn)`` or SOLIDLOOP_SUBJECT_BUDGET; its spend is its
ledger (``solidloop_spend``), where each turn reserves its estimate and settles
to its real usage. The rule, for both: a turn may go while every limit is
unreached; so a loop ends at most one turn's estimate past a limit, and so do
all of a subject's loops together (docs/decisions/0022).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from .._typing import SessionLike
from ..dbapi import execute_on
from ..errors import BudgetExceededError
from ..limit_spec import BUDGET_KEYS, SubjectBudget
from ..loops.store.transaction import commit_keeping_objects, run_alone
from . import sql

#: How each limit reads in a message: its unit after the amount.
_UNITS = {"cost_usd": "USD", "tokens": "tokens", "llm_turns": "LLM turns",
          "tool_calls": "tool calls"}


def amount(key: str, value: float) -> str:
    """A spend or a limit as a person reads it."""
    if key == "cost_usd":
        return f"{value:.4f} USD" if value < 1 else f"{value:.2f} USD"
    return f"{int(value):,} {_UNITS[key]}"


def effective(agent_budget: Mapping[str, float], loop_budget: Mapping[str, Any] | None,
              ) -> dict[str, float]:
    """The loop's limits: its agent's, updated by its own."""
    limits = dict(agent_budget)
    for key, value in (loop_budget or {}).items():
        if key in BUDGET_KEYS and value is not None:
            limits[key] = float(value)
    return limits


def loop_spend(loop: Any, tool_calls: int | None) -> dict[str, float]:
    """What a loop has spent, by limit (``tool_calls`` counted by the caller)."""
    spent = {"cost_usd": float(loop.cost or 0),
             "tokens": float((loop.input_tokens or 0) + (loop.output_tokens or 0)),
             "llm_turns": float(loop.step_count or 0)}
    if tool_calls is not None:
        spent["tool_calls"] = float(tool_calls)
    return spent


def check(limits: Mapping[str, float], spent: Mapping[str, float], *, whose: str,
          hint: str, counted: str = "") -> float:
    """Raise BudgetExceededError when any limit is reached; else the largest
    share of a limit spent (0 to 1), for the soft warning. ``counted`` says
    what the amounts count, after them in the message."""
    share = 0.0
    for key, limit in limits.items():
        used = spent.get(key)
        if used is None:
            continue
        if used >= limit:
            raise BudgetExceededError(
                f"{whose} budget {key} is spent: {amount(key, used)}{counted} of "
                f"{amount(key, limit)}; {hint}")
        share = max(share, used / limit)
    return share


def note(limits: Mapping[str, float], spent: Mapping[str, float], *, whose: str) -> str:
    """The soft warning the model reads at the end of its system prompt."""
    parts = [f"{amount(k, spent.get(k, 0.0))} of {amount(k, v)} used, "
             f"{amount(k, max(v - spent.get(k, 0.0), 0.0))} left"
             for k, v in limits.items() if k in spent]
    return (f"[Budget notice: {whose} budget is nearly spent ({'; '.join(parts)}). "
            "Finish the task now with what you have: give your final answer in this turn "
            "or the next, and avoid further tool calls unless they are essential.]")


def subject_name(subject_type: str | None, subject_id: str | None) -> str | None:
    """A subject's ledger key, or None for a loop without one."""
    if subject_type is None and subject_id is None:
        return None
    return f"{subject_type or ''}:{subject_id or ''}"


@dataclass
class SubjectHold:
    """A turn's row in its subject's ledger, and the window's spend before it."""

    subject: str
    spend_id: int | None
    spent: dict[str, float]


def reserve_subject(session: SessionLike, subject: str, budget: SubjectBudget, *,
                    loop_id: int, cost: Decimal, tokens: int, exempt: bool) -> SubjectHold:
    """Reserve the turn's estimate in the subject's ledger (limits/sql.RESERVE_SPEND):
    refused (``spend_id`` None) when a limit is already reached."""
    limits = budget.limits
    row, alone = run_alone(session, sql.RESERVE_SPEND, {
        "subject": subject, "window": budget.window, "loop_id": loop_id, "exempt": exempt,
        "cost": cost, "tokens": tokens,
        "cost_limit": limits.get("cost_usd"), "tokens_limit": limits.get("tokens"),
        "turns_limit": limits.get("llm_turns"), "calls_limit": limits.get("tool_calls")},
        sole=True)
    if not alone:
        commit_keeping_objects(session)
    assert row is not None
    spent = {key: float(row[key]) for key in BUDGET_KEYS}
    return SubjectHold(subject, row["id"], spent)


def settle_subject(session: SessionLike, spend_id: int, *, cost: Decimal | None, tokens: int,
                   tool_calls: int, billed: bool = True) -> None:
    """The turn's ledger row set to its real usage (zero when it was not billed)."""
    _, alone = run_alone(session, sql.SETTLE_SPEND, {
        "id": spend_id, "cost": (cost or Decimal(0)) if billed else Decimal(0),
        "tokens": tokens if billed else 0, "llm_turns": 1 if billed else 0,
        "tool_calls": tool_calls if billed else 0}, sole=True)
    if not alone:
        commit_keeping_objects(session)


def subject_spend(session: SessionLike, subject: str, window: float) -> dict[str, float]:
    """What a subject spent over ``window`` seconds (settled use, unsettled estimates)."""
    row, _ = run_alone(session, sql.SUBJECT_SPEND, {"subject": subject, "window": window},
                           sole=True)
    return {key: float(row[key]) if row is not None else 0.0 for key in BUDGET_KEYS}


@dataclass
class TreeSpend:
    """One loop of a turn's ancestry (``level`` 0: the loop itself), with what its
    whole tree (itself and its descendants) spent."""

    loop_id: int
    agent_name: str
    budget: dict[str, Any] | None
    level: int
    loops: int
    spent: dict[str, float]


def tree_spend(session: SessionLike, loop_id: int) -> list[TreeSpend]:
    """The loop and each of its ancestors, nearest first, with each one's tree's
    spend (limits/sql.TREE_SPEND, one statement in the session's transaction)."""
    rows = execute_on(session, sql.TREE_SPEND, {"loop_id": loop_id}, fetch=True)
    return [TreeSpend(int(row[0]), str(row[1]), row[2], int(row[3]), int(row[4]),
                      {"cost_usd": float(row[5]), "tokens": float(row[6]),
                       "llm_turns": float(row[7]), "tool_calls": float(row[8])})
            for row in rows]
