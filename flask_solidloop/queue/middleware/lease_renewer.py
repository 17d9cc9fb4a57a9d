"""Start the lease renewer with a dramatiq worker process and stop it with it."""

from __future__ import annotations

from typing import Any

import dramatiq

from ...leases import RenewerSlot


class LeaseRenewerMiddleware(dramatiq.Middleware):
    """One renewer per worker process: started at boot, joined after shutdown.

    Stopped *after* the worker has shut down, not before: dramatiq lets running
    messages finish during its shutdown timeout, and their leases must keep
    being renewed until they do.
    """

    def __init__(self, slot: RenewerSlot) -> None:
        self.slot = slot

    def after_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        self.slot.get().start()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        self.slot.stop()
