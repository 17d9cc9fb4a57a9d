"""The DBOS Transact side of bench/turns.py, run in a process of its own.

The same agent loop as a DBOS workflow: each LLM call is a step (an HTTP POST
to the same emulator with the same growing OpenAI-shaped history), and each
gap between two LLM calls holds one no-op tool step, recorded durably like
ours. Workflows run from a DBOS queue with ``concurrency`` (8) at once.

    python bench/turns_dbos.py --url postgresql://... --llm http://... --loops 200

Prints one JSON line: wall seconds, this process's CPU seconds, and each
loop's completion time (seconds from the enqueue of all loops).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import httpx
from dbos import DBOS, DBOSConfig

CLIENT = httpx.Client(timeout=60)
STARTED = 0.0
LLM_URL = ""


@DBOS.step()
def llm_call(messages: list[dict]) -> dict:
    response = CLIENT.post(LLM_URL + "/v1/chat/completions",
                           json={"model": "bench", "messages": messages,
                                 "tools": [{"type": "function", "function": {
                                     "name": "noop", "description": "Do nothing",
                                     "parameters": {"type": "object", "properties": {
                                         "n": {"type": "integer"}}, "required": ["n"]}}}]},
                           headers={"Authorization": "Bearer sk-bench"})
    response.raise_for_status()
    message: dict = response.json()["choices"][0]["message"]
    return message


@DBOS.step()
def noop(n: int) -> str:
    return f"noop {n}"


@DBOS.workflow()
def agent_loop(label: str) -> float:
    messages: list[dict] = [{"role": "system", "content": "You call noop until told otherwise."},
                            {"role": "user", "content": label}]
    for _ in range(100):
        reply = llm_call(messages)
        calls = reply.get("tool_calls") or []
        messages.append({"role": "assistant", "content": reply.get("content") or "",
                         **({"tool_calls": calls} if calls else {})})
        if not calls:
            break
        for call in calls:
            n = json.loads(call["function"]["arguments"] or "{}").get("n", 0)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": noop(n)})
    return time.time()


def main() -> None:
    global LLM_URL
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--llm", required=True)
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefix", default="loop")
    args = parser.parse_args()
    LLM_URL = args.llm
    config: DBOSConfig = {"name": "solidloop-bench", "system_database_url": args.url,
                          "run_admin_server": False}
    DBOS(config=config)
    DBOS.launch()
    queue = DBOS.register_queue("bench", global_concurrency=args.concurrency,
                                polling_interval_sec=0.1)
    # Warm up (imports, connections, the queue's first polls) like ours does.
    for handle in [queue.enqueue(agent_loop, f"warm {n}") for n in range(4)]:
        handle.get_result()
    cpu0 = os.times()
    started = time.time()
    handles = [queue.enqueue(agent_loop, f"{args.prefix} {n}") for n in range(args.loops)]
    finished = [handle.get_result() for handle in handles]
    wall = time.time() - started
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(json.dumps({"wall": wall, "cpu": cpu, "pid": os.getpid(),
                      "completion": [t - started for t in finished]}), flush=True)
    DBOS.destroy()


if __name__ == "__main__":
    main()
