"""Every statement that writes loop state, and the reads those writes embed,
each named once (the broker's statements are in queue/sql.py), in one module
per part of the store: parts.py (what they share), llm_turn.py, tool_turn.py,
waits.py, commands.py, heals.py, caps.py, retention.py, compaction.py, forks.py
and children.py.

Only loops/store/ runs these (loops/queries.py runs the history read). A fence
is written here, once, and every statement that needs it is composed from it
below, at import; nothing composes SQL at run time. Optional parts of a fused
statement are switched by a boolean parameter (``WHERE %(open_shell)s``, ``CASE
WHEN %(read_history)s THEN ...``): the statement stays one text, prepared once
per connection, and PostgreSQL skips a part whose switch is off (a gated
``INSERT ... SELECT`` inserts nothing; a subquery in a ``CASE`` arm not taken
never runs). tests/unit/loop_sql.txt holds every statement as rendered, so a
change to one shows in review (tests/unit/test_loop_sql.py).

Parameters, with one meaning everywhere: ``loop_id``; ``call_id`` (a tool
call's row id); ``token`` (the generation the writer holds); ``new_token`` and
``ttl`` and ``holder`` (a claim: the new generation, the lease's length, the
worker process); ``lease`` (a tool call's lease); ``shell_id``; ``message_id``
(the assistant message whose calls are answered).

Lock order, everywhere: the loop row first, then a tool call's.
"""

from __future__ import annotations

from types import ModuleType

from . import (
    caps,
    children,
    commands,
    compaction,
    forks,
    heals,
    llm_turn,
    parts,
    retention,
    tool_turn,
    waits,
)
from .caps import *  # noqa: F403
from .children import *  # noqa: F403
from .commands import *  # noqa: F403
from .compaction import *  # noqa: F403
from .forks import *  # noqa: F403
from .heals import *  # noqa: F403
from .llm_turn import *  # noqa: F403
from .parts import *  # noqa: F403
from .retention import *  # noqa: F403
from .tool_turn import *  # noqa: F403
from .waits import *  # noqa: F403


def _statements(module: ModuleType) -> dict[str, str]:
    """The statements a module names: its public upper-case texts that read or
    write (a module's imports from parts.py come again, under the same name)."""
    return {name: value for name, value in vars(module).items()
            if name.isupper() and not name.startswith("_") and isinstance(value, str)
            and name != "HISTORY_ROWS"
            and any(word in value for word in ("SELECT", "UPDATE", "INSERT", "DELETE"))}


#: Every statement by name, each family's variants as ``NAME[key]`` (tests
#: render and prepare each).
STATEMENTS: dict[str, str] = {
    name: text for module in (parts, llm_turn, tool_turn, waits, commands, heals, caps, retention,
                              compaction, forks, children)
    for name, text in _statements(module).items()
} | {f"FINISH_TURN[with_calls={c}]": text for c, text in FINISH_TURN.items()} | {  # noqa: F405
    f"DECIDE[records={r}]": text for r, text in DECIDE.items()} | {  # noqa: F405
    f"TOOL_OUTCOME[record={r}, answer={a}, adopt={d}]": text
    for (r, a, d), text in TOOL_OUTCOME.items()}  # noqa: F405
