"""The database session an in-process tool writes through, and what becomes of
its writes.

An in-process tool runs on a tool thread (pipeline/tool_threads.py), and is
lent the worker's own session for the call: it is ``ctx.session`` of the
tool's :class:`~flask_solidloop.mcp.toolset.CallContext`, and ``db.session``
on the tool's thread resolves to the same Session while the tool runs. What
the tool writes there and does not commit stays in that session's
transaction, and the tool stack records the call's result in the same
transaction (with the answer and the next turn, where they are fused): one
COMMIT for both. A worker killed before it leaves neither, so the call runs
again on a clean database; one killed after it leaves both, and the call is
answered from its recorded result without running again. The tool's database
effect is applied exactly once.

A tool that raises has its writes rolled back (the toolset does it: a tool
error is a transaction that raised). A tool that commits on its own commits
at once, as before: its effect is then at-least-once, like any effect outside
the session. A tool that writes on a session of its own and leaves the writes
uncommitted loses them: :func:`lent_to_tool` notices and logs a warning
naming the tool.

A tool abandoned at its timeout still holds the lent session: the worker
takes a fresh one (:func:`take_back_after_timeout`) and the abandoned tool's
writes are rolled back whenever it returns (:func:`discard`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from psycopg.pq import TransactionStatus
from sqlalchemy import event, text
from sqlalchemy.orm import Session, scoped_session

from .._typing import SessionLike, real_session
from ..loops.store import holds_nothing

logger = logging.getLogger("flask_solidloop.tools")

T = TypeVar("T")

_watching = threading.local()


class _Watch:
    """The sessions other than the lent one that a tool wrote on, while it runs."""

    def __init__(self, lent: Session) -> None:
        self.lent = lent
        self.others: list[Session] = []

    def note(self, session: Session) -> None:
        if session is not self.lent and not any(s is session for s in self.others):
            self.others.append(session)
        if session is not self.lent:
            session.info["solidloop_unsaved"] = True

    def pending(self) -> list[Session]:
        """The other sessions still holding writes: uncommitted, or dropped."""
        return [s for s in self.others
                if s.info.get("solidloop_unsaved") or s.new or s.dirty or s.deleted]


def _on_write(session: Session, *_: Any) -> None:
    watch: _Watch | None = getattr(_watching, "watch", None)
    if watch is not None:
        watch.note(session)


def _on_commit(session: Session) -> None:
    session.info.pop("solidloop_unsaved", None)


_listening = False
_listening_lock = threading.Lock()


def _listen() -> None:
    """Watch every Session's writes (once per process): an attached object or a
    flush marks the session written, its commit clean. Off a watched tool
    thread a listener costs one thread-local lookup."""
    global _listening
    if _listening:
        return
    with _listening_lock:
        if _listening:
            return
        event.listen(Session, "after_attach", _on_write)
        event.listen(Session, "after_flush", _on_write)
        event.listen(Session, "after_commit", _on_commit)
        _listening = True


@contextmanager
def _watched(lent: Session) -> Iterator[_Watch]:
    _listen()
    watch = _watching.watch = _Watch(lent)
    try:
        yield watch
    finally:
        _watching.watch = None


def lent_to_tool(db: Any, session: SessionLike, tool: str,
                 run: Callable[[], T]) -> Callable[[], T]:
    """``run`` (a call to an in-process tool) as it runs on its tool thread:
    with ``db.session`` resolving to ``session``'s Session there, and, once
    the tool returned, its transaction checked (one the tool left failed is
    rolled back, with a warning) and its other sessions' unsaved writes
    reported."""
    lent = real_session(session)
    registry = db.session.registry if isinstance(db.session, scoped_session) else None

    def on_tool_thread() -> T:
        if registry is not None:
            registry.set(lent)
        try:
            with _watched(lent) as watch:
                value = run()
            _roll_back_if_failed(lent, tool)
            for other in watch.pending():
                logger.warning(
                    "tool %r left writes on a database session of its own that it did not "
                    "commit (%r); they are lost. Write through ctx.session (or db.session) "
                    "to commit them with the call's result, exactly once, or commit that "
                    "session yourself (at least once)", tool, other)
                other.info.pop("solidloop_unsaved", None)
            return value
        finally:
            if registry is not None:
                # Not closed: the worker commits it with the call's result. The
                # app context's teardown then finds no session of this scope.
                registry.clear()

    return on_tool_thread


def _roll_back_if_failed(lent: Session, tool: str) -> None:
    """A tool that caught a database error and returned leaves a transaction
    that cannot commit: it is rolled back (the tool's writes with it), so the
    call's result can be recorded."""
    failed = not lent.is_active
    if not failed and not holds_nothing(lent):
        try:
            connection = lent.connection().connection.driver_connection
        except Exception:
            failed = True
        else:
            failed = getattr(getattr(connection, "info", None), "transaction_status",
                             None) == TransactionStatus.INERROR
    if failed:
        logger.warning("tool %r returned with its database transaction failed; its writes "
                       "were rolled back, and its result is recorded without them", tool)
        lent.rollback()


def joins_outcome(session: SessionLike) -> bool:
    """Whether the tool left writes in the lent session's transaction: they then
    commit with the call's outcome, which must not be retried in place, since
    a rollback would lose them. A transaction that only read (PostgreSQL gave
    it no transaction id) is ended here: the outcome then runs as it would
    have without it, alone, and is retried in place on a database error."""
    if holds_nothing(session):
        return False
    real = real_session(session)
    wrote = real.execute(text("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")).scalar()
    if wrote:
        return True
    real.commit()
    return False


def take_back_after_timeout(db: Any) -> None:
    """The worker thread stops using the session it lent to a tool that did not
    return in time (the tool may still use it): its next statement gets a
    fresh Session."""
    if isinstance(db.session, scoped_session):
        db.session.registry.clear()


def discard(session: Session, tool: str) -> Callable[[], None]:
    """What runs when a tool abandoned at its timeout returns at last: its
    writes are rolled back and the lent session closed (its call was answered
    with a timeout error, so they must not land)."""
    def close() -> None:
        try:
            session.close()
        except Exception:
            logger.exception("closing the session of the abandoned tool %r failed", tool)
    return close
