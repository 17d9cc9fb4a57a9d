"""Benchmark the per-call overhead of the tool layer against the bare alternative.

Run it from the project root with the project's virtualenv::

    python bench/tools.py                       # defaults, about half a minute
    python bench/tools.py --http 300 --stdio 10 --samples 500 --batch 1000

Three pairs, measured in the same run, each reported as the median per-call
time, the overhead (ours - raw) and the ratio (ours / raw):

* **in-process**: ``ToolRegistry.call`` of a toolset tool (argument validation
  through the pydantic model, the ``CallContext``, the ``ToolResult``) against
  calling the same Python function directly. ``--samples`` samples (default
  200) of ``--batch`` calls each (default 1000); per-call time = sample / batch.
  Target: overhead < 1 ms per call.
* **http**: ``HttpTransport.call_tool("echo", ...)`` (with an idempotency key in
  ``_meta``, as a tool turn sends it) against a raw SDK call of the same tool:
  ``mcp.Client(url)`` opened once in one ``anyio.run`` and
  ``client.session.call_tool`` N times (the session-level call, which skips the
  client's implicit ``tools/list``, as our transport does). The server is
  ``flask_solidloop.testing.mcp_sdk_server`` started in a child process, so it
  does not share the GIL with the client. ``--http`` calls each (default
  100), after a warm-up call that opens the session. The two are run in two
  alternating rounds. Target: ours <= 1.2 x raw.
* **stdio, kept**: ``StdioTransport.call_tool("list_directory", ...)`` with the
  server kept (the default: one child per process, its session reused) against
  the SDK's own kept session: ``mcp.Client`` over stdio held open in one
  ``anyio.run`` and ``client.session.call_tool`` N times, on
  ``.mcp-peers/node_modules/.bin/mcp-server-filesystem`` serving a temp dir.
  ``--stdio-kept`` calls each (default 100), after a warm-up call that starts
  the server, in two alternating rounds. Target: ours <= 2 x raw.
* **stdio, spawn per call**: the same call with ``stateless=True`` against a raw
  SDK stdio exchange (spawn, handshake, one call, shutdown). Both spawn a
  process per call, so this is dominated by the server's start-up.
  ``--stdio`` calls each (default 5). No target: it is printed so the
  spawn-per-call cost stays visible.

The stdio rows are skipped with a note when the server is not installed
(``npm install --prefix .mcp-peers @modelcontextprotocol/server-filesystem``).

Wall times on a shared machine are noisy; compare medians of a few runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
FS_SERVER = ROOT / ".mcp-peers" / "node_modules" / ".bin" / "mcp-server-filesystem"
META = {"solidloop/idempotencyKey": "solidloop:tool_call:1"}


def ms(seconds: float) -> float:
    return seconds * 1000.0


def report(label: str, ours: list[float], raw: list[float], target: str | None,
           passed: bool | None) -> None:
    """Print medians (ms) of per-call times, the overhead and the ratio."""
    ours_med = statistics.median(ours)
    raw_med = statistics.median(raw)
    ratio = ours_med / raw_med if raw_med else float("inf")
    print(f"\n[{label}]")
    print(f"  raw   median {ms(raw_med):10.4f} ms/call   (n={len(raw)})")
    print(f"  ours  median {ms(ours_med):10.4f} ms/call   (n={len(ours)})")
    print(f"  overhead {ms(ours_med - raw_med):+.4f} ms/call, ratio {ratio:.2f}x")
    if target is not None:
        print(f"  target: {target}: {'PASS' if passed else 'MISS'}")


# --------------------------------------------------------------------------- in-process


def bench_in_process(samples: int, batch: int) -> None:
    from flask_solidloop.mcp.registry import ToolRegistry
    from flask_solidloop.mcp.toolset import CallContext, Toolset

    calc = Toolset("calc")

    @calc.tool
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    registry = ToolRegistry.build([{"name": "calc", "toolset": calc}], agent="bench")
    ctx = CallContext(idempotency_key="solidloop:tool_call:1")
    arguments = {"a": 2, "b": 3}
    assert not registry.call("add", arguments, ctx).is_error

    def direct_sample() -> float:
        started = time.perf_counter()
        for _ in range(batch):
            add(**arguments)
        return (time.perf_counter() - started) / batch

    def ours_sample() -> float:
        started = time.perf_counter()
        for _ in range(batch):
            registry.call("add", arguments, ctx)
        return (time.perf_counter() - started) / batch

    raw: list[float] = []
    ours: list[float] = []
    for _ in range(samples):  # alternate so drift hits both equally
        raw.append(direct_sample())
        ours.append(ours_sample())
    overhead = statistics.median(ours) - statistics.median(raw)
    report(f"in-process: ToolRegistry.call vs direct function, {samples} x {batch} calls",
           ours, raw, "overhead < 1 ms per call", ms(overhead) < 1.0)


# --------------------------------------------------------------------------- http


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_http_server() -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flask_solidloop.testing.mcp_sdk_server", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()  # printed once the server accepts requests
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit("the MCP SDK test server did not start")
    return proc, url


def raw_http_calls(url: str, n: int) -> list[float]:
    from mcp import Client

    times: list[float] = []

    async def main() -> None:
        async with Client(url) as client:
            await client.session.call_tool("echo", {"text": "warm-up"}, meta=META)
            for i in range(n):
                started = time.perf_counter()
                result = await client.session.call_tool("echo", {"text": f"hi {i}"}, meta=META)
                times.append(time.perf_counter() - started)
                assert not getattr(result, "is_error", False)

    anyio.run(main)
    return times


def ours_http_calls(url: str, n: int) -> list[float]:
    from flask_solidloop.mcp.http_transport import HttpTransport

    times: list[float] = []
    with HttpTransport(url, timeout=30) as transport:
        transport.call_tool("echo", {"text": "warm-up"}, meta=META)
        for i in range(n):
            started = time.perf_counter()
            result = transport.call_tool("echo", {"text": f"hi {i}"}, meta=META)
            times.append(time.perf_counter() - started)
            assert result.text() == f"hi {i}", result
    return times


def bench_http(n: int) -> None:
    proc, url = start_http_server()
    try:
        raw: list[float] = []
        ours: list[float] = []
        half = max(1, n // 2)
        for count in (half, n - half):  # two alternating rounds
            if count:
                raw += raw_http_calls(url, count)
                ours += ours_http_calls(url, count)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    ratio = statistics.median(ours) / statistics.median(raw)
    report(f"http: HttpTransport.call_tool vs raw SDK session call, {n} calls each "
           f"(server: mcp_sdk_server in a child process)",
           ours, raw, "ours <= 1.2x raw", ratio <= 1.2)


# --------------------------------------------------------------------------- stdio


def bench_stdio(n: int) -> None:
    if not FS_SERVER.exists():
        print(f"\n[stdio] skipped: {FS_SERVER.relative_to(ROOT)} is not installed "
              "(npm install --prefix .mcp-peers @modelcontextprotocol/server-filesystem)")
        return
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from flask_solidloop.mcp.stdio_transport import StdioTransport

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.realpath(tmp)
        Path(root, "a.txt").write_text("hello\n", encoding="utf-8")
        argv = [str(FS_SERVER), root]
        arguments = {"path": root}
        transport = StdioTransport(argv, timeout=30, server_name="fs", stateless=True)
        env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}

        def raw_once() -> float:
            async def main() -> Any:
                params = StdioServerParameters(command=argv[0], args=argv[1:], env=env)
                with open(os.devnull, "w") as errlog:  # the server logs on stderr
                    async with Client(stdio_client(params, errlog=errlog)) as client:
                        return await client.session.call_tool("list_directory", arguments,
                                                              meta=META)


            started = time.perf_counter()
            anyio.run(main)
            return time.perf_counter() - started

        def ours_once() -> float:
            started = time.perf_counter()
            result = transport.call_tool("list_directory", arguments, meta=META)
            elapsed = time.perf_counter() - started
            assert "a.txt" in result.text(), result
            return elapsed

        raw_once()  # warm the file cache for node and the server's modules
        raw: list[float] = []
        ours: list[float] = []
        for _ in range(n):
            raw.append(raw_once())
            ours.append(ours_once())
    report(f"stdio, spawn per call: StdioTransport(stateless=True).call_tool vs raw SDK "
           f"open+call+close, {n} calls each (mcp-server-filesystem)", ours, raw, None, None)


def bench_stdio_kept(n: int) -> None:
    if not FS_SERVER.exists():
        print(f"\n[stdio, kept] skipped: {FS_SERVER.relative_to(ROOT)} is not installed")
        return
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from flask_solidloop.mcp.stdio_transport import StdioTransport, stop_kept_servers

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.realpath(tmp)
        Path(root, "a.txt").write_text("hello\n", encoding="utf-8")
        argv = [str(FS_SERVER), root]
        arguments = {"path": root}
        env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}

        def raw_calls(count: int) -> list[float]:
            times: list[float] = []

            async def main() -> None:
                params = StdioServerParameters(command=argv[0], args=argv[1:], env=env)
                with open(os.devnull, "w") as errlog:  # the server logs on stderr
                    async with Client(stdio_client(params, errlog=errlog)) as client:
                        await client.session.call_tool("list_directory", arguments, meta=META)
                        for _ in range(count):
                            started = time.perf_counter()
                            await client.session.call_tool("list_directory", arguments,
                                                           meta=META)
                            times.append(time.perf_counter() - started)

            anyio.run(main)
            return times

        def ours_calls(count: int) -> list[float]:
            transport = StdioTransport(argv, timeout=30, server_name="fs")
            transport.call_tool("list_directory", arguments, meta=META)  # starts the child
            times: list[float] = []
            for _ in range(count):
                started = time.perf_counter()
                result = transport.call_tool("list_directory", arguments, meta=META)
                times.append(time.perf_counter() - started)
                assert "a.txt" in result.text(), result
            stop_kept_servers()
            return times

        raw: list[float] = []
        ours: list[float] = []
        half = max(1, n // 2)
        for count in (half, n - half):  # two alternating rounds
            if count:
                raw += raw_calls(count)
                ours += ours_calls(count)
    ratio = statistics.median(ours) / statistics.median(raw)
    report(f"stdio, kept: StdioTransport.call_tool (kept child) vs the SDK's kept stdio "
           f"session, {n} calls each (mcp-server-filesystem)",
           ours, raw, "ours <= 2x raw", ratio <= 2.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="in-process samples")
    parser.add_argument("--batch", type=int, default=1000, help="in-process calls per sample")
    parser.add_argument("--http", type=int, default=100, help="HTTP calls each")
    parser.add_argument("--stdio", type=int, default=5, help="stdio spawn-per-call calls each")
    parser.add_argument("--stdio-kept", type=int, default=100,
                        help="stdio calls each in a kept session")
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]} on {sys.platform}, {os.cpu_count()} CPUs")
    bench_in_process(args.samples, args.batch)
    bench_http(args.http)
    bench_stdio_kept(args.stdio_kept)
    bench_stdio(args.stdio)


if __name__ == "__main__":
    main()
