"""Plain-text rendering of loops and messages for the CLI and the demo."""

from __future__ import annotations

import textwrap

from .models import Loop, Message, ToolCall


def format_loop(loop: Loop) -> str:
    lines = [
        f"loop {loop.id}  agent={loop.agent_name}  status={loop.status}  steps={loop.step_count}",
        f"  tokens in/out: {loop.input_tokens}/{loop.output_tokens}",
    ]
    if loop.subject_label:
        lines.append(f"  subject: {loop.subject_label}")
    if loop.error_message:
        lines.append(f"  error: {loop.error_message}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return textwrap.indent(text.strip() or "(empty)", "    ")


def format_message(
    message: Message, calls: dict[int, ToolCall], *, show_hidden: bool = False
) -> str:
    flags = []
    if message.status != "completed":
        flags.append(message.status)
    if message.is_hidden:
        flags.append("hidden")
    head = f"[{message.id}] {message.role}" + (f" ({', '.join(flags)})" if flags else "")
    parts = [head]
    if message.content:
        parts.append(_indent(message.content))
    own_calls = sorted((c for c in calls.values() if c.message_id == message.id),
                       key=lambda c: c.position)
    for call in own_calls:
        line = f"    -> tool call {call.name}({call.arguments_raw or ''})"
        if show_hidden:  # the status view: say where each call stands
            line += " [" + (("ok" if call.is_success else "error") if call.executed_at
                            else "pending") + "]"
        parts.append(line)
    if message.role == "tool" and message.tool_call_id in calls:
        call = calls[message.tool_call_id]
        parts[0] += f" <- {call.name}" + (" (error)" if call.is_success is False else "")
    return "\n".join(parts)
