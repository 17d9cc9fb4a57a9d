"""What the wire log keeps of a turn: the parameters of its ``llm_request`` and
``tool_call`` events (loops/sql/ writes them with the turn's own rows).

Bodies past ``SOLIDLOOP_EVENT_BODY_LIMIT`` become an excerpt with their size
and SHA-256 (storable.excerpt); a request keeps its conversation from the
model's last answer on (storable.conversation_tail); and tool declarations
already logged whole for a loop are named by count and digest (see
:class:`LoggedTools`). Secrets are redacted before a record reaches here (the
send path scrubs them from the wire record).

``SOLIDLOOP_WIRE_LOG = "summary"`` reaches here as a body limit of
:data:`SUMMARY` (Config.wire_body_limit): an event then keeps no body at all,
only each body's :func:`summary` (its metadata fields, and each part's size
and SHA-256), and says so (``"detail": "summary"``). The conversation itself
is kept whole on the loop's messages and tool calls either way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from ...llm.client import text_size
from .. import storable

if TYPE_CHECKING:
    from ...llm.client import WireRecord
    from ...mcp.toolset import ToolResult

#: The body limit of ``SOLIDLOOP_WIRE_LOG = "summary"``: no body, a summary.
SUMMARY = 0
#: Top-level text fields a summary keeps as they are: names and ids, never
#: content (every dialect's model, ids, object types and stop reasons).
_SUMMARY_TEXT_FIELDS = frozenset({
    "model", "id", "object", "type", "role", "stop_reason", "finish_reason",
    "modelVersion", "responseId", "system_fingerprint", "service_tier", "jsonrpc",
    "method", "status", "previous_response_id"})
#: Top-level fields a summary keeps whole: token counts.
_SUMMARY_WHOLE_FIELDS = frozenset({"usage", "usageMetadata"})
#: A kept text field longer than this is summarized like content.
_SUMMARY_TEXT_MAX = 200


def digest(value: Any) -> dict[str, Any]:
    """``value``'s size (characters of its strings), SHA-256 (of its compact
    JSON, keys sorted: storable.history_digest, hashed as it is encoded, so a
    history of megabytes is never held again as text) and, for a list, its
    count: what a summary keeps of a body or of one of its parts."""
    try:
        kept: dict[str, Any] = {"size": text_size(value),
                                "sha256": storable.history_digest(value)}
    except RecursionError:  # nested deeper than Python walks: named, not hashed
        return {"unhashable": f"{type(value).__name__} nested too deep"}
    if isinstance(value, list | tuple):
        kept["count"] = len(value)
    return kept


def summary(body: Any) -> Any:
    """A body as ``SOLIDLOOP_WIRE_LOG = "summary"`` keeps it: of an object, its
    numbers, booleans and nulls, its names and ids (model, id, type, stop
    reason: short text fields named in _SUMMARY_TEXT_FIELDS), its token
    counts whole, and every other field (messages, tools, choices, content,
    text, arguments) as its :func:`digest`; any other body as its digest.
    No text the model or a tool wrote survives."""
    if not isinstance(body, dict):
        return None if body is None else digest(body)
    kept: dict[str, Any] = {}
    for key, value in body.items():
        metadata = (value is None or isinstance(value, bool | int | float)
                    or (key in _SUMMARY_WHOLE_FIELDS and isinstance(value, dict))
                    or (key in _SUMMARY_TEXT_FIELDS and isinstance(value, str)
                        and len(value) <= _SUMMARY_TEXT_MAX))
        kept[key] = value if metadata else digest(value)
    return kept


def event_payload(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """A wire-log payload with each large body cut to an excerpt, made
    storable; with ``limit`` :data:`SUMMARY`, every body, argument and result
    as its :func:`summary`, and the payload marked ``"detail": "summary"``."""
    if limit == SUMMARY:
        return _summarized(payload)
    for part in ("request", "response"):
        section = payload.get(part)
        if isinstance(section, dict) and "body" in section:
            section["body"], _ = storable.excerpt(section["body"], limit)
    if "result" in payload:
        payload["result"], _ = storable.excerpt(payload["result"], limit)
    cleaned, _, _ = storable.json_value(payload)
    return cleaned  # type: ignore[no-any-return]


def _summarized(payload: dict[str, Any]) -> dict[str, Any]:
    for part in ("request", "response"):
        section = payload.get(part)
        if isinstance(section, dict) and "body" in section:
            section["body"] = summary(section["body"])
    for part in ("arguments", "result"):
        if part in payload:
            value = payload[part]
            payload[part] = (summary(value) if part == "result" and isinstance(value, dict)
                             else digest(value) if value is not None else None)
    payload["detail"] = "summary"
    cleaned, _, _ = storable.json_value(payload)
    return cleaned  # type: ignore[no-any-return]


def llm_event(wire: WireRecord | None, *, body_limit: int, error: str | None = None,
              repeat_history: bool = False, tools_logged: str | None = None,
              tools: str | None = None, event_id: int | None = None) -> dict[str, Any]:
    """The ``llm_request`` event's parameters (``status_code``, ``duration_ms``,
    ``error``, ``payload``, ``event_id``, ``answer``; loops/sql.llm_event).
    ``event_id``: the row :func:`record_request` wrote before the request was
    sent, which the turn's end completes with ``answer`` (the response, the
    attempts, the error, the timings: what the request part of the payload
    lacks); without one, ``payload`` is the whole event, inserted then (None
    when there is no record: no event). The request body keeps the
    conversation from the model's last answer on unless ``repeat_history``
    (SOLIDLOOP_EVENT_REPEAT_HISTORY). ``tools_logged``: the digest of the tools
    an earlier event of the loop holds whole; the same tools are named, not
    repeated. ``tools``: this request's own digest, when the caller has it
    already."""
    params: dict[str, Any] = {"status_code": None, "duration_ms": None,
                              "error": storable.text(error)[0], "payload": None,
                              "event_id": event_id, "answer": None}
    if wire is None:
        return params
    params.update(status_code=wire.status, duration_ms=wire.duration_ms)
    payload = wire.to_payload()
    if event_id is not None:
        # The request is on the row already: only what the answer adds.
        del payload["url"], payload["request"]
        params["answer"] = Jsonb(event_payload(payload, body_limit))
        return params
    params["payload"] = Jsonb(request_payload(payload, body_limit, repeat_history=repeat_history,
                                              tools_logged=tools_logged, tools=tools))
    return params


def request_payload(payload: dict[str, Any], body_limit: int, *, repeat_history: bool,
                    tools_logged: str | None, tools: str | None) -> dict[str, Any]:
    """A wire record's payload (WireRecord.to_payload) as the log keeps it: its
    request body cut to the conversation from the model's last answer on
    (unless ``repeat_history``) and the tools named when the log holds them
    (``tools_logged``; see :func:`llm_event`), each large body an excerpt; or,
    with ``body_limit`` :data:`SUMMARY`, the request's :func:`summary`."""
    if not repeat_history and body_limit != SUMMARY:
        body = storable.conversation_tail(payload["request"]["body"])
        if tools_logged is not None and (
                tools if tools is not None else storable.tools_digest(body)) == tools_logged:
            body = storable.without_tools(body, tools_logged)
        payload["request"]["body"] = body
    return event_payload(payload, body_limit)


def tool_event(call: Any, stored_result: dict[str, Any], canonical: ToolResult,
               duration_ms: float, body_limit: int) -> dict[str, Any]:
    """The ``tool_call`` event's parameters for ``call`` (a ToolCall or the
    facts its step read) and its stored result."""
    return {
        "duration_ms": duration_ms,
        "error": canonical.text()[:storable.MAX_ERROR_TEXT] if canonical.is_error else None,
        "payload": Jsonb(event_payload({
            "name": call.name, "server": call.server_name, "tool": call.tool_name,
            "arguments": call.arguments if call.arguments is not None else call.arguments_raw,
            "idempotency_key": call.idempotency_key, "result": stored_result,
        }, body_limit))}


class LoggedTools:
    """The digest of the tool declarations this process last committed whole in
    a loop's wire log, per loop (its id and ``created_at``: ids repeat across
    databases, and in one after a reset; bounded: forgetting one only logs its
    tools whole again). Every request sends the agent's tools, often many
    kilobytes of schema; the wire log keeps them once per loop and process,
    and again whenever they change."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._digests: OrderedDict[tuple[int, Any], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, loop: tuple[int, Any]) -> str | None:
        with self._lock:
            return self._digests.get(loop)

    def remember(self, loop: tuple[int, Any], digest: str | None) -> None:
        if digest is None:
            return
        with self._lock:
            self._digests[loop] = digest
            self._digests.move_to_end(loop)
            while len(self._digests) > self.LIMIT:
                self._digests.popitem(last=False)


#: This process's memory of what each loop's wire log holds whole.
logged_tools = LoggedTools()
