"""Benchmark the streaming read path: our SSEParser + OpenAIAggregator vs plain httpx lines.

Run it from the project root with the project's virtualenv::

    python bench/streaming.py                     # defaults, a few seconds
    python bench/streaming.py --content 20000 --arguments 1000 --reps 9 --block 4096

What it measures. One long OpenAI chat-completions SSE stream is built in memory,
the way OpenAI sends it with ``stream_options.include_usage``: a role chunk,
``--content`` content deltas (words, some of them non-ASCII, so multi-byte
characters get cut by read boundaries), one tool call whose JSON arguments arrive
over ``--arguments`` deltas, the finish_reason chunk, the usage chunk (``choices:
[]``) and ``data: [DONE]``; every chunk carries the usual id / object / created /
model / system_fingerprint / logprobs / usage:null fields. The same bytes are read
two ways, in the same run, alternating, ``--reps`` times each:

* **raw**: the baseline any hand-rolled client does: ``httpx`` ``iter_lines()`` and
  ``json.loads`` of each ``data:`` line, and nothing else (no aggregation at all);
* **ours**: ``SSEParser.feed`` over ``iter_bytes()``, each event fed to
  ``OpenAIAggregator`` (which parses the JSON too, merges content, reasoning, tool
  calls and usage), then ``result()``; the turn is checked against what was sent.

Two transports:

* **http**: a werkzeug threaded server on 127.0.0.1 in a separate process (so it
  does not share the GIL with the reader), serving the body with Content-Length in
  writes of ``--block`` bytes, read by one keep-alive ``httpx.Client``;
* **memory**: no socket: an ``httpx.Response`` whose stream is the body cut into
  ``--block``-byte pieces, so both readers go through the same httpx decoding
  layers as over HTTP, minus the network.

For each reader and transport it prints the median and best wall time, chunks/s
(SSE events, [DONE] included) and MB/s (of the median), and the ratio ours / raw of
median throughputs, with the target ``ours >= 0.9 x raw`` as PASS/MISS. The HTTP
figure is what a worker sees; the memory figure leaves out the socket time both
readers share, so it shows the Python cost alone. Ours does more than raw (it
aggregates); it keeps up because it skips httpx's text and line layers (the parser
decodes and cuts whole reads itself) and calls the stdlib's C JSON scanner directly
instead of ``json.loads``. Wall times on a shared machine are noisy: compare the
medians of a few runs, and try ``--block 256`` (about one event per read, as a
slow real stream delivers them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flask_solidloop.llm.openai import OpenAIAggregator
from flask_solidloop.llm.sse import SSEParser

TARGET = 0.9
WORDS = ("the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", ",", " and",
         " café", " naïve", " 東京", " 🚀", " résumé", " streaming", " tokens", ".", "\n\n",
         " über", " façade", " 数据", " emoji 🎉", " done")


def build_stream(content_deltas: int, argument_deltas: int) -> tuple[bytes, dict]:
    """The SSE body and what a correct reader must assemble from it."""
    base = {"id": "chatcmpl-AbC123dEf456GhI789jKl0MnOpQ", "object": "chat.completion.chunk",
            "created": 1727000000, "model": "gpt-4o-2024-08-06",
            "system_fingerprint": "fp_0123456789"}
    events: list[str] = []

    def emit(delta: dict | None, finish_reason: str | None = None, usage: dict | None = None):
        chunk = dict(base)
        chunk["choices"] = [] if delta is None else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        chunk["usage"] = usage
        events.append("data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")))

    emit({"role": "assistant", "content": "", "refusal": None})
    content = []
    for i in range(content_deltas):
        word = WORDS[(i * 7) % len(WORDS)]
        content.append(word)
        emit({"content": word})
    arguments = json.dumps({"query": "lorem ipsum dolor sit amet " * (argument_deltas // 4 + 1),
                            "limit": 10, "filters": {"lang": "fr", "tags": ["a", "b"]}})
    step = max(1, len(arguments) // argument_deltas)
    pieces = [arguments[i:i + step] for i in range(0, len(arguments), step)]
    emit({"tool_calls": [{"index": 0, "id": "call_Xyz123", "type": "function",
                          "function": {"name": "search", "arguments": ""}}]})
    for piece in pieces:
        emit({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    emit({}, "tool_calls")
    usage = {"prompt_tokens": 1234, "completion_tokens": content_deltas + len(pieces),
             "total_tokens": 1234 + content_deltas + len(pieces),
             "prompt_tokens_details": {"cached_tokens": 1024},
             "completion_tokens_details": {"reasoning_tokens": 0}}
    emit(None, usage=usage)
    events.append("data: [DONE]")
    body = ("\n\n".join(events) + "\n\n").encode("utf-8")
    expected = {"content": "".join(content), "arguments": arguments, "events": len(events),
                "output_tokens": usage["completion_tokens"], "argument_deltas": len(pieces)}
    return body, expected


# -- readers ---------------------------------------------------------------------------------


def read_raw(response: httpx.Response) -> int:
    loads = json.loads
    parsed = 0
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            if payload != "[DONE]":
                loads(payload)
            parsed += 1
    return parsed


def read_ours(response: httpx.Response, expected: dict) -> int:
    parser = SSEParser()
    aggregator = OpenAIAggregator()
    feed_parser, feed_aggregator = parser.feed, aggregator.feed
    events = 0
    for raw in response.iter_bytes():
        for event in feed_parser(raw):
            feed_aggregator(event)
            events += 1
    for event in parser.close():
        feed_aggregator(event)
        events += 1
    turn = aggregator.result()
    if (turn.content != expected["content"] or len(turn.tool_calls) != 1
            or turn.tool_calls[0].arguments_raw != expected["arguments"]
            or turn.usage is None or turn.usage.output_tokens != expected["output_tokens"]
            or turn.finish_reason != "tool_calls"):
        raise AssertionError("the aggregated turn does not match the stream")
    return events


# -- transports ------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Child process: serve the stream until killed."""
    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    body, _ = build_stream(args.content, args.arguments)
    block = args.block

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream"),
                                  ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-cache")])
        return (body[i:i + block] for i in range(0, len(body), block))

    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(server.server_port, flush=True)
    server.serve_forever()


def http_opener(port: int) -> tuple[Callable[[], httpx.Response], Callable[[], None]]:
    client = httpx.Client(timeout=30)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def open_response() -> httpx.Response:
        request = client.build_request("GET", url)
        return client.send(request, stream=True)

    return open_response, client.close


def memory_opener(body: bytes, block: int) -> Callable[[], httpx.Response]:
    pieces = [body[i:i + block] for i in range(0, len(body), block)]

    def open_response() -> httpx.Response:
        def stream() -> Iterator[bytes]:
            yield from pieces
        return httpx.Response(200, content=stream())

    return open_response


def measure(open_response: Callable[[], httpx.Response], expected: dict, reps: int
            ) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"raw": [], "ours": []}
    for rep in range(reps + 1):  # the first round is a warm-up
        order = ("raw", "ours") if rep % 2 == 0 else ("ours", "raw")
        for name in order:
            response = open_response()
            started = time.perf_counter()
            try:
                count = (read_raw(response) if name == "raw"
                         else read_ours(response, expected))
            finally:
                response.close()
            elapsed = time.perf_counter() - started
            if count != expected["events"]:
                raise AssertionError(f"{name}: read {count} events, sent {expected['events']}")
            if rep:
                times[name].append(elapsed)
    return times


def report(title: str, times: dict[str, list[float]], events: int, size: int) -> float:
    print(f"\n{title}")
    print(f"  {'reader':<6} {'median ms':>10} {'best ms':>9} {'chunks/s':>12} {'MB/s':>8}")
    rates = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rates[name] = 1 / median
        print(f"  {name:<6} {median * 1000:>10.1f} {min(samples) * 1000:>9.1f} "
              f"{events / median:>12,.0f} {size / median / 1e6:>8.1f}")
    ratio = rates["ours"] / rates["raw"]
    verdict = "PASS" if ratio >= TARGET else "MISS"
    print(f"  ratio ours/raw: {ratio:.3f}   target >= {TARGET} of raw: {verdict}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--content", type=int, default=12000, help="content deltas")
    parser.add_argument("--arguments", type=int, default=600, help="tool-argument deltas")
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions per reader")
    parser.add_argument("--block", type=int, default=16384, help="bytes per server write")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    body, expected = build_stream(args.content, args.arguments)
    events, size = expected["events"], len(body)
    print(f"stream: {events:,} events, {size / 1e6:.2f} MB "
          f"({args.content:,} content deltas, tool call over "
          f"{expected['argument_deltas']:,} argument deltas, usage, [DONE]); "
          f"{args.reps} reps, {args.block}-byte blocks")
    print(f"python {sys.version.split()[0]}, httpx {httpx.__version__}")

    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", "--content", str(args.content),
         "--arguments", str(args.arguments), "--block", str(args.block)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        open_http, close_http = http_opener(port)
        try:
            http_ratio = report("http (werkzeug server in a child process, keep-alive client)",
                                measure(open_http, expected, args.reps), events, size)
        finally:
            close_http()
    finally:
        child.terminate()
        child.wait(10)
    memory_ratio = report("memory (httpx.Response over in-memory blocks, no socket)",
                          measure(memory_opener(body, args.block), expected, args.reps),
                          events, size)
    print(f"\nsummary: http {http_ratio:.3f}, memory {memory_ratio:.3f} "
          f"(target >= {TARGET}: http {'PASS' if http_ratio >= TARGET else 'MISS'}, "
          f"memory {'PASS' if memory_ratio >= TARGET else 'MISS'})")


if __name__ == "__main__":
    main()
