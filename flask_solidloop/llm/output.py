"""Structured output: an agent's ``output_type`` as the JSON Schema its loops
start with, an answer lifted out of a turn and validated against that schema,
and the message a model reads when its answer does not match. Pure: no I/O.

The dialects own how the schema goes on the wire (OpenAI ``response_format``,
Gemini ``responseSchema``, a forced :data:`OUTPUT_TOOL` for Anthropic, and for
Gemini when the agent has tools); the LLM stack owns the validation
(pipeline/llm_stack.py); docs/decisions/0036-structured-output.md has the
design.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from ..errors import AgentDefinitionError
from .types import AssistantTurn

#: The tool an answer is given through where the dialect has no native
#: mechanism for the request (Anthropic; Gemini beside other tools).
OUTPUT_TOOL = "final_answer"
OUTPUT_TOOL_DESCRIPTION = (
    "Give your final answer. Call this exactly once, when you have the answer, with "
    "the answer as the arguments; the conversation ends with it.")
#: Errors quoted back to the model (the rest are counted).
MAX_QUOTED_ERRORS = 8


def schema_of(output_type: Any, *, agent: str) -> dict[str, Any] | None:
    """The JSON Schema of an agent's ``output_type`` (a pydantic model class or a
    JSON Schema dict), checked; None for None. AgentDefinitionError names a
    bad one."""
    if output_type is None:
        return None
    if isinstance(output_type, type) and hasattr(output_type, "model_json_schema"):
        schema = output_type.model_json_schema()
    elif isinstance(output_type, dict):
        schema = copy.deepcopy(output_type)
    else:
        raise AgentDefinitionError(
            f"agent {agent!r}: output_type must be a pydantic model class or a JSON Schema "
            f"dict, got {output_type!r}")
    if schema.get("type") != "object":
        raise AgentDefinitionError(
            f"agent {agent!r}: output_type must describe an object (a JSON Schema with "
            f"\"type\": \"object\"), got type {schema.get('type')!r}; wrap a list or a "
            "scalar in a field of a model")
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
        json.dumps(schema)
    except (SchemaError, TypeError, ValueError) as exc:
        raise AgentDefinitionError(
            f"agent {agent!r}: output_type is not a valid JSON Schema: "
            f"{getattr(exc, 'message', exc)}") from None
    return schema


def model_class(output_type: Any) -> type | None:
    """The pydantic model class an ``output_type`` is, or None (a schema dict)."""
    if isinstance(output_type, type) and hasattr(output_type, "model_validate"):
        return output_type
    return None


def lift_answer(turn: AssistantTurn) -> tuple[AssistantTurn, dict[str, Any] | None]:
    """The turn with an answer given through :data:`OUTPUT_TOOL` as its text (the
    call's arguments), and that call (``{"call_id", "arguments_raw"}``, for the
    message's metadata); the turn unchanged and None when it made no such
    call. The call's siblings are dropped with it: the answer ends the turn,
    and a tool call left without its result would break the next request of
    every dialect. The stored message is then plain text, which any dialect
    renders."""
    chosen = next((call for call in turn.tool_calls if call.name == OUTPUT_TOOL), None)
    if chosen is None:
        return turn, None
    import dataclasses

    dropped = [call.name for call in turn.tool_calls if call is not chosen]
    lifted: dict[str, Any] = {"call_id": chosen.call_id}
    if dropped:
        lifted["dropped_calls"] = dropped
    text = chosen.arguments_raw or ""
    finish = "stop" if turn.finish_reason in ("tool_calls", None) else turn.finish_reason
    return dataclasses.replace(turn, content=text, tool_calls=[], finish_reason=finish), lifted


@dataclass(frozen=True)
class Checked:
    """An answer checked against the loop's schema: its value when it matched,
    else the error the model is told."""

    value: Any = None
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


def check(text: str | None, schema: dict[str, Any], model: type | None = None) -> Checked:
    """``text`` (the answer) parsed as JSON and validated against ``schema``; then,
    with ``model`` (the agent's pydantic class, when its schema is the loop's),
    by the model too (its own validators). Never raises."""
    raw = (text or "").strip()
    if raw.startswith("```"):
        # A fenced block around the JSON: taken as what it holds.
        raw = raw.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        excerpt = raw[:80] + ("..." if len(raw) > 80 else "")
        return Checked(error=f"the answer is not JSON ({exc}); it began: {excerpt!r}")
    from jsonschema.validators import validator_for

    validator = validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"at {_where(e.absolute_path)}: {e.message}" for e in errors[:MAX_QUOTED_ERRORS]]
        more = len(errors) - MAX_QUOTED_ERRORS
        if more > 0:
            lines.append(f"and {more} more")
        return Checked(error="; ".join(lines))
    if model is not None:
        try:
            model.model_validate(value)  # type: ignore[attr-defined]
        except Exception as exc:  # pydantic.ValidationError, or a validator's own error
            return Checked(error=_pydantic_errors(exc))
    return Checked(value=value)


def _where(path: Any) -> str:
    parts = list(path)
    if not parts:
        return "the top level"
    return "'" + ".".join(str(p) for p in parts) + "'"


def _pydantic_errors(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            listed = errors()
        except Exception:
            listed = None
        if listed:
            return "; ".join(f"at {_where(e.get('loc', ()))}: {e.get('msg')}"
                             for e in listed[:MAX_QUOTED_ERRORS])
    return f"{type(exc).__name__}: {exc}"


def retry_message(error: str, attempt: int, attempts: int) -> str:
    """The user message that carries a validation error back to the model."""
    return (f"Your answer does not match the required output schema: {error}. "
            f"Answer again with a corrected answer that matches the schema "
            f"(attempt {attempt + 1} of {attempts}).")


def failure_message(error: str, attempts: int) -> str:
    """A loop's error message when its last allowed answer was invalid (the
    failure class ``output_invalid``: loops/queries.FAILURE_CLASSES)."""
    return (f"OutputInvalidError: the answer did not match the output schema after "
            f"{attempts} attempt(s): {error}")


def final_failure(refusal: str | None, finish_reason: str | None) -> str | None:
    """A loop's error message for an invalid answer no retry can mend, else
    None: the model refused (its words), or the answer was cut at the output
    token limit (the same request would be cut again). Class ``output_invalid``."""
    if refusal or finish_reason == "refusal":
        return (f"OutputInvalidError: the model refused to answer in the output schema: "
                f"{refusal or '(it gave no reason)'}")
    if finish_reason == "length":
        return ("OutputInvalidError: the answer was cut at the output token limit "
                "(finish_reason 'length') before it matched the output schema; raise the "
                "agent's max_tokens")
    return None


def instance(output_type: Any, value: Any) -> Any:
    """``value`` as the agent's ``output_type`` sees it: an instance of its model
    class, or the value itself (a schema dict)."""
    model = model_class(output_type)
    return model.model_validate(value) if model is not None else value  # type: ignore[attr-defined]
