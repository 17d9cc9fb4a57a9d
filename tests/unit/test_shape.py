"""The shape of the loop's middle (docs/decisions/0016-the-loops-middle.md),
checked on the source: small files, SQL composed in the two ``sql.py`` files
only, no step that inspects its neighbour, continuation decided by the
runtime, every store function declaring its transaction, and no comment that
cites something outside the repo. Each check also runs on a planted violation
(a check that cannot fail proves nothing)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import flask_solidloop
from flask_solidloop.loops import store
from flask_solidloop.loops.store import transaction

PACKAGE = Path(flask_solidloop.__file__).parent
#: Where SQL text is composed (at import): the loops' statement package and
#: the broker's module.
SQL_MODULES = ("loops/sql/", "queue/sql.py")
SQL_WORDS = re.compile(r"\b(SELECT|UPDATE|INSERT|DELETE|WITH|FROM|WHERE)\b")
OUTSIDE = re.compile(r"issue [0-9]+|the seed|the gem|cut [0-9]+")


def sources(under: str = "") -> dict[str, str]:
    return {path.relative_to(PACKAGE).as_posix(): path.read_text()
            for path in sorted((PACKAGE / under).rglob("*.py"))}


def too_long(files: dict[str, str], limit: int) -> list[str]:
    return [f"{name}: {text.count(chr(10))} lines" for name, text in files.items()
            if text.count("\n") > limit]


def test_no_file_under_loops_is_over_700_lines():
    assert too_long(sources("loops"), 700) == []


def test_no_file_under_testing_is_over_800_lines():
    assert too_long(sources("testing"), 800) == []


def _is_sql_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant | ast.JoinedStr) and bool(
        SQL_WORDS.search(ast.unparse(node)))


def sql_templating(source: str, where: str) -> list[str]:
    """``.replace(...)`` or ``.format(...)`` applied to SQL text: a string that
    reads as SQL, a module constant bound to one, or another module's constant
    (``jobs_sql.MARK_DONE_WHEN.format(...)``). psycopg's own composition
    (``sql.SQL("LISTEN {}").format(sql.Identifier(...))``) is a call on an
    object, not on text, and passes."""
    tree = ast.parse(source)
    sql_names = {target.id for node in tree.body if isinstance(node, ast.Assign)
                 and any(_is_sql_text(n) for n in ast.walk(node.value))
                 for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("replace", "format")):
            continue
        receiver = node.func.value
        if (_is_sql_text(receiver)
                or (isinstance(receiver, ast.Name) and receiver.id in sql_names)
                or (isinstance(receiver, ast.Attribute) and receiver.attr.isupper())):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_sql_is_composed_only_in_the_sql_modules():
    found = [hit for name, text in sources().items() if not name.startswith(SQL_MODULES)
             for hit in sql_templating(text, name)]
    assert found == []


def test_the_templating_check_catches_each_form():
    planted = '''
_CLAIM = "UPDATE solidloop_loops SET status = 'running' WHERE id = %(id)s {condition}"
a = _CLAIM.replace("%(", "%(claim_")
b = "SELECT * FROM t WHERE {x}".format(x=1)
c = jobs_sql.MARK_DONE_WHEN.format(condition="")
d = sql.SQL("LISTEN {}").format(sql.Identifier("x"))
e = value.replace(",", " ")
'''
    assert [hit.split(": ", 1)[0] for hit in sql_templating(planted, "p")] == [
        "p:3", "p:4", "p:5"]


def neighbour_checks(source: str, where: str) -> list[str]:
    return [f"{where}:{n}" for n, line in enumerate(source.splitlines(), 1)
            if "isinstance(self.next_step" in line]


def test_no_step_inspects_its_neighbour():
    found = [hit for name, text in sources("pipeline").items()
             for hit in neighbour_checks(text, name)]
    assert found == []
    assert neighbour_checks("if isinstance(self.next_step, X):", "p") == ["p:1"]


def test_the_store_is_told_whether_to_adopt():
    """Continuation is the runtime's decision, passed down as ``adopt=``: nothing
    under loops/ asks a thread-local."""
    found = [name for name, text in sources("loops").items() if "can_adopt(" in text]
    assert found == []


def citations(source: str, where: str) -> list[str]:
    return [f"{where}:{n}: {m.group(0)}" for n, line in enumerate(source.splitlines(), 1)
            for m in OUTSIDE.finditer(line)]


def test_nothing_outside_the_repo_is_cited():
    found = [hit for name, text in sources().items() for hit in citations(text, name)]
    assert found == []
    assert citations("# as in the seed (issue 15)", "p") == ["p:1: the seed", "p:1: issue 15"]


#: Helpers the store exports that run no transaction of their own.
NOT_TRANSITIONS = {"calls_to_run", "end_transaction", "holds_nothing", "denial", "supplied",
                   "recover", "with_database_retry", "loop_ends", "caps_for", "applicable"}


def test_every_store_function_says_what_transaction_it_runs_in():
    kinds = {}
    for name in store.__all__:
        value = getattr(store, name)
        if inspect.isfunction(value) and name not in NOT_TRANSITIONS:
            kinds[name] = getattr(value, transaction.KIND, None)
    assert kinds and all(kind in ("commits", "joins", "alone") for kind in kinds.values()), \
        {name: kind for name, kind in kinds.items() if kind not in ("commits", "joins", "alone")}
    # Each kind is in use: the labels say something.
    assert set(kinds.values()) == {"commits", "joins", "alone"}
