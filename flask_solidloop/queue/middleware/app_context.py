"""Push one Flask app context around every message a worker processes."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
from flask import Flask


class AppContextMiddleware(dramatiq.Middleware):
    """One fresh app context per message, popped on success, failure or skip.

    Popping the context also removes the Flask-SQLAlchemy scoped session, so
    no transaction or identity map leaks from one message into the next.
    """

    def __init__(self, app: Flask) -> None:
        self.app = app
        self._local = threading.local()

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        ctx = self.app.app_context()
        ctx.push()
        self._local.ctx = ctx

    def _pop(self) -> None:
        ctx = getattr(self._local, "ctx", None)
        self._local.ctx = None
        if ctx is not None:
            ctx.pop()

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        self._pop()

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._pop()
