"""What a store commit claimed for the thread that made it: the loop's next step,
for that thread to run inline (runtime/inline.py).

A turn's end may lease the first tool call to the thread that committed it,
and a tool call's answer may claim the loop's next LLM turn for it: the claim
commits with the state change that makes the step due, so it needs no job row
(its lease is its record, and recovery follows the lease as for any claimed
step). The store functions that end a step take ``adopt=`` from their caller
and return one of these once their commit has happened; a function that
raised returns nothing, so a claim whose commit failed is never run.

Each carries the rows its commit wrote and read back whole (``rows``:
``(model, row)`` pairs), so the step starts from them without reading them
again.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LlmClaim:
    """A committed LLM turn claim: the generation it minted, the run's elapsed
    seconds by the database clock, and what the claim's statement did for the
    turn besides (its shell; its history, read under the loop row lock)."""

    token: uuid.UUID
    run_elapsed_seconds: float
    #: The turn's hidden ``processing`` shell, written with the claim; None:
    #: the turn's stack opens it.
    shell_id: int | None = None
    #: The history the turn sends; None: the turn's stack reads it.
    history: list[Any] | None = None


@dataclass(frozen=True)
class AdoptedToolCall:
    """A tool call leased to this thread by the commit that created its phase
    (or answered its predecessor in a sequential line)."""

    loop_id: int
    tool_call_id: int
    #: The generation of the tool phase.
    execution_token: uuid.UUID
    #: The call's lease: the step's fence.
    lease_token: uuid.UUID
    rows: tuple[tuple[type, dict[str, Any]], ...] = ()
    #: The call is its message's only one: its outcome may be one statement.
    sole_call: bool = False


@dataclass(frozen=True)
class AdoptedLlmTurn:
    """The loop's next LLM turn, claimed for this thread by the commit that
    answered its tool phase's last call."""

    loop_id: int
    claim: LlmClaim
    rows: tuple[tuple[type, dict[str, Any]], ...] = ()


Adopted = AdoptedToolCall | AdoptedLlmTurn
