"""The metrics of a worker fleet: the dramatiq middleware that turns them on in
each worker process, the one endpoint per host that serves them, and the
collector of the figures only the database knows.

The instruments and their hooks are telemetry/metrics.py's; this module is
the part that needs the app (docs/decisions/0034-metrics.md).

* :func:`metrics_middleware`: dramatiq's own Prometheus middleware (its
  message counts and durations by queue and actor), pointed at our
  multiprocess directory, without its forked server; at each worker
  process's boot it turns our instruments on, counts loop ends from our
  signals, and starts a :class:`ServerSlot`.
* :class:`ServerSlot`: every worker process tries to bind the host's port;
  the one that does serves the directory's values and the fleet's figures,
  the others try again every few seconds (one endpoint per host, taken over
  when its holder exits). The holder first removes the files a previous
  run's dead processes left.
* :class:`FleetCollector`: queue depth and the oldest due job's age per
  queue, tool calls waiting for a decision or a result, live and lost worker
  processes; read at each scrape, a few indexed aggregates. The admin's
  ``metrics`` view serves it too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..loops import queries
from ..queue import sql as queue_sql
from ..queue.middleware.worker_registry import MISSED_BEATS
from ..signals import loop_completed, loop_failed, loop_paused
from ..state import SolidLoopState
from ..telemetry import metrics

logger = logging.getLogger("flask_solidloop.metrics")

#: The content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# -- worker processes --------------------------------------------------------------------


def metrics_middleware(state: SolidLoopState) -> Any:
    """The dramatiq middleware of SOLIDLOOP_METRICS (added by init_app)."""
    # Imported here: the module makes a directory of its own at import, and
    # only a fleet with metrics on needs it.
    from dramatiq.middleware import prometheus

    directory = state.config.metrics_directory

    class SolidLoopMetrics(prometheus.Prometheus):
        """dramatiq's message figures into our directory, and our instruments,
        on at each worker process's boot; the host's server, held by one of
        them (:class:`ServerSlot`). dramatiq's own fork is not used."""

        slot: ServerSlot | None = None

        @property
        def forks(self) -> list[Any]:
            return []

        def after_process_boot(self, broker: Any) -> None:
            metrics.enable(directory)
            # dramatiq's middleware reads the directory from this module
            # global at boot and at shutdown.
            prometheus.DB_PATH = directory
            super().after_process_boot(broker)
            count_loop_ends()

        def after_worker_boot(self, broker: Any, worker: Any) -> None:
            self.slot = ServerSlot(state, directory)
            self.slot.start()

        def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
            if self.slot is not None:
                self.slot.stop()

        def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
            prometheus.DB_PATH = directory
            super().after_worker_shutdown(broker, worker)

    return SolidLoopMetrics()


def _loop_completed(sender: Any, **data: Any) -> None:
    metrics.loop_ended("completed")


def _loop_failed(sender: Any, **data: Any) -> None:
    metrics.loop_ended("failed", queries.classify_failure(data.get("error")))


def _loop_paused(sender: Any, **data: Any) -> None:
    found = queries.classify_failure(data.get("reason"))
    metrics.loop_ended("paused", found if found in queries.PAUSING_CLASSES else "operator")


def count_loop_ends() -> None:
    """Count the loops this process ends, from our signals (any app's)."""
    loop_completed.connect(_loop_completed, weak=False)
    loop_failed.connect(_loop_failed, weak=False)
    loop_paused.connect(_loop_paused, weak=False)


# -- the fleet's figures ----------------------------------------------------------------


class FleetCollector:
    """A prometheus_client collector of the figures read from the database at
    each scrape. They are the fleet's, not the host's: every endpoint reports
    the same values (aggregate them with ``max``)."""

    def __init__(self, state: SolidLoopState) -> None:
        self.state = state

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: never at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("solidloop_database_up",
                               "Whether the last scrape could read the fleet's figures.")
        try:
            queues, waiting, workers = self.read()
        except Exception as exc:
            logger.warning("metrics: cannot read the fleet's figures: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily("solidloop_queue_jobs", "Jobs in the queue table, by state.",
                                  labels=["queue", "state"])
        oldest = GaugeMetricFamily("solidloop_queue_oldest_due_age_seconds",
                                   "Age of the oldest job that is due and not yet claimed.",
                                   labels=["queue"])
        for queue, (due, scheduled, running, age) in sorted(queues.items()):
            depth.add_metric([queue, "due"], due)
            depth.add_metric([queue, "scheduled"], scheduled)
            depth.add_metric([queue, "running"], running)
            oldest.add_metric([queue], age)
        yield depth
        yield oldest
        calls = GaugeMetricFamily("solidloop_tool_calls_waiting",
                                  "Tool calls waiting for an approval or a deferred result.",
                                  labels=["waits_for"])
        for kind in ("approval", "result"):
            calls.add_metric([kind], waiting.get(kind, 0))
        yield calls
        alive, lost = workers
        registry = GaugeMetricFamily("solidloop_workers",
                                     "Worker processes in the registry: alive, or lost "
                                     "(silent for three heartbeats, never stopped).",
                                     labels=["state"])
        registry.add_metric(["alive"], alive)
        registry.add_metric(["lost"], lost)
        yield registry

    def read(self) -> tuple[dict[str, tuple[int, int, int, float]], dict[str, int],
                            tuple[int, int]]:
        """(queue -> (due, scheduled, running, oldest due age)), waiting calls by
        kind, (alive, lost) workers: one short read-only transaction."""
        from sqlalchemy.orm import Session

        state = self.state
        with state.app.app_context(), Session(state.db.engine) as session:
            connection = session.connection()
            queues = {str(name): (0, 0, 0, 0.0) for name in state.broker.get_declared_queues()}
            for name, due, scheduled, running, age in connection.exec_driver_sql(
                    queue_sql.QUEUE_FIGURES):
                queues[str(name)] = (int(due), int(scheduled), int(running), float(age))
            waiting = queries.waiting_calls(session)
            (alive, lost), = connection.exec_driver_sql(
                queue_sql.WORKER_FIGURES,
                {"silent": state.config.worker_heartbeat * MISSED_BEATS}).all()
            session.rollback()
            return queues, waiting, (int(alive or 0), int(lost or 0))


def exposition(state: SolidLoopState, directory: str | None) -> bytes:
    """The text exposition: the multiprocess ``directory``'s values (if given
    and present) and the fleet's figures."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    if directory is not None and os.path.isdir(directory):
        MultiProcessCollector(registry, path=directory)
    registry.register(FleetCollector(state))
    return generate_latest(registry)


# -- the server: one per host ------------------------------------------------------------

_PID_FILE = re.compile(r"_(\d+)\.db$")
#: Seconds between a worker process's tries to take the host's port.
RETRY_SECONDS = 5.0


def remove_dead_files(directory: str, *, before: float) -> int:
    """Remove the value files of processes no longer alive that were last
    written before ``before`` (a previous run's); how many. The files of
    workers that died in this run stay, so the counters they hold do not
    drop."""
    removed = 0
    for name in os.listdir(directory):
        found = _PID_FILE.search(name)
        if found is None or _alive(int(found.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_mtime < before:
                os.remove(path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_started_at() -> float | None:
    """When this fleet's run began: the start of this process's parent (the
    dramatiq master), from /proc; None where that cannot be told."""
    try:
        return os.stat(f"/proc/{os.getppid()}").st_ctime
    except OSError:
        return None


def make_server(state: SolidLoopState, host: str, port: int,
                directory: str | None) -> ThreadingHTTPServer:
    """An HTTP server answering every GET with :func:`exposition`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                body = exposition(state, directory)
            except Exception:
                logger.exception("metrics: the exposition failed")
                self.send_error(500)
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class ServerSlot:
    """The host's one metrics endpoint, held by one worker process.

    Every worker process runs one daemon thread that tries to bind
    SOLIDLOOP_METRICS_HOST:SOLIDLOOP_METRICS_PORT; the first to bind serves
    (the others' binds fail: the port is taken) and the rest try again every
    :data:`RETRY_SECONDS`, so when the holder exits, another takes the port
    over within seconds. No process of its own is needed, and it does not
    depend on when the dramatiq master starts its forks."""

    def __init__(self, state: SolidLoopState, directory: str) -> None:
        self.state, self.directory = state, directory
        self.stopping = threading.Event()
        self.server: ThreadingHTTPServer | None = None
        self.thread = threading.Thread(target=self._run, name="solidloop-metrics",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        server = self.server
        if server is not None:
            server.shutdown()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        config = self.state.config
        while not self.stopping.is_set():
            try:
                server = make_server(self.state, config.metrics_host, config.metrics_port,
                                     self.directory)
            except OSError:
                self.stopping.wait(RETRY_SECONDS)  # another process holds it
                continue
            self.server = server
            started = _run_started_at()
            removed = 0 if started is None else remove_dead_files(self.directory,
                                                                  before=started)
            logger.info("metrics: serving http://%s:%d/metrics from %s (%d files of a "
                        "previous run removed)", config.metrics_host, config.metrics_port,
                        self.directory, removed)
            try:
                server.serve_forever(poll_interval=0.5)
            finally:
                server.server_close()
                self.server = None
