"""Every statement of loops/sql/, rendered to tests/unit/loop_sql.txt.

The statements are composed from shared parts (the fences, the claim's
``SET``, the requeue, the shell, the events); the file shows each one whole,
laid out a clause a line, so a change to any part shows in review as a diff
of every statement it reaches. After an intended change, rewrite the file:

    SOLIDLOOP_WRITE_SQL=1 .venv/bin/pytest tests/unit/test_loop_sql.py

(tests/integration/test_loop_sql.py prepares every statement on a real server.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flask_solidloop.loops import sql

RENDERED = Path(__file__).with_name("loop_sql.txt")
#: Where a clause starts a new line.
_CLAUSE = re.compile(
    r"\s(?=(?:SELECT|FROM|WHERE|SET|RETURNING|LEFT JOIN|ORDER BY|UNION ALL|GROUP BY|"
    r"LIMIT|FOR UPDATE|ON CONFLICT|VALUES)\b)|(?<=\),)\s(?=\w+ AS \()")


def layout(statement: str) -> str:
    """One clause a line, indented by the depth of parentheses it opens in."""
    lines, depth = [], 0
    for piece in _CLAUSE.split(statement):
        piece = piece.strip()
        if not piece:
            continue
        lines.append("    " * depth + piece)
        depth = max(0, depth + piece.count("(") - piece.count(")"))
    return "\n".join(lines)


def render() -> str:
    parts = [f"-- {name}\n{layout(text)}\n" for name, text in sql.STATEMENTS.items()]
    return "\n".join(parts)


def test_the_rendered_statements_are_the_ones_reviewed():
    rendered = render()
    if os.environ.get("SOLIDLOOP_WRITE_SQL"):
        RENDERED.write_text(rendered)
    assert RENDERED.read_text() == rendered, (
        "loops/sql/ changed: review the difference, then rewrite tests/unit/loop_sql.txt "
        "with SOLIDLOOP_WRITE_SQL=1")


def test_every_statement_is_rendered_and_named_once():
    names = list(sql.STATEMENTS)
    assert len(names) == len(set(names))
    for expected in ("CLAIM_TURN", "FINISH_TURN[with_calls=True]", "END_TURN", "REQUEUE_TURN",
                     "LEAVE", "HEAL_EXPIRED_LLM",
                     "TOOL_OUTCOME[record=True, answer=True, adopt=True]"):
        assert expected in names
    # A statement reaches the file whole: the layout only adds line breaks.
    for text in sql.STATEMENTS.values():
        assert re.sub(r"\s+", " ", layout(text)) == re.sub(r"\s+", " ", text).strip()


def test_the_fence_is_written_once():
    """The generation fence is one fragment; every statement that fences on the
    generation contains it as written."""
    fenced = [name for name, text in sql.STATEMENTS.items() if sql.OWNED in text]
    assert {"FINISH_TURN[with_calls=False]", "FINISH_TURN[with_calls=True]", "END_TURN",
            "REQUEUE_TURN", "OPEN_SHELL", "CLAIM_CALL",
            "TOOL_OUTCOME[record=True, answer=True, adopt=True]"} <= set(fenced)
    # Nowhere is it spelled another way.
    spelled = re.compile(r"status = 'running' AND execution_token = %\(token\)s")
    for text in sql.STATEMENTS.values():
        assert len(spelled.findall(text)) == text.count(sql.OWNED)
