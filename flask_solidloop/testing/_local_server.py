"""The plumbing both emulators share: a werkzeug server on 127.0.0.1, served
from a daemon thread, with TCP_NODELAY and one write per response (a stock
handler with keep-alive adds ~44 ms per POST here: Nagle meets delayed ACK)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, Self, TypeVar

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

logger = logging.getLogger("flask_solidloop.testing")


class NoDelayRequestHandler(WSGIRequestHandler):
    """werkzeug handler with TCP_NODELAY and without per-request access logging."""

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # tests fire hundreds of requests; access logs are noise

    def log(self, type: str, message: str, *args: Any) -> None:
        if type == "error":
            logger.error(message, *args)
        else:
            logger.debug(message, *args)


R = TypeVar("R")


class LocalServer(Generic[R]):
    """Start/stop/base_url for a WSGI app served on ``host``:``port`` (0 = any free),
    and the thread-safe log of the requests it received."""

    host: str
    port: int
    _lock: threading.Lock
    _requests: list[R]
    _server: BaseWSGIServer | None = None
    _thread: threading.Thread | None = None

    def _wsgi_app(self, environ: dict[str, Any],
                  start_response: Callable[..., Any]) -> Iterable[bytes]:
        raise NotImplementedError

    def start(self) -> Self:
        """Bind the socket and serve from a daemon thread. Returns ``self``."""
        name = type(self).__name__
        if self._server is not None:
            raise RuntimeError(f"{name} is already running")
        server = make_server(self.host, self.port, self._wsgi_app, threaded=True,
                             request_handler=NoDelayRequestHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01},
                                  name=f"{name}:{server.server_port}", daemon=True)
        self._server, self._thread = server, thread
        thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket. Safe to call more than once."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """Origin of the running server, e.g. ``http://127.0.0.1:54321``."""
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self._server.server_port}"

    @property
    def requests(self) -> list[R]:
        """Every request received so far, in arrival order (a snapshot copy)."""
        with self._lock:
            return list(self._requests)

    def last_request(self) -> R:
        """The most recent request; raises ``IndexError`` if none was received."""
        with self._lock:
            if not self._requests:
                raise IndexError(f"{type(self).__name__} has not received any request")
            return self._requests[-1]
