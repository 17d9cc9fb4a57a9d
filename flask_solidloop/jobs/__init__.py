"""The host's own jobs on the transactional queue.

* actors.py: ``@solidloop.actor``, lazy dramatiq actors bound at ``init_app``;
* rq.py: the RQ-compatible API (``Queue``, ``Job``, ``Retry``, the failed registry);
* functions.py: plain functions recorded by import path, and the job body;
* periodic.py: ``@solidloop.periodic``, one job per period across all workers;
* control.py: list, requeue and cancel (the CLI, ``Job`` and the registry call it);
* registry.py: what a ``SolidLoop`` object declared, and binding it to each app.

This layer sits beside ``loops/``: above the broker and the state, below the
runtime, maintenance and the extension (docs/decisions/0010-host-jobs.md).
"""

from .actors import LazyActor
from .registry import JobRegistry
from .rq import JOB_STATUSES, FailedJobRegistry, Job, Queue, Retry, get_current_job

__all__ = ["JOB_STATUSES", "FailedJobRegistry", "Job", "JobRegistry", "LazyActor", "Queue",
           "Retry",
           "get_current_job"]
