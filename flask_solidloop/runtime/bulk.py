"""The bulk_action actor's body: one chunk of a bulk action's walk
(loops/bulk.py), retried on a transient database error, ended with a recorded
error on any other."""

from __future__ import annotations

import logging

from ..dbapi import is_transient
from ..loops import bulk
from ..state import SolidLoopState

logger = logging.getLogger("flask_solidloop.bulk")


def run_bulk_chunk(state: SolidLoopState, bulk_id: int) -> None:
    try:
        bulk.walk(state, bulk_id, chunk=state.config.admin_bulk_batch)
    except Exception as exc:
        if is_transient(exc):
            raise  # dramatiq retries; the walk resumes below the cursor
        logger.exception("bulk action %s failed", bulk_id)
        bulk.fail(state, bulk_id, f"{type(exc).__name__}: {exc}")
