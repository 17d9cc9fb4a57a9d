"""Signals (blinker, as Flask and Flask-Login use): in-process notifications that a
loop or tool call changed, sent *after the commit* that changed it, in the process
that made the change.

========================  ====================================================
``loop_started``          a loop was created (queued, or init with enqueue=False):
                          ``loop_id``, ``agent``
``loop_completed``        the loop completed: ``loop_id``, ``agent``
``loop_failed``           the loop failed (an error, a stop, a force stop):
                          ``loop_id``, ``error``
``loop_paused``           the loop paused (a limit, pause(), freeze()):
                          ``loop_id``, ``reason``
``tool_call_answered``    a tool call's answer was written: ``loop_id``,
                          ``tool_call_id``, ``is_error``
``approval_requested``    a tool call waits for a decision: ``loop_id``,
                          ``tool_call_id``, ``tool``, ``arguments``
``result_requested``      a deferred tool call waits for its result:
                          ``loop_id``, ``tool_call_id``, ``tool``, ``arguments``
``tool_call_decided``     a waiting call was approved, denied or given its
                          result: ``loop_id``, ``tool_call_id``, ``decision``,
                          ``by``
========================  ====================================================

The sender is the Flask app (``current_app``), so ``signal.connect_via(app)``
listens to one app. They are notifications, not a queue: a receiver runs in the
worker (or web) process that committed, only while it is alive; a process
killed between the commit and the send sends nothing, and a receiver's
exception is logged, never raised into the turn. For work that must happen,
enqueue a job (``solidloop.queue().enqueue``) from the receiver, or read the
tables. ``loop_started`` fires when the session that created the loop commits:
with ``start(..., commit=False)``, that is the host's own commit.
"""

from __future__ import annotations

import logging
from typing import Any

from blinker import Namespace, Signal
from flask import current_app, has_app_context

logger = logging.getLogger("flask_solidloop.signals")

_signals = Namespace()

loop_started: Signal = _signals.signal("solidloop-loop-started")
loop_completed: Signal = _signals.signal("solidloop-loop-completed")
loop_failed: Signal = _signals.signal("solidloop-loop-failed")
loop_paused: Signal = _signals.signal("solidloop-loop-paused")
tool_call_answered: Signal = _signals.signal("solidloop-tool-call-answered")
approval_requested: Signal = _signals.signal("solidloop-approval-requested")
result_requested: Signal = _signals.signal("solidloop-result-requested")
tool_call_decided: Signal = _signals.signal("solidloop-tool-call-decided")

__all__ = ["approval_requested", "loop_completed", "loop_failed", "loop_paused",
           "loop_started", "result_requested", "send", "send_after_commit", "send_status",
           "send_wait_requested", "tool_call_answered", "tool_call_decided"]

_PENDING = "solidloop.pending_signals"


def _sender() -> Any:
    return current_app._get_current_object() if has_app_context() else None  # type: ignore[attr-defined]


def send(signal: Signal, **data: Any) -> None:
    """Send ``signal`` now (call it after the commit); receivers' errors are logged."""
    if not signal.receivers:
        return
    sender = _sender()
    for receiver in signal.receivers_for(sender):
        try:
            receiver(sender, **data)
        except Exception:
            logger.exception("a receiver of %s raised; ignored", getattr(signal, "name", signal))


def send_status(status: str, *, loop_id: int, error: str | None = None) -> None:
    """The signal of a loop's new ``status`` (paused or failed), if it has one."""
    if status == "failed":
        send(loop_failed, loop_id=loop_id, error=error)
    elif status == "paused":
        send(loop_paused, loop_id=loop_id, reason=error)


def send_wait_requested(waits_for: str, **data: Any) -> None:
    """The signal of a tool call that waits for an ``approval`` or a ``result``."""
    send(approval_requested if waits_for == "approval" else result_requested, **data)


def send_after_commit(session: Any, signal: Signal, **data: Any) -> None:
    """Send ``signal`` when ``session`` next commits; drop it if it rolls back.

    For writes that leave the commit to the caller (``create_loop``).
    """
    from sqlalchemy import event

    real = session.registry() if hasattr(session, "registry") else session
    pending = real.info.get(_PENDING)
    if pending is None:
        pending = real.info[_PENDING] = []

        @event.listens_for(real, "after_commit")
        def _commit(s: Any) -> None:
            queued, s.info[_PENDING] = list(s.info[_PENDING]), []
            for sig, kwargs in queued:
                send(sig, **kwargs)

        @event.listens_for(real, "after_soft_rollback")
        def _rollback(s: Any, previous: Any) -> None:
            if not s.in_transaction():
                s.info[_PENDING] = []

    pending.append((signal, data))
