"""The app bench/approvals.py's workers run: one agent whose one tool needs an
approval, and a host job that says when it started.

Loaded as ``FLASK_APP='approvals_app:create_app()'`` with bench/ on
PYTHONPATH; SOLIDLOOP_BENCH_DATABASE_URL and SOLIDLOOP_BENCH_LLM_URL come from
the environment.
"""

from __future__ import annotations

import json
import os
import time

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import text

from flask_solidloop import Agent, SolidLoop, Toolset

db = SQLAlchemy()
solidloop = SolidLoop()
tools = Toolset("bench")
#: The host queue of the baseline's probe jobs (declared at import, so the
#: workers consume it).
probes = solidloop.queue("bench")


@tools.tool(requires_approval=True)
def act(n: int) -> str:
    """Act, once a person approved; answers with the moment it started."""
    return f"started {time.time():.6f}"


def probe(sent: float) -> None:
    """A plain host job: records when it was sent and when it started."""
    started = time.time()
    db.session.execute(text("INSERT INTO bench_probe (sent, started) VALUES (:s, :t)"),
                       {"s": sent, "t": started})
    db.session.commit()


@solidloop.agent("approvals")
class Approvals(Agent):
    system_prompt = "You act once approved."
    mcps = [{"name": "bench", "toolset": tools}]

    def llm(self) -> dict:
        return {"base_url": os.environ["SOLIDLOOP_BENCH_LLM_URL"], "model": "bench",
                "api_key_env": "SOLIDLOOP_BENCH_API_KEY", "read_timeout": 60}


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SOLIDLOOP_BENCH_DATABASE_URL"]
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": 6, "max_overflow": 2}
    # bench/memory.py raises the history cap this way.
    app.config.update(json.loads(os.environ.get("SOLIDLOOP_BENCH_CONFIG", "{}")))
    db.init_app(app)
    solidloop.init_app(app, db=db)
    return app
