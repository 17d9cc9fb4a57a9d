"""The package's layers import only downward, and no two subpackages import each other.

Every ``import`` and ``from ... import`` in flask_solidloop/ (those inside
functions and under ``if TYPE_CHECKING:`` included: a type-only import is
still a dependency a reader has to follow) is resolved to the *unit* it names:
a subpackage (``loops``, ``queue``, ...) or a top-level module (``agent``,
``state``, ...). Each unit has a rank in LAYERS; an import from a unit to one
of higher rank fails the test, and so does any cycle between units, even
within one rank. A new module or subpackage must be given its place here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flask_solidloop

PACKAGE = Path(flask_solidloop.__file__).parent
NAME = "flask_solidloop"

#: Bottom first. Units of one rank may import each other (never in a cycle).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "config", "models", "migrations", "urls", "wire", "_typing", "_version", "dbapi",
     "jsontext", "limit_spec", "pooler", "telemetry"),
    ("llm", "mcp", "queue", "leases"),
    # signals: blinker notifications sent by loops.store after its commits.
    ("state", "database", "signals"),
    # Host jobs sit beside loops: they need the broker and the state, and the
    # runtime, maintenance and the extension above use them (decision 0010).
    ("loops", "jobs"),
    # Budgets and rate limits write tables of their own through the store's
    # transaction helpers, and read loops; the pipeline asks them before a request.
    ("limits", "streaming"),
    ("pipeline",),
    ("runtime", "maintenance"),
    # The top: the public face, the CLI and what ships for users' tests. The
    # admin and MCP-server blueprints will live here too, reading through
    # loops.queries and acting through loops.control.
    ("agent", "extension", "cli", "demo", "render", "worker", "testing", "__init__",
     "admin", "mcp_server", "spending"),
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """``flask_solidloop.loops.store`` -> ``loops``; ``flask_solidloop`` -> ``__init__``."""
    parts = module.split(".")
    assert parts[0] == NAME, module
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of our own package in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names
                      if alias.name.split(".")[0] == NAME]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != NAME:
                continue
            if node.module is None or target == NAME:
                # ``from .. import x``: each x may itself be a module of the package.
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'file:line') for every cross-unit import."""
    result = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source_unit = unit_of(module_name(path))
        for line, target in imports_of(path):
            target_unit = unit_of(target)
            if target_unit != source_unit:
                result.append((source_unit, target_unit,
                               f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return result


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    missing = sorted(units - set(RANK))
    assert not missing, f"give these a place in LAYERS: {missing}"


def test_no_import_runs_up_the_layers():
    upward = [f"{where}: {src} (layer {RANK[src]}) imports {dst} (layer {RANK[dst]})"
              for src, dst, where in edges()
              if src in RANK and dst in RANK and RANK[dst] > RANK[src]]
    assert not upward, "imports that run up the layer order:\n" + "\n".join(upward)


def test_no_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges():
        graph.setdefault(src, set()).add(dst)
    assert cycles(graph) == []


def test_the_checks_can_fail():
    # The cycle finder sees a cycle, and an upward edge is ranked as one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert RANK["loops"] > RANK["queue"] and RANK["pipeline"] > RANK["loops"]
    # Relative imports resolve to the right unit (this checker would miss edges otherwise).
    llm_turn = PACKAGE / "loops" / "store" / "llm_turn.py"
    assert "flask_solidloop.queue.current_job" in {target for _, target in imports_of(llm_turn)}
