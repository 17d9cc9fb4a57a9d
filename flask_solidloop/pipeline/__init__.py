"""Middleware pipelines that wrap each LLM turn and each tool turn.

The public face of the pipeline: the :class:`Builder` a ``configure_*_middlewares``
hook edits, the two contexts a middleware sees, and the built-in steps a host
places its own middlewares against (the placement anchors). See
docs/guides/middlewares.md.
"""

from .builder import Builder
from .compaction import Compaction
from .context import LlmContext, ToolContext
from .llm_stack import AgentInitialization, ErrorHandling, NetworkCalling, ResponseParsing
from .tool_stack import ResponseCreation, ToolExecution
from .xml_tools import ToolCallXmlParser

__all__ = [
    "AgentInitialization",
    "Builder",
    "Compaction",
    "ErrorHandling",
    "LlmContext",
    "NetworkCalling",
    "ResponseCreation",
    "ResponseParsing",
    "ToolCallXmlParser",
    "ToolContext",
    "ToolExecution",
]
