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

from ..config import PRICE_KEYS, parse_prices
from .types import Usage

MILLION = Decimal(1_000_000)

# The table is parsed and validated with the rest of the settings (config.py);
# re-exported here, where its users look for it.
__all__ = ["MILLION", "PRICE_KEYS", "cost", "parse_prices"]


def cost(usage: Usage | None, prices: dict[str, Decimal] | None) -> Decimal | None:
    """The cost of ``usage``, or None when the model has no price."""
    if usage is None or prices is None:
        return None
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    fresh = usage.input_tokens - cached
    total = (Decimal(fresh) * prices["input"] + Decimal(cached) * prices["cached_input"]
             + Decimal(usage.output_tokens) * prices["output"])
    return (total / MILLION).quantize(Decimal("0.00000001"))
