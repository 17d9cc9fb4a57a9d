"""The admin's charts' rollup: LLM turns, tool turns, tokens, cost, turn
latency and failed loops, summed per minute and per hour for each agent.

Written only by flask_solidloop/maintenance/rollup.py (the rollup pass, which
replaces whole periods so a rerun never double counts), read by
flask_solidloop/loops/stats.py for the dashboard and the agent pages.
``solidloop_rollup_marks`` remembers up to which minute the pass has rolled up.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, Numeric, String, func, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base


class TurnStat(Base):
    """One agent's figures over one minute (``span_seconds`` 60) or one hour
    (3600). Hour rows of agent ``""`` sum every agent's (the dashboard's)."""

    __tablename__ = "solidloop_turn_stats"

    span_seconds: Mapped[int] = mapped_column(Integer, primary_key=True)
    starts_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    agent_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    llm_turns: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    tool_turns: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    input_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    cost: Mapped[Decimal] = mapped_column(Numeric(18, 8), nullable=False, server_default="0")
    #: LLM turns per latency bucket (loops/stats.LATENCY_BOUNDS_MS; one more
    #: entry than bounds: below the first, between each pair, above the last).
    latency: Mapped[list[int]] = mapped_column(
        ARRAY(Integer), nullable=False, server_default=text("'{}'::integer[]"))
    #: Loops that failed in the period, by failure class.
    failures: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb"))


class RollupMark(Base):
    """How far a rollup has gone: every minute before ``rolled_to`` is in."""

    __tablename__ = "solidloop_rollup_marks"

    name: Mapped[str] = mapped_column(String(50), primary_key=True)
    rolled_to: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False)
