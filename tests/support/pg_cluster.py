"""A throwaway PostgreSQL cluster for tests that restart or crash the server.

Restarting the shared cluster (the one every test database lives on) would
cut every other test, benchmark and session using it. A test that needs a
restart gets a cluster of its own instead: a copy of a data directory
``initdb`` made once per process (as the ``postgres`` user), on a free port of 127.0.0.1, restarted
with ``pg_ctl restart -m fast`` or ``-m immediate`` (a crash: recovery from
the WAL on start), and removed afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: Where Debian puts the server's programs.
BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def _bin(name: str) -> str | None:
    for directory in BIN_DIRS:
        if (directory / name).exists():
            return str(directory / name)
    return shutil.which(name)


def available() -> bool:
    """Whether this machine can run a throwaway cluster (the server's programs,
    and a ``postgres`` user to run them as when we are root)."""
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return False
    return os.geteuid() != 0 or shutil.which("runuser") is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayCluster:
    """One cluster: ``url(database)`` to reach it, ``restart(mode)`` to restart it."""

    def __init__(self, *, port: int | None = None, max_connections: int = 100) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="solidloop-pg-"))
        self.data = self.root / "data"
        self.port = port or _free_port()
        self.max_connections = max_connections
        self.log = self.root / "server.log"

    @staticmethod
    def _run_as_server(*argv: str, timeout: float = 120, log: Path | None = None) -> None:
        command = list(argv)
        if os.geteuid() == 0:  # initdb and the server refuse to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                               f"{done.stderr[-2000:]}\n{tail}")

    def _run(self, *argv: str, timeout: float = 120) -> None:
        self._run_as_server(*argv, timeout=timeout, log=self.log)

    def start(self) -> ThrowawayCluster:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        # A copy of one freshly initialised, never started data directory is the
        # same cluster initdb would make; copying it is several times quicker.
        self._run("cp", "-a", str(_initialised()), str(self.data))
        self.start_server()
        return self

    def start_server(self) -> None:
        """Start the (initialised) server: again after ``stop_server``."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.root} "
                   f"-c max_connections={self.max_connections}")
        self._pg_ctl("start", "-o", options)

    def stop_server(self) -> None:
        """Stop the server, keeping its data (``start_server`` brings it back)."""
        self._pg_ctl("stop", "-m", "fast")

    def _pg_ctl(self, action: str, *extra: str) -> None:
        self._run(str(_bin("pg_ctl")), action, "-D", str(self.data), "-l", str(self.log),
                  "-w", "-t", "60", *extra)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def restart(self, mode: str = "fast") -> None:
        """Restart the server: ``fast`` (sessions cut, a clean shutdown) or
        ``immediate`` (a crash: no checkpoint, recovery from the WAL on start)."""
        self._pg_ctl("restart", "-m", mode)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(self.root, ignore_errors=True)


_pristine: Path | None = None


def _initialised() -> Path:
    """The data directory ``initdb`` made once for this process (never started:
    each cluster starts from a copy of it); removed when the process exits."""
    global _pristine
    if _pristine is None:
        root = Path(tempfile.mkdtemp(prefix="solidloop-pg-initdb-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        ThrowawayCluster._run_as_server(
            str(_bin("initdb")), "-D", str(root / "data"), "-A", "trust", "-U", "postgres",
            "--no-sync", "-E", "UTF8")
        _pristine = root / "data"
    return _pristine


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[ThrowawayCluster]:
    cluster = ThrowawayCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
