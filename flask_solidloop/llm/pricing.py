"""Cost of a turn from its normalized usage and a host-configured price table.

``SOLIDLOOP_PRICES`` maps a model name to prices in currency units per million
tokens::

    SOLIDLOOP_PRICES = {
        "gpt-4o": {"input": 2.50, "cached_input": 1.25, "output": 10.00},
        "claude-sonnet-4": {"input": 3.00, "cached_input": 0.30, "output": 15.00},
    }

``cached_input`` defaults to ``input``. Reasoning tokens are billed as output
(every provider counts them there once usage is normalized). A model missing
from the table costs nothing and is recorded as unpriced.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from ..errors import ConfigurationError
from .types import Usage

PRICE_KEYS = ("input", "cached_input", "output")
MILLION = Decimal(1_000_000)


def parse_prices(key: str, value: Any) -> dict[str, dict[str, Decimal]]:
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise ConfigurationError(key, value, "must be a dict of model -> {input, output, ...}")
    table: dict[str, dict[str, Decimal]] = {}
    for model, prices in value.items():
        if not isinstance(prices, dict):
            raise ConfigurationError(key, value, f"prices for {model!r} must be a dict")
        unknown = set(prices) - set(PRICE_KEYS)
        if unknown or "input" not in prices or "output" not in prices:
            raise ConfigurationError(
                key, value,
                f"prices for {model!r} need input and output (per million tokens), optionally "
                f"cached_input; got keys {sorted(prices)}",
            )
        try:
            parsed = {k: Decimal(str(v)) for k, v in prices.items()}
        except ArithmeticError:
            raise ConfigurationError(key, value, f"prices for {model!r} must be numbers") from None
        if any(v < 0 for v in parsed.values()):
            raise ConfigurationError(key, value, f"prices for {model!r} must be >= 0")
        parsed.setdefault("cached_input", parsed["input"])
        table[str(model)] = parsed
    return table


def cost(usage: Usage | None, prices: dict[str, Decimal] | None) -> Decimal | None:
    """The cost of ``usage``, or None when the model has no price."""
    if usage is None or prices is None:
        return None
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    fresh = usage.input_tokens - cached
    total = (Decimal(fresh) * prices["input"] + Decimal(cached) * prices["cached_input"]
             + Decimal(usage.output_tokens) * prices["output"])
    return (total / MILLION).quantize(Decimal("0.00000001"))
