"""The only writer of loop, message, tool-call, MCP-session and event rows, and
of the jobs that follow their changes.

Every function is one named transition, with its statement in loops/sql/,
and declares the kind of transaction it runs in (transaction.py: ``commits``,
``joins`` or ``alone``). State and the successor job land together or not at
all (invariant: transactional dispatch). A turn whose fence closed gets
``LostLeaseError`` (or False) from the turn's functions and writes nothing;
host commands and heals return False or an empty list instead.

One module per concern: ``llm_turn``, ``tool_turn``, ``commands`` (creation and
the host's commands), ``heals`` (the reaper's repairs), ``wirelog`` (what the
events keep), ``adopted`` (what a commit claimed for its thread), ``ending``
(the host's hooks, run in the transaction that ends a loop), ``children``
(child agents: started with the parent's call, deciding it when they end),
``caps`` (a capped loop's admission, a new loop's fair rank), ``compaction``
(a summary turn's end), ``retention`` (ended loops deleted, after the host's
archive hooks), ``forks`` (a new loop from another's history) and
``transaction``. Lease *renewal*
is the one write elsewhere: leases.py, on the renewer's own connection.
"""

from .adopted import Adopted, AdoptedLlmTurn, AdoptedToolCall, LlmClaim
from .caps import Caps, admit, caps_for, fair_ranks
from .children import ChildStart, TreeLoop, child_result, decide_parent, lock_tree
from .commands import (
    NewLoop,
    applicable,
    create_loop,
    create_loops,
    force_stop,
    freeze,
    mark_watched,
    pause,
    resume,
    set_observed,
    stop,
    unfreeze,
)
from .compaction import Compacted, finish_summary_turn, pin_message
from .conversation import POLICIES, SentMessage, send_message
from .ending import NO_HOOKS, LoopEndHook, LoopEnds, loop_ends
from .forks import ForkedLoop, ForkPlan, fork_loop
from .heals import (
    heal_dropped_tools,
    heal_expired_llm,
    heal_expired_waits,
    heal_orphan_shells,
    heal_stalled_tools,
    heal_stuck_queued,
    heal_stuck_tool_phase,
)
from .llm_turn import (
    CallWait,
    Deferral,
    FinishedTurn,
    NewToolCall,
    WaitRequest,
    calls_to_run,
    claim_llm_turn,
    defer_for_capacity,
    defer_llm_turn,
    end_turn,
    fail_unclaimed,
    fenced_transition,
    finish_llm_turn,
    open_shell,
    record_delta,
    record_partial,
    record_request,
    record_tool_snapshots,
    requeue_llm_turn,
    take_capacity_slot,
)
from .output import end_with_invalid_output
from .retention import (
    ArchivedLoop,
    LoopArchiveHook,
    PurgedBatch,
    count_ended_loops,
    purge_ended_loops,
)
from .tool_turn import (
    CallFacts,
    NextTurn,
    ToolClaim,
    ToolOutcome,
    answer_tool_call,
    checkpoint_and_answer_tool_call,
    checkpoint_tool_call,
    claim_tool_call,
    hand_back_tool_call,
    release_tool_call,
    store_mcp_session_state,
)
from .transaction import end_transaction, holds_nothing, recover, with_database_retry
from .waits import (
    APPROVAL,
    APPROVED,
    COMPLETED,
    DENIED,
    RESULT,
    Decision,
    DueWait,
    decide,
    denial,
    due_wait,
    retry_time_out,
    supplied,
    time_out,
)

__all__ = [
    "APPROVAL",
    "APPROVED",
    "COMPLETED",
    "DENIED",
    "NO_HOOKS",
    "POLICIES",
    "RESULT",
    "Adopted",
    "AdoptedLlmTurn",
    "AdoptedToolCall",
    "ArchivedLoop",
    "CallFacts",
    "CallWait",
    "Caps",
    "ChildStart",
    "Compacted",
    "Decision",
    "Deferral",
    "DueWait",
    "FinishedTurn",
    "ForkPlan",
    "ForkedLoop",
    "LlmClaim",
    "LoopArchiveHook",
    "LoopEndHook",
    "LoopEnds",
    "NewLoop",
    "NewToolCall",
    "NextTurn",
    "PurgedBatch",
    "SentMessage",
    "ToolClaim",
    "ToolOutcome",
    "TreeLoop",
    "WaitRequest",
    "admit",
    "answer_tool_call",
    "applicable",
    "calls_to_run",
    "caps_for",
    "checkpoint_and_answer_tool_call",
    "checkpoint_tool_call",
    "child_result",
    "claim_llm_turn",
    "claim_tool_call",
    "count_ended_loops",
    "create_loop",
    "create_loops",
    "decide",
    "decide_parent",
    "defer_for_capacity",
    "defer_llm_turn",
    "denial",
    "due_wait",
    "end_transaction",
    "end_turn",
    "end_with_invalid_output",
    "fail_unclaimed",
    "fair_ranks",
    "fenced_transition",
    "finish_llm_turn",
    "finish_summary_turn",
    "force_stop",
    "fork_loop",
    "freeze",
    "hand_back_tool_call",
    "heal_dropped_tools",
    "heal_expired_llm",
    "heal_expired_waits",
    "heal_orphan_shells",
    "heal_stalled_tools",
    "heal_stuck_queued",
    "heal_stuck_tool_phase",
    "holds_nothing",
    "lock_tree",
    "loop_ends",
    "mark_watched",
    "open_shell",
    "pause",
    "pin_message",
    "purge_ended_loops",
    "record_delta",
    "record_partial",
    "record_request",
    "record_tool_snapshots",
    "recover",
    "release_tool_call",
    "requeue_llm_turn",
    "resume",
    "retry_time_out",
    "send_message",
    "set_observed",
    "stop",
    "store_mcp_session_state",
    "supplied",
    "take_capacity_slot",
    "time_out",
    "unfreeze",
    "with_database_retry",
]
