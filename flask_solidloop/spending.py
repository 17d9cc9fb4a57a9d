"""What is spent against which limit, as `flask solidloop status`, `list`,
`limits` and the admin show it: a loop's budget and its subject's as gauges,
the subjects that spent in their window, and the rate-limit buckets drained to
now. Reads only: limits/ writes every row read here (docs/decisions/0022).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row
from sqlalchemy import func, select

from ._typing import SessionLike
from .errors import SolidLoopError
from .limit_spec import BUDGET_KEYS, KEY_ROW, SubjectBudget
from .limits import admission, budgets
from .limits import sql as limits_sql
from .models import Loop, Spend
from .state import SolidLoopState

#: The soft warning's share when no agent says (the agent option's default).
DEFAULT_WARNING = 0.8
#: How many subjects with ledger rows the limits view looks at (most recent first).
SUBJECT_CANDIDATES = 500
#: A limit's short name in the loop list's budget column.
SHORT = {"cost_usd": "cost", "tokens": "tokens", "llm_turns": "turns", "tool_calls": "calls"}


def number(key: str, value: float) -> str:
    """An amount without its unit: ``0.4213`` (a cost under a dollar keeps its
    sub-cent digits), ``0.20``, ``1.50``, ``12,345``."""
    if key == "cost_usd":
        whole_cents = round(value, 2) == round(value, 6)
        return f"{value:.4f}" if 0 < abs(value) < 1 and not whole_cents else f"{value:,.2f}"
    return f"{value:,.0f}"


def window_text(seconds: float) -> str:
    """A subject's window as its budget message names it: ``24 h``, ``90 s``."""
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


@dataclass(frozen=True)
class Gauge:
    """One limit: what is spent of it, and the share past which it warns."""

    key: str
    spent: float
    limit: float
    warning: float = DEFAULT_WARNING

    @property
    def share(self) -> float:
        return self.spent / self.limit if self.limit > 0 else 0.0

    @property
    def percent(self) -> int:
        """The share in whole percent (past 100 when a turn overshot the limit)."""
        return int(self.share * 100 + 0.5)

    @property
    def width(self) -> float:
        """The bar's filled part, 0 to 100 (a spend past its limit fills it)."""
        return round(min(max(self.share, 0.0), 1.0) * 100, 1)

    @property
    def level(self) -> str:
        """``ok``, ``warn`` (at the warning share: the model is told to wrap up) or
        ``over`` (reached: no further turn goes)."""
        if self.share >= 1:
            return "over"
        return "warn" if self.share >= self.warning else "ok"

    def text(self) -> str:
        """``cost_usd 0.4200 of 1.00 USD (42%)``, ``llm_turns 7 of 20 (35%)``."""
        unit = " USD" if self.key == "cost_usd" else ""
        return (f"{self.key} {number(self.key, self.spent)} of "
                f"{number(self.key, self.limit)}{unit} ({self.percent}%)")


def gauges(limits: Mapping[str, float], spent: Mapping[str, float],
           warning: float = DEFAULT_WARNING) -> list[Gauge]:
    """A gauge per limit, in the order budgets list their keys."""
    return [Gauge(key, float(spent.get(key, 0.0)), float(limits[key]), warning)
            for key in BUDGET_KEYS if key in limits]


def tightest(found: list[Gauge]) -> Gauge | None:
    """The gauge nearest its limit (the one that will stop the loop first)."""
    return max(found, key=lambda g: g.share, default=None)


@dataclass
class LoopBudget:
    """A loop's spend against its own budget and its subject's."""

    gauges: list[Gauge]
    warning: float
    deferrals: int
    subject: str | None = None
    subject_window: float | None = None
    subject_gauges: list[Gauge] = field(default_factory=list)
    #: resume(budget=) released the loop from its subject's budget.
    exempt: bool = False

    @property
    def empty(self) -> bool:
        return not self.gauges and not self.subject_gauges and not self.deferrals


class AgentLimits:
    """Each agent's budget option and warning share, read once per view (an
    unknown agent, one no longer registered, has neither)."""

    def __init__(self, state: SolidLoopState) -> None:
        self.state = state
        self._seen: dict[str, tuple[dict[str, float], float]] = {}

    def of(self, agent_name: str) -> tuple[dict[str, float], float]:
        if agent_name not in self._seen:
            try:
                agent: Any = self.state.agent_for(agent_name)
                found = (agent.budget_limits(), float(agent.option("budget_warning")))
            except SolidLoopError:
                found = ({}, DEFAULT_WARNING)
            self._seen[agent_name] = found
        return self._seen[agent_name]

    def loop_gauges(self, session: SessionLike, loop: Loop) -> list[Gauge]:
        """The loop's own budget as gauges (empty when it has none), against the
        spend of its tree: itself and its child agents, as its turns count it."""
        agent_limits, warning = self.of(loop.agent_name)
        limits = budgets.effective(agent_limits, loop.budget)
        if not limits:
            return []
        spent = budgets.tree_spend(session, loop.id)[0].spent
        return gauges(limits, spent, warning)


def subject_spend(session: SessionLike, subject: str, window: float) -> dict[str, float]:
    """What a subject spent over ``window`` seconds (settled use, unsettled
    estimates), by limit."""
    return budgets.subject_spend(session, subject, window)


def subject_budget_of(state: SolidLoopState, subject_type: str | None,
                      subject_id: str | None) -> SubjectBudget | None:
    """The subject's budget, or None (none applies, or the host's hook failed:
    a view never fails on it)."""
    try:
        return admission.subject_budget(state, subject_type, subject_id)
    except Exception:  # a host hook's bug must not take the page down
        return None


def loop_budget(state: SolidLoopState, session: SessionLike, loop: Loop,
                agents: AgentLimits | None = None) -> LoopBudget:
    """Everything the status view and the loop page show of a loop's budgets."""
    agents = agents or AgentLimits(state)
    own = agents.loop_gauges(session, loop)
    warning = agents.of(loop.agent_name)[1]
    found = LoopBudget(own, warning, int(loop.capacity_deferrals or 0),
                       exempt=bool((loop.budget or {}).get("over_subject")))
    subject = budgets.subject_name(loop.subject_type, loop.subject_id)
    if subject is None:
        return found
    budget = subject_budget_of(state, loop.subject_type, loop.subject_id)
    if budget is None:
        return found
    spent = subject_spend(session, subject, budget.window)
    found.subject = subject
    found.subject_window = budget.window
    found.subject_gauges = gauges(budget.limits, spent, warning)
    return found


# -- the limits view ------------------------------------------------------------------


@dataclass(frozen=True)
class SubjectSpend:
    """A subject with a budget and what it spent in its window."""

    subject: str
    window: float
    gauges: list[Gauge]

    @property
    def share(self) -> float:
        top = tightest(self.gauges)
        return top.share if top else 0.0


def subjects(state: SolidLoopState, session: SessionLike, *, top: int = 10
             ) -> list[SubjectSpend]:
    """The ``top`` subjects with a budget that spent anything in their window,
    nearest their limit first. Each subject's window is its own (a host's hook
    may give each a different one), so each is summed on its own, over the
    :data:`SUBJECT_CANDIDATES` subjects whose ledger rows are most recent."""
    rows = session.execute(
        select(Spend.subject, func.max(Spend.loop_id).label("loop_id"))
        .group_by(Spend.subject).order_by(func.max(Spend.at).desc())
        .limit(SUBJECT_CANDIDATES)).all()
    loop_ids = [row.loop_id for row in rows if row.loop_id is not None]
    owners = {row.id: (row.subject_type, row.subject_id) for row in session.execute(
        select(Loop.id, Loop.subject_type, Loop.subject_id).where(Loop.id.in_(loop_ids)))
    } if loop_ids else {}
    found = []
    for row in rows:
        # The ledger's key is ``type:id``; a loop of the subject names its parts
        # exactly (a type may hold a colon), else split at the first.
        kind, _, ident = row.subject.partition(":")
        kind_id = owners.get(row.loop_id, (kind or None, ident or None))
        budget = subject_budget_of(state, *kind_id)
        if budget is None:
            continue
        spent = subject_spend(session, row.subject, budget.window)
        if not any(spent.values()):
            continue
        found.append(SubjectSpend(row.subject, budget.window, gauges(budget.limits, spent)))
    found.sort(key=lambda s: (-s.share, s.subject))
    return found[:top]


@dataclass(frozen=True)
class BucketLevel:
    """One dimension of a key: its level drained to now against its capacity."""

    dimension: str
    level: float
    capacity: float | None
    period: float | None

    @property
    def share(self) -> float:
        return self.level / self.capacity if self.capacity else 0.0

    @property
    def gauge(self) -> Gauge | None:
        """The level as a gauge (warning at the budgets' share), when configured."""
        if not self.capacity:
            return None
        return Gauge(self.dimension, self.level, self.capacity)


@dataclass
class RateKey:
    """A rate-limited key: its buckets, its block, what it deferred and was refused."""

    key: str
    configured: bool
    buckets: list[BucketLevel] = field(default_factory=list)
    blocked_until: datetime | None = None
    deferrals: int = 0
    refusals: int = 0


def drained(level: float, drained_at: datetime | None, now: datetime,
            capacity: float | None, period: float | None) -> float:
    """A bucket's level at ``now``: it drains at capacity per period since its
    last write, never below zero (an unconfigured bucket does not drain)."""
    if not capacity or not period or drained_at is None:
        return max(float(level), 0.0)
    elapsed = max((now - drained_at).total_seconds(), 0.0)
    return max(float(level) - elapsed * capacity / period, 0.0)


def rate_keys(state: SolidLoopState, session: SessionLike) -> tuple[list[RateKey], datetime]:
    """Every configured key and every key with rows (a key dropped from
    SOLIDLOOP_RATE_LIMITS keeps its counts), and the database's clock they
    were read at. ``blocked_until`` only when it is still in the future."""
    table = state.config.rate_limits
    connection = session.connection().connection
    try:
        cursor = connection.cursor(row_factory=dict_row)
        rows = cursor.execute(limits_sql.BUCKETS).fetchall()
        now: datetime = session.execute(select(func.clock_timestamp())).scalar_one()
    finally:
        session.rollback()
    keys = {name: RateKey(name, True) for name in table}
    stored = {(row["key"], row["dimension"]): row for row in rows}
    for row in rows:
        keys.setdefault(row["key"], RateKey(row["key"], False))
    for name, entry in keys.items():
        configured = {b.dimension: b for b in table.get(name, ())}
        own = stored.get((name, KEY_ROW))
        if own is not None:
            entry.deferrals = int(own["deferrals"] or 0)
            entry.refusals = int(own["refusals"] or 0)
            until = own["blocked_until"]
            entry.blocked_until = until if until is not None and until > now else None
        dims = list(configured) + sorted(d for k, d in stored if k == name and d != KEY_ROW
                                         and d not in configured)
        for dim in dims:
            bucket = configured.get(dim)
            capacity, period = (bucket.capacity, bucket.period) if bucket else (None, None)
            row = stored.get((name, dim))
            level = drained(row["level"], row["drained_at"], now, capacity, period) \
                if row is not None else 0.0
            entry.buckets.append(BucketLevel(dim, level, capacity, period))
    return sorted(keys.values(), key=lambda k: k.key), now


def period_text(seconds: float | None) -> str:
    """``per min``, ``per s``, ``per 90 s``."""
    if seconds is None:
        return ""
    return {60.0: "per min", 1.0: "per s", 3600.0: "per h"}.get(seconds, f"per {seconds:g} s")
