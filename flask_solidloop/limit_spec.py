"""What the host configures for budgets and rate limits, parsed and checked once:
the budget dicts (an agent's ``budget`` option, ``start(budget=)``,
``resume(budget=)``, ``SOLIDLOOP_SUBJECT_BUDGET``) and the rate-limit table
(``SOLIDLOOP_RATE_LIMITS``). Each bad value is refused with one line naming
the key, the value and the fix (:class:`~flask_solidloop.errors.ConfigurationError`
for settings, :class:`~flask_solidloop.errors.InvalidArgumentError` for calls).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError, InvalidArgumentError

#: The limits a budget may set, and what each counts.
BUDGET_KEYS: dict[str, str] = {
    "cost_usd": "cost in the currency of SOLIDLOOP_PRICES (input, cached and output tokens)",
    "tokens": "input plus output tokens",
    "llm_turns": "LLM requests (turns)",
    "tool_calls": "tool calls the model made",
}
#: A subject's budget's window, when it names none: a rolling day.
DEFAULT_WINDOW = 86400.0

#: A rate limit's dimensions: the key in SOLIDLOOP_RATE_LIMITS, the bucket's
#: dimension, its period in seconds, and whether it counts tokens (settled to
#: the real usage) or requests.
RATE_DIMENSIONS: dict[str, tuple[str, float, bool]] = {
    "rpm": ("requests", 60.0, False),
    "tpm": ("tokens", 60.0, True),
    "rps": ("requests_per_second", 1.0, False),
    "per_minute": ("calls", 60.0, False),
    "per_second": ("calls_per_second", 1.0, False),
}
#: The dimension of a key's own row: its block, its deferrals, its refusals.
KEY_ROW = "-"
#: The prefix of a tool's rate-limit key.
TOOL_PREFIX = "tool:"


def parse_budget(value: Any, *, where: str) -> dict[str, float]:
    """A budget dict checked: known keys, each a number > 0 (or None, dropped).
    ``where`` names the value's origin in the error."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{where}: a budget is a dict of limits ({', '.join(BUDGET_KEYS)}), not "
            f"{type(value).__name__}")
    limits: dict[str, float] = {}
    for key, limit in value.items():
        if key not in BUDGET_KEYS:
            raise InvalidArgumentError(
                f"{where}: unknown budget limit {key!r}; a budget takes "
                f"{', '.join(BUDGET_KEYS)}")
        if limit is None:
            continue
        if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
            raise InvalidArgumentError(
                f"{where}: budget {key} must be a number > 0, not {limit!r}")
        limits[str(key)] = float(limit)
    return limits


@dataclass(frozen=True)
class SubjectBudget:
    """A subject's limits over a rolling window of seconds."""

    limits: dict[str, float]
    window: float = DEFAULT_WINDOW


def parse_subject_budget(value: Any, *, where: str) -> SubjectBudget | None:
    """``{"cost_usd": 5.0, "window": 86400}`` (any budget limits, and the window
    in seconds) as a :class:`SubjectBudget`; None for None or no limits."""
    if value is None or isinstance(value, SubjectBudget):
        return value
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{where}: a subject budget is a dict of limits and a window in seconds, e.g. "
            '{"cost_usd": 5.0, "window": 86400}')
    window = value.get("window", DEFAULT_WINDOW)
    if isinstance(window, bool) or not isinstance(window, int | float) or window <= 0:
        raise InvalidArgumentError(f"{where}: window must be seconds > 0, not {window!r}")
    limits = parse_budget({k: v for k, v in value.items() if k != "window"}, where=where)
    return SubjectBudget(limits, float(window)) if limits else None


def subject_budget_setting(key: str, value: Any) -> SubjectBudget | None:
    """The SOLIDLOOP_SUBJECT_BUDGET setting (config.py's parser)."""
    try:
        return parse_subject_budget(value or None, where=key)
    except InvalidArgumentError as exc:
        raise ConfigurationError(key, value, str(exc).removeprefix(f"{key}: ")) from None


@dataclass(frozen=True)
class Bucket:
    """One dimension of one key: capacity per period."""

    key: str
    dimension: str
    capacity: float
    period: float
    tokens: bool


def rate_limits_setting(key: str, value: Any) -> dict[str, tuple[Bucket, ...]]:
    """SOLIDLOOP_RATE_LIMITS: ``{"<origin> [<model>]" | "tool:<name>": {"rpm": ...,
    "tpm": ..., "rps": ..., "per_second": ..., "per_minute": ...}}`` as each
    key's buckets (a key with ``{}`` has none: only the provider's Retry-After
    blocks are shared for it)."""
    if value is None or value == "":
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(key, value, 'must be a dict like {"https://api.openai.com '
                                             'gpt-4o": {"rpm": 500, "tpm": 30000}}')
    table: dict[str, tuple[Bucket, ...]] = {}
    for name, limits in value.items():
        name = " ".join(str(name).split())
        if not name:
            raise ConfigurationError(key, value, "a key may not be empty")
        if not isinstance(limits, Mapping):
            raise ConfigurationError(key, value, f"the limits of {name!r} must be a dict, e.g. "
                                                 '{"rpm": 500, "tpm": 30000}')
        tool = name.startswith(TOOL_PREFIX)
        allowed = ("per_second", "per_minute") if tool else ("rpm", "tpm", "rps")
        buckets = []
        for dim, amount in limits.items():
            if dim not in allowed:
                raise ConfigurationError(
                    key, value, f"{name!r}: unknown limit {dim!r}; "
                                f"{'a tool key' if tool else 'a provider key'} takes "
                                f"{', '.join(allowed)}")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
                raise ConfigurationError(key, value, f"{name!r}: {dim} must be a number > 0")
            dimension, period, tokens = RATE_DIMENSIONS[dim]
            buckets.append(Bucket(name, dimension, float(amount), period, tokens))
        table[name] = tuple(buckets)
    return table
