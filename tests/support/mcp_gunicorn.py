"""A real gunicorn serving tests/support/mcp_server_app.py, for the MCP server blueprint tests.

``serve(workers=4, threads=4)`` starts ``gunicorn -k gthread`` on a free port of
127.0.0.1 with the test database in its environment, waits until it answers,
and stops it (SIGTERM, then SIGKILL) on exit. Used by the acceptance tests and
bench/mcp_server.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.mcp_server_app:create_app()"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(*, workers: int = 4, threads: int = 4, env: dict[str, str] | None = None,
          log_path: Path | None = None, port: int | None = None) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:<port>``) of a running gunicorn
    (on ``port``, when the app must know its own URL before it starts)."""
    port = port or free_port()
    gunicorn = Path(sys.executable).with_name("gunicorn")
    command = [str(gunicorn), "-w", str(workers), "-k", "gthread", "--threads", str(threads),
               "-b", f"127.0.0.1:{port}", "--graceful-timeout", "3", APP]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})},
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {process.returncode}; see {log_path}")
            try:
                httpx.get(f"{base}/mcp/conformance", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("gunicorn did not answer within 60 s") from None
                time.sleep(0.1)
        _wait_for_workers(base, workers)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
        if log_path:
            log.close()  # type: ignore[union-attr]


def _wait_for_workers(base: str, workers: int) -> None:
    """Until every worker has booted (an app import takes a while on a busy
    machine), so a test's first burst is spread over all of them."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {"Accept": "application/json, text/event-stream", "Mcp-Method": "ping",
               "MCP-Protocol-Version": "2026-07-28", "Authorization": "Bearer token-boot"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = set()
        for _ in range(workers * 6):
            # A new connection each time: a kept-alive one stays on one worker.
            reply = httpx.post(f"{base}/mcp/calc", json={
                **body, "method": "tools/call", "params": {
                    **body["params"], "name": "echo", "arguments": {"text": "boot"}}},
                headers={**headers, "Mcp-Method": "tools/call", "Mcp-Name": "echo"})
            text = reply.json()["result"]["content"][0]["text"]
            seen.add(text.rsplit(" ", 1)[-1])
        if len(seen) >= workers:
            return
        time.sleep(0.2)


def eventually(fetch, done, *, timeout: float = 10.0):
    """``fetch()`` until ``done(value)`` (the wire log is written off the request
    path, within milliseconds); return the last value either way."""
    deadline = time.monotonic() + timeout
    value = fetch()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = fetch()
    return value
