"""MCP methods of the server blueprint: parse, run, serialize, with the SDK's own functions.

This module owns what an exposed server *answers* to one JSON-RPC request,
independent of HTTP: the method table (``initialize``, ``ping``,
``tools/list``, ``tools/call``, ``server/discover``, ``subscriptions/listen``,
and on 2026-07-28 the Tasks extension's ``tasks/*`` when agents are exposed
(:mod:`.tasks`); everything else is ``-32601``), the per-version validation of params
(``mcp_types.methods.parse_client_request``: a ``KeyError`` is a method the
version does not have, a ``ValidationError`` is ``-32602``), and the shaping of
results for the negotiated version (``serialize_server_result``; 2026-07-28
results also carry ``resultType``, ``ttlMs``/``cacheScope`` where the method is
cacheable, and the ``serverInfo`` stamp). The HTTP glue (headers, sessions,
status codes) is in :mod:`.http`.

Tool calls run synchronously on the request's thread, inside its app context,
through :meth:`Toolset.call` (the same path a worker uses), so a tool behaves
the same for an agent of ours and for an outside client; only the text of an
exception a tool raised is kept from the outside client unless the blueprint
says ``expose_errors=True`` (it gets an error id the server's log names).
"""

from __future__ import annotations

import contextvars
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types
from mcp_types import SERVER_INFO_META_KEY
from mcp_types import methods as sdk_methods
from mcp_types.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
)
from mcp_types.version import (
    HANDSHAKE_PROTOCOL_VERSIONS,
    LATEST_HANDSHAKE_VERSION,
    MODERN_PROTOCOL_VERSIONS,
)
from pydantic import ValidationError

from .._version import __version__
from ..errors import SolidLoopError
from ..mcp.toolset import CallContext, ToolResult, Toolset
from ..mcp.transport import IDEMPOTENCY_META_KEY
from . import tasks
from .tooltasks import ToolTasks

__all__ = ["McpError", "Served", "ServerSpec", "dispatch", "report_progress"]

logger = logging.getLogger("flask_solidloop.mcp_server")

#: Methods answered; any other is METHOD_NOT_FOUND even when the version knows it
#: (a toolset server offers no resources, prompts, completion or logging).
HANDSHAKE_METHODS = frozenset({"initialize", "ping", "tools/list", "tools/call"})
MODERN_METHODS = frozenset({"server/discover", "tools/list", "tools/call",
                            "subscriptions/listen"})
#: How long a 2026-07-28 client may reuse ``tools/list`` / ``server/discover``
#: results. The tool list of a blueprint is fixed when it is created, but a
#: deployment changes it, so clients are told to ask again after a minute.
CACHE_TTL_MS = 60_000
SUBSCRIPTION_ID_META_KEY = "io.modelcontextprotocol/subscriptionId"


class McpError(SolidLoopError):
    """A JSON-RPC error answer: ``code``, ``message`` and optional ``data``."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_error(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@dataclass
class ServerSpec:
    """What one blueprint exposes: its name, its tools (by advertised name) and
    the instructions it gives clients."""

    name: str
    tools: dict[str, tuple[Toolset, str]]
    instructions: str | None = None
    #: Who owns the tasks of the Tasks extension (None: the extension is not offered).
    tasks: tasks.TaskBackend | None = None
    #: Send a raising tool's exception text to outside callers (False: a generic
    #: message with an error id, the text in the server's log).
    expose_errors: bool = False
    #: The task-supporting tools' tasks (None: no tool declares ``task=``).
    tool_tasks: ToolTasks | None = None

    def list_tools(self) -> list[dict[str, Any]]:
        listed = []
        for advertised, (toolset, tool_name) in self.tools.items():
            tool = toolset.get(tool_name).to_mcp()
            tool["name"] = advertised
            listed.append(tool)
        return listed

    def input_schema(self, name: str) -> dict[str, Any] | None:
        entry = self.tools.get(name)
        return entry[0].get(entry[1]).input_schema if entry is not None else None

    def server_info(self) -> dict[str, Any]:
        return {"name": self.name, "version": __version__}


@dataclass
class Served:
    """The outcome of one request: a result (or an error) and the notifications
    to send before it (progress, a subscription acknowledgement). ``stream``
    asks the HTTP layer for an SSE response even with no notifications (a
    ``subscriptions/listen`` answer is always a stream)."""

    result: dict[str, Any] | None = None
    error: McpError | None = None
    notifications: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    tool: str | None = None
    tool_error: bool = False
    #: The result is already in its wire shape (a task): stamped, not re-serialized.
    shaped: bool = False


# --------------------------------------------------------------------------- progress

_progress: contextvars.ContextVar[Callable[[float, float | None, str | None], None] | None] = (
    contextvars.ContextVar("solidloop_mcp_progress", default=None))


def report_progress(progress: float, total: float | None = None,
                    message: str | None = None) -> None:
    """Report progress from inside a tool: a ``notifications/progress`` to an
    outside MCP client that asked for it (a ``progressToken``); a no-op
    anywhere else (inside a loop, or for a client that did not ask)."""
    sink = _progress.get()
    if sink is not None:
        sink(progress, total, message)


@contextmanager
def _collect_progress(token: Any, into: list[dict[str, Any]]) -> Iterator[None]:
    if token is None or isinstance(token, bool) or not isinstance(token, str | int):
        yield
        return

    def sink(progress: float, total: float | None, message: str | None) -> None:
        params: dict[str, Any] = {"progressToken": token, "progress": progress}
        if total is not None:
            params["total"] = total
        if message is not None:
            params["message"] = message
        into.append({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})

    reset = _progress.set(sink)
    try:
        yield
    finally:
        _progress.reset(reset)


# --------------------------------------------------------------------------- dispatch


def negotiate(requested: Any) -> str:
    """The handshake version to answer an ``initialize`` with: the client's when
    we speak it, else our latest (the client then decides whether to go on)."""
    return requested if requested in HANDSHAKE_PROTOCOL_VERSIONS else LATEST_HANDSHAKE_VERSION


def dispatch(spec: ServerSpec, method: str, params: Mapping[str, Any] | None, *,
             version: str, request_id: Any, principal: Any, session: Any = None) -> Served:
    """Answer one request at ``version`` (the session's, or the envelope's).
    ``session``: the database session a called tool writes through
    (``ctx.session``); what the tool leaves there is committed once it
    returned, before the response."""
    modern = version in MODERN_PROTOCOL_VERSIONS
    served_methods = MODERN_METHODS if modern else HANDSHAKE_METHODS
    if modern and method in tasks.TASK_METHODS and spec.tasks is not None:
        # The SDK's method table has no extension methods: checked in .tasks.
        try:
            answered = tasks.answer(spec.tasks, method, params or {}, principal)
        except tasks.TasksError as exc:
            return Served(error=McpError(exc.code, exc.message, exc.data))
        return Served(result=_stamp(spec, answered))
    try:
        sdk_methods.parse_client_request(method, version, params)
    except KeyError:
        return Served(error=McpError(METHOD_NOT_FOUND, "Method not found", method))
    except ValidationError as exc:
        return Served(error=McpError(INVALID_PARAMS, "Invalid request parameters",
                                     _validation_summary(exc)))
    if method not in served_methods:
        return Served(error=McpError(METHOD_NOT_FOUND, "Method not found", method))
    params = dict(params or {})
    try:
        if method == "initialize":
            served = Served(result=_initialize(spec, params))
        elif method == "ping":
            served = Served(result={})
        elif method == "tools/list":
            served = Served(result={"tools": spec.list_tools()})
        elif method == "server/discover":
            served = Served(result=types.DiscoverResult(
                supported_versions=list(MODERN_PROTOCOL_VERSIONS),
                capabilities=_capabilities(spec), instructions=spec.instructions,
            ).model_dump(by_alias=True, mode="json", exclude_none=True))
        elif method == "subscriptions/listen":
            served = _listen(params, request_id)
        else:
            served = _call_tool(spec, params, principal, session,
                                tasks_declared=modern and tasks.declared(params))
    except McpError as exc:
        return Served(error=exc)
    if served.result is not None:
        served.result = (_stamp(spec, served.result) if served.shaped
                         else _serialize(spec, method, version, served.result))
    return served


def _validation_summary(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False)[:5]:
        location = ".".join(str(p) for p in error.get("loc", ())) or "params"
        parts.append(f"{location}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def _capabilities(spec: ServerSpec | None = None) -> types.ServerCapabilities:
    capabilities = types.ServerCapabilities(tools=types.ToolsCapability(list_changed=False))
    if spec is not None and spec.tasks is not None:
        capabilities.extensions = {tasks.EXTENSION_ID: {}}
    return capabilities


def _initialize(spec: ServerSpec, params: dict[str, Any]) -> dict[str, Any]:
    result = types.InitializeResult(
        protocol_version=negotiate(params.get("protocolVersion")),
        capabilities=_capabilities(),
        server_info=types.Implementation(**spec.server_info()),
        instructions=spec.instructions,
    )
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def _listen(params: dict[str, Any], request_id: Any) -> Served:
    """Acknowledge a subscription and end it at once: the tool list of a
    blueprint never changes while it runs, so there is nothing to deliver, and
    a held stream would pin a WSGI worker thread (research.md). The client
    reads the graceful end (the result) and may listen again later."""
    meta = {SUBSCRIPTION_ID_META_KEY: request_id}
    ack = types.SubscriptionsAcknowledgedNotification(
        params=types.SubscriptionsAcknowledgedNotificationParams(
            notifications=types.SubscriptionFilter(), _meta=meta))
    return Served(
        result={"_meta": meta},
        notifications=[{"jsonrpc": "2.0", **ack.model_dump(by_alias=True, mode="json",
                                                          exclude_none=True)}],
        stream=True,
    )


def _call_tool(spec: ServerSpec, params: dict[str, Any], principal: Any,
               session: Any = None, *, tasks_declared: bool = False) -> Served:
    name = params.get("name")
    entry = spec.tools.get(name) if isinstance(name, str) else None
    if entry is None:
        available = ", ".join(spec.tools) or "none"
        raise McpError(INVALID_PARAMS, f"Unknown tool: {name!r}; available tools: {available}")
    toolset, tool_name = entry
    name = str(name)
    support = spec.tool_tasks.task_support(name) if spec.tool_tasks is not None else None
    if support is not None and spec.tool_tasks is not None:
        if tasks_declared and session is not None:
            # Run on the workers: the task is durable once the job is committed.
            started = spec.tool_tasks.start(name, params.get("arguments"), principal, session)
            return Served(result=tasks.created(started), tool=name, shaped=True)
        if support == "required":
            raise McpError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"tool {name!r} runs only as a task: declare the {tasks.EXTENSION_ID} "
                f"extension in _meta[{types.CLIENT_CAPABILITIES_META_KEY!r}].extensions "
                "(on the 2026-07-28 protocol)",
                {"requiredCapabilities": {"extensions": {tasks.EXTENSION_ID: {}}}})
    raw_meta = params.get("_meta")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    key = meta.get(IDEMPOTENCY_META_KEY)
    ctx = CallContext(principal=principal, idempotency_key=key if isinstance(key, str) else None,
                      session=session)
    notifications: list[dict[str, Any]] = []
    with _collect_progress(meta.get("progressToken"), notifications):
        result = toolset.call(tool_name, params.get("arguments"), ctx)
    if session is not None:
        # What the tool wrote through ctx.session (a tool that raised had its
        # writes rolled back by the toolset) lands before the caller hears of it.
        session.commit()
    if tasks_declared and spec.tasks is not None and spec.tasks.supports(str(name)):
        view = spec.tasks.created(str(name), result, principal)
        if view is not None:
            return Served(result=tasks.created(view), notifications=notifications, tool=name,
                          shaped=True)
    if result.input_requests:
        # Input requests reach a client only through a task's input_required.
        result = ToolResult.error(f"tool {name!r} asks the client for input, which it can "
                                  f"only do as a task: call it with the {tasks.EXTENSION_ID} "
                                  "extension declared (2026-07-28)")
    if result.raised and not spec.expose_errors:
        error_id = secrets.token_hex(6)
        logger.error("MCP server %r: tool %r raised for an outside caller (error id %s): %s",
                     spec.name, name, error_id, result.text())
        result = ToolResult.error(f"the tool failed (error id {error_id}); the server's log "
                                  "has the details")
    return Served(result=result.to_mcp(), notifications=notifications, tool=name,
                  tool_error=result.is_error)


def _serialize(spec: ServerSpec, method: str, version: str,
               result: dict[str, Any]) -> dict[str, Any]:
    modern = version in MODERN_PROTOCOL_VERSIONS
    if modern:
        # Required on the 2026-07-28 wire (every result says whether it is complete).
        result = {"resultType": "complete", **result}
        if method in sdk_methods.CACHEABLE_METHODS:
            result = {"ttlMs": CACHE_TTL_MS, "cacheScope": "private", **result}
    try:
        dumped = sdk_methods.serialize_server_result(method, version, result)
    except ValidationError:
        if method != "tools/call":
            logger.exception("the MCP server blueprint built an invalid %s result", method)
            raise McpError(INTERNAL_ERROR, "Internal error: invalid result") from None
        # A handler returned content blocks MCP cannot carry: the caller gets a
        # tool error it can read, the operator the details in the log.
        logger.warning("tool result is not a valid MCP CallToolResult", exc_info=True)
        fallback = ToolResult.error(
            "the tool returned a result MCP cannot carry (invalid content blocks)").to_mcp()
        if modern:
            fallback["resultType"] = "complete"
        dumped = sdk_methods.serialize_server_result(method, version, fallback)
    return _stamp(spec, dumped) if modern else dumped


def _stamp(spec: ServerSpec, result: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 result's ``resultType`` (complete unless set) and the
    ``serverInfo`` stamp in its ``_meta``."""
    result.setdefault("resultType", "complete")
    meta = result.get("_meta")
    stamp = spec.server_info()
    if meta is None:
        result["_meta"] = {SERVER_INFO_META_KEY: stamp}
    elif isinstance(meta, dict) and meta.get(SERVER_INFO_META_KEY) is None:
        result["_meta"] = {**meta, SERVER_INFO_META_KEY: stamp}
    return result
