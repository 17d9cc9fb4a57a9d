"""A small Flask app that declares one agent with in-process tools.

Run the whole thing with ``flask --app example_app solidloop demo``.

Configuration comes from the environment:

* ``DATABASE_URL``: PostgreSQL URL (default ``postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_demo``,
  created on first run).
* ``DEMO_LLM_BASE_URL``, ``DEMO_LLM_MODEL``, ``DEMO_LLM_API_KEY``: an
  OpenAI-compatible provider. Unset, the agent uses the built-in offline model
  that ``flask solidloop demo`` serves.
"""

from __future__ import annotations

import os

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import SolidLoop

from .agents import solidloop

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_demo"

db = SQLAlchemy()


def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL)
    app.config.update(config or {})
    db.init_app(app)
    solidloop.init_app(app, db=db)
    return app


app = create_app()

__all__ = ["SolidLoop", "app", "create_app", "db", "solidloop"]
