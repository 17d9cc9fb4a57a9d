"""Every exception the package raises comes from its one tree (flask_solidloop/errors.py).

Each ``raise X(...)``, ``raise module.X(...)`` and ``raise X`` in flask_solidloop/
is resolved statically, through the names its module defines and imports (those
inside functions included), to the class it raises. The class must be
:class:`~flask_solidloop.errors.SolidLoopError` or derive from it: a class of
errors.py, or a subclass defined anywhere in the package (an internal signal
such as the send path's retry). A call of a function or method (``raise
self._error(...)``) counts as raising the class its return annotation names.

Allowed besides: click's exceptions in cli.py and demo.py (the body of ``flask
solidloop demo``), which is how a command fails; ``dramatiq.Retry`` (how a
dramatiq actor asks to be retried); and where the package plays another
framework's part, the exception that framework reads: pytest's ``UsageError``
in the pytest plugin, the MCP SDK's ``MCPError`` in the MCP emulator's handlers
(a JSON-RPC error) and its ``ToolError`` in a tool of the SDK test server. Re-raising is
fine: a bare ``raise``, or ``raise exc`` of a name the module does not define
(a caught or stored exception). A called name the module does not define
cannot be checked, and fails too.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import flask_solidloop

PACKAGE = Path(flask_solidloop.__file__).parent
NAME = "flask_solidloop"
BASE = f"{NAME}.errors.SolidLoopError"

#: Raised anywhere: dramatiq's request to retry the message (``dramatiq.Retry``
#: is ``dramatiq.errors.Retry`` re-exported).
ALLOWED = {"dramatiq.Retry", "dramatiq.errors.Retry"}
#: Raised in one module: the prefixes of the classes it may raise. demo.py is the
#: body of the ``flask solidloop demo`` command.
ALLOWED_IN = {f"{NAME}.cli": ("click.",), f"{NAME}.demo": ("click.",),
              f"{NAME}.testing.plugin": ("pytest.",),
              f"{NAME}.testing.mcp_emulator.server": ("mcp.shared.exceptions.",),
              f"{NAME}.testing.mcp_sdk_server": ("mcp.server.mcpserver.exceptions.",)}


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    #: name -> the dotted name it stands for (a module, a class, a function, ...)
    symbols: dict[str, str] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)


def package_sources() -> dict[str, tuple[str, str]]:
    """module name -> (path shown in reports, source) for every module of the package."""
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        shown = str(path.relative_to(PACKAGE.parent))
        sources[".".join(parts)] = (shown, path.read_text())
    return sources


class Checker:
    def __init__(self, sources: dict[str, tuple[str, str]]) -> None:
        self.modules: dict[str, Module] = {}
        for name, (path, source) in sources.items():
            self.modules[name] = Module(name, path, ast.parse(source, filename=path))
        for module in self.modules.values():
            self._index(module)
        self.checked = 0

    # -- the names each module binds -------------------------------------------

    def _index(self, module: Module) -> None:
        is_package = module.path.endswith("__init__.py")
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.symbols[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        module.symbols[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(module.name, is_package, node.module, node.level)
                for alias in node.names:
                    if alias.name != "*":
                        module.symbols[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
                module.symbols[node.name] = f"{module.name}.{node.name}"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                module.functions[node.name] = node
                module.symbols[node.name] = f"{module.name}.{node.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                dotted = _dotted(node.value)
                if dotted is not None:  # an alias: Name = other.Name
                    module.symbols[node.targets[0].id] = f"{module.name}.=" + dotted

    @staticmethod
    def _absolute(current: str, is_package: bool, target: str | None, level: int) -> str:
        if level == 0:
            return target or ""
        parts = current.split(".")
        if not is_package:
            parts.pop()
        parts = parts[: len(parts) - (level - 1)]
        return ".".join([*parts, target] if target else parts)

    # -- from an expression to what it names --------------------------------------

    def resolve_expr(self, module: Module, expr: ast.expr) -> str | None:
        """The canonical dotted name ``expr`` stands for in ``module``, or None when
        its first name is not bound by the module (a local variable)."""
        dotted = _dotted(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in module.symbols:
            target = module.symbols[head]
        elif isinstance(getattr(builtins, head, None), type):
            target = f"builtins.{head}"
        else:
            return None
        return self.canonical(f"{target}.{rest}" if rest else target, module)

    def canonical(self, dotted: str, within: Module | None = None, depth: int = 0) -> str:
        """Follow re-exports and aliases inside the package to where a name is defined."""
        if depth > 20:
            return dotted
        if "=" in dotted:  # "module.=alias.path": an assignment alias in that module
            owner, _, aliased = dotted.partition(".=")
            module = self.modules[owner]
            resolved = self.resolve_expr(module, _parse_dotted(aliased))
            return resolved if resolved is not None else dotted
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in self.modules:
                rest = parts[cut:]
                if not rest:
                    return prefix
                module = self.modules[prefix]
                first = rest[0]
                if first in module.classes or first in module.functions:
                    return dotted
                if first in module.symbols:
                    target = module.symbols[first]
                    return self.canonical(".".join([target, *rest[1:]]), module, depth + 1)
                return dotted
        return dotted

    def split(self, dotted: str) -> tuple[Module, list[str]] | None:
        """The package module ``dotted`` lies in and the names after it."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in self.modules:
                return self.modules[prefix], parts[cut:]
        return None

    def package_class(self, dotted: str) -> tuple[Module, ast.ClassDef] | None:
        found = self.split(dotted)
        if found is None:
            return None
        module, rest = found
        if len(rest) == 1 and rest[0] in module.classes:
            return module, module.classes[rest[0]]
        return None

    def package_function(self, dotted: str
                         ) -> tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        found = self.split(dotted)
        if found is None:
            return None
        module, rest = found
        if len(rest) == 1 and rest[0] in module.functions:
            return module, module.functions[rest[0]]
        if len(rest) == 2 and rest[0] in module.classes:  # Class.method
            method = _method(module.classes[rest[0]], rest[1])
            if method is not None:
                return module, method
        return None

    def in_tree(self, dotted: str, seen: frozenset[str] = frozenset()) -> bool:
        if dotted == BASE:
            return True
        found = self.package_class(dotted)
        if found is None or dotted in seen:
            return False
        module, node = found
        for base in node.bases:
            resolved = self.resolve_expr(module, base)
            if resolved is not None and self.in_tree(resolved, seen | {dotted}):
                return True
        return False

    # -- the check -------------------------------------------------------------

    def violations(self) -> list[str]:
        found = []
        for module in self.modules.values():
            found += self._check(module)
        return found

    def _check(self, module: Module) -> list[str]:
        reports = []

        def visit(node: ast.AST, owner: ast.ClassDef | None) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, child)
                    continue
                if isinstance(child, ast.Raise) and child.exc is not None:
                    problem = self._judge(module, child.exc, owner)
                    if problem is not None:
                        reports.append(f"{module.path}:{child.lineno}: {problem}")
                visit(child, owner)

        visit(module.tree, None)
        return reports

    def _judge(self, module: Module, exc: ast.expr, owner: ast.ClassDef | None) -> str | None:
        called = isinstance(exc, ast.Call)
        target = exc.func if isinstance(exc, ast.Call) else exc
        shown = ast.unparse(target)
        # self._error(...) / cls._error(...): a method of the enclosing class
        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id in ("self", "cls")):
            method = self._method_of(module, owner, target.attr)
            if method is None:
                return f"raise {shown}(...): no such method in the enclosing class to check"
            self.checked += 1
            return self._judge_function(module, method, shown)
        resolved = self.resolve_expr(module, target)
        if resolved is None:
            if not called:
                return None  # re-raising a caught or stored exception
            return f"raise {shown}(...): not a name this module defines or imports"
        self.checked += 1
        function = self.package_function(resolved)
        if function is not None:
            if not called:
                return f"raise {shown}: a function, not an exception"
            return self._judge_function(*function, shown)
        return self._judge_class(module, resolved, shown)

    def _judge_function(self, module: Module, function: ast.FunctionDef | ast.AsyncFunctionDef,
                        shown: str) -> str | None:
        returns = function.returns
        if isinstance(returns, ast.Constant) and isinstance(returns.value, str):
            returns = ast.parse(returns.value, mode="eval").body
        resolved = self.resolve_expr(module, returns) if returns is not None else None
        if resolved is None:
            return (f"raise {shown}(...): give {function.name} a return annotation naming "
                    "the class it returns")
        problem = self._judge_class(module, resolved, shown)
        return None if problem is None else f"{problem} (the return type of {function.name})"

    def _judge_class(self, module: Module, resolved: str, shown: str) -> str | None:
        if self.in_tree(resolved) or resolved in ALLOWED:
            return None
        if resolved.startswith(ALLOWED_IN.get(module.name, ())):
            return None
        return (f"raises {resolved}, not a class of the flask_solidloop.errors tree "
                f"(raise {shown})")

    def _method_of(self, module: Module, owner: ast.ClassDef | None, name: str,
                   ) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        if owner is None:
            return None
        method = _method(owner, name)
        if method is not None:
            return method
        for base in owner.bases:  # inherited from a package class
            resolved = self.resolve_expr(module, base)
            found = self.package_class(resolved) if resolved else None
            if found is not None:
                inherited = self._method_of(found[0], found[1], name)
                if inherited is not None:
                    return inherited
        return None


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    return None


def _dotted(expr: ast.expr) -> str | None:
    """``a.b.C`` -> "a.b.C"; None for anything but a name or an attribute chain."""
    names = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    names.append(expr.id)
    return ".".join(reversed(names))


def _parse_dotted(dotted: str) -> ast.expr:
    return ast.parse(dotted, mode="eval").body


# --------------------------------------------------------------------------- tests


def test_every_raise_in_the_package_is_from_the_tree():
    checker = Checker(package_sources())
    found = checker.violations()
    assert checker.checked > 300  # the walk reached the package's raises
    assert found == [], "raise a class of flask_solidloop.errors:\n" + "\n".join(found)


PLANTED = textwrap.dedent('''
    import click
    import dramatiq

    from . import errors
    from .errors import ConfigurationError as Conf
    from .mcp.toolset import _ArgumentError

    Alias = errors.SetupError
    BadAlias = LookupError


    class Local(errors.InvalidArgumentError):
        pass


    class Stray(ValueError):
        pass


    def make() -> errors.SetupError:
        return errors.SetupError("x")


    def make_bad() -> KeyError:
        return KeyError("x")


    def bare():
        return ValueError("x")


    class Transport:
        def _error(self) -> Conf:
            return Conf("K", 1, "rule")

        def _wrong(self) -> RuntimeError:
            return RuntimeError("x")

        def run(self, exc):
            raise self._error()
            raise self._wrong()  # bad
            raise self._missing()  # bad


    def f(exc):
        raise Conf("K", 1, "rule")
        raise errors.SetupError("x")
        raise Local("x")
        raise Alias("x")
        raise _ArgumentError("x")
        raise make()
        raise dramatiq.Retry(delay=1)
        raise exc
        raise
        raise ValueError("x")  # bad
        raise Stray("x")  # bad
        raise make_bad()  # bad
        raise bare()  # bad
        raise BadAlias("x")  # bad
        raise click.ClickException("x")  # bad: click is for cli.py
        raise NotImplementedError  # bad
        raise unknown_factory("x")  # bad
''')


def test_a_planted_violation_is_reported_and_the_allowed_raises_are_not():
    sources = package_sources()
    sources[f"{NAME}._planted"] = (f"{NAME}/_planted.py", PLANTED)
    planted = [line for line in Checker(sources).violations()
               if line.startswith(f"{NAME}/_planted.py:")]
    lines = {int(line.split(":")[1]) for line in planted}
    expected = {number for number, text in enumerate(PLANTED.splitlines(), 1)
                if text.rstrip().endswith("# bad") or "# bad:" in text}
    assert len(expected) == 10
    assert lines == expected, "\n".join(planted)
    assert any("raises builtins.ValueError" in line for line in planted)
    assert any("give bare a return annotation" in line for line in planted)
