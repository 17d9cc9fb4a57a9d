"""The LLM client's connection pool, over real HTTP on 127.0.0.1: a request
that finds every connection of its origin busy waits the pool timeout, and
that wait is a transient failure (nothing was sent), retried, never reported
as a read timeout."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from flask_solidloop.errors import ProviderUnavailableError
from flask_solidloop.llm.client import RetryPolicy, WireRecord, post_json

BODY = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}


class HeldServer:
    """Answers every POST, the first one only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.first_in = threading.Event()
        self.requests = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    server.requests += 1
                    first = server.requests == 1
                if first:
                    server.first_in.set()
                    server.release.wait(30)
                body = json.dumps(BODY).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/chat/completions"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def held() -> Iterator[HeldServer]:
    server = HeldServer()
    yield server
    server.close()


def send(url: str, http: httpx.Client, policy: RetryPolicy, record: WireRecord | None = None,
         pool_timeout: float = 0.2):
    return post_json(url, {"messages": []}, headers={}, read_timeout=30, policy=policy,
                     client=http, pool_timeout=pool_timeout, record=record)


def hold_the_only_connection(held: HeldServer, http: httpx.Client) -> threading.Thread:
    """A first request that keeps the pool's one connection until released."""
    first = threading.Thread(target=send, args=(held.url, http, RetryPolicy(retries=0)),
                             kwargs={"pool_timeout": 30}, daemon=True)
    first.start()
    assert held.first_in.wait(30)
    return first


def test_a_full_pool_is_retried_and_then_unavailable_never_a_read_timeout(held):
    http = httpx.Client(limits=httpx.Limits(max_connections=1))
    first = hold_the_only_connection(held, http)
    with pytest.raises(ProviderUnavailableError, match="no free connection") as raised:
        send(held.url, http, RetryPolicy(retries=2, base_delay=0.01, max_delay=0.02))
    message = str(raised.value)
    assert "read" not in message.lower() and "SOLIDLOOP_LLM_MAX_CONNECTIONS" in message
    attempts = raised.value.wire.attempts
    assert len(attempts) == 3  # the first try and both retries
    assert all(a["error"].startswith("pool timeout") for a in attempts)
    assert "retry_in_s" in attempts[0] and "retry_in_s" in attempts[1]
    # Nothing of the refused request reached the server.
    assert held.requests == 1
    held.release.set()
    first.join(30)
    http.close()


def test_a_request_that_waited_for_the_pool_goes_once_a_connection_frees(held):
    http = httpx.Client(limits=httpx.Limits(max_connections=1))
    first = hold_the_only_connection(held, http)
    record = WireRecord(url=held.url, request_headers={}, request_body=None)

    def release_after_a_pool_timeout() -> None:
        while not any("pool timeout" in str(a.get("error", "")) for a in list(record.attempts)):
            if held.release.wait(0.01):
                return
        held.release.set()

    threading.Thread(target=release_after_a_pool_timeout, daemon=True).start()
    body, wire = send(held.url, http, RetryPolicy(retries=50, base_delay=0.01, max_delay=0.05),
                      record=record)
    assert body == BODY and wire.status == 200
    assert wire.attempts[0]["error"].startswith("pool timeout")
    assert "error" not in wire.attempts[-1]
    assert held.requests == 2  # the held one, and this one once, when it got through
    first.join(30)
    http.close()
