"""A kept stdio MCP server in a real dramatiq worker: reused by a loop's calls,
stopped with the worker (no server process outlives it)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from flask_solidloop.models import ToolCall

from ..support.support_app import STDIO_KEPT_MARK, StdioKeptAssistant
from .test_e2e_workers import kill_group, spawn_workers, wait_for

ROOT = Path(__file__).resolve().parents[2]
EVERYTHING = ROOT / ".mcp-peers" / "node_modules" / ".bin" / "mcp-server-everything"
pytestmark = pytest.mark.e2e


def _marked_servers_under(group: int) -> list[int]:
    """Live processes carrying the agent's mark whose parent is in process group ``group``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent_group = os.getpgid(parent)
        except (OSError, ValueError, IndexError):
            continue
        if f"SOLIDLOOP_TEST_MARK={STDIO_KEPT_MARK}".encode() in environ \
                and parent_group == group:
            found.append(int(entry))
    return sorted(found)


def test_a_worker_keeps_one_stdio_server_and_stops_it_when_it_stops(app, session, llm,
                                                                     tmp_path):
    if not EVERYTHING.exists():
        pytest.fail("run `bash scripts/mcp_peers.sh` first", pytrace=False)
    llm.script("echo", {"tool_calls": [{"name": "echo", "arguments": {"message": "one"}}]},
               times=1)
    llm.script(lambda body: len([m for m in body["messages"] if m["role"] == "tool"]) == 1,
               {"tool_calls": [{"name": "echo", "arguments": {"message": "two"}}]})
    llm.script(lambda body: len([m for m in body["messages"] if m["role"] == "tool"]) == 2,
               {"content": "done"})
    log = tmp_path / "workers.log"
    proc = spawn_workers([sys.executable, "-m", "dramatiq", "flask_solidloop.worker",
                          "--processes", "1", "--threads", "2"], log=log)
    try:
        loop_id = StdioKeptAssistant.start(message="echo twice").id
        statuses = wait_for(session, [loop_id], timeout=90, proc=proc, log=log)
        assert statuses[loop_id] == "completed", log.read_text()[-3000:]
        calls = list(session.scalars(select(ToolCall).where(ToolCall.loop_id == loop_id)))
        assert len(calls) == 2 and all(c.is_success for c in calls)
        # Listing at the first turn and both calls: one server, kept by the worker.
        servers = _marked_servers_under(proc.pid)
        assert len(servers) == 1, servers
        # A clean stop: SIGTERM to the main process, which stops its workers
        # (a second signal would make them exit at once, skipping shutdown).
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in servers) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in servers if Path(f"/proc/{pid}").exists()]
        assert left == [], f"stdio server(s) {left} outlived the worker"
        # Stopped by the worker's shutdown, not left to notice its stdin closing.
        assert "stopped 1 kept stdio MCP server(s)" in log.read_text()
    finally:
        kill_group(proc)
