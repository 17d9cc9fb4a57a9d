"""In-process MCP toolsets: plain Python functions exposed as MCP tools.

This module owns :class:`Toolset` (a named group of tools), the tool declaration
rules (names, input schemas derived from type hints and docstrings), argument
validation, and the conversion of whatever a handler returns into an MCP
``CallToolResult`` (:class:`ToolResult`). It also defines :class:`CallContext`,
the object a tool receives to learn who is calling it.

A toolset is called on the caller's thread with no network hop::

    search = Toolset("search")

    @search.tool
    def query(text: str, limit: int = 10, ctx: CallContext | None = None) -> list[str]:
        '''Search the catalogue.

        Args:
            text: What to look for.
            limit: Maximum number of hits.
        '''
        ...

    search.add_tool(catalogue.find, name="find")  # the same, without a decorator
    search.list_tools()                     # MCP tool dicts, declaration order
    search.call("query", {"text": "tea"})   # -> ToolResult, never raises for tool faults

Declaration rules
-----------------
* :meth:`Toolset.add_tool` is the one way a tool enters a toolset; the
  ``@tool`` decorator is a thin wrapper over it that returns the function.
* Tool names match ``^[A-Za-z0-9._-]{1,128}$`` and are unique within a toolset;
  breaking either raises :class:`~flask_solidloop.errors.ToolDefinitionError`
  when the tool is added, as does anything else that cannot become a tool
  (the message says what was wrong and what to write instead).
* The input schema is built with pydantic from the signature's type hints. A
  parameter without a hint is ``Any``; a parameter with a default is optional;
  ``*args`` / ``**kwargs`` and positional-only parameters are refused. A
  Google-style ``Args:`` docstring section supplies per-property descriptions,
  the docstring's first paragraph the tool description (unless
  ``description=`` is given).
* The *context parameter* - annotated :class:`CallContext` (or
  ``CallContext | None``), or named ``ctx`` without annotation - receives the
  :class:`CallContext` and never appears in the schema.
* ``input_schema=`` replaces the derived schema verbatim. Arguments are then
  passed to the handler as keyword arguments unvalidated, except that the
  schema's ``required`` keys must be present. Only in this mode may the
  handler take ``**kwargs``.

Calling rules
-------------
:meth:`Toolset.call` reports every tool-level problem as an error
:class:`ToolResult` the model can read and correct: unknown tool (listing the
available ones), arguments that are not an object, validation failures (naming
each field and what was expected), and exceptions raised by the handler
(``"<ExceptionClass>: <message>"``, logged at WARNING with the traceback on the
``flask_solidloop.tools`` logger). The one exception that propagates is
:class:`~flask_solidloop.errors.LostLeaseError`: it means the worker must stop
writing, which a tool result cannot express.

``async def`` handlers are supported. Each call gets a **fresh event loop**
(:func:`flask_solidloop.mcp.bridge.run_isolated`): on the calling thread, or,
if that thread already runs an event loop, on a one-shot loop thread while the
caller blocks. Async tools therefore must not rely on loop-bound state
(clients, locks) created outside the call. They never run on the process's
shared MCP loop, so a tool that blocks cannot stall the MCP transports.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from flask_solidloop.errors import (
    DecisionConflictError,
    InvalidArgumentError,
    LostLeaseError,
    ToolDefinitionError,
    UnknownToolError,
)

from . import bridge

__all__ = ["CallContext", "ToolDefinition", "ToolResult", "Toolset"]

logger = logging.getLogger("flask_solidloop.tools")

F = typing.TypeVar("F", bound=Callable[..., Any])

TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_NAME_RULE = "names must match ^[A-Za-z0-9._-]{1,128}$"
#: A tool's MCP task support (``execution.taskSupport``; None: calls answer at once).
TASK_SUPPORT = (None, "optional", "required")

_ARGS_HEADERS = {"args", "arguments", "parameters", "params"}
_SECTION_HEADERS = _ARGS_HEADERS | {
    "returns",
    "return",
    "yields",
    "raises",
    "examples",
    "example",
    "notes",
    "note",
    "attributes",
    "see also",
    "warning",
    "warnings",
}
_SECTION_RE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*):\s*$")
_ARG_LINE_RE = re.compile(r"^\*{0,2}([A-Za-z_][A-Za-z0-9_]*)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_MAX_REPR = 120


# --------------------------------------------------------------------------- data


@dataclass
class CallContext:
    """What a tool learns about the call it is serving.

    Inside a loop, ``agent`` and ``loop`` are set and ``principal`` is what the
    agent's ``mcp_principal()`` names (by default the label of the outside MCP
    client that started the loop through a server blueprint, else None). For an external MCP
    caller, ``principal`` identifies the caller and the other two are None.
    ``idempotency_key`` (``"solidloop:tool_call:<id>"``) is stable across
    retries of the same tool call; pass it to side-effecting APIs. An approval
    policy sees the call before it has a row: ``server_name`` and
    ``tool_name`` then say which server's tool it is (the model calls it by its
    advertised name), and ``idempotency_key`` is None.

    ``session`` is the database session an in-process tool writes through (it
    is also what ``db.session`` gives on the tool's thread): what the tool
    writes there and does not commit commits with the call's result, in one
    transaction, exactly once (docs/guides/tools.md). If the tool raises, its
    writes are rolled back. None for remote and stdio servers' tools.
    """

    agent: Any = None
    loop: Any = None
    principal: Any = None
    idempotency_key: str | None = None
    server_name: str | None = None
    tool_name: str | None = None
    session: Any = None
    #: A tool run as an MCP task that asked the client for input
    #: (:meth:`ToolResult.input_required`) runs again with the client's answers
    #: here, keyed as it keyed its requests; None on the first run and elsewhere.
    input_responses: dict[str, Any] | None = None


@dataclass
class ToolResult:
    """The outcome of one tool call, shaped like MCP ``CallToolResult``."""

    content: list[dict]
    structured_content: dict | None = None
    is_error: bool = False
    #: Set when the failure was the infrastructure's, not the tool's
    #: (``infra:<kind>``); stored on the tool call, never sent to the model.
    error_kind: str | None = None
    #: The handler raised (not InvalidArgumentError or DecisionConflictError,
    #: which are written for the caller) and the text is the
    #: exception's: an MCP server blueprint hides it from outside callers
    #: unless ``expose_errors=True``. Never sent to the model as such.
    raised: bool = False
    #: The tool asks the client for input before it can answer (a tool run as an
    #: MCP task): request key -> request (``{"method", "params"}``).
    input_requests: dict[str, dict[str, Any]] | None = None

    @classmethod
    def input_required(cls, requests: dict[str, dict[str, Any]]) -> ToolResult:
        """Ask the MCP client for input (a tool run as an MCP task only): the task
        reads ``input_required`` with these requests (key -> ``{"method":
        "elicitation/create", "params": {...}}``), and once the client answered
        them all the tool runs again with the answers in ``ctx.input_responses``."""
        if not isinstance(requests, dict) or not requests or not all(
                isinstance(key, str) and isinstance(request, dict)
                and isinstance(request.get("method"), str)
                for key, request in requests.items()):
            raise InvalidArgumentError(
                "ToolResult.input_required needs a non-empty dict of key -> "
                "{'method': 'elicitation/create', 'params': {...}}")
        # Anywhere but a task (a loop's call, a direct call) this is an error.
        return cls(content=[{"type": "text", "text": "the tool asks the MCP client for input, "
                             "which it can do only when it runs as an MCP task"}],
                   is_error=True, input_requests=dict(requests))

    def text(self) -> str:
        """All text blocks joined with a newline (other block types are skipped)."""
        return "\n".join(
            str(block.get("text", ""))
            for block in self.content
            if isinstance(block, dict) and block.get("type") == "text"
        )

    def to_mcp(self) -> dict:
        """MCP ``CallToolResult`` JSON; ``structuredContent`` only when set."""
        data: dict[str, Any] = {"content": [dict(block) for block in self.content]}
        if self.structured_content is not None:
            data["structuredContent"] = self.structured_content
        data["isError"] = bool(self.is_error)
        return data

    @property
    def outcome(self) -> str:
        """``ok``, ``error``, or the error's kind (``timeout``, ...): the metrics' label."""
        return (self.error_kind or "error") if self.is_error else "ok"

    @classmethod
    def error(cls, message: str) -> ToolResult:
        """An error result holding ``message`` as its only text block."""
        return cls(content=[{"type": "text", "text": message}], is_error=True)

    @classmethod
    def from_mcp(cls, data: dict) -> ToolResult:
        """Build a result from MCP ``CallToolResult`` JSON (the inverse of :meth:`to_mcp`)."""
        if not isinstance(data, dict):
            raise InvalidArgumentError(
                f"an MCP CallToolResult must be a JSON object, got {type(data).__name__}"
            )
        content = data.get("content") or []
        if not isinstance(content, list):
            raise InvalidArgumentError("an MCP CallToolResult's 'content' must be a list of blocks")
        structured = data.get("structuredContent")
        return cls(
            content=[dict(block) for block in content],
            structured_content=structured if isinstance(structured, dict) else None,
            is_error=bool(data.get("isError", False)),
        )


#: What a call does when its approval times out.
ON_TIMEOUT = ("deny", "approve")


@dataclass(frozen=True)
class WaitRule:
    """How a tool's calls wait inside a loop (docs/guides/approvals.md).

    ``requires_approval``: each call waits for a person's decision before it
    runs; a callable ``(arguments, ctx) -> bool`` decides per call (a policy
    such as "refunds over 50 EUR"). ``deferred``: the loop never runs the
    tool; each call waits for the host to supply its result. A timeout is in
    seconds; ``on_timeout`` is what an approval's timeout decides.
    """

    requires_approval: bool | Callable[[dict[str, Any], CallContext], bool] = False
    deferred: bool = False
    approval_timeout: float | None = None
    on_timeout: str = "deny"
    result_timeout: float | None = None
    #: A child agent (an Agent class or a registered agent's name): each call
    #: starts a loop of it, whose end is the call's result (:meth:`Toolset.agent_tool`).
    agent: Any = None

    @property
    def waits(self) -> bool:
        """Whether calls of this tool may wait at all."""
        return bool(self.requires_approval) or self.deferred


#: A tool whose calls run at once.
NO_WAIT = WaitRule()


@dataclass
class ToolDefinition:
    """One declared tool: what is advertised and how to call it."""

    name: str
    description: str
    input_schema: dict
    handler: Callable
    context_param: str | None
    #: pydantic model validating the arguments; None when ``input_schema=`` was explicit.
    arguments_model: type[BaseModel] | None = field(default=None, repr=False)
    #: model field name -> handler parameter name (derived schemas only).
    param_names: dict[str, str] = field(default_factory=dict, repr=False)
    #: model fields always passed to the handler (their Python default is a FieldInfo).
    always_pass: frozenset[str] = field(default_factory=frozenset, repr=False)
    #: How its calls wait inside a loop (approvals, deferred results).
    wait: WaitRule = NO_WAIT
    #: Seconds a call may run inside a loop before it is answered with a timeout
    #: error; None: the server entry's ``timeout``, else SOLIDLOOP_DEFAULT_TOOL_TIMEOUT.
    timeout: float | None = None
    #: Its key in SOLIDLOOP_RATE_LIMITS is ``"tool:<rate_limit>"`` (None: unlimited).
    rate_limit: str | None = None

    #: The JSON Schema of its result, when its return annotation is a pydantic
    #: model: advertised as ``outputSchema``, its results carry ``structuredContent``.
    output_schema: dict | None = None
    #: Its MCP task support: None (calls answer at once), ``"optional"`` or
    #: ``"required"`` (an MCP server blueprint runs task-augmented calls on the workers).
    task: str | None = None

    def to_mcp(self) -> dict:
        """The MCP ``Tool`` JSON: ``name``, ``description``, ``inputSchema``, and
        ``outputSchema`` for a tool that returns a pydantic model."""
        data = {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }
        if self.output_schema is not None:
            data["outputSchema"] = self.output_schema
        return data


# --------------------------------------------------------------------------- toolset


class Toolset:
    """A named group of in-process MCP tools."""

    def __init__(self, name: str, *, description: str | None = None) -> None:
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
            raise ToolDefinitionError(f"toolset name {name!r} is invalid: {_NAME_RULE}")
        self.name = name
        self.description = description
        self._tools: dict[str, ToolDefinition] = {}

    def __repr__(self) -> str:
        return f"<Toolset {self.name!r} tools={list(self._tools)}>"

    # -- declaration ------------------------------------------------------------

    def add_tool(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        requires_approval: bool | Callable[[dict[str, Any], CallContext], bool] = False,
        deferred: bool = False,
        approval_timeout: float | None = None,
        on_timeout: str = "deny",
        result_timeout: float | None = None,
        timeout: float | None = None,
        rate_limit: str | None = None,
        task: str | None = None,
    ) -> ToolDefinition:
        """Add ``fn`` to this toolset as a tool; return the definition it stores.

        The one way a tool enters a toolset: :meth:`tool` calls it, and so will
        anything that builds toolsets at run time (the MCP server blueprint).
        ``name`` defaults to ``fn.__name__``, ``description`` to the first
        paragraph of the docstring, and ``input_schema`` to a schema derived from
        the type hints (see the module docs). ``fn`` is stored as it is, not
        wrapped, and stays callable as plain Python.

        Inside a loop, a call of a tool with ``requires_approval`` (True, or a
        callable ``(arguments, ctx) -> bool``) waits for a decision before it
        runs, at most ``approval_timeout`` seconds (then ``on_timeout``:
        ``"deny"`` or ``"approve"``); a ``deferred`` tool is never run by the
        loop: each call waits, at most ``result_timeout`` seconds, for the
        host's ``complete_call`` (its function is the declaration: its
        signature is the schema). See docs/guides/approvals.md. ``timeout``
        bounds a call's run inside a loop, in seconds (default: the server
        entry's ``timeout``, else SOLIDLOOP_DEFAULT_TOOL_TIMEOUT); past it the
        model gets a timeout error and the tool is abandoned (docs/guides/tools.md).
        ``rate_limit`` names the tool's key in SOLIDLOOP_RATE_LIMITS
        (``"tool:<rate_limit>"``): a call that finds no capacity is deferred,
        its job due when there is (docs/guides/limits.md).
        ``task`` (``"optional"`` or ``"required"``) is the tool's MCP task
        support: an MCP server blueprint runs a call of it as an MCP task on the
        workers when the caller speaks the Tasks extension (``"required"``:
        refuses callers that do not); see docs/guides/mcp_server.md, "Tasks".

        Raises :class:`ToolDefinitionError`, saying what was wrong and what to do,
        and adds nothing, when ``fn`` is not callable (a string, a
        ``classmethod`` object, a coroutine or other result of calling the
        function), the name is missing, invalid or already taken, the
        description is not a string, the signature cannot become a schema, or
        ``input_schema`` is not an object schema.
        """
        where = f"toolset {self.name!r}"
        _check_handler(where, fn)
        if name is not None and not isinstance(name, str):
            raise ToolDefinitionError(
                f"{where}: name= must be a string, got {type(name).__name__} {_short_repr(name)}"
            )
        tool_name = name if name is not None else getattr(fn, "__name__", None)
        if tool_name is None:
            raise ToolDefinitionError(
                f"{where}: {_short_repr(fn)} has no __name__ to name the tool after; "
                "pass name='...'"
            )
        if not isinstance(tool_name, str) or not TOOL_NAME_PATTERN.match(tool_name):
            hint = "; a lambda has no name of its own: pass name='...'" if (
                name is None and tool_name == "<lambda>") else ""
            raise ToolDefinitionError(
                f"{where}: tool name {tool_name!r} is invalid: {_NAME_RULE}{hint}"
            )
        if tool_name in self._tools:
            taken_by = _describe_callable(self._tools[tool_name].handler)
            raise ToolDefinitionError(
                f"{where}: tool name {tool_name!r} is already declared (by {taken_by}); "
                "tool names must be unique within a toolset: pass name= to declare this "
                "one under another name, or put it in another Toolset"
            )
        if description is not None and not isinstance(description, str):
            raise ToolDefinitionError(
                f"{where}, tool {tool_name!r}: description= must be a string, got "
                f"{type(description).__name__} {_short_repr(description)}"
            )
        wait = _wait_rule(f"{where}, tool {tool_name!r}", requires_approval, deferred,
                          approval_timeout, on_timeout, result_timeout)
        caller_locals = _caller_locals()
        definition = _build_definition(
            self.name, tool_name, fn, description, input_schema, caller_locals
        )
        definition.output_schema = _output_schema(fn, caller_locals)
        definition.wait = wait
        definition.timeout = _timeout(f"{where}, tool {tool_name!r}", "timeout", timeout)
        if rate_limit is not None and (not isinstance(rate_limit, str)
                                       or not rate_limit.strip()):
            raise ToolDefinitionError(
                f"{where}, tool {tool_name!r}: rate_limit= must be a non-empty string naming "
                f"its key in SOLIDLOOP_RATE_LIMITS (as 'tool:<name>'), got {rate_limit!r}")
        definition.rate_limit = rate_limit
        if task not in TASK_SUPPORT:
            raise ToolDefinitionError(
                f"{where}, tool {tool_name!r}: task= must be None (calls answer at once), "
                f"'optional' or 'required' (an MCP server blueprint runs its calls as MCP "
                f"tasks on the workers), got {task!r}")
        definition.task = task
        self._tools[tool_name] = definition
        return definition

    @typing.overload
    def tool(
        self,
        fn: F,
        *,
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        requires_approval: bool | Callable[[dict[str, Any], CallContext], bool] = False,
        deferred: bool = False,
        approval_timeout: float | None = None,
        on_timeout: str = "deny",
        result_timeout: float | None = None,
        timeout: float | None = None,
        rate_limit: str | None = None,
        task: str | None = None,
    ) -> F: ...

    @typing.overload
    def tool(
        self,
        fn: None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        requires_approval: bool | Callable[[dict[str, Any], CallContext], bool] = False,
        deferred: bool = False,
        approval_timeout: float | None = None,
        on_timeout: str = "deny",
        result_timeout: float | None = None,
        timeout: float | None = None,
        rate_limit: str | None = None,
        task: str | None = None,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        requires_approval: bool | Callable[[dict[str, Any], CallContext], bool] = False,
        deferred: bool = False,
        approval_timeout: float | None = None,
        on_timeout: str = "deny",
        result_timeout: float | None = None,
        timeout: float | None = None,
        rate_limit: str | None = None,
        task: str | None = None,
    ) -> F | Callable[[F], F]:
        """Declare a tool with a decorator: ``@ts.tool`` or ``@ts.tool(name=..., ...)``.

        A thin wrapper over :meth:`add_tool` (same options, same errors) that
        returns the function unchanged, so it stays callable as plain Python.
        ``ts.tool(fn, name=...)`` works too.
        """
        if not isinstance(self, Toolset):  # @Toolset.tool: the class, not a toolset
            raise ToolDefinitionError(
                "Toolset.tool was used on the class, not on a toolset: create one first "
                "(search = Toolset('search')) and decorate with @search.tool"
            )
        if isinstance(fn, str):  # @ts.tool("lookup")
            raise ToolDefinitionError(
                f"toolset {self.name!r}: @tool({fn!r}) passes the name where the function "
                f"goes; give it by keyword: @tool(name={fn!r})"
            )
        options: dict[str, Any] = dict(
            name=name, description=description, input_schema=input_schema,
            requires_approval=requires_approval, deferred=deferred,
            approval_timeout=approval_timeout, on_timeout=on_timeout,
            result_timeout=result_timeout, timeout=timeout, rate_limit=rate_limit, task=task)
        if fn is not None:
            self.add_tool(fn, **options)
            return fn

        def decorator(func: F) -> F:
            self.add_tool(func, **options)
            return func

        return decorator

    def agent_tool(self, agent: Any, *, name: str | None = None,
                   description: str | None = None,
                   result_timeout: float | None = None) -> Callable[[F], F]:
        """Declare a child agent's tool with a decorator: each call starts a loop
        of ``agent`` (an Agent class registered with ``@solidloop.agent``, or a
        registered agent's name) with the call's ``message``, and the child's
        end is the call's result (docs/guides/conversations.md). What an
        ``mcps`` entry ``{"name": ..., "agent": ...}`` offers, in a toolset.

        The decorated function is the declaration, as for a ``deferred`` tool:
        its name is the tool's, its docstring the description (else the
        agent's), its signature the schema, which must take ``message: str``.
        The loop never runs it. ``result_timeout``: seconds after which the
        call gets an error result (the child runs on; its end is then dropped).
        """
        where = f"toolset {self.name!r}"
        agent_name = agent if isinstance(agent, str) else getattr(agent, "agent_name", None) \
            if isinstance(agent, type) else None
        if not (isinstance(agent, str) and agent.strip()) and not (
                isinstance(agent, type) and hasattr(agent, "agent_name")):
            raise ToolDefinitionError(
                f"{where}: agent_tool() takes an Agent class or a registered agent's name, "
                f"got {_short_repr(agent)}")

        def decorator(func: F) -> F:
            text = description
            if text is None and not inspect.getdoc(func) and not isinstance(agent, str):
                text = inspect.getdoc(agent) or None
            definition = self.add_tool(func, name=name, description=text, deferred=True,
                                       result_timeout=result_timeout)
            properties = definition.input_schema.get("properties") or {}
            if (properties.get("message") or {}).get("type") != "string":
                del self._tools[definition.name]
                raise ToolDefinitionError(
                    f"{where}, tool {definition.name!r}: an agent tool takes the child's "
                    f"first message: declare a parameter message: str (agent "
                    f"{agent_name or agent!r})")
            definition.wait = dataclasses.replace(definition.wait, agent=agent)
            return func

        return decorator

    # -- lookup -------------------------------------------------------------------

    def list_tools(self) -> list[dict]:
        """MCP tool dicts (``name``, ``description``, ``inputSchema``) in declaration order."""
        return [definition.to_mcp() for definition in self._tools.values()]

    def definitions(self) -> list[ToolDefinition]:
        """Every tool's definition, in declaration order."""
        return list(self._tools.values())

    def get(self, name: str) -> ToolDefinition:
        """The definition of tool ``name``; raises :class:`UnknownToolError` (a
        ``KeyError``) naming the available tools."""
        try:
            return self._tools[name]
        except (KeyError, TypeError):
            raise UnknownToolError(self._unknown_message(name)) from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._tools

    def __iter__(self) -> Iterator[ToolDefinition]:
        return iter(list(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def _unknown_message(self, name: object) -> str:
        available = ", ".join(self._tools) or "none"
        return f"unknown tool {name!r} in toolset {self.name!r}; available tools: {available}"

    # -- calling ------------------------------------------------------------------

    def call(self, name: str, arguments: dict | None, ctx: CallContext | None = None) -> ToolResult:
        """Run tool ``name`` on this thread and return its result.

        Tool-level failures (unknown tool, bad arguments, handler exceptions)
        come back as ``ToolResult(is_error=True)``; only
        :class:`~flask_solidloop.errors.LostLeaseError` propagates. With a
        ``ctx.session``, what the tool wrote there is flushed once it returns
        (a write the database refuses is the tool's error), and rolled back
        when it raised.
        """
        if not isinstance(name, str) or name not in self._tools:
            return ToolResult.error(self._unknown_message(name))
        definition = self._tools[name]
        if ctx is None:
            ctx = CallContext()
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return ToolResult.error(
                f"invalid arguments for tool {name!r}: arguments must be a JSON object, "
                f"got {_json_type_name(arguments)}"
            )

        try:
            kwargs = _bind_arguments(definition, arguments)
        except _ArgumentError as exc:
            return ToolResult.error(f"invalid arguments for tool {name!r}: {exc}")

        if definition.context_param is not None:
            kwargs[definition.context_param] = ctx

        try:
            value = definition.handler(**kwargs)
            if inspect.isawaitable(value):
                value = _run_awaitable(value)
            if ctx.session is not None:
                ctx.session.flush()
        except LostLeaseError:
            _undo(ctx)
            raise
        except Exception as exc:
            _undo(ctx)
            logger.warning(
                "tool %r in toolset %r raised %s",
                name,
                self.name,
                type(exc).__name__,
                exc_info=True,
            )
            message = str(exc)
            label = type(exc).__name__
            failed = ToolResult.error(f"{label}: {message}" if message else label)
            # These are written for the caller (what to fix, who decided first).
            failed.raised = not isinstance(exc, InvalidArgumentError | DecisionConflictError)
            return failed

        try:
            return _to_result(value)
        except Exception as exc:  # a result we could not convert is the tool's fault
            _undo(ctx)
            logger.warning(
                "tool %r in toolset %r returned an unconvertible %s",
                name,
                self.name,
                type(value).__name__,
                exc_info=True,
            )
            unconvertible = ToolResult.error(f"{type(exc).__name__}: {exc}")
            unconvertible.raised = True
            return unconvertible


def _undo(ctx: CallContext) -> None:
    """Roll back what a tool that failed wrote through ``ctx.session``: a tool
    error is a transaction that raised."""
    if ctx.session is not None:
        try:
            ctx.session.rollback()
        except Exception:
            logger.exception("rolling back the writes of a tool that failed raised")


# --------------------------------------------------------------------------- definition


def _caller_locals() -> dict[str, Any]:
    """Locals of the first frame outside this module: the code that declared the tool.

    Used only as a fallback namespace to resolve string annotations
    (``from __future__ import annotations``) of tools declared inside a function.
    Walking out of the module, rather than a fixed number of frames, finds the
    same frame whether the tool came through ``@tool``, ``@tool(...)`` or
    :meth:`Toolset.add_tool`.
    """
    try:
        frame: types.FrameType | None = sys._getframe(1)
    except (AttributeError, ValueError):  # pragma: no cover - non-CPython
        return {}
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return dict(frame.f_locals) if frame is not None else {}


def _check_handler(where: str, fn: object) -> None:
    """Refuse what cannot be a tool handler, naming the likely mistake."""
    if callable(fn):
        return
    if isinstance(fn, ToolDefinition):
        hint = (
            "that is a ToolDefinition, already declared in a toolset; add its handler: "
            "add_tool(definition.handler, name=definition.name, "
            "description=definition.description)"
        )
    elif isinstance(fn, classmethod | staticmethod | property):
        hint = (
            f"that is a {type(fn).__name__} object from a class body; declare the method "
            "once the class exists: add_tool(MyClass.method) or add_tool(instance.method)"
        )
    elif inspect.iscoroutine(fn) or inspect.isawaitable(fn):
        if inspect.iscoroutine(fn):
            fn.close()  # it will never run; no "never awaited" warning on top of this error
        hint = (
            "that is what calling an async function returns; did you call it? "
            "Pass the function itself: add_tool(fn), not add_tool(fn())"
        )
    elif isinstance(fn, str):
        hint = (
            "the function goes first, and a name by keyword: "
            f"add_tool(fn, name={fn!r}); if that string is what the function returns, "
            "pass the function itself, not add_tool(fn())"
        )
    else:
        hint = (
            "did you pass the result of calling the function? Pass the function "
            "itself: add_tool(fn), not add_tool(fn())"
        )
    raise ToolDefinitionError(
        f"{where}: a tool needs a function or other callable, got "
        f"{type(fn).__name__} {_short_repr(fn)}: {hint}"
    )


def _describe_callable(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a handler, for messages (its repr when it has none)."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if qualname is None:
        return _short_repr(fn)
    return f"{module}.{qualname}" if module else str(qualname)


def _timeout(where: str, option: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ToolDefinitionError(
            f"{where}: {option}= must be a number of seconds > 0, or None; got {value!r}")
    return float(value)


def _wait_rule(where: str, requires_approval: Any, deferred: Any, approval_timeout: Any,
               on_timeout: Any, result_timeout: Any) -> WaitRule:
    """The declared waiting rules, checked (ToolDefinitionError names the fix)."""
    if not (isinstance(requires_approval, bool) or callable(requires_approval)):
        raise ToolDefinitionError(
            f"{where}: requires_approval= must be True, False or a callable "
            f"(arguments, ctx) -> bool; got {_short_repr(requires_approval)}")
    if not isinstance(deferred, bool):
        raise ToolDefinitionError(f"{where}: deferred= must be True or False; "
                                  f"got {_short_repr(deferred)}")
    if deferred and requires_approval is not False:
        raise ToolDefinitionError(
            f"{where}: a deferred tool is never run by the loop, so it cannot also require "
            "an approval; drop requires_approval= (the host that supplies the result decides)")
    if on_timeout not in ON_TIMEOUT:
        raise ToolDefinitionError(f"{where}: on_timeout= must be one of "
                                  f"{', '.join(map(repr, ON_TIMEOUT))}; got {on_timeout!r}")
    if on_timeout != "deny" and requires_approval is False:
        raise ToolDefinitionError(f"{where}: on_timeout= needs requires_approval=")
    approval = _timeout(where, "approval_timeout", approval_timeout)
    result = _timeout(where, "result_timeout", result_timeout)
    if approval is not None and requires_approval is False:
        raise ToolDefinitionError(f"{where}: approval_timeout= needs requires_approval=")
    if result is not None and not deferred:
        raise ToolDefinitionError(f"{where}: result_timeout= needs deferred=True")
    return WaitRule(requires_approval, deferred, approval, on_timeout, result)


def _build_definition(
    toolset: str,
    tool_name: str,
    fn: Callable,
    description: str | None,
    input_schema: dict | None,
    caller_locals: dict[str, Any],
) -> ToolDefinition:
    where = f"toolset {toolset!r}, tool {tool_name!r}"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"{where}: cannot read the signature: {exc}") from exc

    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _parse_docstring(doc)
    if description is None:
        description = summary

    hints = _resolve_hints(fn, signature, where, caller_locals)

    context_param: str | None = None
    params: list[inspect.Parameter] = []
    for param in signature.parameters.values():
        annotation = hints.get(param.name, param.annotation)
        is_context = _is_context_annotation(annotation) or (
            param.name == "ctx" and param.annotation is inspect.Parameter.empty
        )
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ToolDefinitionError(
                f"{where}: *{param.name} is not allowed; tools take named arguments only"
            )
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if input_schema is None:
                raise ToolDefinitionError(
                    f"{where}: **{param.name} is not allowed when the schema is derived "
                    "from type hints; declare each argument, or pass input_schema="
                )
            continue
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"{where}: positional-only parameter {param.name!r} is not allowed; "
                "tools receive their arguments by keyword"
            )
        if is_context:
            if context_param is not None:
                raise ToolDefinitionError(
                    f"{where}: both {context_param!r} and {param.name!r} ask for the "
                    "CallContext; declare at most one context parameter"
                )
            context_param = param.name
            continue
        params.append(param)

    if input_schema is not None:
        if not isinstance(input_schema, dict) or input_schema.get("type") != "object":
            raise ToolDefinitionError(
                f'{where}: input_schema must be a JSON Schema dict with "type": "object", '
                f"got {input_schema!r}"
            )
        required = input_schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolDefinitionError(
                f"{where}: input_schema 'required' must be a list of property names"
            )
        return ToolDefinition(
            name=tool_name,
            description=description,
            input_schema=input_schema,
            handler=fn,
            context_param=context_param,
        )

    model, param_names, always_pass = _build_model(tool_name, params, hints, arg_docs, where)
    try:
        schema = model.model_json_schema()
    except Exception as exc:
        raise ToolDefinitionError(
            f"{where}: cannot build a JSON schema from the type hints: {exc}"
        ) from exc
    return ToolDefinition(
        name=tool_name,
        description=description,
        input_schema=_tidy_schema(schema),
        handler=fn,
        context_param=context_param,
        arguments_model=model,
        param_names=param_names,
        always_pass=always_pass,
    )


def _output_schema(fn: Callable, caller_locals: dict[str, Any]) -> dict | None:
    """The JSON Schema of a handler's result when its return annotation is a
    pydantic model (``_to_result`` then gives its value as ``structuredContent``
    too); None otherwise. An annotation that cannot be resolved is left as
    documentation: the tool simply declares no output schema."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    try:
        annotation = inspect.signature(target).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, str):
        globalns = getattr(inspect.unwrap(target), "__globals__", {})
        try:
            annotation = eval(annotation, globalns, dict(caller_locals))
        except Exception:
            return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.model_json_schema()
    return None


def _resolve_hints(
    fn: Callable,
    signature: inspect.Signature,
    where: str,
    caller_locals: dict[str, Any],
) -> dict[str, Any]:
    """Evaluated annotations of the parameters, string annotations included."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__  # a callable instance: read its __call__
    target = inspect.unwrap(target)
    globalns = getattr(target, "__globals__", {})
    localns = {"CallContext": CallContext}

    hints: dict[str, Any] = {}
    for param in signature.parameters.values():
        annotation = param.annotation
        if annotation is inspect.Parameter.empty:
            continue
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, globalns, {**caller_locals, **localns})
            except Exception as exc:
                raise ToolDefinitionError(
                    f"{where}: cannot resolve the annotation {param.annotation!r} of "
                    f"parameter {param.name!r}: {exc}"
                ) from exc
        hints[param.name] = annotation
    return hints


def _is_context_annotation(annotation: Any) -> bool:
    if annotation is CallContext:
        return True
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _is_context_annotation(typing.get_args(annotation)[0])
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(members) == 1 and members[0] is CallContext
    return False


def _build_model(
    tool_name: str,
    params: list[inspect.Parameter],
    hints: dict[str, Any],
    arg_docs: dict[str, str],
    where: str,
) -> tuple[type[BaseModel], dict[str, str], frozenset[str]]:
    """A pydantic model whose fields are the tool's arguments.

    Fields get neutral names (``f0``, ``f1``...) aliased to the parameter
    names, so parameters called ``json``, ``schema`` or ``_x`` cannot clash
    with BaseModel attributes or pydantic's private-name rules.
    """
    fields: dict[str, Any] = {}
    param_names: dict[str, str] = {}
    always_pass: set[str] = set()
    for index, param in enumerate(params):
        field_name = f"f{index}"
        annotation = hints.get(param.name, Any)
        extra: dict[str, Any] = {"alias": param.name}
        if param.name in arg_docs:
            extra["description"] = arg_docs[param.name]
        ours = pydantic.Field(**extra)
        if typing.get_origin(annotation) is Annotated:
            base, *metadata = typing.get_args(annotation)
            annotation = Annotated[(base, ours, *metadata)]
        else:
            annotation = Annotated[annotation, ours]
        if param.default is inspect.Parameter.empty:
            default: Any = ...
        else:
            default = param.default
            if isinstance(default, FieldInfo):
                always_pass.add(field_name)
        fields[field_name] = (annotation, default)
        param_names[field_name] = param.name
    try:
        model = pydantic.create_model(  # type: ignore[call-overload]
            f"{_model_name(tool_name)}Arguments",
            __config__=ConfigDict(extra="ignore"),
            **fields,
        )
    except Exception as exc:
        raise ToolDefinitionError(
            f"{where}: cannot build an argument model from the type hints: {exc}"
        ) from exc
    return model, param_names, frozenset(always_pass)


def _model_name(tool_name: str) -> str:
    parts = re.split(r"[^A-Za-z0-9]+", tool_name)
    return "".join(part[:1].upper() + part[1:] for part in parts if part) or "Tool"


def _tidy_schema(schema: dict) -> dict:
    """Top level ``{"type": "object", "properties": ..., "required": ...}``.

    Drops the synthetic model title and the per-property titles pydantic makes
    up from parameter names; nested model titles (``$defs``) are kept.
    """
    properties = {}
    for prop_name, prop in (schema.get("properties") or {}).items():
        if isinstance(prop, dict):
            prop = {k: v for k, v in prop.items() if k != "title"}
        properties[prop_name] = prop
    tidy: dict[str, Any] = {"type": "object", "properties": properties}
    if schema.get("required"):
        tidy["required"] = list(schema["required"])
    for key, value in schema.items():
        if key not in ("type", "properties", "required", "title"):
            tidy[key] = value
    return tidy


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {argument: description}) from a cleaned docstring."""
    lines = doc.splitlines()
    summary_lines: list[str] = []
    for line in lines:
        if not line.strip():
            if summary_lines:
                break
            continue
        match = _SECTION_RE.match(line)
        if match and match.group(1).strip().lower() in _SECTION_HEADERS:
            break
        summary_lines.append(line.strip())
    summary = " ".join(summary_lines)

    arg_docs: dict[str, str] = {}
    index = 0
    while index < len(lines):
        match = _SECTION_RE.match(lines[index])
        if match and match.group(1).strip().lower() in _ARGS_HEADERS:
            header_indent = _indent(lines[index])
            index += 1
            entry_indent: int | None = None
            current: str | None = None
            while index < len(lines):
                line = lines[index]
                if not line.strip():
                    index += 1
                    continue
                indent = _indent(line)
                if indent <= header_indent:
                    break
                if entry_indent is None:
                    entry_indent = indent
                arg_match = _ARG_LINE_RE.match(line.strip())
                if indent <= entry_indent and arg_match:
                    current = arg_match.group(1)
                    arg_docs[current] = arg_match.group(2).strip()
                elif current is not None:
                    joined = f"{arg_docs[current]} {line.strip()}"
                    arg_docs[current] = joined.strip()
                index += 1
            continue
        index += 1
    return summary, arg_docs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# --------------------------------------------------------------------------- calling


class _ArgumentError(InvalidArgumentError):
    """Arguments did not satisfy the tool's schema; the message is LLM-readable."""


def _bind_arguments(definition: ToolDefinition, arguments: dict) -> dict[str, Any]:
    model = definition.arguments_model
    if model is None:
        required = definition.input_schema.get("required") or []
        missing = [key for key in required if key not in arguments]
        if missing:
            raise _ArgumentError("; ".join(f"{key}: Field required" for key in missing))
        return dict(arguments)
    try:
        instance = model.model_validate(arguments)
    except ValidationError as exc:
        raise _ArgumentError(_format_validation_error(exc)) from None
    passed = instance.model_fields_set | definition.always_pass
    return {
        definition.param_names[field_name]: getattr(instance, field_name)
        for field_name in definition.param_names
        if field_name in passed
    }


def _format_validation_error(exc: ValidationError) -> str:
    messages = []
    for error in exc.errors(include_url=False):
        location = ".".join(str(part) for part in error.get("loc", ())) or "arguments"
        message = f"{location}: {error.get('msg', 'invalid value')}"
        if error.get("type") != "missing" and "input" in error:
            message += f" (got {_short_repr(error['input'])})"
        messages.append(message)
    return "; ".join(messages)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def _run_awaitable(awaitable: Any) -> Any:
    """Await what an ``async def`` handler returned, on an event loop of its own."""
    return bridge.run_isolated(lambda: awaitable)


def _to_result(value: Any) -> ToolResult:
    """Convert a handler's return value into a :class:`ToolResult`."""
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult(content=[{"type": "text", "text": ""}])
    if isinstance(value, str):
        return ToolResult(content=[{"type": "text", "text": value}])
    if isinstance(value, BaseModel):
        structured = value.model_dump(mode="json")
        return ToolResult(
            content=[{"type": "text", "text": json.dumps(structured, ensure_ascii=False)}],
            structured_content=structured,
        )
    if isinstance(value, dict):
        try:
            text = json.dumps(value, ensure_ascii=False)
            structured = value
        except (TypeError, ValueError):
            structured = pydantic_core.to_jsonable_python(value, fallback=str)
            text = json.dumps(structured, ensure_ascii=False)
        return ToolResult(content=[{"type": "text", "text": text}], structured_content=structured)
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return ToolResult(content=[{"type": "text", "text": text}])
