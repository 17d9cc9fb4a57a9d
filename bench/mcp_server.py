"""tools/call through our MCP server blueprint (gunicorn) vs the MCP SDK's own server (uvicorn).

    .venv/bin/python bench/mcp_server.py                 # about a minute
    .venv/bin/python bench/mcp_server.py --calls 300 --workers 2 --threads 8

Both servers run in the same run, as separate processes on 127.0.0.1, and serve
the same ``echo(text)`` tool:

* ours: tests/support/mcp_server_app.py's ``/mcp/calc`` blueprint under
  ``gunicorn -w W -k gthread --threads T`` (defaults 4 x 4), with its PostgreSQL
  writes (one wire-log event per request, a session touch per handshake-era
  request);
* theirs: ``python -m flask_solidloop.testing.mcp_sdk_server`` (the SDK's
  ``MCPServer`` behind uvicorn, one process, its defaults).

For each protocol era (``2026-07-28``, and the handshake era as ``legacy``), the
``mcp`` SDK client opens a session per client and then times ``tools/call``
(sent as a ``CallToolRequest``, no implicit listing): latency with 1 client
(p50, p95 of ``--calls`` sequential calls), and throughput with 1 and 8
concurrent clients (calls/s over ``--calls`` calls each). The targets are printed
beside the ratios: latency <= 1.5x the SDK server's, throughput >= 0.7x at 8
clients. The clients share this process's event loop and the 2 cores with both
servers and PostgreSQL: compare ratios within a run, not figures across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import httpx2  # noqa: E402
import mcp_types as types  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from flask_solidloop.database import ensure_database  # noqa: E402
from flask_solidloop.migrations import upgrade  # noqa: E402
from tests.support.mcp_gunicorn import free_port, serve  # noqa: E402

DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_bench_mcp"


async def _client_calls(url: str, mode: str, token: str | None, calls: int,
                        latencies: list[float]) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = types.CallToolRequest(params=types.CallToolRequestParams(
        name="echo", arguments={"text": "hi"}))
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http, \
            Client(streamable_http_client(url, http_client=http), mode=mode) as client:
        await client.session.send_request(request, types.CallToolResult)  # warm-up
        for _ in range(calls):
            started = time.perf_counter()
            await client.session.send_request(request, types.CallToolResult)
            latencies.append((time.perf_counter() - started) * 1000)


async def _run(url: str, mode: str, token: str | None, clients: int,
               calls: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(_client_calls(url, mode, token, calls, latencies)
                           for _ in range(clients)))
    wall = time.perf_counter() - started
    return latencies, clients * calls / wall


def measure(url: str, mode: str, token: str | None, calls: int) -> dict[str, float]:
    single, rate1 = asyncio.run(_run(url, mode, token, 1, calls))
    _, rate8 = asyncio.run(_run(url, mode, token, 8, calls))
    single.sort()
    return {"p50": statistics.median(single), "p95": single[int(len(single) * 0.95) - 1],
            "rate1": rate1, "rate8": rate8}


def sdk_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "flask_solidloop.testing.mcp_sdk_server", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the SDK server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per client and phase")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()

    ensure_database(DATABASE_URL)
    upgrade(DATABASE_URL)
    port = free_port()
    theirs = sdk_server(port)
    results: dict[tuple[str, str], dict[str, float]] = {}
    try:
        with serve(workers=args.workers, threads=args.threads,
                   env={"SOLIDLOOP_TEST_DATABASE_URL": DATABASE_URL}) as base:
            for mode in ("2026-07-28", "legacy"):
                results[("ours", mode)] = measure(f"{base}/mcp/calc", mode, "token-bench",
                                                  args.calls)
                results[("sdk", mode)] = measure(f"http://127.0.0.1:{port}/mcp", mode, None,
                                                 args.calls)
    finally:
        theirs.terminate()
        theirs.wait(10)

    print(f"\ntools/call, {args.calls} calls per client; ours: gunicorn -w {args.workers} "
          f"-k gthread --threads {args.threads}; SDK: MCPServer under uvicorn (1 process)\n")
    print("| era | figure | ours | SDK server | ratio (ours/SDK) | target |")
    print("|---|---|---:|---:|---:|---|")
    for mode in ("2026-07-28", "legacy"):
        ours, sdk = results[("ours", mode)], results[("sdk", mode)]
        rows = [("latency p50, 1 client (ms)", "p50", "<= 1.5x"),
                ("latency p95, 1 client (ms)", "p95", ""),
                ("throughput, 1 client (calls/s)", "rate1", ""),
                ("throughput, 8 clients (calls/s)", "rate8", ">= 0.7x")]
        for label, key, target in rows:
            ratio = ours[key] / sdk[key]
            verdict = ""
            if target.startswith("<="):
                verdict = " PASS" if ratio <= 1.5 else " MISS"
            elif target.startswith(">="):
                verdict = " PASS" if ratio >= 0.7 else " MISS"
            print(f"| {mode} | {label} | {ours[key]:.2f} | {sdk[key]:.2f} | {ratio:.2f}x | "
                  f"{target}{verdict} |")
    print(f"\n(load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
