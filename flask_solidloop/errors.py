"""The one exception tree of flask-solidloop.

Every error the package raises on purpose derives from :class:`SolidLoopError`,
so a host can catch the whole family in one clause::

    SolidLoopError
    ├── ConfigurationError        a SOLIDLOOP_* value broke its rule
    ├── SetupError                the app, the extension or a worker is set up so it cannot work
    │   └── NotInitializedError   the extension was used before init_app
    ├── InvalidArgumentError      a call got an argument it cannot use
    ├── DatabaseUnavailableError  PostgreSQL did not answer at the URL tried
    ├── AgentError
    │   ├── AgentDefinitionError  an agent class declared something invalid
    │   └── UnknownAgentError     a loop names an agent nobody registered
    ├── UnknownMiddlewareError    a pipeline edit named a middleware not in the stack
    ├── ProviderError             the LLM provider failed the turn (``wire``: what was sent)
    │   ├── ProviderHTTPError     ... with a non-2xx status
    │   ├── ProviderUnavailableError  ... could not be reached at all (nothing was sent)
    │   ├── ProviderResponseError ... with a body we could not understand
    │   │   ├── ProviderConnectionLostError ... or a connection that broke mid-response
    │   │   └── ProviderAnswerError   ... or an answer a retry would only repeat
    │   │       └── TurnLimitError    ... or past turn_timeout / max_output_chars
    │   └── AbortedError          the loop was paused or stopped during the request
    ├── ToolDefinitionError       a tool was declared with an invalid name or schema
    ├── UnknownToolError          a toolset was asked for a tool it does not declare
    ├── McpTransportError         an MCP server could not be reached or answered badly
    │   └── McpAuthError          ... or needs an OAuth sign-in we have no usable token for
    ├── McpTokenRefusedError      the MCP server blueprint refuses a caller's OAuth token
    ├── LimitExceededError        max_steps / max_duration reached (the loop pauses)
    │   └── BudgetExceededError   ... or a loop's or its subject's budget is spent
    ├── HistoryTooLargeError      a history past SOLIDLOOP_MAX_HISTORY_BYTES (the loop fails)
    ├── LoopFailedError           Agent(loop).result() of a loop that failed or was stopped
    ├── LostLeaseError            this worker no longer owns the turn; write nothing
    ├── DecisionConflictError     a waiting tool call was decided already (who, when)
    ├── ConversationBusyError     a message for a live loop whose agent rejects it
    ├── WaitTimeoutError          a bounded wait ran out before the work it waited on finished
    └── BrokerError               the Postgres job queue could not do what was asked
        ├── BrokerUnavailableError  PostgreSQL did not answer the broker (dramatiq reconnects)
        ├── QueueNotDeclaredError   a message or consumer named a queue the broker does not have
        ├── ClaimLapsedError      a claimed job reached a thread too late: handed back, not run
        └── JobError              a host job could not be declared, sent, found or run
            ├── JobEncodeError    the message encoder rejected an argument (at send)
            ├── InvalidJobError   an option, function, queue name, session or datetime
            │                     that cannot work
            ├── JobImportError    the worker cannot import the job's function
            └── NoSuchJobError    no job with that id (``Job.fetch``, ``requeue``)

Errors carry what the user needs to act: the key, the value, the rule, the
names that would have worked.
"""

from __future__ import annotations

from typing import Any

from dramatiq.errors import BrokerConnectionError, QueueNotFound
from dramatiq.middleware import SkipMessage

from .wire import WireRecord

__all__ = [
    "AbortedError",
    "AgentDefinitionError",
    "AgentError",
    "BrokerError",
    "BrokerUnavailableError",
    "BudgetExceededError",
    "ClaimLapsedError",
    "ConfigurationError",
    "ConversationBusyError",
    "DatabaseUnavailableError",
    "DecisionConflictError",
    "HistoryTooLargeError",
    "InvalidArgumentError",
    "InvalidJobError",
    "JobEncodeError",
    "JobError",
    "JobImportError",
    "LimitExceededError",
    "LoopFailedError",
    "LostLeaseError",
    "McpAuthError",
    "McpTokenRefusedError",
    "McpTransportError",
    "NoSuchJobError",
    "NotInitializedError",
    "ProviderAnswerError",
    "ProviderConnectionLostError",
    "ProviderError",
    "ProviderHTTPError",
    "ProviderResponseError",
    "ProviderUnavailableError",
    "QueueNotDeclaredError",
    "SetupError",
    "SolidLoopError",
    "ToolDefinitionError",
    "TurnLimitError",
    "UnknownAgentError",
    "UnknownMiddlewareError",
    "UnknownToolError",
    "WaitTimeoutError",
]


class SolidLoopError(Exception):
    """Base class of every error raised by flask-solidloop."""


class ConfigurationError(SolidLoopError, ValueError):
    """A ``SOLIDLOOP_*`` setting has a value that breaks its rule."""

    def __init__(self, key: str, value: Any, rule: str) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        super().__init__(f"{key}={value!r} is invalid: {rule}")


class SetupError(SolidLoopError, RuntimeError):
    """The app, the extension or a worker is set up in a way that cannot work:
    ``init_app`` twice, no Flask-SQLAlchemy, a worker without ``FLASK_APP``, a
    test server that did not start."""


class NotInitializedError(SetupError):
    """The extension was used on an app it was never initialised for."""


class InvalidArgumentError(SolidLoopError, ValueError, TypeError):
    """A call got an argument it cannot use: a subject without an id, a status
    that can never be resumed, an emulator option it does not know. It is a
    ``ValueError`` and a ``TypeError`` both, whichever a caller catches."""


class DatabaseUnavailableError(SolidLoopError):
    """PostgreSQL could not be reached; the message names the URL tried."""


class AgentError(SolidLoopError):
    """Base class for agent registration and lookup problems."""


class AgentDefinitionError(AgentError, TypeError):
    """An agent class declares an unknown option or an invalid value."""


class UnknownAgentError(AgentError, LookupError):
    """A loop names an agent that is not registered in this process."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        listing = ", ".join(sorted(known)) or "none"
        super().__init__(
            f"agent {name!r} is not registered; known agents: {listing}. "
            "Was it renamed, or is the module that declares it not imported by the worker?"
        )


class UnknownMiddlewareError(SolidLoopError, LookupError):
    """insert_before / insert_after / replace named a middleware not in the stack."""


class ProviderError(SolidLoopError):
    """The LLM provider failed the turn.

    ``wire`` is what the turn sent and got, as the wire log keeps it (the redacted
    request, every attempt, the response as far as it came): the send path
    (:mod:`flask_solidloop.llm.client`) sets it on every ProviderError it raises,
    the way httpx sets ``HTTPError.request``. It is ``None`` for an error raised
    before anything was sent.
    """

    def __init__(self, *args: object, wire: WireRecord | None = None) -> None:
        super().__init__(*args)
        self.wire: WireRecord | None = wire


class ProviderHTTPError(ProviderError):
    """The provider answered with a non-2xx status."""

    def __init__(self, status: int, body: str, url: str, *,
                 retry_after: float | None = None) -> None:
        self.status = status
        self.body = body
        self.url = url
        #: The server's wait, when the request was refused with one that the
        #: turn defers to rather than sleeps through (RetryPolicy.defer_after).
        self.retry_after = retry_after
        excerpt = body if len(body) <= 500 else body[:500] + "..."
        super().__init__(f"HTTP {status} from {url}: {excerpt}")


class ProviderUnavailableError(ProviderError):
    """The provider could not be reached at all (the connection never opened):
    nothing was sent."""


#: Statuses that say the provider is out or overloaded for now, not that the
#: request is wrong: a turn that meets one past its retries waits for the
#: provider (SOLIDLOOP_PROVIDER_OUTAGE_MAX_WAIT) instead of failing.
OUTAGE_STATUSES = frozenset({429, 502, 503, 504, 529})


def is_provider_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the provider is away or overloaded for now."""
    return isinstance(exc, ProviderUnavailableError | ProviderConnectionLostError) or (
        isinstance(exc, ProviderHTTPError) and exc.status in OUTAGE_STATUSES)


class ProviderResponseError(ProviderError):
    """The provider answered 2xx with a body we could not interpret."""


class ProviderConnectionLostError(ProviderResponseError):
    """The connection broke after the request was sent (a provider restart, a
    dropped proxy): the request may have been served. An outage for the loop,
    deferred a few times at most (each deferral sends the request again)."""


class ProviderAnswerError(ProviderResponseError):
    """The provider answered in a way a retry would only repeat (an unknown
    finish reason, a blocked prompt): fail the turn without re-sending it."""


class TurnLimitError(ProviderAnswerError):
    """An LLM request passed one of its turn's hard limits (``limit``:
    ``"turn_timeout"``, the request's total wall time, or ``"max_output_chars"``,
    the answer's length): the request was ended there and is not sent again."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class HistoryTooLargeError(SolidLoopError):
    """A loop's history passed SOLIDLOOP_MAX_HISTORY_BYTES: its turn is not sent
    (the loop fails, naming both sizes)."""


class AbortedError(ProviderError):
    """The loop was paused or stopped while its turn waited to retry or read a
    stream: the request ends there and the turn writes nothing."""


class ToolDefinitionError(SolidLoopError, ValueError):
    """A tool was declared with an invalid name, schema or signature."""


class UnknownToolError(SolidLoopError, KeyError):
    """A toolset was asked for a tool it does not declare (``Toolset.get``); the
    message names the tools it has."""


class McpTransportError(SolidLoopError):
    """An MCP server could not be reached, timed out, refused us or broke the
    protocol. ``kind`` classifies it for the admin and the loop policy:
    ``connect``, ``timeout``, ``auth``, ``http``, ``protocol``, ``session``, ``spawn``.
    The tool turn turns it into a tool error the model sees (infra-classified)."""

    def __init__(self, kind: str, message: str, *, server: str | None = None) -> None:
        self.kind = kind
        self.server = server
        super().__init__(f"{server}: {message}" if server else message)


class McpAuthError(McpTransportError):
    """An OAuth-protected MCP server (``auth={"type": "oauth", ...}``) cannot be
    called: no token yet, a refresh the authorization server refused (revoked),
    or a fresh token the server still refuses. The message names the server and
    ``sign_in_url``, where a user signs in again; it fails the loop (failure
    class ``auth:oauth``) instead of becoming a tool error the model retries."""

    def __init__(self, message: str, *, server: str | None = None,
                 sign_in_url: str | None = None) -> None:
        self.sign_in_url = sign_in_url
        if sign_in_url:
            message = f"{message}; sign in at {sign_in_url}"
        super().__init__("auth", message, server=server)
class McpTokenRefusedError(SolidLoopError):
    """The MCP server blueprint (``oauth=``) does not let a request in: ``status``
    (401, 403 or 503) and the RFC 6750 ``error`` code (``invalid_token``,
    ``insufficient_scope``, ``temporarily_unavailable``; empty when no token was
    sent), ``description``, and for 403 the ``scope`` needed. Raised and
    answered inside the view (mcp_server/oauth.py); a host calling
    ``OAuthResource.authenticate`` itself sees it."""

    def __init__(self, status: int, error: str, description: str,
                 scope: str | None = None) -> None:
        super().__init__(description)
        self.status = status
        self.error = error
        self.description = description
        self.scope = scope


class LimitExceededError(SolidLoopError):
    """The agent reached max_steps or max_duration; the loop is paused."""


class BudgetExceededError(LimitExceededError):
    """A loop's or its subject's budget is spent; the loop is paused, and its
    message (``BudgetExceededError: ...``) names the limit and the spend.
    ``resume(budget=...)`` raises the loop's limits and continues."""


class LoopFailedError(SolidLoopError):
    """``Agent(loop).result()`` of a loop that failed (or was stopped): the
    loop's id and its error message are on the exception."""

    def __init__(self, loop_id: int, error_message: str | None) -> None:
        super().__init__(f"loop {loop_id} failed: {error_message or 'no error recorded'}")
        self.loop_id = loop_id
        self.error_message = error_message


class LostLeaseError(SolidLoopError):
    """This worker's generation no longer owns the loop; it must write nothing."""


class WaitTimeoutError(SolidLoopError, TimeoutError):
    """A bounded wait ran out before the work it waited on finished: a coroutine
    run through the MCP bridge (``run_sync``) that did not answer in time (the
    coroutine is cancelled)."""


class DecisionConflictError(SolidLoopError):
    """A decision on a waiting tool call (approve, deny, a supplied result) came
    after another one landed: exactly one decision is taken per call. It names
    the first: ``decision``, ``decided_by`` and ``decided_at``."""

    def __init__(self, tool_call_id: int, decision: str, decided_by: str | None,
                 decided_at: Any) -> None:
        self.tool_call_id = tool_call_id
        self.decision = decision
        self.decided_by = decided_by
        self.decided_at = decided_at
        if decision == "answered":
            super().__init__(f"tool call {tool_call_id} is answered already: nothing waits for "
                             "a decision on it")
            return
        who = f" by {decided_by}" if decided_by else ""
        when = f" at {decided_at.isoformat(timespec='seconds')}" if hasattr(
            decided_at, "isoformat") else ""
        super().__init__(f"tool call {tool_call_id} was {decision}{who}{when}; a call takes "
                         "one decision")


class ConversationBusyError(SolidLoopError):
    """``send_message`` to a loop that is queued, running or waiting, for an
    agent whose ``on_new_message`` is ``"reject"``: nothing was written. The
    loop's ``loop_id`` and ``status`` are on the exception."""

    def __init__(self, loop_id: int, status: str) -> None:
        super().__init__(f"loop {loop_id} is {status}; wait for it or set "
                         'on_new_message="queue"')
        self.loop_id = loop_id
        self.status = status


class BrokerError(SolidLoopError):
    """The Postgres job queue could not complete an operation."""


class BrokerUnavailableError(BrokerError, BrokerConnectionError):
    """PostgreSQL did not answer the broker. It is dramatiq's
    ``BrokerConnectionError`` too: dramatiq's workers back off and reconnect."""


class QueueNotDeclaredError(BrokerError, QueueNotFound):
    """A message or a consumer named a queue the broker has not declared (it is
    dramatiq's ``QueueNotFound`` too, as dramatiq's broker contract expects)."""


class ClaimLapsedError(BrokerError, SkipMessage):
    """A claimed job reached a worker thread after its claim lapsed (it was not
    started within half its lease, so its lease was not renewed and it may run
    elsewhere): it is handed back to its queue, never run here. It is
    dramatiq's ``SkipMessage`` too, so no other middleware runs for it."""


class JobError(BrokerError):
    """A host job could not be declared, sent, found or run."""


class JobEncodeError(JobError, TypeError):
    """The message encoder (``dramatiq.get_encoder()``) rejected a job's arguments."""


class InvalidJobError(JobError, ValueError):
    """A job, an actor or a queue was declared or sent with input that cannot work."""


class JobImportError(JobError, ImportError):
    """The worker could not import a job's function from its recorded path."""


class NoSuchJobError(JobError, LookupError):
    """No job has this id (it never existed, or the janitor pruned it)."""
