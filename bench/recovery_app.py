"""The app bench/recovery.py's workers run: default settings, three agents.

Loaded by worker processes as ``FLASK_APP='recovery_app:create_app()'`` with
bench/ on PYTHONPATH; the database and the LLM emulator come from the
environment (SOLIDLOOP_BENCH_DATABASE_URL, SOLIDLOOP_BENCH_LLM_URL).
"""

from __future__ import annotations

import os
import time

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import Agent, CallContext, SolidLoop, Toolset

db = SQLAlchemy()
solidloop = SolidLoop()
tools = Toolset("bench")


@tools.tool
def wait(seconds: float, ctx: CallContext) -> str:
    """Sleep for a while, then answer."""
    time.sleep(seconds)
    return f"waited {seconds}s"


def llm() -> dict:
    return {"base_url": os.environ["SOLIDLOOP_BENCH_LLM_URL"], "model": "bench",
            "api_key_env": "SOLIDLOOP_BENCH_API_KEY", "read_timeout": 120}


@solidloop.agent("streamer")
class Streamer(Agent):
    streaming = True
    mcps = [{"name": "bench", "toolset": tools}]

    def llm(self) -> dict:
        return llm()


@solidloop.agent("caller")
class Caller(Agent):
    mcps = [{"name": "bench", "toolset": tools}]

    def llm(self) -> dict:
        return llm()


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SOLIDLOOP_BENCH_DATABASE_URL"]
    db.init_app(app)
    solidloop.init_app(app, db=db)
    return app
