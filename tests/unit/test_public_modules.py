"""The public surface is declared: the modules a host may import from
(:data:`PUBLIC`, listed in docs/index.md under "The public API"), each with an
``__all__``; every other module is internal and may change in any release.
The docs, the README and the example app import from public modules only,
and only names those modules export."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import flask_solidloop

ROOT = Path(flask_solidloop.__file__).parent.parent
#: The modules a host imports from.
PUBLIC = (
    "flask_solidloop",
    "flask_solidloop.errors",
    "flask_solidloop.models",
    "flask_solidloop.signals",
    "flask_solidloop.state",
    "flask_solidloop.database",
    "flask_solidloop.migrations",
    "flask_solidloop.pipeline",
    "flask_solidloop.mcp.transport",
    "flask_solidloop.mcp.oauth_blueprint",
    "flask_solidloop.mcp_server",
    "flask_solidloop.testing",
)
_FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each ``from flask_solidloop... import ...`` in ``code``."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # a fragment with elisions ("..."): nothing to read
    return [(node.module, [alias.name for alias in node.names])
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] == "flask_solidloop"]


def documented_imports() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if "decisions" in path.parts:
            continue  # the records narrate the code as it was
        for block in _FENCE.findall(path.read_text()):
            found += [(path.name, module, names) for module, names in imports(block)]
    for path in sorted((ROOT / "example_app").rglob("*.py")):
        found += [(path.name, module, names) for module, names in imports(path.read_text())]
    return found


def test_every_public_module_declares_what_it_exports():
    for name in PUBLIC:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported, f"{name} has no __all__"
        missing = [n for n in exported if not hasattr(module, n)]
        assert missing == [], (name, missing)


def test_the_docs_import_only_public_names():
    found = documented_imports()
    assert len(found) > 10  # the docs do import things (a check of nothing proves nothing)
    def internal(module: str, names: list[str]) -> bool:
        if module not in PUBLIC:
            return True
        # A public submodule imported by name (``from flask_solidloop import signals``).
        exported = set(importlib.import_module(module).__all__)
        return any(name not in exported and f"{module}.{name}" not in PUBLIC for name in names)

    private = [f"{where}: from {module} import {', '.join(names)}"
               for where, module, names in found if internal(module, names)]
    assert private == [], "docs import internals:\n" + "\n".join(private)


def test_the_placement_anchors_are_public():
    from flask_solidloop import pipeline

    for anchor in ("ErrorHandling", "AgentInitialization", "NetworkCalling",
                   "ResponseParsing", "ToolExecution", "ResponseCreation",
                   "ToolCallXmlParser", "Builder", "LlmContext", "ToolContext"):
        assert anchor in pipeline.__all__


def test_the_check_finds_an_internal_import():
    assert imports("from flask_solidloop.pipeline.llm_stack import AgentInitialization") == [
        ("flask_solidloop.pipeline.llm_stack", ["AgentInitialization"])]
    assert imports("x = 1\nfrom flask_solidloop import Agent, ...") == []
