"""A throwaway Prometheus server (Debian's ``/usr/bin/prometheus``) with a config
and a data directory of its own, on a free port of 127.0.0.1, and ``promtool``.

The package's own service is never used: the tests start the binary as a
subprocess and stop it. :func:`available` tells whether the binaries are here
(scripts/setup.sh --tests installs Debian's ``prometheus``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK) and os.access(PROMTOOL, os.X_OK)


def require() -> None:
    """Skip (or in CI, fail) without Debian's prometheus."""
    if available():
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"{PROMETHEUS} is missing: scripts/setup.sh --tests installs "
                           "Debian's prometheus")
    pytest.skip(f"{PROMETHEUS} not installed (apt-get install prometheus)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """A running server: :meth:`query` asks its HTTP API."""

    def __init__(self, port: int, root: Path, proc: subprocess.Popen) -> None:
        self.port, self.root, self.proc = port, root, proc
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def targets_up(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as response:
            active = json.load(response)["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def log(self) -> str:
        return (self.root / "prometheus.log").read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def prometheus(targets: list[str], *, interval: str = "1s") -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (``host:port``) every ``interval``."""
    require()
    root = Path(tempfile.mkdtemp(prefix="solidloop-prometheus-"))
    port = free_port()
    (root / "prometheus.yml").write_text(
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: solidloop\n"
        "    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n")
    log = open(root / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
         f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Prometheus(port, root, proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def promtool(*args: str) -> subprocess.CompletedProcess:
    require()
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
