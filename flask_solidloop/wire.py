"""What the wire log keeps of one exchange with a provider: the redacted request,
the response, every attempt and the timings.

At the bottom of the layers: the send path (llm/) fills it, ``ProviderError.wire``
carries it, and loops/store/ writes it as an event row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WireRecord:
    """What the wire log keeps of one turn: redacted request, response, attempts, timings."""

    url: str
    request_headers: dict[str, str]
    request_body: Any
    attempts: list[dict[str, Any]] = field(default_factory=list)
    status: int | None = None
    response_body: Any = None
    duration_ms: float | None = None
    error: str | None = None
    #: The provider's rate-limit headers on the last response (limits/ reads
    #: them); not part of the stored payload.
    rate_headers: dict[str, str] = field(default_factory=dict)

    def to_payload(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "request": {"headers": self.request_headers, "body": self.request_body},
            "response": {"status": self.status, "body": self.response_body},
            "attempts": self.attempts,
            "duration_ms": self.duration_ms,
            "error": self.error,
        }
