"""A task module the jobs app itself never imports: workers get it with
``flask solidloop worker --module tests.support.jobs_tasks``."""

from __future__ import annotations

from .jobs_app import effect, solidloop


@solidloop.actor(queue_name="extra")
def extra_task(key: str) -> None:
    effect("extra_task", key)
