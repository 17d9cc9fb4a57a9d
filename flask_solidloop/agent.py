"""The agent API: declare an agent as a class, then start, pause, resume, stop loops.

::

    @solidloop.agent("support")
    class Support(Agent):
        system_prompt = "You are a helpful assistant."
        llm = {"base_url": "https://api.openai.com", "model": "gpt-4o",
               "api_key_env": "OPENAI_API_KEY"}
        mcps = [{"name": "search", "toolset": search}]

    loop = Support.start(subject=user, message="Summarize this week")
    Support(loop).pause()
    Support(loop).resume(from_=("paused", "failed"))

Options are class attributes (or methods, for values computed at run time).
A public non-callable attribute that is not an option is an error, so a typo
like ``streming = True`` fails at import instead of being ignored.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ._typing import SessionLike
from .errors import AgentDefinitionError, InvalidArgumentError, LoopFailedError
from .llm.types import ProviderSettings
from .loops import control, queries, store
from .loops.store import Decision, WaitRequest
from .mcp.registry import validate_entry
from .mcp.toolset import CallContext
from .models import RESUMABLE_STATUSES, Loop, Message, ToolCall
from .models.loop import LoopStatus
from .state import get_state
from .streaming import StreamEvent

if TYPE_CHECKING:
    from .pipeline.builder import Builder
    from .state import AgentRegistry

OPTIONS: dict[str, str] = {
    "system_prompt": "str, or a method returning one",
    "llm": "dict of provider settings (base_url, model, api_key_env, read_timeout, ...)",
    "mcps": "list of tool server entries, each a dict with a name",
    "streaming": "bool: stream the LLM response",
    "llm_params": "dict deep-merged over the request payload last",
    "max_steps": "int: LLM turns before the loop pauses",
    "max_duration": "int seconds: wall time before the loop pauses",
    "budget": "dict of limits on the loop's spend (cost_usd, tokens, llm_turns, tool_calls); "
              "reaching one pauses the loop (docs/guides/limits.md)",
    "budget_warning": "float share of a budget limit (default 0.8) past which the model "
                      "is told in its request what is left",
    "rate_limit_key": "str naming this agent's provider quota in SOLIDLOOP_RATE_LIMITS in "
                      "place of the provider's origin (a separate API key)",
    "sequential_tool_calls": "bool: run a turn's tool calls one after another",
    "reasoning_effort": "str passed to the provider, or None",
    "stream_reasoning": "bool: write the model's reasoning to the loop's event stream as "
                        "reasoning_delta events while it streams (default False)",
    "max_tokens": "int output cap, or None for the provider default",
    "turn_timeout": "seconds of wall time per LLM request, retries and streaming included "
                    "(default 600), or None for none",
    "max_output_chars": "int: characters an answer may reach before its request is ended "
                        "(default 1,000,000), or None for none",
    "reasoning_strategies": "how past reasoning is sent back (list), or None for the default",
    "tool_prompting": "'xml': tools described in the system prompt, no tools field; or None",
    "tool_result_format": "'tool' (tool role) or 'user_xml' (<tool_response> in a user "
                          "message); None: 'user_xml' with tool_prompting, else 'tool'",
    "max_concurrent_loops": "int: loops of this agent in flight at once (a loop past it is "
                            "held before its first turn until one ends), or None for no cap",
    "on_new_message": "what send_message does while the loop is queued, running or waiting: "
                      "'queue' (answer it after the current work), 'interrupt' or 'reject'",
    "output_type": "a pydantic model class or a JSON Schema dict: the final answer is "
                   "validated against it and kept as the loop's output (None: plain text)",
    "output_retries": "int: answers that fail validation sent back with the error before "
                      "the loop fails as output_invalid (default 2)",
}
HOOKS = ("configure_llm_middlewares", "configure_tool_middlewares")


def _new_loop(index: int, item: Any) -> store.NewLoop:
    """One item of :meth:`Agent.start_many`, checked (the error names its index)."""
    if isinstance(item, str):
        item = {"message": item}
    if not isinstance(item, Mapping):
        raise InvalidArgumentError(
            f"start_many: item {index} is a {type(item).__name__}; pass a message string "
            "or a mapping with 'message' (and optionally 'subject', 'state')")
    unknown = set(item) - {"message", "subject", "state"}
    if unknown:
        raise InvalidArgumentError(
            f"start_many: item {index} has unknown keys {sorted(unknown)}; the keys are "
            "'message', 'subject' and 'state'")
    message = item.get("message")
    if not isinstance(message, str) or not message.strip():
        raise InvalidArgumentError(f"start_many: item {index}: message must be a non-empty "
                                   "string")
    loop_state = item.get("state") or {}
    if not isinstance(loop_state, Mapping):
        raise InvalidArgumentError(f"start_many: item {index}: state must be a dict")
    try:
        json.dumps(dict(loop_state))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"start_many: item {index}: state must be JSON-friendly "
                                   f"({exc})") from None
    subject_type, subject_id = _subject_key(item.get("subject"))
    return store.NewLoop(subject_type, subject_id, dict(loop_state), message)


def _subject_key(subject: Any) -> tuple[str | None, str | None]:
    if subject is None:
        return None, None
    if isinstance(subject, tuple) and len(subject) == 2:
        return str(subject[0]), str(subject[1])
    ident = getattr(subject, "id", None)
    if ident is None:
        raise InvalidArgumentError(
            "subject must be a model instance with an id, a (type, id) tuple, or None; "
            f"got {subject!r}"
        )
    return type(subject).__name__, str(ident)


class Agent:
    """Base class of every agent. Subclass it and register with ``@solidloop.agent(name)``."""

    system_prompt: Any = "You are a helpful assistant."
    llm: Any = None
    mcps: Any = ()
    streaming: Any = False
    llm_params: Any = None
    max_steps: Any = 50
    max_duration: Any = None
    budget: Any = None
    budget_warning: Any = 0.8
    rate_limit_key: Any = None
    sequential_tool_calls: Any = False
    reasoning_effort: Any = None
    stream_reasoning: Any = False
    max_tokens: Any = None
    turn_timeout: Any = 600
    max_output_chars: Any = 1_000_000
    reasoning_strategies: Any = None
    tool_prompting: Any = None
    tool_result_format: Any = None
    max_concurrent_loops: Any = None
    on_new_message: Any = "queue"
    output_type: Any = None
    output_retries: Any = 2

    #: The loop's own provider settings, once read (:meth:`_llm_override`).
    _override: dict[str, Any] | None

    #: The stable registry name, stored on every loop of this agent.
    agent_name: ClassVar[str | None] = None
    #: The loop-state key where an MCP server blueprint keeps the label of the
    #: outside client that started the loop (what ``mcp_principal()`` returns).
    MCP_PRINCIPAL_STATE_KEY: ClassVar[str] = "mcp_principal"
    _extension: ClassVar[AgentRegistry | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        policy = vars(cls).get("on_new_message")
        if policy is not None and not callable(policy):
            # A plain value is checked now: a typo fails at import, not at the
            # first message that finds the loop busy.
            try:
                control.check_policy(policy, where=f"agent class {cls.__name__}")
            except InvalidArgumentError as exc:
                raise AgentDefinitionError(str(exc)) from None
        for name, value in vars(cls).items():
            if name.startswith("_") or name in OPTIONS or name in HOOKS:
                continue
            if callable(value) or isinstance(value, property | classmethod | staticmethod):
                continue
            close = difflib.get_close_matches(name, list(OPTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AgentDefinitionError(
                f"agent class {cls.__name__}: unknown option {name!r}{hint}; "
                f"options: {', '.join(OPTIONS)}"
            )

    def __init__(self, loop: Loop | int | None = None) -> None:
        self._loop_id = loop.id if isinstance(loop, Loop) else loop
        self._loop = loop if isinstance(loop, Loop) else None

    # -- option access: attributes or zero-argument methods --------------------

    def option(self, name: str) -> Any:
        value = getattr(self, name)
        # A class (output_type's model) is a value, not a method to call.
        return value() if callable(value) and not isinstance(value, type) else value

    @property
    def loop(self) -> Loop | None:
        if self._loop is None and self._loop_id is not None:
            self._loop = queries.get_loop(get_state().db.session, self._loop_id)
        return self._loop

    def provider(self) -> ProviderSettings:
        data = self.option("llm")
        if data is None:
            raise AgentDefinitionError(
                f"agent {self.agent_name!r} declares no llm settings; set llm = "
                "{'base_url': ..., 'model': ..., 'api_key_env': ...}"
            )
        override = self._llm_override()
        if override and isinstance(data, dict):
            data = {**data, **override}
        return ProviderSettings.from_dict(data, agent=str(self.agent_name))

    def _llm_override(self) -> dict[str, Any] | None:
        """The loop's own provider settings (``Loop.llm_override``: a replay's
        model), read once per agent object: a turn's later reads must not
        reload an expired loop row."""
        if not hasattr(self, "_override"):
            loop = self._loop if self._loop is not None else (
                self.loop if self._loop_id is not None else None)
            self._override = dict(loop.llm_override or {}) if loop is not None else None
        return self._override

    def tool_entries(self) -> list[dict[str, Any]]:
        entries = list(self.option("mcps") or [])
        for entry in entries:
            validate_entry(entry, str(self.agent_name))
        return entries

    def effective_max_duration(self, default: int) -> int:
        value = self.option("max_duration")
        return int(value) if value else default

    def validate(self) -> None:
        """Check every option now; raise AgentDefinitionError naming the first bad one."""
        from .mcp.registry import ToolRegistry

        name = self.agent_name
        self.provider()
        ToolRegistry.build(self.tool_entries(), agent=str(name), remote=False)
        timeout = self.option("turn_timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, int | float) or timeout <= 0):
            raise AgentDefinitionError(
                f"agent {name!r}: turn_timeout must be a positive number of seconds or None, "
                f"got {timeout!r}")
        for option in ("max_steps", "max_duration", "max_tokens", "max_output_chars",
                       "max_concurrent_loops"):
            value = self.option(option)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise AgentDefinitionError(
                    f"agent {name!r}: {option} must be a positive int or None, got {value!r}"
                )
        for option in ("streaming", "sequential_tool_calls"):
            if not isinstance(self.option(option), bool):
                raise AgentDefinitionError(f"agent {name!r}: {option} must be a bool")
        from .llm.reasoning import validate_strategies

        validate_strategies(self.option("reasoning_strategies"), agent=str(name))
        effort = self.option("reasoning_effort")
        dialect = self.provider().dialect
        if effort is not None and dialect in ("anthropic", "gemini") \
                and effort not in ("low", "medium", "high"):
            raise AgentDefinitionError(
                f"agent {name!r}: reasoning_effort {effort!r} is not understood by the "
                f"{dialect} dialect; use 'low', 'medium' or 'high' (or None)"
            )
        from .llm.tool_text import PROMPTING, RESULT_FORMATS

        prompting = self.option("tool_prompting")
        if prompting is not None and prompting not in PROMPTING:
            raise AgentDefinitionError(
                f"agent {name!r}: tool_prompting must be None (tools in the request's tools "
                f"field) or 'xml' (tools described in the system prompt), got {prompting!r}"
            )
        results = self.option("tool_result_format")
        if results is not None and results not in RESULT_FORMATS:
            raise AgentDefinitionError(
                f"agent {name!r}: tool_result_format must be None, 'tool' (a tool role "
                f"message) or 'user_xml' (a <tool_response> block in a user message), "
                f"got {results!r}"
            )
        params = self.option("llm_params")
        if params is not None and not isinstance(params, dict):
            raise AgentDefinitionError(f"agent {name!r}: llm_params must be a dict or None")
        self.budget_limits()
        warning = self.option("budget_warning")
        if isinstance(warning, bool) or not isinstance(warning, int | float) \
                or not 0 < warning <= 1:
            raise AgentDefinitionError(
                f"agent {name!r}: budget_warning must be a share of the budget in (0, 1], "
                f"e.g. 0.8, got {warning!r}")
        try:
            control.check_policy(self.option("on_new_message"), where=f"agent {name!r}")
        except InvalidArgumentError as exc:
            raise AgentDefinitionError(str(exc)) from None
        key = self.option("rate_limit_key")
        if key is not None and (not isinstance(key, str) or not key.strip()):
            raise AgentDefinitionError(
                f"agent {name!r}: rate_limit_key must be a non-empty str or None")
        self.output_schema()
        retries = self.option("output_retries")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise AgentDefinitionError(
                f"agent {name!r}: output_retries must be an int >= 0, got {retries!r}")

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of this agent's ``output_type`` (None without one), as
        its loops are started with; AgentDefinitionError names a bad one."""
        from .llm.output import schema_of

        return schema_of(self.option("output_type"), agent=str(self.agent_name))

    def budget_limits(self) -> dict[str, float]:
        """This agent's ``budget`` option, checked (AgentDefinitionError names a bad one)."""
        from .limit_spec import parse_budget

        try:
            return parse_budget(self.option("budget"), where=f"agent {self.agent_name!r}")
        except InvalidArgumentError as exc:
            raise AgentDefinitionError(str(exc)) from None

    def render_system_prompt(self) -> str:
        return str(self.option("system_prompt") or "")

    # -- middleware hooks ---------------------------------------------------------

    def configure_llm_middlewares(self, builder: Builder) -> None:
        """Edit this agent's LLM stack (insert_before/after, replace, delete)."""

    def configure_tool_middlewares(self, builder: Builder) -> None:
        """Edit this agent's tool stack."""

    # -- waiting tool calls (docs/guides/approvals.md) ---------------------------------

    def approval_policy(self, tool_name: str, arguments: dict[str, Any],
                        ctx: CallContext) -> bool:
        """Whether a call the model asked for waits for a person's approval, for
        any tool (a remote server's too, whose definitions the app does not
        own): ``tool_name`` as advertised to the model, ``ctx.server_name`` and
        ``ctx.tool_name`` its route, ``ctx.loop`` the loop. A tool's own
        ``requires_approval=`` is asked first. If it raises, the call waits."""
        return False

    approval_policy.solidloop_default = True  # type: ignore[attr-defined]

    def on_wait(self, request: WaitRequest, session: SessionLike) -> None:
        """Called for each tool call that begins to wait, inside the transaction
        that makes it wait: a job enqueued here with ``session=session`` (a
        notification, say) commits with the wait, or not at all. It runs in a
        savepoint: if it raises, its writes are undone, the error is logged,
        and the call waits all the same."""

    def mcp_principal(self) -> Any:
        """The principal this agent's tool calls carry: ``ctx.principal`` of an
        in-process tool's CallContext, and of the context a remote server's
        call is made with (an HTTP transport puts identity in its headers
        instead). ``self.loop`` is the loop being served.

        By default, the label of the outside MCP client that started the loop
        through an MCP server blueprint (kept in the loop's state under
        :attr:`MCP_PRINCIPAL_STATE_KEY`), so the agent's tools act for that
        caller; None for a loop started any other way."""
        loop = self._loop if self._loop is not None else (
            self.loop if self._loop_id is not None else None)
        if loop is None:
            return None
        return (loop.state or {}).get(self.MCP_PRINCIPAL_STATE_KEY)

    # -- lifecycle ----------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        message: str,
        subject: Any = None,
        session: SessionLike | None = None,
        commit: bool = True,
        state: dict[str, Any] | None = None,
        budget: Mapping[str, float] | None = None,
    ) -> Loop:
        """Create a queued loop with its system and user messages and its first job.

        Everything is written in one transaction on ``session`` (the app's
        ``db.session`` by default). With ``commit=False`` the caller commits,
        so the loop can start atomically with the caller's own writes.
        ``budget`` (any of ``cost_usd``, ``tokens``, ``llm_turns``,
        ``tool_calls``) updates the agent's ``budget`` for this loop.
        """
        return cls._create(message=message, subject=subject, session=session, commit=commit,
                           state=state, enqueue=True, budget=budget)

    @classmethod
    def start_many(
        cls,
        loops: Iterable[str | Mapping[str, Any]],
        *,
        session: SessionLike | None = None,
        commit: bool = True,
    ) -> list[int]:
        """Start many loops of this agent at once; their ids, in the order given.

        Each item is a user message, or a mapping with ``message`` and, as for
        :meth:`start`, optional ``subject`` and ``state``. Every loop, its
        messages and its first job are written in one transaction (three
        statements and one NOTIFY, whatever their number), so the batch starts
        whole or not at all. Every item is checked before anything is written:
        a bad one raises InvalidArgumentError naming its index. With
        ``commit=False`` the caller commits, with its own writes.
        """
        ext_state = get_state()
        name = cls._registered_name()
        agent = cls()
        agent.validate()
        checked = [_new_loop(index, item) for index, item in enumerate(loops)]
        session = session or ext_state.db.session
        assert session is not None
        ids = store.create_loops(ext_state, session, agent_name=name,
                                 system_prompt=agent.render_system_prompt(), loops=checked,
                                 enqueue=True, output_schema=agent.output_schema())
        if commit:
            session.commit()
        return ids

    @classmethod
    def create(
        cls,
        *,
        message: str,
        subject: Any = None,
        session: SessionLike | None = None,
        commit: bool = True,
        state: dict[str, Any] | None = None,
    ) -> Loop:
        """Like :meth:`start`, but leave the loop in ``init`` with no job.

        Nothing runs until ``resume()`` queues it: useful to prepare loops in
        bulk and release them later.
        """
        return cls._create(message=message, subject=subject, session=session, commit=commit,
                           state=state, enqueue=False)

    @classmethod
    def _create(cls, *, message: str, subject: Any, session: SessionLike | None, commit: bool,
                state: dict[str, Any] | None, enqueue: bool,
                budget: Mapping[str, float] | None = None) -> Loop:
        from .limit_spec import parse_budget

        limits = parse_budget(budget, where="start(budget=...)")
        ext_state = get_state()
        name = cls._registered_name()
        agent = cls()
        agent.validate()
        if not isinstance(message, str) or not message.strip():
            raise InvalidArgumentError("message must be a non-empty string")
        session = session or ext_state.db.session
        assert session is not None
        subject_type, subject_id = _subject_key(subject)
        loop = store.create_loop(
            ext_state, session, agent_name=name, subject_type=subject_type,
            subject_id=subject_id, system_prompt=agent.render_system_prompt(),
            message=message, loop_state=dict(state or {}), enqueue=enqueue, budget=limits,
            output_schema=agent.output_schema(),
        )
        if commit:
            session.commit()
        return loop

    @classmethod
    def _registered_name(cls) -> str:
        if not cls.agent_name or cls._extension is None:
            raise AgentDefinitionError(
                f"{cls.__name__} is not registered; decorate it with @solidloop.agent('name')"
            )
        return cls.agent_name

    def _require_loop(self) -> int:
        if self._loop_id is None:
            raise InvalidArgumentError(f"{type(self).__name__}() was created without a loop")
        return self._loop_id

    def pause(self, *, session: SessionLike | None = None) -> bool:
        """Pause a queued or running loop. Pending jobs of the old generation no-op.

        Returns False when the loop was not live.
        """
        return control.pause(get_state(), self._require_loop(), session=session)

    def stop(
        self, *, reason: str = "stopped by request", session: SessionLike | None = None
    ) -> bool:
        """Fail the loop with ``reason``. False if it was already terminal.

        A stopped loop ends ``failed``, a resumable status, so
        ``resume(from_=("failed",))`` can take the stop back. To forbid that,
        ``freeze()`` the loop before stopping it: a frozen loop stays frozen when
        stopped, and ``freeze()`` refuses a loop that has already ended. A running
        tool call finishes on its worker and its result is kept.
        """
        return control.stop(get_state(), self._require_loop(), reason=reason, session=session)

    def force_stop(self, *, reason: str = "by request",
                   session: SessionLike | None = None) -> bool:
        """Stop now: like stop(), and also cancel queued jobs and revoke tool leases."""
        return control.force_stop(get_state(), self._require_loop(), reason=reason,
                                  session=session)

    def freeze(self, *, session: SessionLike | None = None) -> bool:
        """Pause the loop if live and lock it; resume() refuses until unfreeze()."""
        return control.freeze(get_state(), self._require_loop(), session=session)

    def unfreeze(self, *, session: SessionLike | None = None) -> bool:
        """Lift a freeze. The loop stays paused until resumed."""
        return control.unfreeze(get_state(), self._require_loop(), session=session)

    def observe(self, on: bool = True, *, session: SessionLike | None = None) -> bool:
        """Mark the loop as watched live (or not). Returns True when the flag changed."""
        return control.observe(get_state(), self._require_loop(), on, session=session)

    def pin(self, message_id: int, pinned: bool = True, *,
            session: SessionLike | None = None, commit: bool = True) -> None:
        """Pin one of the loop's user messages (``pinned=False`` unpins it): a
        :class:`~flask_solidloop.Compaction` summary never replaces a pinned
        message, as it never replaces the system prompt or the task. Committed
        on ``session`` (the app's ``db.session`` by default) unless
        ``commit=False``; InvalidArgumentError, naming the fix, for a message
        that is not one of the loop's user messages or was summarised already."""
        control.pin(get_state(), self._require_loop(), message_id, pinned, session=session,
                    commit=commit)

    def resume(
        self,
        *,
        from_: Iterable[str] = RESUMABLE_STATUSES,
        message: str | None = None,
        session: SessionLike | None = None,
        budget: Mapping[str, float] | None = None,
    ) -> bool:
        """Re-enter the loop when its status is in ``from_``.

        ``from_`` defaults to every resumable status, completed included;
        narrow it (``from_=("paused", "failed")``) where a finished loop has
        already reported its result. A status that can never be resumed
        (queued, running) raises ValueError. ``message`` appends a user message
        first. ``budget`` raises the loop's limits (a loop paused by its
        budget goes on) and releases it from its subject's budget (and a child
        agent from its ancestors'). Returns
        False when the loop's status is not in ``from_``.
        """
        return control.resume(get_state(), self._require_loop(), from_=from_, message=message,
                              session=session, budget=budget)

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the loop settles (completed, failed, paused, waiting for
        a decision or a result, or init) and return its status; after
        ``timeout`` seconds return the status it has then (None: no bound).
        Woken by the status notification every loop sends, not by polling;
        while it waits it holds no database connection. None when the loop
        does not exist."""
        from .streaming import wait_settled

        state = get_state()
        return wait_settled(state, self._require_loop(), timeout,
                            heartbeat=state.config.stream_heartbeat)

    def events(self, after: str | int | None = None, timeout: float | None = None, *,
               reasoning: bool = False) -> Iterator[StreamEvent]:
        """The loop's event stream (``SolidLoop.events``)."""
        from .streaming import follow, parse_after, require_loop

        state = get_state()
        start = parse_after(after)
        require_loop(state, self._require_loop())
        stream = follow(state, self._require_loop(), start, seconds=timeout,
                        heartbeat=state.config.stream_heartbeat, reasoning=reasoning)
        return (event for event in stream if event is not None)

    def send_message(self, message: str, *,
                     session: SessionLike | None = None) -> store.SentMessage:
        """Continue the conversation with a user message, and commit.

        A loop at rest (completed, paused, failed, init) re-enters with it, as
        ``resume(message=...)`` does (outcome ``"started"``); a queued loop's
        next turn reads it (``"appended"``). While the loop runs or waits, the
        agent's ``on_new_message`` decides: ``"queue"`` keeps it and delivers
        it when the current work ends (``"queued"``), ``"interrupt"`` cancels
        that work and answers it (``"interrupted"``), ``"reject"`` raises
        ConversationBusyError and writes nothing. Returns a SentMessage."""
        return control.send_message(get_state(), self._require_loop(), message,
                                    session=session)

    def pending_approvals(self) -> list[ToolCall]:
        """The loop's tool calls that await an approval, in order."""
        return control.pending_calls(get_state(), loop_id=self._require_loop(),
                                     waits_for=store.APPROVAL)

    def pending_calls(self) -> list[ToolCall]:
        """The loop's tool calls that await an approval or a result, in order."""
        return control.pending_calls(get_state(), loop_id=self._require_loop())

    def approve(self, tool_call_id: int, by: str | None = None,
                arguments: dict[str, Any] | None = None, *,
                session: SessionLike | None = None) -> Decision:
        """Approve a call that awaits an approval: its tool runs, with
        ``arguments`` when given (the model's are kept beside them). Commits,
        with the tool's job; given ``session=``, joins its transaction and the
        caller commits. Raises DecisionConflictError when another decision
        landed first."""
        return control.approve(get_state(), tool_call_id, by=by, arguments=arguments,
                               loop_id=self._require_loop(), session=session)

    def deny(self, tool_call_id: int, reason: str, by: str | None = None, *,
             session: SessionLike | None = None) -> Decision:
        """Deny a call that awaits an approval: the tool never runs; the model
        reads ``reason`` as the call's error result and carries on. Commits as
        :meth:`approve` does."""
        return control.deny(get_state(), tool_call_id, reason=reason, by=by,
                            loop_id=self._require_loop(), session=session)

    def complete_call(self, tool_call_id: int, result: Any, is_error: bool = False, *,
                      by: str | None = None, session: SessionLike | None = None) -> Decision:
        """Supply the result of a deferred call (text, an MCP ``CallToolResult``
        dict or a ToolResult); the model reads it as the call's result. Commits
        as :meth:`approve` does."""
        return control.complete_call(get_state(), tool_call_id, result, is_error=is_error,
                                     by=by, loop_id=self._require_loop(), session=session)

    def result(self) -> str | None:
        """The loop's final answer: the text of its last assistant message once
        it completed. None while it has not finished (queued, running,
        waiting, paused), the way RQ's ``job.return_value()`` answers for a
        job still running. Raises :class:`LoopFailedError` (with the loop's
        error message) for a loop that failed or was stopped."""
        loop = self._ended_loop()
        if loop is None:
            return None
        return queries.final_answer(get_state().db.session, loop.id)

    def _ended_loop(self) -> Loop | None:
        """The loop, read afresh, when it completed; None while it has not
        finished; LoopFailedError for one that failed or was stopped."""
        loop_id = self._require_loop()
        session = get_state().db.session
        loop = queries.get_loop(session, loop_id)
        if loop is None:
            raise InvalidArgumentError(f"loop {loop_id} does not exist")
        session.refresh(loop)
        if loop.status == LoopStatus.FAILED:
            raise LoopFailedError(loop_id, loop.error_message)
        return loop if loop.status == LoopStatus.COMPLETED else None

    def fork(self, at_message_id: int, message: str | None = None, *,
             model: str | None = None, session: SessionLike | None = None,
             commit: bool = True) -> Loop:
        """Start a new loop from this loop's history up to ``at_message_id``.

        The history is copied up to and including that message, each tool call
        with its result: a fork point inside a finished tool phase takes the
        whole phase (so forking at a tool result gives the request the loop's
        next turn sent), one inside an unfinished phase moves back to before
        the assistant message that opened it. ``message`` replaces the last
        user message (what followed it is not copied). ``model`` runs the fork
        against another model of the same provider. The new loop records
        where it came from (``forked_from_loop_id``, ``forked_at_message_id``)
        and is queued with its first job in one transaction on ``session``
        (the app's ``db.session`` by default), committed unless
        ``commit=False``. Raises InvalidArgumentError, naming the fix, for a
        message that is not in this loop's history."""
        return control.fork(get_state(), self._require_loop(), at_message_id, message=message,
                            llm={"model": model} if model is not None else None,
                            session=session, commit=commit)

    def output(self) -> Any:
        """The loop's structured output (its agent's ``output_type``): an
        instance of the agent's model class when it declares one, else the
        validated value (a dict). None while the loop has not completed;
        :class:`LoopFailedError` for a loop that failed (an answer that never
        matched its schema fails it as ``output_invalid``) or was stopped.
        InvalidArgumentError for an agent without ``output_type``."""
        from .llm.output import instance

        self._require_loop()
        output_type = self.option("output_type")
        if output_type is None:
            raise InvalidArgumentError(
                f"agent {self.agent_name!r} declares no output_type; result() returns its "
                "final answer as text")
        loop = self._ended_loop()
        if loop is None or loop.output is None:
            return None
        return instance(output_type, loop.output)

    def history(self, *, include_hidden: bool = False) -> list[Message]:
        return queries.messages(get_state().db.session, self._require_loop(),
                                include_hidden=include_hidden)

    def tool_calls(self) -> list[ToolCall]:
        return queries.tool_calls(get_state().db.session, self._require_loop())
