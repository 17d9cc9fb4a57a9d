"""A request's worst-case size, before it is sent: what budgets and rate limits
reserve (limits/). The prompt is the rendered payload's UTF-8 bytes / 4, the
JSON around the text making it generous; the output is the request's own cap,
or ``default_output`` when it names none. Settling after the answer replaces
the estimate with the usage the provider reports.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from .pricing import MILLION

#: Where each dialect's payload names its output cap.
_OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True)
class Estimate:
    prompt_tokens: int
    output_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def cost(self, prices: dict[str, Decimal] | None) -> Decimal:
        """The estimate priced as fresh input and output (0 when unpriced)."""
        if prices is None:
            return Decimal(0)
        return ((Decimal(self.prompt_tokens) * prices["input"]
                 + Decimal(self.output_tokens) * prices["output"]) / MILLION).quantize(
            Decimal("0.00000001"))


def output_cap(payload: dict[str, Any]) -> int | None:
    """The output cap a rendered payload asks for, in any dialect."""
    for key in _OUTPUT_CAPS:
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    generation = payload.get("generationConfig")
    if isinstance(generation, dict):
        value = generation.get("maxOutputTokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def estimate(payload: dict[str, Any], *, default_output: int) -> Estimate:
    """The worst-case tokens of sending ``payload``."""
    size = len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())
    cap = output_cap(payload)
    return Estimate(math.ceil(size / 4), cap if cap is not None else default_output)
