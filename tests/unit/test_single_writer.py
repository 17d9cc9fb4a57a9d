"""loops/store.py is the only writer of loop state (decision 0009).

Greps the package for every way code writes the loop-owned tables
(solidloop_loops, _messages, _tool_calls, _mcp_sessions, _events) and fails on
any outside loops/store.py and its primitive loops/fence.py:

* raw SQL: ``INSERT INTO`` / ``UPDATE`` naming one of those tables;
* SQLAlchemy Core: ``update(Model)``, ``insert(Model)``, ``pg_insert(Model)``;
* ORM: constructing a model row (``Loop(...)``, ``Message(...)``, ...), or
  assigning a mapped column on a variable that holds such a row.

The one allowed exception is lease renewal in leases.py, whose UPDATEs may
set nothing but the two lease-expiry columns.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flask_solidloop
from flask_solidloop.models import Event, Loop, McpSession, Message, ToolCall

PACKAGE = Path(flask_solidloop.__file__).parent
OWNERS = {"loops/store.py", "loops/fence.py"}
SKIPPED = ("migrations/", "models/")
MODELS = {model.__name__: model for model in (Loop, Message, ToolCall, McpSession, Event)}
TABLES = "|".join(model.__tablename__ for model in MODELS.values())
RAW_WRITE = re.compile(rf"\b(INSERT\s+INTO|UPDATE)\s+({TABLES})\b", re.IGNORECASE)
COLUMNS = {column.key for model in MODELS.values() for column in model.__table__.columns}
#: Variable names the code uses for rows of those tables.
ROW_NAMES = {"loop", "call", "shell", "message", "checkpoint", "tool_call", "row", "stored"}
LEASE_COLUMNS = {"lease_expires_at", "leased_until"}


def imported_models(tree: ast.AST) -> set[str]:
    """Names bound to our models by ``from ...models import ...`` (dramatiq has a
    ``Message`` too; only ours count)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "models" or node.module.startswith("models.")
                or ".models" in f".{node.module}"):
            names |= {alias.asname or alias.name for alias in node.names
                      if alias.name in MODELS}
    return names


def violations(source: str, where: str) -> list[str]:
    found = []
    for match in RAW_WRITE.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        found.append(f"{where}:{line}: raw {match.group(1).upper()} {match.group(2)}")
    tree = ast.parse(source)
    models = imported_models(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else None)
            if name in ("update", "insert", "pg_insert") and node.args:
                target = node.args[0]
                if isinstance(target, ast.Name) and target.id in models:
                    found.append(f"{where}:{node.lineno}: {name}({target.id})")
            elif name in models and isinstance(func, ast.Name):
                found.append(f"{where}:{node.lineno}: new {name} row")
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for target in targets:
            # Only where rows can exist: a module that imports a model.
            if (models and isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in ROW_NAMES and target.attr in COLUMNS):
                found.append(f"{where}:{node.lineno}: {target.value.id}.{target.attr} = ...")
    return found


def lease_renewal_violations(source: str, where: str) -> list[str]:
    """leases.py may only extend lease expiries."""
    found = []
    for statement in re.findall(r"UPDATE\s+solidloop_\w+.*?(?=\"\"\"|$)", source,
                                re.IGNORECASE | re.DOTALL):
        set_clause = re.search(r"\bSET\b(.*?)\b(FROM|WHERE)\b", statement, re.DOTALL)
        assert set_clause, statement
        columns = set(re.findall(r"(\w+)\s*=(?!>)", set_clause.group(1)))
        if columns - LEASE_COLUMNS:
            found.append(f"{where}: lease renewal sets {sorted(columns - LEASE_COLUMNS)}")
    return found


def package_files() -> list[tuple[str, str]]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OWNERS or rel.startswith(SKIPPED):
            continue
        files.append((rel, path.read_text()))
    return files


def test_only_the_store_writes_loop_state():
    found = []
    for rel, source in package_files():
        if rel == "leases.py":
            found += lease_renewal_violations(source, rel)
        else:
            found += violations(source, rel)
    assert not found, "loop state written outside loops/store.py:\n" + "\n".join(found)


def test_the_store_does_write_them():
    # The owners really hold the writes this test looks for (a check that
    # passes on an empty package would prove nothing).
    store = (PACKAGE / "loops" / "store.py").read_text()
    kinds = " ".join(violations(store, "store"))
    for expected in ("update(Loop)", "update(ToolCall)", "update(Message)", "new Message row",
                     "raw INSERT INTO solidloop_tool_calls", "raw INSERT INTO solidloop_events",
                     "raw INSERT INTO solidloop_messages", "new Event row",
                     "raw UPDATE solidloop_loops", "raw UPDATE solidloop_tool_calls",
                     "loop.status = ...", "pg_insert(McpSession)"):
        assert expected in kinds, expected


def test_the_checks_catch_each_kind_of_write():
    sample = '''
from ..models import Event, Message, ToolCall
session.execute(text("UPDATE solidloop_loops SET status = 'queued'"))
session.execute(update(ToolCall).values(lease_token=None))
session.execute(insert(Event).values(kind="tool_call"))
session.add(Message(loop_id=1, role="user", content="x"))
loop.status = "paused"
call.lease_token = None
'''
    kinds = violations(sample, "sample")
    assert len(kinds) == 6, kinds
    assert lease_renewal_violations(
        '_X = """\nUPDATE solidloop_loops AS l SET status = 1 FROM x WHERE y\n"""', "s")
    assert not lease_renewal_violations(
        '_X = """\nUPDATE solidloop_loops AS l\n SET lease_expires_at = now() FROM x\n"""', "s")
    # leases.py itself is checked by the rule, not skipped.
    assert "UPDATE solidloop_loops" in (PACKAGE / "leases.py").read_text()
