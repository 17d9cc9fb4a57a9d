"""What a middleware sees: the state of one LLM turn or one tool turn.

The fields are typed and documented (docs/guides/middlewares.md lists them);
``extras`` is the host's own, for passing data between its layers: the
built-in steps keep nothing there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._typing import SessionLike
from ..loops.queries import get_loop
from ..loops.store import fenced_transition, loop_ends

if TYPE_CHECKING:
    from ..leases import RenewerHandle
    from ..limits.admission import Admitted
    from ..llm.client import WireRecord
    from ..llm.types import AssistantTurn, ChatMessage
    from ..loops.store import Adopted, CallFacts, LlmClaim
    from ..mcp.registry import ToolRegistry
    from ..mcp.toolset import ToolResult
    from ..models import Loop, Message, ToolCall
    from ..state import AgentLike, SolidLoopState
    from .llm_stack import PartialWriter
    from .plan import StackPlan


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
    #: The agent's stacks and what their shape lets the durable writes fuse.
    plan: StackPlan | None = None
    #: Whether the turn's canonical commit may claim the loop's next step for
    #: this thread (the runtime continues inline: runtime/inline.py).
    adopt_next: bool = False
    #: The next step the turn's canonical commit claimed for this thread, if any.
    adopted: Adopted | None = None

    @property
    def loop(self) -> Loop:
        loop = get_loop(self.session, self.loop_id)
        assert loop is not None
        return loop

    def still_ours(self) -> bool:
        """Whether the step's lease has not been found lost (the renewer's view;
        a step without a registration counts as holding it: its writes are
        fenced all the same)."""
        lease = getattr(self, "lease", None)
        return lease is None or not lease.lost()

    def transition(self, *, from_: str | tuple[str, ...], to: str, **changes: Any) -> bool:
        """Fenced transition on this turn's generation, committed now.

        Returns False (and writes nothing) when the loop is no longer ours.
        """
        lease = getattr(self, "lease", None)
        if lease is not None and lease.lost():
            return False
        return fenced_transition(self.session, self.loop_id, self.execution_token,
                                 from_=from_, to=to,
                                 ends=loop_ends(self.state, self.loop), **changes)


@dataclass
class LlmContext(TurnContext):
    """One LLM turn. Filled in as the stack runs:

    * AgentInitialization: ``tools`` (the registry), ``history``, ``history_chars``
    * NetworkCalling: ``shell_id`` (unless the claim wrote it),
      ``request_event_id``, ``response``, ``wire``, ``metrics``,
      ``reasoning_carried``
    * ResponseParsing: ``message`` (the finalized assistant message)
    """

    tools: ToolRegistry | None = None
    history: list[ChatMessage] = field(default_factory=list)
    #: The history's text, in characters (AgentInitialization measures it).
    history_chars: int = 0
    #: The turn's claim, committed before the stack ran: its generation, the
    #: run's elapsed seconds, and the shell and history it wrote and read.
    claim: LlmClaim | None = None
    #: The renewer registration; ``lease.check()`` raises LostLeaseError once lost.
    lease: RenewerHandle | None = None
    shell_id: int | None = None
    #: Set by NetworkCalling as it sends the request: from then on the turn's
    #: end may have committed even when its statement raised.
    requested: bool = False
    #: The request's ``llm_request`` event, written (pending) before it was
    #: sent; the turn's end completes it (decision 0025).
    request_event_id: int | None = None
    #: Whether someone watched the loop when its request went on record.
    watched: bool = False
    response: AssistantTurn | None = None
    wire: WireRecord | None = None
    #: ttft_ms (when text streamed), thinking_ms, output_tokens (+
    #: output_tokens_estimated, output_tokens_per_s_whole_turn) when streaming;
    #: duration_ms, output_tokens_per_s of the answering attempt.
    metrics: dict[str, Any] = field(default_factory=dict)
    #: What this request spent on earlier reasoning (see llm/reasoning.py).
    reasoning_carried: dict[str, int] = field(default_factory=dict)
    #: How past reasoning was sent back (stored on the message).
    reasoning_strategies: list[str] | None = None
    #: The loop's structured-output schema, as NetworkCalling read it from the
    #: loop it holds (ResponseParsing validates against it: llm/output.py).
    output_schema: dict[str, Any] | None = None
    #: The API key and secret-looking header values of this request: scrubbed
    #: from anything stored or logged.
    secrets: list[str] = field(default_factory=list)
    #: The streaming turn's partial-text writer (NetworkCalling).
    partial: PartialWriter | None = None
    message: Message | None = None
    #: The request's budget and rate-limit reservations (limits/admission.py),
    #: settled after its answer; None when no limit applies.
    admitted: Admitted | None = None
    #: Set by the runtime in async mode (SOLIDLOOP_LLM_IO): NetworkCalling
    #: hands the request to the process's I/O loop instead of sending it.
    hand_off: bool = False


@dataclass
class UnrecordedResult:
    """A tool's result that ToolExecution leaves for ResponseCreation to record
    with the call's answer, in one statement (the plan's ``fuse_outcome``)."""

    result: ToolResult
    duration_ms: float


@dataclass
class ToolContext(TurnContext):
    """One tool turn. ``lease_token`` is None on the continuation path
    (the call was already executed and checkpointed)."""

    tool_call_id: int = 0
    lease_token: uuid.UUID | None = None
    #: The call's lease registration with the renewer, once claimed.
    lease: RenewerHandle | None = None
    #: The call is its message's only one and this thread adopted it with the
    #: turn that asked for it (its outcome may be one statement, alone).
    sole_call: bool = False
    tool_call: ToolCall | None = None
    #: The call's columns as read before the tool ran (the outcome's event and
    #: notes are made from them).
    facts: CallFacts | None = None
    tools: ToolRegistry | None = None
    result: ToolResult | None = None
    #: Set by ToolExecution when ResponseCreation records the result with the answer.
    unrecorded: UnrecordedResult | None = None
    #: Set by ToolExecution once the tool has run (its effect may have happened):
    #: from then on the step is never handed back for the tool to run again.
    tool_ran: bool = False
    #: Set by ToolExecution when an in-process tool left its session's
    #: transaction open: the outcome commits in it, with the tool's writes.
    joined: bool = False
