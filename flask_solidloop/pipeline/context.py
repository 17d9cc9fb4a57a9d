"""What a middleware sees: the state of one LLM turn or one tool turn."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._typing import SessionLike
from ..loops.queries import get_loop
from ..loops.store import fenced_transition

if TYPE_CHECKING:
    from ..leases import RenewerHandle
    from ..llm.client import WireRecord
    from ..llm.types import AssistantTurn, ChatMessage
    from ..loops.store import LlmClaim
    from ..mcp.registry import ToolRegistry
    from ..mcp.toolset import ToolResult
    from ..models import Loop, Message, ToolCall
    from ..state import AgentLike, SolidLoopState


@dataclass
class TurnContext:
    state: SolidLoopState
    session: SessionLike
    loop_id: int
    execution_token: uuid.UUID
    agent: AgentLike
    extras: dict[str, Any] = field(default_factory=dict)
    #: Set once the turn's canonical write has committed; errors after it are
    #: reported but no longer fail the loop.
    committed: bool = False

    @property
    def loop(self) -> Loop:
        loop = get_loop(self.session, self.loop_id)
        assert loop is not None
        return loop

    def transition(self, *, from_: str | tuple[str, ...], to: str, **changes: Any) -> bool:
        """Fenced transition on this turn's generation, committed now.

        Returns False (and writes nothing) when the loop is no longer ours.
        """
        lease = getattr(self, "lease", None)
        if lease is not None and lease.lost():
            return False
        return fenced_transition(self.session, self.loop_id, self.execution_token,
                                 from_=from_, to=to, **changes)


@dataclass
class LlmContext(TurnContext):
    """One LLM turn. Filled in as the stack runs:

    * AgentInitialization: ``tools`` (the registry), ``history``
    * NetworkCalling: ``shell`` (the hidden assistant message), ``response``, ``wire``
    * ResponseParsing: ``message`` (the finalized assistant message)
    """

    tools: ToolRegistry | None = None
    history: list[ChatMessage] = field(default_factory=list)
    #: The turn's claim while its transaction is open (the runtime claims
    #: without committing; AgentInitialization commits the claim together with
    #: the initialization reads and the shell). None when the claim was
    #: committed before the stack ran.
    claim: LlmClaim | None = None
    #: The renewer registration; ``lease.check()`` raises LostLeaseError once lost.
    lease: RenewerHandle | None = None
    shell_id: int | None = None
    #: Set by NetworkCalling as it sends the request: from then on the turn's
    #: end may have committed even when its statement raised.
    requested: bool = False
    response: AssistantTurn | None = None
    wire: WireRecord | None = None
    #: ttft_ms, thinking_ms, output_tokens (+ output_tokens_estimated) when streaming;
    #: duration_ms, output_tokens_per_s of the answering attempt.
    metrics: dict[str, Any] = field(default_factory=dict)
    #: What this request spent on earlier reasoning (see llm/reasoning.py).
    reasoning_carried: dict[str, int] = field(default_factory=dict)
    message: Message | None = None


@dataclass
class ToolContext(TurnContext):
    """One tool turn. ``lease_token`` is None on the continuation path
    (the call was already executed and checkpointed)."""

    tool_call_id: int = 0
    lease_token: uuid.UUID | None = None
    #: The call is its message's only one and this thread adopted it with the
    #: turn that asked for it (the built-in stack may then record its outcome
    #: in one statement).
    sole_call: bool = False
    tool_call: ToolCall | None = None
    tools: ToolRegistry | None = None
    result: ToolResult | None = None
