"""Each table of loop state has one writer (decisions 0009 and 0016): the loop
tables are written by loops/store/ (with their statements in loops/sql/),
the MCP server's own rows (its inbound sessions, and inbound events) by
mcp_server/store.py.

Greps the package for every way code writes those tables (solidloop_loops,
_messages, _tool_calls, _mcp_sessions, _events, _mcp_inbound_sessions) and
fails on any write outside the table's owners (:data:`OWNERS`):

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
from flask_solidloop.models import Event, Loop, McpInboundSession, McpSession, Message, ToolCall

PACKAGE = Path(flask_solidloop.__file__).parent
#: The loop store: its statements and the functions that run them.
_LOOP_STORE = ("loops/sql/", "loops/store/")
#: Who may write each table (a path, or a directory ending in "/").
OWNERS: dict[str, tuple[str, ...]] = {
    "solidloop_loops": _LOOP_STORE,
    "solidloop_messages": _LOOP_STORE,
    "solidloop_tool_calls": _LOOP_STORE,
    "solidloop_mcp_sessions": _LOOP_STORE,
    "solidloop_events": (*_LOOP_STORE, "mcp_server/store.py"),
    "solidloop_mcp_inbound_sessions": ("mcp_server/store.py",),
}
SKIPPED = ("migrations/", "models/")
MODELS = {model.__name__: model for model in (Loop, Message, ToolCall, McpSession, Event,
                                              McpInboundSession)}
TABLES = "|".join(model.__tablename__ for model in MODELS.values())
RAW_WRITE = re.compile(rf"\b(INSERT\s+INTO|UPDATE)\s+({TABLES})\b", re.IGNORECASE)
#: The tables each mapped attribute belongs to.
COLUMNS: dict[str, set[str]] = {}
for _model in MODELS.values():
    for _column in _model.__table__.columns:
        COLUMNS.setdefault(_column.key, set()).add(_model.__tablename__)
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


def owns(where: str, tables: set[str]) -> bool:
    """Whether the file ``where`` may write one of ``tables``."""
    return any(where == owner or (owner.endswith("/") and where.startswith(owner))
               for table in tables for owner in OWNERS[table])


def violations(source: str, where: str, *, strict: bool = True) -> list[str]:
    """Every write of the tables in ``source``; ``strict``: only those the file
    ``where`` does not own."""
    found = []

    def report(tables: set[str], message: str) -> None:
        if not strict or not owns(where, tables):
            found.append(message)

    for match in RAW_WRITE.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        report({match.group(2).lower()},
               f"{where}:{line}: raw {match.group(1).upper()} {match.group(2)}")
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
                    report({MODELS[target.id].__tablename__},
                           f"{where}:{node.lineno}: {name}({target.id})")
            elif name in models and isinstance(func, ast.Name):
                report({MODELS[name].__tablename__}, f"{where}:{node.lineno}: new {name} row")
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for target in targets:
            # Only where rows can exist: a module that imports a model.
            if (models and isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in ROW_NAMES and target.attr in COLUMNS):
                report(COLUMNS[target.attr],
                       f"{where}:{node.lineno}: {target.value.id}.{target.attr} = ...")
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
        if rel.startswith(SKIPPED):
            continue
        files.append((rel, path.read_text()))
    return files


def test_each_table_is_written_only_by_its_owners():
    found = []
    for rel, source in package_files():
        if rel == "leases.py":
            found += lease_renewal_violations(source, rel)
        else:
            found += violations(source, rel)
    assert not found, "tables written outside their owners:\n" + "\n".join(found)


def test_the_owners_do_write_them():
    # The owners really hold the writes this test looks for (a check that
    # passes on an empty package would prove nothing).
    sources = {rel: source for rel, source in package_files()
               if rel.startswith(("loops/sql/", "loops/store/", "mcp_server/store.py"))}
    kinds = " ".join(kind for rel, source in sources.items()
                     for kind in violations(source, rel, strict=False))
    for expected in ("update(Loop)", "new Loop row", "new Message row", "new Event row",
                     "new McpInboundSession row",
                     "raw INSERT INTO solidloop_tool_calls", "raw INSERT INTO solidloop_events",
                     "raw INSERT INTO solidloop_messages", "raw INSERT INTO solidloop_mcp_sessions",
                     "raw UPDATE solidloop_loops", "raw UPDATE solidloop_tool_calls",
                     "raw UPDATE solidloop_messages", "raw UPDATE solidloop_mcp_inbound_sessions"):
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
    # The owner of a table may write it; of another table, not.
    assert violations(sample, "loops/store/commands.py") == []
    assert len(violations(sample, "mcp_server/store.py")) == 5  # it owns the events
    assert lease_renewal_violations(
        '_X = """\nUPDATE solidloop_loops AS l SET status = 1 FROM x WHERE y\n"""', "s")
    assert not lease_renewal_violations(
        '_X = """\nUPDATE solidloop_loops AS l\n SET lease_expires_at = now() FROM x\n"""', "s")
    # leases.py itself is checked by the rule, not skipped.
    assert "UPDATE solidloop_loops" in (PACKAGE / "leases.py").read_text()
