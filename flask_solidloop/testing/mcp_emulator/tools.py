"""Tools: the definition :meth:`MCPEmulator.tool` registers (:func:`make_tool` checks
what it was given), a call's arguments checked against the input schema, and a
result in any accepted shape turned into a validated ``CallToolResult``."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from typing import Any

import mcp.types as mcp_types
from pydantic import BaseModel

from ...errors import InvalidArgumentError
from .types import TOOL_NAME_RE, Handler, Tool

logger = logging.getLogger(__name__)

_RESULT_KEYS = frozenset({"content", "structuredContent", "isError", "_meta", "resultType"})


def make_tool(
    name: str,
    *,
    description: str,
    input_schema: dict[str, Any] | None,
    result: Any,
    handler: Handler | None,
    output_schema: dict[str, Any] | None,
    annotations: dict[str, Any] | None,
) -> Tool:
    """The tool ``MCPEmulator.tool`` registers: its arguments checked, its ``tools/list``
    entry validated by the SDK's ``Tool`` model."""
    if not TOOL_NAME_RE.match(name):
        raise InvalidArgumentError(
            f"invalid MCP tool name {name!r}: must match {TOOL_NAME_RE.pattern}")
    if result is not None and handler is not None:
        raise InvalidArgumentError("pass result or handler, not both")
    if handler is not None and not callable(handler):
        raise InvalidArgumentError("handler must be callable")
    if result is not None:
        normalise_result(result)  # fail in the test, not in the server thread
    schema = copy.deepcopy(input_schema) if input_schema is not None else {
        "type": "object", "properties": {},
    }
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidArgumentError(
            'input_schema must be a JSON Schema object with "type": "object"')
    wire: dict[str, Any] = {"name": name, "inputSchema": schema}
    if description:
        wire["description"] = description
    if output_schema is not None:
        wire["outputSchema"] = copy.deepcopy(output_schema)
    if annotations is not None:
        wire["annotations"] = copy.deepcopy(annotations)
    definition = mcp_types.Tool.model_validate(wire, by_name=False).model_dump(
        by_alias=True, mode="json", exclude_none=True
    )
    return Tool(definition, schema, copy.deepcopy(result), handler)


def _is_full_result(value: Mapping[str, Any]) -> bool:
    return isinstance(value.get("content"), list) and set(value) <= _RESULT_KEYS


def normalise_result(value: Any) -> dict[str, Any]:
    """A tool's result in any accepted shape -> a CallToolResult wire dict (validated)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True, mode="json", exclude_none=True)
    if isinstance(value, str):
        data: dict[str, Any] = {"content": [{"type": "text", "text": value}]}
    elif isinstance(value, Mapping):
        if _is_full_result(value):
            data = dict(value)
        else:
            structured = dict(value)
            data = {
                "content": [{"type": "text", "text": json.dumps(structured, ensure_ascii=False)}],
                "structuredContent": structured,
            }
    else:
        raise InvalidArgumentError(
            "a tool result must be a str, a dict or an mcp.types.CallToolResult, "
            f"not {type(value).__name__}"
        )
    model = mcp_types.CallToolResult.model_validate(data, by_name=False)
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def error_result(message: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": message}], "isError": True}


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """A message describing why ``arguments`` do not match ``schema``, or None."""
    try:
        from jsonschema import exceptions as jsonschema_exceptions
        from jsonschema.validators import validator_for
    except ImportError:  # pragma: no cover - jsonschema comes with the mcp SDK
        return None
    try:
        validator = validator_for(schema)(schema)
        error = jsonschema_exceptions.best_match(validator.iter_errors(arguments))
    except Exception as exc:  # an unusable schema must not take the server down
        logger.warning("MCPEmulator: could not validate arguments: %r", exc)
        return None
    return None if error is None else f"Input validation error: {error.message}"
