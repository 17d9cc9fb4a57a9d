"""The app bench/rate_limits.py's workers run: an agent on a rate-limited provider,
an agent on another (unlimited) one, and one in-process tool they both call.

Loaded as ``FLASK_APP='rate_limits_app:create_app()'`` with bench/ on PYTHONPATH.
From the environment: SOLIDLOOP_BENCH_DATABASE_URL; SOLIDLOOP_BENCH_LLM_URL (the
limited provider) and SOLIDLOOP_BENCH_OTHER_URL (the other one);
SOLIDLOOP_BENCH_MAX_TOKENS (the limited agent's max_tokens); and
SOLIDLOOP_BENCH_RATE_LIMITS, a JSON object for SOLIDLOOP_RATE_LIMITS (absent or
empty: no limiter).
"""

from __future__ import annotations

import json
import os

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import Agent, SolidLoop, Toolset

db = SQLAlchemy()
solidloop = SolidLoop()
tools = Toolset("ratebench")

LIMITED_MODEL = "bench-limited"
OTHER_MODEL = "bench-other"

#: About 140 tokens of instructions (the emulator counts 4 characters a token).
SYSTEM_PROMPT = (
    "You are a support agent for a shop that sells garden tools. For each ticket you "
    "receive, look up the customer's record with the lookup tool exactly once, then "
    "write a short answer the customer can read: greet them, say what the record shows, "
    "say what happens next and by when, and close politely. Never promise refunds above "
    "the order's value, never share another customer's data, and keep to plain words. "
    "If the record shows nothing useful, say that a person will follow up within a day."
)


@tools.tool
def lookup(n: int) -> str:
    """Look up the customer record ``n``."""
    return f"record {n}: order shipped, no open refund"


@solidloop.agent("limited")
class Limited(Agent):
    system_prompt = SYSTEM_PROMPT
    mcps = [{"name": "ratebench", "toolset": tools}]
    max_steps = 20
    max_tokens = int(os.environ.get("SOLIDLOOP_BENCH_MAX_TOKENS", "256"))

    def llm(self) -> dict:
        return {"base_url": os.environ["SOLIDLOOP_BENCH_LLM_URL"], "model": LIMITED_MODEL,
                "api_key_env": "SOLIDLOOP_BENCH_API_KEY", "read_timeout": 60}


@solidloop.agent("other")
class Other(Agent):
    system_prompt = "You call lookup until told otherwise."
    mcps = [{"name": "ratebench", "toolset": tools}]
    max_steps = 20

    def llm(self) -> dict:
        return {"base_url": os.environ["SOLIDLOOP_BENCH_OTHER_URL"], "model": OTHER_MODEL,
                "api_key_env": "SOLIDLOOP_BENCH_API_KEY", "read_timeout": 60}


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SOLIDLOOP_BENCH_DATABASE_URL"]
    pool = int(os.environ.get("SOLIDLOOP_BENCH_POOL", "4"))
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": pool, "max_overflow": 2}
    limits = json.loads(os.environ.get("SOLIDLOOP_BENCH_RATE_LIMITS") or "null")
    if limits:
        app.config["SOLIDLOOP_RATE_LIMITS"] = limits
    db.init_app(app)
    solidloop.init_app(app, db=db)
    return app
