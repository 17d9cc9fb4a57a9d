"""A throwaway PgBouncer (Debian's ``/usr/sbin/pgbouncer``) in front of a PostgreSQL.

Started as a subprocess with an ini file of its own in a temporary directory,
on a free port of 127.0.0.1 (or the one asked for), ``auth_type = trust``
with an auth file naming the ``postgres`` user, every database passed
through to the upstream server. PgBouncer refuses to run as root: as root it
runs as the ``postgres`` user. Used by tests/acceptance/test_pgbouncer_workers.py
and bench/scale_pgbouncer.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

PGBOUNCER = "/usr/sbin/pgbouncer"


def available() -> bool:
    """Whether Debian's PgBouncer is installed (and can be run as ``postgres`` when root)."""
    if not os.path.exists(PGBOUNCER):
        return False
    return os.geteuid() != 0 or shutil.which("runuser") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One running PgBouncer: ``url(database)`` reaches ``database`` through it."""

    def __init__(self, *, upstream_port: int, pool_mode: str, port: int | None = None,
                 pool_size: int = 20, max_client_conn: int = 500, extra: str = "") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="solidloop-pgbouncer-"))
        self.port = port or free_port()
        self.log = self.root / "pgbouncer.log"
        self.ini = self.root / "pgbouncer.ini"
        (self.root / "users.txt").write_text('"postgres" ""\n')
        self.ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={upstream_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.root / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            f"max_client_conn = {max_client_conn}\n"
            "admin_users = postgres\n"
            f"logfile = {self.log}\n"
            + extra
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        command = [PGBOUNCER, str(self.ini)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            shutil.chown(self.root, "postgres", "postgres")
            for path in self.root.iterdir():
                shutil.chown(path, "postgres", "postgres")
            command = ["runuser", "-u", "postgres", "--", *command]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                with psycopg.connect(self.conninfo("pgbouncer"), autocommit=True,
                                     connect_timeout=2):
                    return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log.read_text(errors="replace") if self.log.exists() else ""
                    self.stop()
                    raise RuntimeError(f"PgBouncer did not start:\n{log[-2000:]}") from None
                time.sleep(0.1)

    def conninfo(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def show(self, what: str) -> list[dict[str, object]]:
        """``SHOW <what>`` on PgBouncer's admin console (simple query protocol)."""
        with psycopg.connect(self.conninfo("pgbouncer"), autocommit=True) as conn:
            cur = psycopg.ClientCursor(conn)
            cur.execute(f"SHOW {what}")
            names = [c.name for c in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(*, upstream_port: int = 5432, pool_mode: str = "transaction",
              port: int | None = None, pool_size: int = 20,
              extra: str = "") -> Iterator[PgBouncer]:
    """A started PgBouncer, stopped (and its directory removed) afterwards;
    ``extra`` adds lines to its ``[pgbouncer]`` section."""
    bouncer = PgBouncer(upstream_port=upstream_port, pool_mode=pool_mode, port=port,
                        pool_size=pool_size, extra=extra)
    try:
        yield bouncer.start()
    finally:
        bouncer.stop()
