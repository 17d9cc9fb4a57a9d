"""The HTTP plumbing both emulators share: a werkzeug server on 127.0.0.1, served
from a daemon thread, with TCP_NODELAY and one write per response (a stock
handler with keep-alive adds ~44 ms per POST here: Nagle meets delayed ACK).

This module owns the server's life (:class:`LocalServer`: start, stop,
``base_url``, the request log), reading a request off the WSGI environ
(:func:`read_request`, :func:`parse_json`) and writing a :class:`Response`: all
of it at once, or piece by piece for the answers a timing fault shapes. What a
request means is each emulator's own ``_handle``.
"""

from __future__ import annotations

import contextlib
import http
import json
import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from ..errors import SetupError, SolidLoopError

logger = logging.getLogger("flask_solidloop.testing")


class NoRequestError(SolidLoopError, IndexError):
    """``last_request()`` on an emulator that has not received any request yet
    (an ``IndexError``, as ``[][-1]`` raises)."""


class InjectedDisconnect(SolidLoopError, ConnectionAbortedError):
    """Ends a response an injected fault cuts short. werkzeug takes any
    ``ConnectionError`` for a client that went away and stays quiet about it."""


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


@dataclass
class Response:
    """An emulator's answer before it is written."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"  # None: no Content-Type header
    headers: dict[str, str] = field(default_factory=dict)
    # Set only by timing faults: written one piece at a time instead of ``body`` at once.
    pieces: Iterable[bytes] | None = None
    delay: float = 0.0  # seconds of silence between pieces
    abort: bool = False  # close the socket after the last piece
    chunked: bool = False  # no Content-Length (streams); else Content-Length = len(body)


@dataclass(frozen=True)
class Incoming:
    """What :func:`read_request` read off the WSGI environ."""

    method: str  # upper-case
    path: str
    query: str  # raw query string, e.g. "alt=sse"
    headers: dict[str, str]  # lower-case keys
    body: str  # decoded as UTF-8 (invalid bytes replaced)


def read_request(environ: dict[str, Any]) -> Incoming:
    """The request in ``environ``: its body read whole (sized, or chunked until its end)."""
    method = environ.get("REQUEST_METHOD", "GET").upper()
    path = environ.get("PATH_INFO", "") or "/"
    query = environ.get("QUERY_STRING", "") or ""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    stream = environ["wsgi.input"]
    if length > 0:
        raw = stream.read(length)
    elif environ.get("wsgi.input_terminated"):
        raw = stream.read()
    else:
        raw = b""
    headers = {
        key[5:].replace("_", "-").lower(): value
        for key, value in environ.items()
        if key.startswith("HTTP_")
    }
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            headers[key.replace("_", "-").lower()] = environ[key]
    return Incoming(method, path, query, headers, raw.decode("utf-8", errors="replace"))


def parse_json(body: str) -> tuple[Any, str | None]:
    """``(value, None)`` for a JSON body, ``(None, why)`` for one that is not JSON,
    ``(None, None)`` for a blank one."""
    if not body.strip():
        return None, None
    try:
        return json.loads(body), None
    except ValueError as exc:
        return None, str(exc)


def reason_phrase(status: int) -> str:
    """The standard reason phrase for ``status`` (``"Status"`` for a code without one)."""
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Status"


def _trickle(response: Response, sock: socket.socket | None) -> Iterator[bytes]:
    """Write ``response.pieces`` one by one (werkzeug flushes each), then maybe hang up."""
    yield b""  # werkzeug sends the status line and headers on the first write
    for index, piece in enumerate(response.pieces or []):
        if index and response.delay:
            time.sleep(response.delay)
        yield piece
    if response.abort:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # FIN now: no chunked terminator follows
        raise InjectedDisconnect("injected disconnect")


R = TypeVar("R")


class LocalServer(ABC, Generic[R]):
    """Start/stop/base_url for a WSGI app served on ``host``:``port`` (0 = any free),
    and the thread-safe log of the requests it received.

    A subclass answers each request in :meth:`_handle`; this class writes the answer,
    and turns an exception in ``_handle`` into :meth:`_internal_error`'s answer rather
    than a dropped connection.
    """

    host: str
    port: int
    _lock: threading.Lock
    _requests: list[R]
    _server: BaseWSGIServer | None = None
    _thread: threading.Thread | None = None

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._requests = []

    @abstractmethod
    def _handle(self, environ: dict[str, Any]) -> Response:
        """The answer to the request in ``environ`` (recorded in ``_requests`` by the
        subclass)."""

    @abstractmethod
    def _internal_error(self, environ: dict[str, Any], exc: Exception) -> Response:
        """The answer when :meth:`_handle` raised ``exc``."""

    def _reason(self, status: int) -> str:
        """The reason phrase of the status line."""
        return reason_phrase(status)

    def _wsgi_app(self, environ: dict[str, Any],
                  start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            response = self._handle(environ)
        except Exception as exc:  # never let a bug here turn into a dropped connection
            logger.exception("%s: error while handling request", type(self).__name__)
            response = self._internal_error(environ, exc)
        headers = dict(response.headers)
        if response.content_type is not None:
            headers = {"Content-Type": response.content_type, **headers}
        if response.pieces is None or not response.chunked:
            headers["Content-Length"] = str(len(response.body))
        start_response(f"{response.status} {self._reason(response.status)}",
                       list(headers.items()))
        if response.pieces is None:
            return [response.body]  # a single write: no Nagle + delayed-ACK stall
        return _trickle(response, environ.get("werkzeug.socket"))

    def start(self) -> Self:
        """Bind the socket and serve from a daemon thread. Returns ``self``."""
        name = type(self).__name__
        if self._server is not None:
            raise SetupError(f"{name} is already running")
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
            raise SetupError(f"{type(self).__name__} is not running; call start() first")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self._server.server_port}"

    @property
    def requests(self) -> list[R]:
        """Every request received so far, in arrival order (a snapshot copy)."""
        with self._lock:
            return list(self._requests)

    def last_request(self) -> R:
        """The most recent request; raises :class:`NoRequestError` (an ``IndexError``)
        if none was received."""
        with self._lock:
            if not self._requests:
                raise NoRequestError(f"{type(self).__name__} has not received any request")
            return self._requests[-1]
