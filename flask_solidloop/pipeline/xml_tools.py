"""ToolCallXmlParser: tool calls written in the answer's text become real tool calls.

For models and servers without native tool calling (see docs/guides/providers.md,
"Models without native tool calls"). An agent inserts it just before the
canonical write::

    def configure_llm_middlewares(self, builder):
        builder.insert_before(ResponseParsing, ToolCallXmlParser)

It runs after NetworkCalling, on the assembled answer (streamed or not): the
calls found by :func:`..llm.tool_text.parse_tool_calls` are appended to the
turn's tool calls with stable ids, their text is removed from the visible
answer, and ResponseParsing records them through ``store.NewToolCall`` exactly
like native calls (leases, idempotency key, one canonical result). A malformed
call is recorded too, so the tool phase answers it with the usual correctable
error. This middleware writes nothing itself.

While streaming, NetworkCalling's PartialWriter hides call markup from
observers when this middleware is in the agent's stack (the plan's
``parses_tool_text``, pipeline/plan.py) or tool prompting is on.
"""

from __future__ import annotations

from typing import Any

from ..llm import tool_text
from .builder import Handler
from .context import LlmContext


class ToolCallXmlParser:
    def __init__(self, next_step: Handler) -> None:
        self.next_step = next_step

    def __call__(self, ctx: LlmContext) -> Any:
        response = ctx.response
        if response is not None and response.content:
            names = set(ctx.tools.routes) if ctx.tools is not None else None
            parsed = tool_text.parse_tool_calls(response.content, names)
            if parsed.calls:
                # The ids are drawn from the message the calls were written in: a
                # redelivered turn writes a new shell, a re-read of the same answer
                # the same ids.
                seed = f"{ctx.loop_id}:{ctx.shell_id}"
                offset = len(response.tool_calls)
                requests = tool_text.to_requests(parsed, seed)
                for index, request in enumerate(requests):
                    request.call_id = tool_text.call_id(seed, offset + index)
                response.tool_calls = [*response.tool_calls, *requests]
                response.content = parsed.content
                if response.finish_reason in (None, "stop"):
                    response.finish_reason = "tool_calls"
                response.provider_meta = {**response.provider_meta, "tool_call_text": {
                    "format": parsed.format, "calls": len(parsed.calls),
                    "errors": [call.error for call in parsed.calls if call.error],
                }}
        return self.next_step(ctx)
