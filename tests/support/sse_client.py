"""A small Server-Sent Events client over httpx, as a host's page would use
``sse_response()``: it parses ``id:`` / ``event:`` / ``data:``, resumes with
``Last-Event-ID`` after any break (a closed stream, a dead server, a refused
connection, an error status), and stops at the ``end`` event.

Used by the stream-restart acceptance tests and bench/streaming_fanout.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class SSEEvent:
    id: str | None
    event: str
    data: str
    received: float  # time.time() when its blank line arrived

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class SSEReader:
    """Reads ``url`` until the ``end`` event (or ``stop()``), reconnecting
    with the last id seen; ``events`` holds every event with an id and
    ``end`` the end event's data."""

    url: str
    on_event: Callable[[SSEEvent], None] | None = None
    read_timeout: float = 30.0
    events: list[SSEEvent] = field(default_factory=list)
    end: str | None = None
    last_id: str | None = None
    #: Connections opened (a 200 answer), and the breaks seen (error text).
    connections: int = 0
    breaks: list[str] = field(default_factory=list)
    #: What the server's ``retry:`` asked to wait before reconnecting.
    retry_ms: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        self._stop.set()

    def run(self, deadline: float | None = None) -> None:
        timeout = httpx.Timeout(5.0, read=self.read_timeout)
        # A new connection for each reconnect, as an EventSource makes it: a
        # kept-alive one, reused after the server's ``retry:`` wait (2 s while
        # the database is down), may be closed by the server's keep-alive
        # timeout (gunicorn's is 2 s) as the request goes out, a reset that a
        # browser retries unseen and that is no break of a stream.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=timeout, limits=limits) as client:
            while self.end is None and not self._stop.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    return
                headers = {"Accept": "text/event-stream"}
                if self.last_id is not None:
                    headers["Last-Event-ID"] = self.last_id
                try:
                    with client.stream("GET", self.url, headers=headers) as response:
                        if response.status_code != 200:
                            self.breaks.append(f"status {response.status_code}")
                            time.sleep(0.2)
                            continue
                        self.connections += 1
                        self._read(response)
                    if self.end is None:  # a stream that ended: come back as told
                        time.sleep(self.retry_ms / 1000)
                except httpx.HTTPError as exc:
                    self.breaks.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.2)

    def _read(self, response: httpx.Response) -> None:
        event_id: str | None = None
        name = "message"
        data: list[str] = []
        for line in response.iter_lines():
            if self._stop.is_set():
                return
            if line == "":
                if data or event_id is not None:
                    self._dispatch(event_id, name, "\n".join(data))
                    if self.end is not None:
                        return
                event_id, name, data = None, "message", []
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "retry" and value.isdigit():
                self.retry_ms = int(value)
            elif key == "id":
                event_id = value
            elif key == "event":
                name = value
            elif key == "data":
                data.append(value)

    def _dispatch(self, event_id: str | None, name: str, data: str) -> None:
        event = SSEEvent(event_id, name, data, time.time())
        if name == "end":
            self.end = data
            return
        if event_id is not None:
            self.events.append(event)
            self.last_id = event_id
        if self.on_event is not None:
            self.on_event(event)
