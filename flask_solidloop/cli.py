"""``flask solidloop ...``: thin click commands over plain functions.

Errors a newcomer meets are one line each, never a traceback
(:class:`SolidLoopGroup`): a configuration error exits 2; an unreachable,
missing or never-migrated database exits 1 naming the database (password
redacted) and the command that fixes it. ``flask solidloop --traceback ...``
(or ``SOLIDLOOP_TRACEBACK=1``) shows the details. The group is also a
``flask.commands`` entry point, so it exists, and reports a configuration error
in one line, even when the app fails to load.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import click
from flask import current_app, has_app_context
from flask.cli import ScriptInfo, with_appcontext

from .config import QUEUES
from .errors import ConfigurationError, DatabaseUnavailableError, SolidLoopError
from .runtime.worker import worker_command
from .runtime.worker import worker_env as launch_env
from .state import SolidLoopState, get_state

#: Commands that work before the solidloop tables exist (they create them, or
#: only talk about them).
SCHEMA_FREE = {"db", "demo"}
TRACEBACK_ENV = "SOLIDLOOP_TRACEBACK"
_TRACEBACK = "solidloop.traceback"
_ARGS = "solidloop.args"


def _fail(ctx: click.Context, message: str, code: int) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    ctx.exit(code)


def _database_url(ctx: click.Context) -> str | None:
    try:
        return get_state().database_url if has_app_context() else None
    except SolidLoopError:
        return None


class SolidLoopGroup(click.Group):
    """The ``solidloop`` group: every error a user can act on becomes one line."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        ctx.meta[_ARGS] = [name, *rest]
        return name, cmd, rest

    def invoke(self, ctx: click.Context) -> Any:
        import psycopg
        import sqlalchemy.exc

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if ctx.meta.get(_TRACEBACK) or os.environ.get(TRACEBACK_ENV):
                raise
            if isinstance(exc, ConfigurationError):
                _fail(ctx, str(exc), 2)
            if isinstance(exc, SolidLoopError):
                _fail(ctx, str(exc), 1)
            url = _database_url(ctx)
            if isinstance(exc, sqlalchemy.exc.ProgrammingError | psycopg.errors.UndefinedTable) \
                    and "solidloop_" in str(exc) and url:
                from .database import check_schema

                try:
                    check_schema(url)
                except DatabaseUnavailableError as schema:
                    _fail(ctx, str(schema), 1)
                raise
            if isinstance(exc, sqlalchemy.exc.OperationalError | psycopg.OperationalError) \
                    and url:
                from .database import unavailable

                original = getattr(exc, "orig", None) or exc
                _fail(ctx, f"{unavailable(url, original)} (--traceback shows details)", 1)
            raise


@click.group("solidloop", cls=SolidLoopGroup)
@click.option("--traceback", is_flag=True, default=False,
              help="Show the full traceback of an error instead of its one-line summary "
                   f"(or set {TRACEBACK_ENV}=1).")
@click.pass_context
def solidloop_cli(ctx: click.Context, traceback: bool) -> None:
    """Durable LLM agent loops: workers, migrations, loops.

    Every command but `db` and `demo` first checks that the solidloop tables
    are migrated, and names the command to run when they are not.
    """
    ctx.meta[_TRACEBACK] = traceback
    args = ctx.meta.get(_ARGS) or []
    if not args or args[0] in SCHEMA_FREE or "--help" in args or "-h" in args:
        return
    from .database import check_schema

    if has_app_context():
        app = current_app._get_current_object()  # type: ignore[attr-defined]
    else:
        info = ctx.find_object(ScriptInfo) or ScriptInfo()
        app = info.load_app()
    check_schema(get_state(app).database_url)


def _state() -> SolidLoopState:
    return get_state()


def _stamp() -> str:
    """A UTC timestamp for lines of long-running commands (``reap --every``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- database -------------------------------------------------------------------


@solidloop_cli.group("db")
def db_group() -> None:
    """Migrate the solidloop_* tables (own Alembic version table)."""


@db_group.command("upgrade")
@click.option("--revision", default="heads", show_default=True, help="Target revision.")
@click.option("--create-database/--no-create-database", default=False,
              help="Create the database first if it does not exist.")
@with_appcontext
def db_upgrade(revision: str, create_database: bool) -> None:
    """Create or upgrade the solidloop tables in the configured database."""
    from .database import ensure_database, upgrade_database

    url = _state().database_url
    try:
        if create_database:
            name = url.rsplit("/", 1)[-1].split("?", 1)[0]
            if ensure_database(url):
                click.echo(f"created database {name!r}")
            else:
                click.echo(f"database {name!r} already exists")
        upgrade_database(url, revision)
    except DatabaseUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    from .migrations import current_revision

    click.echo(f"solidloop tables are at revision {current_revision(url)}")


@db_group.command("downgrade")
@click.argument("revision")
@with_appcontext
def db_downgrade(revision: str) -> None:
    """Downgrade the solidloop tables to REVISION ('base' drops them all)."""
    from .database import check_connection
    from .migrations import downgrade

    check_connection(_state().database_url)
    downgrade(_state().database_url, revision)
    click.echo(f"solidloop tables are at revision {revision}")


@db_group.command("current")
@with_appcontext
def db_current() -> None:
    """Show the applied and the latest revision."""
    from .database import applied_revision
    from .migrations import head_revision

    click.echo(f"applied: {applied_revision(_state().database_url) or 'none'}")
    click.echo(f"latest:  {head_revision()}")


# -- workers --------------------------------------------------------------------


def worker_env(app_import_path: str | None) -> dict[str, str]:
    try:
        return launch_env(app_import_path)
    except (ValueError, SolidLoopError) as exc:  # no FLASK_APP: ValueError, or a SetupError
        raise click.ClickException(str(exc)) from exc


def _queue_names(ctx: click.Context, param: click.Parameter,
                 value: tuple[str, ...]) -> tuple[str, ...]:
    from .errors import InvalidJobError
    from .queue.broker import check_queue_name

    for name in value:
        try:
            check_queue_name(name)
        except InvalidJobError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


@solidloop_cli.command("worker", context_settings={"ignore_unknown_options": True})
@click.option("-p", "--processes", default=2, show_default=True, help="Worker processes.")
@click.option("-t", "--threads", default=4, show_default=True, help="Threads per process.")
@click.option("-Q", "--queue", "queues", multiple=True, callback=_queue_names,
              help="Consume only these queues (repeatable). Default: solidloop's three, "
                   "'default', and every queue the app's actors and solidloop.queue() "
                   "declared.")
@click.option("-m", "--module", "modules", multiple=True, metavar="MODULE",
              help="Also import this module in each worker process (repeatable): task "
                   "modules the app itself does not import.")
@click.option("--dry-run", is_flag=True,
              help="Print the command and the PostgreSQL connections these processes "
                   "need, and start nothing.")
@click.argument("dramatiq_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def worker(ctx: click.Context, processes: int, threads: int, queues: tuple[str, ...],
           modules: tuple[str, ...], dry_run: bool, dramatiq_args: tuple[str, ...]) -> None:
    """Run dramatiq workers for this app's loops and jobs (extra args go to dramatiq).

    Size the database pool as threads + 1 per process (--dry-run prints the
    whole connection budget). A worker that consumes an explicit queue list
    must include all three solidloop queues somewhere in the fleet, or loops
    stall.
    """
    info = ctx.find_object(ScriptInfo)
    import_path = info.app_import_path if info else None
    if queues and not set(queues) & set(QUEUES):
        click.echo(f"warning: this worker consumes none of solidloop's queues "
                   f"({', '.join(QUEUES)}); make sure other workers do, or agent loops "
                   "will wait forever", err=True)
    cmd = worker_command(processes=processes, threads=threads, queues=queues,
                         extra=dramatiq_args)
    # dramatiq takes extra modules as positional arguments right after the broker module.
    at = cmd.index("flask_solidloop.worker") + 1
    cmd[at:at] = list(modules)
    env = worker_env(import_path)
    if dry_run:
        click.echo(f"would start: FLASK_APP={shlex.quote(env['FLASK_APP'])} {shlex.join(cmd)}")
        app = info.load_app() if info else None
        if app is None:
            raise click.UsageError("--dry-run needs the app: flask --app yourapp solidloop ...")
        with app.app_context():
            _print_connection_budget(processes=processes, threads=threads)
        return
    # A line that can be pasted into a shell as it is: the interpreter included.
    click.echo(f"starting: FLASK_APP={shlex.quote(env['FLASK_APP'])} {shlex.join(cmd)}",
               err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Become the dramatiq master process, so signals (SIGTERM from a process
    # manager, Ctrl-C) reach it directly and nothing is left orphaned.
    os.execvpe(cmd[0], cmd, env)


def _print_connection_budget(*, processes: int, threads: int) -> None:
    """The connections ``processes`` worker processes of ``threads`` threads
    need at most, line by line, against the server's max_connections."""
    from .runtime.worker import connection_budget

    state = _state()
    needs = connection_budget(state.config, threads=threads)
    per_process = sum(need.count for need in needs)
    click.echo(f"PostgreSQL connections per worker process (-t {threads}), at most:")
    for need in needs:
        click.echo(f"  {need.count:>4}  {need.what}")
    click.echo(f"  {per_process:>4}  per process")
    total = per_process * processes
    click.echo(f"{total} for {processes} process(es) (-p {processes} x {per_process}), plus "
               "your web processes' pools and any separate `flask solidloop reap`")
    session = state.db.session
    try:
        limit = int(session.connection().exec_driver_sql("SHOW max_connections").scalar_one())
        reserved = int(session.connection().exec_driver_sql(
            "SHOW superuser_reserved_connections").scalar_one())
    except Exception as exc:  # the plan is still worth printing
        click.echo(f"(could not read max_connections: {' '.join(str(exc).split())})")
        return
    finally:
        session.rollback()
    usable = limit - reserved
    verdict = "fits" if total <= usable else "does NOT fit: raise max_connections, or run " \
        "fewer processes or threads, or put PgBouncer in front of the SQLAlchemy pools " \
        "(docs/guides/pgbouncer.md)"
    click.echo(f"PostgreSQL max_connections = {limit} ({usable} after "
               f"superuser_reserved_connections): {verdict}")


def _registry(identities: list[str] | None = None, recent: float | None = None) -> list:
    from .queue.middleware.worker_registry import list_workers

    state = _state()
    session = state.db.session
    try:
        connection = session.connection().connection
        return list_workers(connection, identities=identities,
                            recent=recent if recent is not None else state.config.worker_retention)
    finally:
        session.rollback()


def _seconds(value: float) -> str:
    value = max(0, int(value))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if value >= size:
            return f"{value // size}{unit}"
    return f"{value}s"


def _ids(kind: str, ids: list[int], limit: int = 8) -> str:
    shown = ",".join(str(i) for i in ids[:limit]) + ("..." if len(ids) > limit else "")
    return f"{kind} {shown}" if ids else ""


@solidloop_cli.command("workers")
@click.option("--recent", default=3600.0, show_default=True, metavar="SECONDS",
              help="Also show workers that stopped or went silent within SECONDS.")
@with_appcontext
def workers_command(recent: float) -> None:
    """List worker processes: live, and recently stopped or lost, with what each holds.

    A worker is lost when its heartbeat (SOLIDLOOP_WORKER_HEARTBEAT) went
    silent for three beats without a clean shutdown: it died, and the reaper
    takes over what it held once those leases lapse.
    """
    interval = _state().config.worker_heartbeat
    rows = _registry(recent=recent)
    if not rows:
        click.echo("no workers registered; start one with `flask solidloop worker`")
        return
    # Columns as wide as their longest value: a worker identity or a queue name
    # cut short could not be passed on to `flask solidloop worker -Q` or grep.
    who = max(len("worker"), *(len(row.identity) for row in rows))
    queues = {row.identity: ",".join(row.queues) for row in rows}
    wide = max(len("queues"), *(len(q) for q in queues.values()))
    click.echo(f"{'worker':<{who}} {'state':<8} {'threads':>7} {'started':>8} {'seen':>6}  "
               f"{'queues':<{wide}} holds")
    for row in rows:
        holds = "  ".join(x for x in (_ids("loops", row.loops),
                                      _ids("tool calls", row.tool_calls)) if x) or "-"
        started = _seconds((row.last_seen_at - row.started_at).total_seconds() + row.silent_for)
        click.echo(f"{row.identity:<{who}} {row.state(interval):<8} {row.threads:>7} "
                   f"{started + ' ago':>8} {_seconds(row.silent_for) + ' ago':>6}  "
                   f"{queues[row.identity]:<{wide}} {holds}")


# -- host jobs ------------------------------------------------------------------


def _job_error(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@solidloop_cli.group("jobs", invoke_without_command=True)
@click.option("--state", "states", multiple=True, metavar="STATE",
              help="Only jobs in this state (repeatable): queued, running, done, dead, "
                   "or RQ's started, finished, failed.")
@click.option("--queue", "queues", multiple=True, metavar="QUEUE",
              help="Only jobs of this queue (repeatable).")
@click.option("--limit", default=50, show_default=True, help="Newest N jobs.")
@click.pass_context
@with_appcontext
def jobs_group(ctx: click.Context, states: tuple[str, ...], queues: tuple[str, ...],
               limit: int) -> None:
    """List jobs (newest first); `jobs retry` and `jobs cancel` act on one.

    A `*` after a queued job's queue: no live worker consumes that queue.
    """
    if ctx.invoked_subcommand is not None:
        return
    from .errors import JobError
    from .jobs.control import list_jobs

    try:
        rows = list_jobs(_state().broker, states=states, queues=queues, limit=limit)
    except JobError as exc:
        raise _job_error(exc) from exc
    if not rows:
        click.echo("no jobs")
        return
    unconsumed = _unconsumed_queues({row.queue_name for row in rows if row.state == "queued"})
    click.echo(f"{'row':>8}  {'queue':<22} {'state':<8} {'tries':>5}  {'what':<40} job id")
    for row in rows:
        what = row.func_name or row.actor_name
        flag = "*" if row.state == "queued" and row.queue_name in unconsumed else ""
        queue = row.queue_name[:22 - len(flag)] + flag
        click.echo(f"{row.id:>8}  {queue:<22} {row.state:<8} {row.attempts:>5}  "
                   f"{what[:40]:<40} {row.host_job_id or ''}")
        if row.state == "dead" and row.last_error:
            click.echo(f"{'':>10}{row.last_error.strip().splitlines()[-1][:110]}")
    if unconsumed:
        waiting = Counter(row.queue_name for row in rows
                          if row.state == "queued" and row.queue_name in unconsumed)
        names = ", ".join(f"{queue} ({count})" for queue, count in sorted(waiting.items()))
        click.echo(f"* waiting on a queue no live worker consumes: {names}. Start "
                   "`flask solidloop worker` (it consumes 'default' and every queue declared "
                   f"at import), or add -Q {' -Q '.join(sorted(waiting))}")


def _unconsumed_queues(queues: set[str]) -> set[str]:
    """Of ``queues``, those no live worker consumes (per the worker registry)."""
    if not queues:
        return set()
    from .queue.middleware.worker_registry import live_queues

    state = _state()
    session = state.db.session
    try:
        consumed = live_queues(session.connection().connection,
                               interval=state.config.worker_heartbeat)
    finally:
        session.rollback()
    return queues - consumed


@jobs_group.command("retry")
@click.argument("job_id", required=False)
@click.option("--failed", is_flag=True,
              help="Requeue every dead-lettered job of the host's queues (not solidloop_*).")
@click.option("--queue", "queues", multiple=True, help="With --failed: only these queues.")
@with_appcontext
def jobs_retry(job_id: str | None, failed: bool, queues: tuple[str, ...]) -> None:
    """Requeue a failed job (JOB_ID: a row id or an RQ job id), or all with --failed."""
    from .errors import JobError
    from .jobs.control import retry, retry_failed

    if bool(job_id) == failed:
        raise click.UsageError("give a JOB_ID or --failed (one of them)")
    broker = _state().broker
    try:
        if job_id:
            click.echo(retry(broker, job_id))
        else:
            done = retry_failed(broker, queues)
            click.echo(f"requeued {len(done)} failed job(s)")
    except JobError as exc:
        raise _job_error(exc) from exc


@jobs_group.command("cancel")
@click.argument("job_id")
@with_appcontext
def jobs_cancel(job_id: str) -> None:
    """Cancel a queued job (JOB_ID: a row id or an RQ job id): it will not run."""
    from .errors import JobError
    from .jobs.control import cancel

    try:
        click.echo(cancel(_state().broker, job_id))
    except JobError as exc:
        raise _job_error(exc) from exc


# -- loops ----------------------------------------------------------------------


@solidloop_cli.command("start")
@click.argument("agent")
@click.argument("message")
@with_appcontext
def start(agent: str, message: str) -> None:
    """Start a loop of AGENT with MESSAGE; prints the loop id."""
    state = _state()
    try:
        cls = state.agent_class(agent)
        loop = cls.start(message=message)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"loop {loop.id} queued (agent {agent!r}); watch it with "
               f"`flask solidloop status {loop.id}`")


@solidloop_cli.command("fork")
@click.argument("loop_id", type=int)
@click.option("--at", "at_message_id", type=int, required=True, metavar="MESSAGE_ID",
              help="Fork at this message of the loop (ids as `flask solidloop status` "
                   "lists them).")
@click.option("--message", default=None, help="Replace the last user message with this.")
@with_appcontext
def fork(loop_id: int, at_message_id: int, message: str | None) -> None:
    """Start a new loop from LOOP_ID's history up to a message; prints its id.

    Each tool call is copied with its result: a fork point inside a finished
    tool phase takes the whole phase, one inside an unfinished phase moves
    back to before the assistant message that opened it.
    """
    from .loops import control

    try:
        loop = control.fork(_state(), loop_id, at_message_id, message=message)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"loop {loop.id} queued: a fork of loop {loop_id} at message {at_message_id}; "
               f"watch it with `flask solidloop status {loop.id}`")


@solidloop_cli.command("replay")
@click.argument("loop_id", type=int)
@click.option("--against-model", "model", required=True, metavar="MODEL",
              help="The model the new loop runs against (same provider settings otherwise).")
@with_appcontext
def replay(loop_id: int, model: str) -> None:
    """Run LOOP_ID again from its first user message against another model;
    prints the new loop's id (a fork, for comparing models)."""
    from .loops import control

    try:
        loop = control.replay(_state(), loop_id, model=model)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"loop {loop.id} queued: a replay of loop {loop_id} against model {model!r}; "
               f"watch it with `flask solidloop status {loop.id}`")


@solidloop_cli.command("status")
@click.argument("loop_id", type=int)
@with_appcontext
def status(loop_id: int) -> None:
    """Show a loop, its messages and its tool calls (and an LLM request in
    flight, with its elapsed time)."""
    from .loops import queries, wire_reads
    from .loops.lineage import lineage
    from .render import (
        format_budget,
        format_lineage,
        format_loop,
        format_message,
        format_requests,
    )
    from .spending import loop_budget

    session = _state().db.session
    loop = queries.get_loop(session, loop_id)
    if loop is None:
        raise click.ClickException(f"no loop with id {loop_id}")
    click.echo(format_loop(loop))
    tree = lineage(session, loop)
    for line in format_lineage(tree):
        click.echo(line)
    for line in format_budget(loop_budget(_state(), session, loop)):
        click.echo(line)
    for line in format_requests(wire_reads.pending_requests(session, loop_id)):
        click.echo(line)
    calls = {c.id: c for c in queries.tool_calls(session, loop_id)}
    states = queries.tool_call_states(session, loop_id)
    holders = sorted({s.holder for s in states.values() if s.holder and s.state == "running"}
                     | ({loop.lease_holder} if loop.status == "running" and loop.lease_holder
                        else set()))
    if holders:
        interval = _state().config.worker_heartbeat
        seen = {row.identity: row for row in _registry(identities=holders)}
        for holder in holders:
            row = seen.get(holder)
            if row is None:
                click.echo(f"  worker {holder}: not in the registry")
            else:
                click.echo(f"  worker {holder}: {row.state(interval)}, last heartbeat "
                           f"{_seconds(row.silent_for)} ago, queues {','.join(row.queues)}")
    for message in queries.messages(session, loop_id, include_hidden=True):
        click.echo(format_message(message, calls, show_hidden=True, states=states,
                                  children={kin.tool_call_id: kin for kin in tree.children
                                            if kin.tool_call_id is not None}))


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """``30m``, ``2h``, ``7d``, ``90s`` ago, or an ISO date/time (UTC if naive)."""
    now = now or datetime.now(UTC)
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
    text = value.strip()
    if text[:-1].isdigit() and text[-1:].lower() in units:
        return now - timedelta(**{units[text[-1].lower()]: int(text[:-1])})
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO date "
            "(2025-01-31 or 2025-01-31T08:00)", param_hint="--since") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _age(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    seconds = max(0, int((now - moment).total_seconds()))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _short(text: str | None, width: int) -> str:
    if not text:
        return ""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


@solidloop_cli.command("list")
@click.option("--status", "statuses", multiple=True,
              type=click.Choice(["init", "queued", "running", "waiting", "completed", "failed",
                                 "paused"]),
              help="Only loops in this status (repeatable).")
@click.option("--agent", default=None, help="Only loops of this agent.")
@click.option("--since", default=None, metavar="WHEN",
              help="Only loops created since WHEN: a duration ago (30m, 2h, 7d) or an ISO date.")
@click.option("--failed", is_flag=True, default=False, help="Only failed loops (same as "
              "--status failed).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10000),
              help="Newest N loops.")
@with_appcontext
def list_command(statuses: tuple[str, ...], agent: str | None, since: str | None,
                 failed: bool, limit: int) -> None:
    """List loops, newest first: id, agent, status, steps, tokens, cost, age, why it failed.

    The budget column is the share spent of the loop's tightest budget limit
    (`status ID` shows each limit).
    """
    from .loops.queries import LoopFilter, list_loops
    from .spending import SHORT, AgentLimits, tightest

    now = datetime.now(UTC)
    filters = LoopFilter(statuses=statuses, agent=agent, failed_only=failed,
                         since=parse_since(since, now) if since else None)
    loops = list_loops(_state().db.session, filters, limit=limit)
    if not loops:
        click.echo("no loops match")
        return
    click.echo(f"{'id':>7}  {'agent':<18} {'status':<9} {'steps':>5} {'tokens':>9} "
               f"{'cost':>10} {'budget':>11} {'age':>5}  reason")
    agents = AgentLimits(_state())
    for loop in loops:
        top = tightest(agents.loop_gauges(_state().db.session, loop))
        budget = f"{top.percent}% {SHORT[top.key]}" if top is not None else "-"
        tokens = (loop.input_tokens or 0) + (loop.output_tokens or 0)
        reason = _short(loop.error_message, 60) if loop.status in ("failed", "paused") else ""
        if not reason and loop.provider_wait_since is not None:
            reason = _short(f"waiting for its provider: {loop.provider_wait_error or ''}", 60)
        click.echo(f"{loop.id:>7}  {_short(loop.agent_name, 18):<18} {loop.status:<9} "
                   f"{loop.step_count:>5} {tokens:>9} {f'${loop.cost:.4f}':>10} "
                   f"{budget:>11} {_age(loop.created_at, now):>5}  {reason}".rstrip())
    if len(loops) == limit:
        click.echo(f"(newest {limit}; --limit shows more)")


@solidloop_cli.command("limits")
@click.option("--top", default=10, show_default=True, type=click.IntRange(1, 1000),
              help="Show the N subjects nearest their budget.")
@with_appcontext
def limits_command(top: int) -> None:
    """Show the shared rate limits and the subjects' budgets.

    Per rate-limited key (SOLIDLOOP_RATE_LIMITS): each dimension's level,
    drained to now, against its capacity per period; the turns and tool calls
    it deferred, the provider's refusals (429s) met on it, and the block a
    Retry-After set while it lasts. Then the subjects with a budget that spent
    anything in their window, nearest their limit first.
    """
    from .spending import period_text, rate_keys, subjects, window_text

    state = _state()
    session = state.db.session
    keys, now = rate_keys(state, session)
    if not keys:
        click.echo("rate limits: none configured (SOLIDLOOP_RATE_LIMITS) and none recorded")
    else:
        click.echo("rate limits (levels drained to now):")
    for key in keys:
        line = f"  {key.key}  deferrals {key.deferrals}  refusals {key.refusals}"
        if key.blocked_until is not None:
            left = (key.blocked_until - now).total_seconds()
            line += f"  blocked until {key.blocked_until.astimezone(UTC):%H:%M:%S} UTC " \
                    f"({_seconds(left + 0.999)} left)"
        if not key.configured:
            line += "  (no longer configured)"
        click.echo(line)
        for bucket in key.buckets:
            if bucket.capacity is None:
                click.echo(f"    {bucket.dimension:<20} {bucket.level:>12,.1f}")
                continue
            click.echo(f"    {bucket.dimension:<20} {bucket.level:>12,.1f} of "
                       f"{bucket.capacity:,g} {period_text(bucket.period)} "
                       f"({bucket.share * 100:.0f}%)")
    found = subjects(state, session, top=top)
    session.rollback()
    if not found:
        click.echo("subjects: none with a budget has spent anything in its window")
        return
    click.echo(f"subjects with a budget, nearest their limit first (top {top}):")
    for spend in found:
        click.echo(f"  {spend.subject}  over {window_text(spend.window)}: "
                   + ", ".join(g.text() for g in spend.gauges))


def _control(loop_id: int, action: str, **kwargs) -> None:
    from .loops import queries

    state = _state()
    loop = queries.get_loop(state.db.session, loop_id)
    if loop is None:
        raise click.ClickException(f"no loop with id {loop_id}")
    try:
        agent = state.agent_for(loop.agent_name, loop)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    changed = getattr(agent, action)(**kwargs)
    state.db.session.refresh(loop)
    verb = {"pause": "paused", "resume": "resumed", "stop": "stopped",
            "force_stop": "force stopped", "freeze": "frozen", "unfreeze": "unfrozen"}[action]
    if changed:
        click.echo(f"loop {loop_id} {verb}; status is now {loop.status}")
    elif loop.frozen and action == "resume":
        raise click.ClickException(
            f"loop {loop_id} is frozen; run `flask solidloop unfreeze {loop_id}` first")
    else:
        raise click.ClickException(f"loop {loop_id} is {loop.status}; nothing was {verb}")


@solidloop_cli.command("pause")
@click.argument("loop_id", type=int)
@with_appcontext
def pause(loop_id: int) -> None:
    """Pause a queued or running loop."""
    _control(loop_id, "pause")


@solidloop_cli.command("resume")
@click.argument("loop_id", type=int)
@click.option("--from", "from_", multiple=True,
              type=click.Choice(["init", "paused", "failed", "completed"]),
              help="Resume only from these statuses (repeatable). Default: all four.")
@click.option("--message", default=None, help="Append this user message first.")
@click.option("--again", is_flag=True, default=False,
              help="Resume a completed loop without a new message anyway (pays for a turn "
                   "that adds to a finished answer).")
@with_appcontext
def resume(loop_id: int, from_: tuple[str, ...], message: str | None, again: bool) -> None:
    """Resume a paused, failed, completed or init loop.

    A failed loop (stopped, or failed by an error) restarts where it was: a tool
    phase re-runs only the calls no live worker holds. A completed loop needs
    --message (the next user turn), or --again to run one more turn as it is.
    A frozen loop refuses until `flask solidloop unfreeze`.
    """
    from .loops import queries

    loop = queries.get_loop(_state().db.session, loop_id)
    if loop is not None and loop.status == "completed" and not message and not again:
        raise click.ClickException(
            f"loop {loop_id} is completed; resuming it without --message would pay for "
            "another LLM turn that adds to a finished answer. Pass --message TEXT to "
            "continue the conversation, or --again to run one more turn anyway")
    kwargs: dict = {"message": message}
    if from_:
        kwargs["from_"] = from_
    _control(loop_id, "resume", **kwargs)


@solidloop_cli.command("stop")
@click.argument("loop_id", type=int)
@click.option("--reason", default="stopped from the command line", show_default=True)
@with_appcontext
def stop(loop_id: int, reason: str) -> None:
    """Stop a loop: it ends failed, with the reason.

    A stopped loop ends failed, a resumable status, so it can be resumed later
    (`flask solidloop resume ID --from failed`); to forbid that, `flask solidloop
    freeze` the loop before stopping it (a loop that has already ended cannot be
    frozen).
    A tool call that is running finishes on its worker and its result is kept.
    """
    _control(loop_id, "stop", reason=reason)


# -- waiting tool calls ---------------------------------------------------------------


def _decider(by: str | None) -> str:
    """Who decides from the command line: ``--by``, else ``cli:<OS user>``."""
    if by:
        return by
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli"


@solidloop_cli.command("approvals")
@click.option("--agent", default=None, help="Only calls of this agent's loops.")
@click.option("--results", is_flag=True, default=False,
              help="Also list deferred calls that await their result.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10000),
              help="Oldest N calls.")
@with_appcontext
def approvals_command(agent: str | None, results: bool, limit: int) -> None:
    """List the tool calls that await an approval, oldest first."""
    from .loops import control

    state = _state()
    calls = control.pending_calls(state, agent=agent, limit=limit,
                                  waits_for=None if results else "approval")
    if not calls:
        click.echo("nothing awaits a decision" if not results
                   else "nothing awaits a decision or a result")
        return
    now = datetime.now(UTC)
    click.echo(f"{'call':>7} {'loop':>7}  {'awaits':<8} {'tool':<20} {'age':>5} "
               f"{'times out':>10}  arguments")
    for call in calls:
        deadline = call.wait_deadline.astimezone(UTC).strftime("%H:%M:%S") \
            if call.wait_deadline else "never"
        arguments = json.dumps(call.arguments, ensure_ascii=False) \
            if call.arguments is not None else (call.arguments_raw or "")
        click.echo(f"{call.id:>7} {call.loop_id:>7}  {call.waits_for:<8} "
                   f"{_short(call.name, 20):<20} {_age(call.created_at, now):>5} "
                   f"{deadline:>10}  {_short(arguments, 60)}")
    if len(calls) == limit:
        click.echo(f"(oldest {limit}; --limit shows more)")


def _decide(action: str, tool_call_id: int, **kwargs: Any) -> None:
    from .loops import control

    state = _state()
    try:
        decided = getattr(control, action)(state, tool_call_id, **kwargs)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    then = ("its job is queued" if decided.enqueued else
            "the loop is not running: resume it to act on the decision")
    click.echo(f"tool call {tool_call_id} (loop {decided.loop_id}) {decided.decision}; {then}")


@solidloop_cli.command("approve")
@click.argument("tool_call_id", type=int)
@click.option("--arguments", default=None, metavar="JSON",
              help="Run the tool with these arguments instead (a JSON object); the "
                   "model's are kept beside them.")
@click.option("--by", default=None, help="Who decides (default: cli:<your user name>).")
@with_appcontext
def approve_command(tool_call_id: int, arguments: str | None, by: str | None) -> None:
    """Approve a tool call that awaits an approval: its tool runs."""
    edited = None
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--arguments") from None
        if not isinstance(edited, dict):
            raise click.BadParameter('must be a JSON object, such as \'{"amount": 20}\'',
                                     param_hint="--arguments")
    _decide("approve", tool_call_id, by=_decider(by), arguments=edited)


@solidloop_cli.command("deny")
@click.argument("tool_call_id", type=int)
@click.option("--reason", required=True, help="Why; the model reads it as the call's result.")
@click.option("--by", default=None, help="Who decides (default: cli:<your user name>).")
@with_appcontext
def deny_command(tool_call_id: int, reason: str, by: str | None) -> None:
    """Deny a tool call that awaits an approval: it never runs; the model reads why."""
    _decide("deny", tool_call_id, reason=reason, by=_decider(by))


@solidloop_cli.command("complete")
@click.argument("tool_call_id", type=int)
@click.argument("result")
@click.option("--error", "is_error", is_flag=True, default=False,
              help="The model reads the result as an error.")
@click.option("--by", default=None, help="Who supplies it (default: cli:<your user name>).")
@with_appcontext
def complete_command(tool_call_id: int, result: str, is_error: bool, by: str | None) -> None:
    """Supply the RESULT (text) of a deferred tool call that awaits it."""
    _decide("complete_call", tool_call_id, result=result, is_error=is_error, by=_decider(by))


def _every(seconds: float | None, run, label: str) -> None:
    """Run ``run()`` once, or forever every ``seconds`` (errors are reported, not fatal)."""
    import time

    while True:
        started = time.monotonic()
        stamp = f"{_stamp()} " if seconds is not None else ""
        try:
            click.echo(f"{stamp}{label}: {run()}")
        except Exception as exc:
            if seconds is None:
                raise
            reason = " ".join(str(exc).split())
            click.echo(f"{stamp}{label} failed: {type(exc).__name__}: {reason}", err=True)
        finally:
            _state().db.session.remove()
        if seconds is None:
            return
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))


@solidloop_cli.command("reap")
@click.option("--every", type=float, default=None, metavar="SECONDS",
              help="Repeat every SECONDS instead of running once.")
@with_appcontext
def reap_command(every: float | None) -> None:
    """Heal loops whose worker died: expired leases, lost jobs, orphaned shells.

    Idempotent and safe to run from several processes at once.
    """
    from .maintenance.reaper import reap

    _every(every, lambda: reap(_state()).summary(), "reap")


@solidloop_cli.command("prune")
@click.option("--every", type=float, default=None, metavar="SECONDS",
              help="Repeat every SECONDS instead of running once.")
@click.option("--dry-run", is_flag=True, default=False,
              help="Print what a sweep would delete now, per table, and delete nothing.")
@click.option("--loops", "loops_only", is_flag=True, default=False,
              help="Only the loop retention: delete ended loops past it (with --dry-run: "
                   "count them).")
@click.option("--loop-retention", type=int, default=None, metavar="SECONDS",
              help="Delete loops that ended more than SECONDS ago, for this run, in place "
                   "of SOLIDLOOP_LOOP_RETENTION.")
@with_appcontext
def prune_command(every: float | None, dry_run: bool, loops_only: bool,
                  loop_retention: int | None) -> None:
    """Delete rows past their retention: wire-log events, done jobs, expired
    RQ-style jobs and results, old inbound MCP sessions and worker rows (the
    SOLIDLOOP_*_RETENTION settings and the jobs' TTLs; None keeps forever),
    and ended loops with all their rows once SOLIDLOOP_LOOP_RETENTION (or
    --loop-retention) is set. Rows of loops not yet ended, unfinished jobs and
    dead-lettered jobs stay."""
    import dataclasses
    import time

    from .maintenance.janitor import prune, purge_loops

    state = _state()
    if loop_retention is not None:
        if loop_retention <= 0:
            raise click.UsageError("--loop-retention takes seconds > 0")
        state.config = dataclasses.replace(state.config, loop_retention=loop_retention)
    if dry_run:
        if every is not None:
            raise click.UsageError("--dry-run prints once: drop --every")
        _print_prune_preview(loops_only=loops_only)
        return

    def run() -> str:
        if loops_only:
            if state.config.loop_retention is None:
                return ("loops=0 (SOLIDLOOP_LOOP_RETENTION is None: every loop is kept; "
                        "pass --loop-retention SECONDS)")
            started = time.perf_counter()
            try:
                purge = purge_loops(state)
            finally:
                state.db.session.remove()
            return (f"loops={purge.deleted} kept_by_hooks={len(purge.kept)} "
                    f"({(time.perf_counter() - started) * 1000:.1f} ms)")
        report = prune(state)
        return (f"events={report.events} jobs={report.jobs} host_jobs={report.host_jobs} "
                f"results={report.results} inbound_sessions={report.inbound_sessions} "
                f"workers={report.workers} spend={report.spend} loops={report.loops} "
                f"({report.duration_ms:.1f} ms)")

    _every(every, run, "prune")


@solidloop_cli.command("rollup")
@click.option("--every", type=float, default=None, metavar="SECONDS",
              help="Repeat every SECONDS instead of running once.")
@with_appcontext
def rollup_command(every: float | None) -> None:
    """Sum each minute's turns, tokens, cost, latency and failures for the
    admin charts, from the last rolled-up minute to now (the first run goes
    back 7 days). Idempotent: a rerun recomputes, never double counts."""
    from .maintenance.rollup import rollup

    def run() -> str:
        report = rollup(_state())
        return (f"rolled up {report.chunks} hour(s): {report.minute_rows} minute row(s), "
                f"{report.hour_rows} hour row(s), {report.pruned} pruned; "
                f"up to {report.rolled_to}")

    _every(every, run, "rollup")


def _print_prune_preview(*, loops_only: bool = False) -> None:
    from .maintenance.janitor import NEVER_DELETED, preview, rules

    state = _state()
    try:
        report = preview(state)
    finally:
        state.db.session.remove()
    counts = report.counts()
    shown = [rule for rule in rules(state.config) if not loops_only or rule.name == "loops"]
    total = sum(counts[rule.name] for rule in shown)
    click.echo(f"prune --dry-run: nothing deleted; a sweep now would delete "
               f"{total} {'loop(s), each with its rows' if loops_only else 'row(s)'}:")
    for rule in shown:
        click.echo(f"  {rule.name:<17}{counts[rule.name]:>8}  {rule.goes}")
    click.echo(f"never deleted: {NEVER_DELETED}")


@solidloop_cli.command("force-stop")
@click.argument("loop_id", type=int)
@click.option("--reason", default="from the command line", show_default=True)
@with_appcontext
def force_stop(loop_id: int, reason: str) -> None:
    """Stop a loop now: fail it, cancel its queued jobs, revoke its tool leases."""
    _control(loop_id, "force_stop", reason=reason)


@solidloop_cli.command("freeze")
@click.argument("loop_id", type=int)
@with_appcontext
def freeze(loop_id: int) -> None:
    """Pause a loop and lock it against resume until unfrozen."""
    _control(loop_id, "freeze")


@solidloop_cli.command("unfreeze")
@click.argument("loop_id", type=int)
@with_appcontext
def unfreeze(loop_id: int) -> None:
    """Lift a freeze (the loop stays paused until resumed)."""
    _control(loop_id, "unfreeze")


@solidloop_cli.command("export")
@click.argument("loop_id", type=int)
@click.option("--format", "format_", type=click.Choice(["json", "md"]), default="json",
              show_default=True, help="json: the solidloop.conversation/1 document; "
              "md: Markdown for people.")
@with_appcontext
def export(loop_id: int, format_: str) -> None:
    """Print a loop's conversation (messages, tool calls, costs) as JSON or Markdown."""
    from .loops import export as exporting
    from .loops import queries

    session = _state().db.session
    loop = queries.get_loop(session, loop_id)
    if loop is None:
        raise click.ClickException(f"no loop with id {loop_id}")
    document = exporting.conversation(session, loop)
    click.echo(exporting.to_json(document) if format_ == "json"
               else exporting.to_markdown(document), nl=False)


@solidloop_cli.command("demo")
@click.option("--agent", default=None, help="Agent to run (default: the only one registered).")
@click.option("--message", default="What's the weather in Paris right now?", show_default=True)
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait.")
@click.option("--processes", default=1, show_default=True)
@click.option("--threads", default=4, show_default=True)
@click.pass_context
def demo(ctx: click.Context, agent: str | None, message: str, timeout: float,
         processes: int, threads: int) -> None:
    """Migrate, start workers, run one loop and print it as it happens.

    With no provider configured the agent talks to the built-in offline
    model, so this needs no API key and no network.
    """
    from .demo import run_demo

    info = ctx.find_object(ScriptInfo)
    app = info.load_app() if info else current_app
    import_path = info.app_import_path if info else None
    code = run_demo(app, import_path, agent=agent, message=message, timeout=timeout,
                    processes=processes, threads=threads)
    sys.exit(code)
