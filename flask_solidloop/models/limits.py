"""The shared state of rate limits and subjects' budgets (limits/ writes them).

* :class:`RateBucket`: one rate-limited key's dimension (``requests``,
  ``tokens``, ...), a generic cell rate algorithm's level that drains at its
  capacity per period; the block a provider's Retry-After set on the key; the
  deferrals and refusals counted on it.
* :class:`Spend`: a subject's ledger, a row per LLM turn of its loops:
  written as the turn's reservation (its estimate) and settled to its usage.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Identity,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class RateBucket(Base):
    """One dimension of one rate-limited key, shared by every worker."""

    __tablename__ = "solidloop_rate_buckets"

    key: Mapped[str] = mapped_column(Text, primary_key=True)
    #: ``requests``, ``tokens``, ``input_tokens``, ``output_tokens`` (per
    #: minute), ``requests_per_second``, ``calls``: or ``-`` for the key's own row.
    dimension: Mapped[str] = mapped_column(String(40), primary_key=True)
    #: What is reserved and not yet drained, in the dimension's unit; past the
    #: capacity when turns hold future slots.
    level: Mapped[float] = mapped_column(Float, nullable=False, server_default="0")
    drained_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())
    #: Until when the provider told us to stay away (a 429/503 Retry-After).
    blocked_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deferrals: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    #: The provider's own refusals (429s) met on this key.
    refusals: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")


class Spend(Base):
    """One LLM turn of a subject's loop in the subject's budget window."""

    __tablename__ = "solidloop_spend"
    __table_args__ = (Index("ix_solidloop_spend_subject_at", "subject", "at"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    #: ``subject_type:subject_id``.
    subject: Mapped[str] = mapped_column(Text, nullable=False)
    loop_id: Mapped[int | None] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())
    cost: Mapped[Decimal] = mapped_column(Numeric(18, 8), nullable=False, server_default="0")
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    llm_turns: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    tool_calls: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    #: False while the row holds the turn's estimate; true once it holds its usage.
    settled: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
