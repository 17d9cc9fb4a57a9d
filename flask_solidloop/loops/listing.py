"""The loop list's total and its pages newer than a loop (loops.queries pages
older ones): what the admin's list shows above and below its rows.

The total is exact when counting is cheap: the count runs under a
``statement_timeout`` local to its transaction (the admin's
SOLIDLOOP_ADMIN_COUNT_BUDGET), on a pooled connection apart from the request's
session; past it the planner's estimate of the same query's rows is given
instead, marked as one (the page says "about N"). A set the planner expects
to be huge is not counted at all: its estimate is the total.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from psycopg import errors as pg_errors
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ClauseElement, Executable

from .._typing import SessionLike, real_session
from ..models import Loop
from .queries import LoopSearch, _search_query


@dataclass(frozen=True)
class Total:
    """How many loops a search matches: ``exact``, or the planner's estimate."""

    count: int
    exact: bool


class _Explain(Executable, ClauseElement):
    """``EXPLAIN (FORMAT JSON) <statement>``, its parameters bound as the statement's."""

    inherit_cache = False

    def __init__(self, statement: Any) -> None:
        self.statement = statement


@compiles(_Explain, "postgresql")
def _explain_sql(element: _Explain, compiler: Any, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + compiler.process(element.statement, **kw)


#: Past this many estimated rows the estimate is the total: an exact count
#: of that many index entries would spend the whole budget, to print a number
#: whose last digits no operator reads.
ESTIMATE_IS_ENOUGH = 250_000


def estimate(session: SessionLike, search: LoopSearch) -> Total:
    """The planner's estimate of the loops ``search`` matches (``EXPLAIN``: no scan)."""
    plan = real_session(session).execute(_Explain(_search_query(search, Loop.id))).scalar_one()
    if isinstance(plan, str):
        plan = json.loads(plan)
    return Total(int(plan[0]["Plan"]["Plan Rows"]), False)


def count_or_estimate(session: SessionLike, search: LoopSearch, *,
                      budget_seconds: float) -> Total:
    """The number of loops ``search`` matches: counted when the planner
    expects at most ESTIMATE_IS_ENOUGH rows and the count takes at most
    ``budget_seconds``, else the planner's estimate."""
    guess = estimate(session, search)
    if guess.count > ESTIMATE_IS_ENOUGH:
        return guess
    counted = _count_within(real_session(session).get_bind(), _search_query(search, Loop.id),
                            budget_seconds)
    return guess if counted is None else Total(counted, True)


def _count_within(bind: Any, query: Any, budget_seconds: float) -> int | None:
    """``count(*)`` of ``query`` under a ``statement_timeout``, on a pooled
    connection of its own (None when cancelled). A timeout can fire just as a
    statement ends and cancel the next one, the rollback included: a
    connection whose rollback failed is discarded, never handed out again
    with a timeout still set, and the request's own session never carries it."""
    counted = None
    with bind.connect() as connection:
        try:
            connection.execute(text("SELECT set_config('statement_timeout', :ms, true)"),
                               {"ms": f"{max(1, int(budget_seconds * 1000))}ms"})
            counted = connection.scalar(select(func.count()).select_from(query.subquery()))
        except DBAPIError as exc:
            if not isinstance(exc.orig, pg_errors.QueryCanceled):
                raise
        finally:
            try:
                connection.rollback()
            except DBAPIError:
                connection.invalidate()
    return None if counted is None else int(counted)


def search_loops_newer(session: SessionLike, search: LoopSearch, *, limit: int,
                       after_id: int, window: int | None = None,
                       budget_seconds: float = 0.15) -> list[Loop]:
    """The ``limit`` matching loops just newer than ``after_id``, newest first
    (the page before a keyset page: the list's "newer" link). With ``window``
    (filters no index serves) the ids are walked upwards that many at a time
    and the walk stops when the time budget is spent, as
    ``queries.search_loops_bounded`` does downwards."""
    import time

    if window is None:
        query = _search_query(search).where(Loop.id > after_id)
        return list(reversed(list(session.scalars(query.order_by(Loop.id.asc()).limit(limit)))))
    top = session.scalar(select(func.max(Loop.id))) or 0
    rows: list[Loop] = []
    low, started = after_id, time.monotonic()
    while low < top and len(rows) < limit and time.monotonic() - started <= budget_seconds:
        high = low + window
        query = _search_query(search).where(Loop.id > low, Loop.id <= high)
        rows += session.scalars(query.order_by(Loop.id.asc()).limit(limit - len(rows)))
        low = high
    return list(reversed(rows))
