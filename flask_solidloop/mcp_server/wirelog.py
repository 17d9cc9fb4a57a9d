"""The inbound wire log's writer: one event row per request, off the request path.

A request hands its event to a per-process queue and returns; one daemon
thread per process (and per app) writes what has queued up in one transaction
through mcp_server/store.py (``record_events``), so a request never waits
for the log. Rows land within milliseconds; :func:`flush` waits for them (the
tests use it, and an exiting process runs it). The writer is fork-aware: a
child process (a gunicorn worker forked after the first request) starts its
own. Events that cannot be written are logged and dropped: the wire log is a
diagnostic, never a reason to fail a call.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Any

from flask import Flask

from ..state import get_state
from . import store as inbound

__all__ = ["enqueue", "flush"]

logger = logging.getLogger("flask_solidloop.mcp_server")

#: The most events one transaction writes.
BATCH = 200


class _Writer:
    def __init__(self, app: Flask) -> None:
        self.app = app
        self.pid = os.getpid()
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="solidloop-mcp-wirelog",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._write(batch)
            for _ in batch:
                self.queue.task_done()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        try:
            with self.app.app_context():
                state = get_state(self.app)
                try:
                    inbound.record_events(state.db.session, batch,
                                                body_limit=state.config.wire_body_limit)
                finally:
                    state.db.session.remove()
        except Exception:
            logger.exception("could not write %d inbound MCP event(s)", len(batch))


_writers: dict[int, _Writer] = {}
_lock = threading.Lock()


def enqueue(app: Flask, event: dict[str, Any]) -> None:
    """Queue one event of ``app`` for writing."""
    key = id(app)
    writer = _writers.get(key)
    if writer is None or writer.pid != os.getpid():
        with _lock:
            writer = _writers.get(key)
            if writer is None or writer.pid != os.getpid():
                writer = _writers[key] = _Writer(app)
    writer.queue.put(event)


def flush() -> None:
    """Wait until every queued event of this process has been written."""
    for writer in list(_writers.values()):
        if writer.pid == os.getpid():
            writer.queue.join()


atexit.register(flush)
