"""Plain-text rendering of loops and messages for the CLI and the demo, of
a loop's spend against its budgets (:func:`format_budget`), of its LLM
requests with no answer on record (:func:`format_requests`; the admin shows
them in the same words), and of a child agent's tree (:func:`format_lineage`)."""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, datetime

from sqlalchemy.orm import object_session

from .loops import queries
from .loops.lineage import Kin, Lineage
from .loops.queries import ToolCallState
from .loops.wire_reads import PendingRequest
from .models import Loop, Message, ToolCall
from .spending import LoopBudget, window_text


def format_loop(loop: Loop) -> str:
    assistant = _assistant_messages(loop)
    unknown = [m for m in assistant if (m.meta or {}).get("usage_missing")]
    tokens = f"  tokens in/out: {loop.input_tokens}/{loop.output_tokens}"
    if unknown:
        # Not $0.00: the server sent no counts for these turns (see the messages).
        tokens += (f", usage unknown for {len(unknown)} of {len(assistant)} turn(s) "
                   "(the server sent no token counts; totals and cost leave them out)")
    lines = [
        f"loop {loop.id}  agent={loop.agent_name}  status={loop.status}  steps={loop.step_count}",
        tokens,
    ]
    last = assistant[-1] if assistant else None
    if last is not None and last.finish_reason == "refusal":
        reason = (last.meta or {}).get("refusal") or last.content or ""
        lines.append(f"  outcome: refusal: the model declined: {reason}".rstrip(": "))
    if loop.status == "running" and loop.lease_expires_at is not None:
        lines.append(f"  LLM turn held by {loop.lease_holder or 'a worker'}, lease until "
                     f"{_clock(loop.lease_expires_at)}")
    if loop.provider_wait_since is not None:
        lines.append(f"  waiting for its provider since {_clock(loop.provider_wait_since)} "
                     f"({loop.provider_wait_attempts} deferred turn(s); the turn is queued "
                     f"again, holding nothing): {loop.provider_wait_error or ''}".rstrip(": "))
    if loop.status == "waiting":
        lines.append("  waiting: its tool calls await a decision or a result (marked below); "
                     "`flask solidloop approvals` lists every call that waits")
    if loop.frozen:
        lines.append("  frozen: resume refuses until `flask solidloop unfreeze` lifts it")
    if loop.subject_label:
        lines.append(f"  subject: {loop.subject_label}")
    if loop.forked_from_loop_id is not None:
        lines.append(f"  forked from loop {loop.forked_from_loop_id} at message "
                     f"{loop.forked_at_message_id}")
    if loop.llm_override:
        lines.append("  llm override: " + ", ".join(
            f"{key}={value}" for key, value in sorted(loop.llm_override.items())))
    if loop.error_message:
        lines.append(f"  error: {loop.error_message}")
    lines += format_output(loop)
    return "\n".join(lines)


def format_output(loop: Loop) -> list[str]:
    """A structured-output loop's lines: its validated output (indented JSON),
    or that it has none yet."""
    if loop.output_schema is None:
        return []
    if loop.output is None:
        return ["  output: none (structured output; no valid answer yet)"]
    text = json.dumps(loop.output, indent=2, ensure_ascii=False)
    return ["  output:", *(f"    {line}" for line in text.splitlines())]


def format_budget(budget: LoopBudget) -> list[str]:
    """The status lines of a loop's budgets: its own limits, its subject's over
    the subject's window, and the turns rate limits deferred."""
    lines = []
    if budget.gauges:
        lines.append("  budget: " + ", ".join(g.text() for g in budget.gauges))
    if budget.subject_gauges and budget.subject_window is not None:
        released = (" (this loop was released from it by resume(budget=))"
                    if budget.exempt else "")
        window = window_text(budget.subject_window)
        lines.append(f"  subject {budget.subject} budget over {window}: "
                     + ", ".join(g.text() for g in budget.subject_gauges) + released)
    if budget.deferrals:
        lines.append(f"  capacity deferrals: {budget.deferrals} (turns a rate limit deferred "
                     "to a later slot, holding nothing while they waited)")
    return lines


def format_requests(pending: list[PendingRequest]) -> list[str]:
    """The status lines of a loop's LLM requests with no answer on record
    (loops/wire_reads.py): the one in flight, with its elapsed time, model and
    endpoint; those whose turns ended without an answer, by event id."""
    lines = [f"  {describe_request(r)}" for r in pending if r.in_flight]
    lost = [r for r in pending if not r.in_flight]
    if lost:
        lines.append(f"  {len(lost)} LLM request(s) unanswered (their turns ended without an "
                     "answer: a worker died, a lease was lost, or the loop was paused or "
                     "stopped): wire-log event(s) " + ", ".join(f"#{r.event_id}" for r in lost))
    return lines


def describe_request(request: PendingRequest) -> str:
    """``LLM request in flight for 12.4 s (model gpt-4o, endpoint https://...)``,
    or unanswered and since when."""
    about = ", ".join(part for part in (
        f"model {request.model}" if request.model else None,
        f"endpoint {request.url}" if request.url else None) if part)
    about = f" ({about})" if about else ""
    if request.in_flight:
        return f"LLM request in flight for {_elapsed(request.seconds)}{about}"
    return (f"LLM request #{request.event_id} unanswered: sent {_elapsed(request.seconds)} "
            f"ago{about}, its turn ended without an answer")


def _elapsed(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _assistant_messages(loop: Loop) -> list[Message]:
    """The loop's completed assistant turns, when the loop is attached to a session."""
    session = object_session(loop)
    if session is None:
        return []
    return [m for m in queries.messages(session, loop.id)
            if m.role == "assistant" and m.status == "completed"]


def _indent(text: str) -> str:
    return textwrap.indent(text.strip() or "(empty)", "    ")


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M:%S UTC")


def _timing(message: Message) -> str | None:
    """The turn's timing and output tokens; for a turn still streaming, the tokens
    so far, estimated from its partial text."""
    if message.role != "assistant":
        return None
    if message.status == "processing":
        chars = len(message.content or "") + len(message.reasoning or "")
        if not chars:
            return None
        return (f"    streaming: ~{(chars + 3) // 4} output tokens so far "
                "(estimate: characters / 4)")
    metrics = (message.meta or {}).get("metrics") or {}
    pieces = []
    for key, label in (("ttft_ms", "first token"), ("thinking_ms", "thinking"),
                       ("duration_ms", "total")):
        if metrics.get(key) is not None:
            pieces.append(f"{label} {metrics[key]:.0f} ms")
    if metrics.get("output_tokens"):
        estimated = metrics.get("output_tokens_estimated")
        pieces.append(f"{'~' if estimated else ''}{metrics['output_tokens']} output tokens"
                      + (" (estimate: the server sent no usage)" if estimated else ""))
    if metrics.get("output_tokens_per_s"):
        # Over the whole turn when no text streamed early enough to time the
        # generation alone (an answer that only called tools): a lower bound.
        whole = " over the whole turn" if metrics.get("output_tokens_per_s_whole_turn") else ""
        pieces.append(f"{metrics['output_tokens_per_s']} tokens/s{whole}")
    return f"    timing: {', '.join(pieces)}" if pieces else None


def describe_call_state(state: ToolCallState) -> str:
    """``running on host:42 until 12:00:03 UTC``, ``queued``, ``answered`` ..."""
    if state.state in ("running", "stalled") and state.leased_until is not None:
        holder = f" on {state.holder}" if state.holder else ""
        verb = "running" if state.state == "running" else "stalled (lease lapsed"
        tail = "" if state.state == "running" else "; the reaper takes it over)"
        return f"{verb}{holder}, lease until {_clock(state.leased_until)}{tail}"
    return {"executed": "ran; answer pending", "waiting": "waiting (not started)",
            "awaiting_approval": "awaiting approval", "awaiting_result": "awaiting its result"
            }.get(state.state, state.state)


def describe_decision(call: ToolCall) -> str | None:
    """``approved by alice``, ``denied by bob: too big`` ...; None when undecided."""
    if call.decision is None:
        return None
    text = call.decision + (f" by {call.decided_by}" if call.decided_by else "")
    if call.decision == "denied" and call.decision_reason:
        text += f": {call.decision_reason}"
    if call.requested_arguments is not None:
        text += " (with edited arguments)"
    return text


def describe_wait(call: ToolCall, state: ToolCallState, child: Kin | None = None) -> str:
    """An awaiting call's state, the command that decides it, and its deadline;
    for a child agent's call, the child loop whose end answers it."""
    deadline = f", times out at {_clock(call.wait_deadline)}" if call.wait_deadline else ""
    if child is not None:
        return (f"awaiting child agent loop {child.id} ({child.agent_name}, {child.status}): "
                f"its end answers the call{deadline}")
    how = (f"`flask solidloop approve {call.id}` or `deny {call.id} --reason ...`"
           if call.waits_for == "approval" else f"`flask solidloop complete {call.id} RESULT`")
    return f"{describe_call_state(state)}: {how}{deadline}"


def format_message(
    message: Message, calls: dict[int, ToolCall], *, show_hidden: bool = False,
    states: dict[int, ToolCallState] | None = None,
    children: dict[int, Kin] | None = None,
) -> str:
    flags = []
    if message.status != "completed":
        flags.append(message.status)
    if message.is_hidden:
        flags.append("hidden")
    meta = message.meta or {}
    if meta.get("refusal"):
        flags.append("refusal")
    head = f"[{message.id}] {message.role}" + (f" ({', '.join(flags)})" if flags else "")
    parts = [head]
    if message.content:
        parts.append(_indent(message.content))
    if meta.get("refusal") and meta["refusal"] != message.content:
        # Anthropic: the text that came before the classifier stopped the answer.
        parts.append(f"    refusal: {meta['refusal']}")
    if meta.get("usage_missing"):
        estimate = meta.get("usage_estimate") or {}
        line = "    usage unknown (the server sent no token counts)"
        if estimate:
            line += (f"; estimated ~{estimate.get('input_tokens')} in / "
                     f"~{estimate.get('output_tokens')} out, not billed")
        parts.append(line)
    timing = _timing(message)
    if timing:
        parts.append(timing)
    own_calls = sorted((c for c in calls.values() if c.message_id == message.id),
                       key=lambda c: c.position)
    for call in own_calls:
        line = f"    -> tool call {call.name}({call.arguments_raw or ''})"
        if show_hidden:  # the status view: say where each call stands
            if call.executed_at is not None:
                outcome = "ok" if call.is_success else "error"
                if call.response_message_id is None:
                    outcome += ", answer pending"
            elif states and call.id in states:
                state = states[call.id]
                outcome = (describe_wait(call, state, (children or {}).get(call.id))
                           if state.state.startswith("awaiting_")
                           else describe_call_state(state))
            else:
                outcome = "pending"
            decision = describe_decision(call)
            if decision:
                outcome += f"; {decision}"
            line += f" [{outcome}]"
        parts.append(line)
    if message.role == "tool" and message.tool_call_id in calls:
        call = calls[message.tool_call_id]
        parts[0] += f" <- {call.name}" + (" (error)" if call.is_success is False else "")
    return "\n".join(parts)


def format_lineage(tree: Lineage) -> list[str]:
    """A child agent's tree as ``status`` shows it: its parent and its children."""
    lines = []
    if tree.parent is not None:
        lines.append(f"  parent: loop {tree.parent.id} ({tree.parent.agent_name}), tool call "
                     f"{tree.parent.tool_call_id}, depth {tree.depth}")
    if tree.children:
        lines.append("  children: " + ", ".join(
            f"{kin.id} ({kin.agent_name}, {kin.status})" for kin in tree.children))
    return lines
