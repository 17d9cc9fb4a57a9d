"""Maintenance run by the solidloop_maintenance actor or the CLI."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..extension import SolidLoopState

logger = logging.getLogger("flask_solidloop.maintenance")

TASKS = ("recover_jobs",)


def run_maintenance(state: SolidLoopState, task: str) -> None:
    """Run one named maintenance task. Unknown names are logged and dropped."""
    if task == "recover_jobs":
        recovered = state.broker.recover_expired()
        logger.info("recovered %s job(s) with expired leases", recovered)
        return
    logger.error("unknown maintenance task %r; known: %s", task, ", ".join(TASKS))
