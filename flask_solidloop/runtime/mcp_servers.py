"""The worker process's kept stdio MCP servers: stopped when the worker stops.

A ``command=`` server runs as a long-lived child of the worker process
(mcp/stdio_transport.py). :class:`StdioServersMiddleware` stops them all in
``after_worker_shutdown``, once the worker threads are done with them, so a
stopped worker leaves no server process behind. The process portal's shutdown
(``atexit``) is the fallback for processes that never run the middleware.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import dramatiq

__all__ = ["StdioServersMiddleware"]

logger = logging.getLogger("flask_solidloop.mcp")

#: How long the worker waits for its stdio servers to exit (each gets the
#: SDK's close-stdin, SIGTERM, SIGKILL sequence, about 4 s at worst; in parallel).
STOP_SECONDS = 10.0


class StdioServersMiddleware(dramatiq.Middleware):
    """Stops the process's kept stdio MCP servers at worker shutdown."""

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: Any) -> None:
        # Not imported, no servers: the MCP SDK is optional and stays unloaded.
        module = sys.modules.get("flask_solidloop.mcp.stdio_transport")
        if module is None:
            return
        stopped = module.stop_kept_servers(STOP_SECONDS)
        if stopped:
            logger.info("stopped %d kept stdio MCP server(s)", stopped)
