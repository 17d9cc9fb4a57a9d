"""Maintenance: the reaper (heals loops whose worker died), the janitor
(retention) and the rollup (the admin charts' per-minute figures).

The maintenance actor (queue ``solidloop_maintenance``) runs these tasks for
hosts with their own scheduler; ``flask solidloop reap`` / ``prune`` run them
from the command line, once or ``--every N`` seconds. Every pass, however it
ran, records itself in ``solidloop_maintenance_runs`` (``runs.py``).
"""

from __future__ import annotations

import logging

from ..state import SolidLoopState
from .janitor import prune
from .reaper import reap

logger = logging.getLogger("flask_solidloop.maintenance")

TASKS = ("reap", "prune", "recover_jobs", "rollup")


def run_maintenance(state: SolidLoopState, task: str) -> None:
    """Run one named maintenance task. Unknown names are logged and dropped."""
    if task == "reap":
        reap(state)
    elif task == "prune":
        prune(state)
    elif task == "rollup":
        from .rollup import rollup  # the function; the package keeps the module's name

        rollup(state)
    elif task == "recover_jobs":
        recovered = state.broker.recover_expired()
        logger.info("recovered %s job(s) with expired leases", recovered)
    else:
        logger.error("unknown maintenance task %r; known: %s", task, ", ".join(TASKS))
