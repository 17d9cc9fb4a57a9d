"""``flask solidloop demo``: one loop end to end, printed as it happens.

Creates the database if missing, migrates it, serves the built-in offline
model on 127.0.0.1 (exporting its URL as ``SOLIDLOOP_OFFLINE_LLM_URL`` so an
agent can fall back to it when no provider is configured), starts real
dramatiq worker processes, starts a loop and follows it until it ends.

Every run uses the same database (``solidloop_demo`` by default, or
``DATABASE_URL``): loops of earlier runs stay in it, and the new loop gets
the next id. ``flask solidloop list`` shows them all.

Exit status 0 means the loop completed after using a tool; on anything else
the last line says why (the loop failed or paused, it never called a tool,
the workers died, or the timeout passed) and where the workers' log is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from typing import Any

import click
from flask import Flask
from sqlalchemy import select

from .database import ensure_database, upgrade_database
from .errors import SolidLoopError
from .loops import control, queries
from .models import Event
from .render import format_message
from .runtime.worker import worker_command, worker_env
from .state import get_state

OFFLINE_URL_ENV = "SOLIDLOOP_OFFLINE_LLM_URL"

#: Seconds without output after which the demo says what it is waiting for, so
#: the workers' start or a slow model never looks like a hang (a first run
#: prints something at least every 5 s).
QUIET_SECONDS = 3.0


def _database_name(url: str) -> str:
    return url.rsplit("/", 1)[-1].split("?", 1)[0]


def _pick_agent(app: Flask, name: str | None) -> str:
    agents = get_state(app).extension.agents
    if name:
        return name
    if len(agents) == 1:
        return next(iter(agents))
    raise click.ClickException(
        f"pass --agent; registered agents: {', '.join(sorted(agents)) or 'none'}"
    )


def run_demo(app: Flask, import_path: str | None, *, agent: str | None, message: str,
             timeout: float, processes: int = 1, threads: int = 4) -> int:
    state = get_state(app)
    url = state.database_url
    click.echo(f"preparing database {_database_name(url)}")
    from .testing.llm_emulator import LLMEmulator

    try:
        if ensure_database(url):
            click.echo(f"created database {url.rsplit('/', 1)[-1]}")
        upgrade_database(url)
    except SolidLoopError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"database migrated ({_database_name(url)}; shared by every demo run: loops of "
               "earlier runs stay, `flask solidloop list` shows them)")

    emulator = LLMEmulator(offline_model=True).start()
    os.environ.setdefault(OFFLINE_URL_ENV, emulator.base_url)
    try:
        env = worker_env(import_path)
    except (ValueError, SolidLoopError) as exc:  # no FLASK_APP: ValueError, or a SetupError
        raise click.ClickException(str(exc)) from exc
    cmd = worker_command(processes=processes, threads=threads, queues=())
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - outlives this block: workers write it
        prefix="solidloop-demo-workers-", suffix=".log",
        delete=False)
    workers = subprocess.Popen(cmd, env=env, start_new_session=True,
                               stdout=log, stderr=subprocess.STDOUT)
    click.echo(f"started {processes} worker process(es) x {threads} threads "
               f"(log: {log.name})")
    try:
        with app.app_context():
            name = _pick_agent(app, agent)
            agent_cls = state.agent_class(name)
            provider = agent_cls().provider()
            using_offline = provider.base_url == os.environ.get(OFFLINE_URL_ENV)
            click.echo(f"model: {'built-in offline model' if using_offline else provider.base_url}"
                       f" ({provider.model})")
            loop = agent_cls.start(message=message)
            click.echo(f"loop {loop.id} started (agent {name!r})\n")
            return _follow(app, loop.id, timeout, workers, log.name)
    finally:
        _stop(workers)
        log.close()
        emulator.stop()


def _follow(app: Flask, loop_id: int, timeout: float, workers: subprocess.Popen,
            log_path: str) -> int:
    state = get_state(app)
    session = state.db.session
    printed: set[int] = set()
    deadline = time.monotonic() + timeout
    started = last_output = time.monotonic()
    while True:
        session.expire_all()
        loop = queries.get_loop(session, loop_id)
        assert loop is not None
        # Messages before tool calls: a turn's calls commit with its message, so
        # every call of a message read here is in the read that follows.
        messages = [m for m in queries.messages(session, loop_id) if m.status == "completed"]
        calls = {c.id: c for c in queries.tool_calls(session, loop_id)}
        for message in messages:
            if message.id not in printed and message.role != "system":
                printed.add(message.id)
                click.echo(format_message(message, calls))
                last_output = time.monotonic()
        status = loop.status
        used_tool = any(c.executed_at for c in calls.values())
        session.rollback()
        if status == "completed":
            click.echo(f"\nloop {loop_id} completed in {loop.step_count} LLM turns, "
                       f"{len(calls)} tool call(s)")
            if used_tool:
                return 0
            click.echo(explain_no_tool_call(session, loop_id), err=True)
            session.rollback()
            return 1
        if status in ("failed", "paused"):
            click.echo(f"\nloop {loop_id} ended {status}: {loop.error_message}", err=True)
            click.echo(f"demo failed: the loop did not complete (exit 1); `flask solidloop "
                       f"status {loop_id}` shows it, the workers' log is {log_path}", err=True)
            return 1
        if loop.provider_wait_attempts:
            # A deployment waits out its provider's outage; a first run against a
            # wrong URL should not wait 15 minutes to say so.
            control.stop(state, loop_id, reason="the demo stopped it: its provider is out")
            click.echo(f"\nloop {loop_id} waits for its provider: {loop.provider_wait_error}",
                       err=True)
            click.echo(f"demo failed: the loop did not complete (exit 1): check the "
                       f"provider's URL; `flask solidloop status {loop_id}` shows it, the "
                       f"workers' log is {log_path}", err=True)
            return 1
        if workers.poll() is not None:
            with open(log_path, errors="replace") as handle:
                err = handle.read()
            click.echo(f"\nworkers exited with code {workers.returncode}:\n{err[-3000:]}",
                       err=True)
            click.echo(f"demo failed: the worker processes exited before loop {loop_id} ended "
                       f"(exit 1); their log is above and in {log_path}", err=True)
            return 1
        if time.monotonic() > deadline:
            click.echo(f"\nloop {loop_id} still {status} after {timeout:.0f}s", err=True)
            click.echo(f"demo failed: timed out (exit 1); raise --timeout for a slow model, or "
                       f"read the workers' log: {log_path}", err=True)
            return 1
        if time.monotonic() - last_output >= QUIET_SECONDS:
            last_output = time.monotonic()
            answered = any(m.role == "assistant" for m in messages)
            click.echo(f"    ... waiting for {'the next' if answered else 'the first'} turn "
                       f"(loop {loop_id} {status}, {last_output - started:.0f}s)")
        time.sleep(0.2)


#: The usual fix when a server's chat format drops the tool definitions.
TOOL_FORMAT_HINT = (
    "use the server's tool-capable chat format, e.g. llama-cpp-python "
    "`--chat_format chatml-function-calling` (llama.cpp's llama-server: `--jinja`)"
)


def explain_no_tool_call(session: Any, loop_id: int) -> str:
    """Why the demo exits 1 after a completed loop: the model called no tool. When
    the first turn's prompt tokens are fewer than the tool definitions alone would
    take, the server most likely dropped them (its chat format ignores ``tools``)."""
    lines = ["exit code 1: the loop completed, but the model answered without calling "
             "any tool, so the demo did not show a tool round trip."]
    event = session.scalars(
        select(Event).where(Event.loop_id == loop_id, Event.kind == "llm_request")
        .order_by(Event.id)).first()
    first = next((m for m in queries.messages(session, loop_id) if m.role == "assistant"),
                 None)
    body = ((event.payload or {}).get("request") or {}).get("body") if event else None
    tools = (body or {}).get("tools") if isinstance(body, dict) else None
    prompt = (first.usage or {}).get("input_tokens") if first is not None else None
    if tools and prompt:
        tools_tokens = len(json.dumps(tools)) // 4
        if prompt < tools_tokens:
            lines.append(
                f"The first request sent {len(tools)} tool definition(s) (about "
                f"{tools_tokens} tokens on their own), but the server counted only "
                f"{prompt} prompt tokens: it most likely dropped the tools from the "
                f"prompt. Usual fix: {TOOL_FORMAT_HINT}.")
            return "\n".join(lines)
    if tools and first is not None and first.usage is None:
        lines.append("The server reported no token counts, so whether it kept the tools "
                     f"cannot be told; if it dropped them: {TOOL_FORMAT_HINT}.")
    else:
        lines.append("Try a message that needs a tool, a model trained for tool calling, "
                     "or `tool_choice` in llm_params to force one.")
    return "\n".join(lines)


def _stop(workers: subprocess.Popen) -> None:
    if workers.poll() is not None:
        return
    try:
        os.killpg(workers.pid, signal.SIGTERM)
        workers.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(workers.pid, signal.SIGKILL)
        workers.wait()
