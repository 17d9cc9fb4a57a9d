"""Provider-neutral shapes that dialects translate to and from the wire."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import AgentDefinitionError, ConfigurationError

PROVIDER_KEYS = {
    "dialect": "wire format: 'openai' (any OpenAI-compatible server), 'openai_responses' "
               "(OpenAI's Responses API), 'anthropic' or 'gemini'",
    "base_url": "origin of the server, e.g. https://api.openai.com (no /v1)",
    "model": "model name sent in the payload (openai, anthropic) or the URL (gemini)",
    "url_model": "gemini only: the model put in the request URL instead of model "
                 "(a name, or a resource path such as tunedModels/my-model)",
    "llm_model_name": "another name for url_model",
    "api_key": "the key itself (prefer api_key_env; never stored)",
    "api_key_env": "name of the environment variable holding the key, read at run time",
    "read_timeout": "seconds of silence allowed between reads",
    "connect_timeout": "seconds allowed to open the connection",
    "headers": "extra HTTP headers sent on every request",
    "max_tokens_param": "'max_tokens' or 'max_completion_tokens' (openai dialect)",
    "anthropic_version": "the anthropic-version header (anthropic dialect)",
    "previous_response_id": "openai_responses only: True stores responses on the server "
                            "and sends only the new items with the last response's id",
}

DIALECTS = ("openai", "openai_responses", "anthropic", "gemini")
DEFAULT_ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class ProviderSettings:
    """An agent's validated ``llm`` settings. The API key is resolved per call."""

    dialect: str
    base_url: str
    model: str
    api_key: str | None = None
    api_key_env: str | None = None
    read_timeout: float | None = None
    connect_timeout: float = 10.0
    headers: dict[str, str] = field(default_factory=dict)
    max_tokens_param: str = "max_tokens"
    anthropic_version: str = DEFAULT_ANTHROPIC_VERSION
    #: Gemini only: the model named in the request URL when it differs from
    #: ``model`` (a gateway's deployment name, a tuned model's resource path);
    #: ``model`` stays the name recorded on messages and priced.
    url_model: str | None = None
    #: openai_responses only: chain requests with ``previous_response_id``
    #: (``store: true``) instead of sending the whole history each time.
    previous_response_id: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, agent: str) -> ProviderSettings:
        if not isinstance(data, dict):
            raise AgentDefinitionError(
                f"agent {agent!r}: llm must be a dict of provider settings, "
                f"got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(PROVIDER_KEYS))
        if unknown:
            known = ", ".join(PROVIDER_KEYS)
            raise AgentDefinitionError(
                f"agent {agent!r}: unknown llm setting(s) {', '.join(unknown)}; known: {known}"
            )
        missing = [k for k in ("base_url", "model") if not data.get(k)]
        if missing:
            raise AgentDefinitionError(
                f"agent {agent!r}: llm needs {' and '.join(missing)} "
                "(e.g. llm = {'base_url': 'https://api.openai.com', 'model': 'gpt-4o', "
                "'api_key_env': 'OPENAI_API_KEY'})"
            )
        dialect = data.get("dialect", "openai")
        if dialect not in DIALECTS:
            raise AgentDefinitionError(
                f"agent {agent!r}: unknown llm dialect {dialect!r}; known: {', '.join(DIALECTS)}"
            )
        base_url = str(data["base_url"]).rstrip("/")
        for suffix in ("/v1", "/v1beta"):
            if base_url.endswith(suffix):
                raise AgentDefinitionError(
                    f"agent {agent!r}: llm base_url {base_url!r} ends in {suffix}. Give the "
                    f"origin only ({base_url[:-len(suffix)]!r}); the dialect appends its own "
                    "path (/v1/chat/completions, /v1/messages or /v1beta/models/...)."
                )
        if not base_url.startswith(("http://", "https://")):
            raise AgentDefinitionError(
                f"agent {agent!r}: llm base_url {base_url!r} must start with http:// or https://"
            )
        read_timeout = data.get("read_timeout")
        if read_timeout is not None and (
            isinstance(read_timeout, bool) or not isinstance(read_timeout, int | float)
            or read_timeout <= 0
        ):
            raise AgentDefinitionError(
                f"agent {agent!r}: llm read_timeout must be a positive number of seconds, "
                f"got {read_timeout!r}"
            )
        param = data.get("max_tokens_param", "max_tokens")
        if param not in ("max_tokens", "max_completion_tokens"):
            raise AgentDefinitionError(
                f"agent {agent!r}: llm max_tokens_param must be 'max_tokens' or "
                f"'max_completion_tokens', got {param!r}"
            )
        if data.get("url_model") is not None and data.get("llm_model_name") is not None:
            raise AgentDefinitionError(
                f"agent {agent!r}: llm url_model and llm_model_name are one setting; "
                "keep url_model")
        url_model = _url_model(data.get("url_model", data.get("llm_model_name")), dialect,
                               agent)
        chain = data.get("previous_response_id", False)
        if not isinstance(chain, bool):
            raise AgentDefinitionError(
                f"agent {agent!r}: llm previous_response_id must be True or False, "
                f"got {chain!r}")
        if chain and dialect != "openai_responses":
            raise AgentDefinitionError(
                f"agent {agent!r}: llm previous_response_id is read only when "
                f"dialect='openai_responses' (the {dialect} dialect sends the whole history); "
                "remove it or set dialect='openai_responses'")
        return cls(
            previous_response_id=chain,
            dialect=dialect,
            base_url=base_url,
            model=str(data["model"]),
            api_key=data.get("api_key"),
            api_key_env=data.get("api_key_env"),
            read_timeout=read_timeout,
            connect_timeout=float(data.get("connect_timeout", 10.0)),
            headers=dict(data.get("headers") or {}),
            max_tokens_param=param,
            anthropic_version=str(data.get("anthropic_version") or DEFAULT_ANTHROPIC_VERSION),
            url_model=url_model,
        )

    def resolve_api_key(self) -> str | None:
        """The key, read now from the environment when configured that way.

        Surrounding whitespace (a trailing newline from a secrets file) is
        stripped; a key with control characters inside is refused without
        echoing it, because an HTTP library would put it in an error message.
        """
        source = "llm api_key"
        value = self.api_key
        if not value and self.api_key_env:
            source = f"environment variable {self.api_key_env}"
            value = os.environ.get(self.api_key_env)
            if not value or not value.strip():
                raise ConfigurationError(
                    self.api_key_env, "(unset)" if value is None else "(empty)",
                    "the agent's llm api_key_env names this environment variable, but it is "
                    "unset or empty in the worker's environment",
                )
        if not value:
            return None
        value = value.strip()
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise ConfigurationError(
                self.api_key_env or "llm.api_key", "(hidden)",
                f"the API key from {source} contains control characters; check how the "
                "secret is written (the value is not shown)",
            )
        return value


def _url_model(value: Any, dialect: str, agent: str) -> str | None:
    """The validated ``url_model``: a model name or resource path for Gemini's URL."""
    if value is None:
        return None
    if dialect != "gemini":
        raise AgentDefinitionError(
            f"agent {agent!r}: llm url_model is read only when dialect='gemini' (the "
            f"{dialect} dialect sends model in the payload); remove it or set "
            "dialect='gemini'"
        )
    if not isinstance(value, str) or not value.strip() or value != value.strip() \
            or value.startswith("/") or ":" in value or any(ch.isspace() for ch in value):
        raise AgentDefinitionError(
            f"agent {agent!r}: llm url_model must be a model name or resource path "
            f"without spaces, a leading '/' or ':' (e.g. 'gemini-2.5-flash' or "
            f"'tunedModels/my-model'), got {value!r}"
        )
    return value


@dataclass
class ChatMessage:
    """One history entry as the dialects see it."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    #: Dialect data kept from the response that produced this message, sent back
    #: as-is: "anthropic_blocks" (the content blocks, thinking and signatures in
    #: order), "gemini_parts" (the parts, thoughtSignature included),
    #: "responses_items" / "responses_id" (OpenAI Responses: the output order with
    #: the reasoning items verbatim, and the response's id).
    meta: dict[str, Any] = field(default_factory=dict)
    #: For role "tool": whether the result was an error (Anthropic's is_error).
    is_error: bool = False
    #: The stored message's id, for a history read from the database (None for
    #: one made in memory); never rendered.
    message_id: int | None = field(default=None, compare=False)


@dataclass
class ToolCallRequest:
    """A tool call as the model asked for it; ``arguments_raw`` is the JSON text."""

    call_id: str | None
    name: str
    arguments_raw: str


@dataclass
class Usage:
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            "output_tokens": self.output_tokens,
            "reasoning_tokens": self.reasoning_tokens,
        }


@dataclass
class AssistantTurn:
    """What one LLM call produced."""

    content: str | None
    tool_calls: list[ToolCallRequest]
    finish_reason: str | None
    usage: Usage | None = None
    reasoning: str | None = None
    raw: dict[str, Any] | None = None
    #: Dialect data to store on the message and give back next turn (see ChatMessage.meta).
    provider_meta: dict[str, Any] = field(default_factory=dict)
    #: The model declined to answer, in its own words (OpenAI ``message.refusal`` /
    #: ``delta.refusal``); the turn's finish_reason is then ``"refusal"``.
    refusal: str | None = None
