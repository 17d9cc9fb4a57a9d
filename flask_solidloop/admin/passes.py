"""What the dashboard says about the last reaper and janitor passes.

The rows come from solidloop_maintenance_runs (maintenance/runs.py), written
by whichever process ran the pass; this module only judges them against the
database clock and this app's settings: how long ago, by whom, what it did,
and whether that calls for a warning (a reap older than a few reaper
intervals means no worker is reaping, and loops whose worker died are not
being healed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from ..config import Config
from ..maintenance.janitor import runs_in_workers
from ..models import MaintenanceRun
from .format import span

#: A reap is stale after this many reaper intervals without one...
STALE_INTERVALS = 5
#: ...and never sooner than this (seconds): a short interval must not flicker.
STALE_FLOOR = 10.0
#: With the in-worker reaper off (SOLIDLOOP_REAPER_INTERVAL=0) something else
#: must reap (``flask solidloop reap --every N``, the maintenance actor on the
#: host's schedule); its reaps are stale after this (seconds).
REAP_OFF_STALE = 300.0

_OFF_HINT = ("SOLIDLOOP_REAPER_INTERVAL=0 turns the in-worker reaper off; then run "
             "'flask solidloop reap --every 5' or schedule the maintenance actor")


@dataclass(frozen=True)
class PassStatus:
    """One task's line on the dashboard."""

    task: str
    #: The row, None when no pass was ever recorded.
    run: MaintenanceRun | None
    #: Seconds since the last pass ended (database clock), None without a row.
    age: float | None
    #: Why this line needs attention (stale, never ran, last pass failed), or None.
    warning: str | None
    #: Context that is not a problem (the janitor is off, who reaps instead).
    note: str | None

    @property
    def failed(self) -> bool:
        return self.run is not None and not self.run.last_ok

    @property
    def nonzero_counts(self) -> list[tuple[str, int]]:
        counts = self.run.counts if self.run is not None else {}
        return sorted((k, int(v)) for k, v in counts.items() if v)


def reap_stale_after(config: Config) -> float:
    """Seconds after which the last reap counts as stale for this app."""
    if config.reaper_interval <= 0:
        return REAP_OFF_STALE
    return max(STALE_INTERVALS * config.reaper_interval, STALE_FLOOR)


def _age(run: MaintenanceRun | None, now: datetime) -> float | None:
    if run is None:
        return None
    return max(0.0, (now - run.last_finished_at).total_seconds())


def reap_status(run: MaintenanceRun | None, now: datetime, config: Config) -> PassStatus:
    age = _age(run, now)
    off = config.reaper_interval <= 0
    warning = note = None
    if age is None:
        warning = (f"no reap was ever recorded: {_OFF_HINT}" if off else
                   "no worker has reaped yet: is any worker running? "
                   "(start one with 'flask solidloop worker'; "
                   "SOLIDLOOP_REAPER_INTERVAL=0 turns the in-worker reaper off)")
    elif age > reap_stale_after(config):
        warning = (f"nothing has reaped for {span(age)}: {_OFF_HINT}" if off else
                   f"no worker has reaped for {span(age)}: is any worker running? "
                   "SOLIDLOOP_REAPER_INTERVAL=0 turns the in-worker reaper off")
    elif off:
        note = ("the in-worker reaper is off here (SOLIDLOOP_REAPER_INTERVAL=0); "
                "these reaps come from elsewhere")
    return PassStatus("reap", run, age, warning, note)


def prune_status(run: MaintenanceRun | None, now: datetime, config: Config) -> PassStatus:
    age = _age(run, now)
    warning = note = None
    interval = config.janitor_interval
    if not runs_in_workers(config):
        note = ("workers do not prune: SOLIDLOOP_JANITOR_INTERVAL=0 (run 'flask solidloop "
                "prune --every 3600' or schedule the maintenance actor)")
    elif age is None:
        note = f"workers prune every {span(interval)}"
    elif age > STALE_INTERVALS * interval:
        warning = (f"no worker has pruned for {span(age)} (they prune every "
                   f"{span(interval)}): is any worker running?")
    return PassStatus("prune", run, age, warning, note)


def statuses(runs: Mapping[str, MaintenanceRun], now: datetime,
             config: Config) -> list[PassStatus]:
    """The dashboard's maintenance lines: reap, then prune."""
    return [reap_status(runs.get("reap"), now, config),
            prune_status(runs.get("prune"), now, config)]
