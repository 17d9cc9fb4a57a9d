"""A small Flask app that declares one agent with in-process tools, and a chat
page that talks to it (``/chat/``, example_app/chat.py).

Run the whole thing with ``flask --app example_app solidloop demo``; the chat
page with ``flask --app example_app run`` beside ``flask --app example_app
solidloop worker`` (README, "A chat page").

Configuration comes from the environment:

* ``DATABASE_URL``: PostgreSQL URL (default ``postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_demo``,
  created on first run).
* ``DEMO_LLM_BASE_URL``, ``DEMO_LLM_MODEL``, ``DEMO_LLM_API_KEY``: an
  OpenAI-compatible provider. Unset, the agent uses the built-in offline model
  (the one ``flask solidloop demo`` serves, else one each process serves itself).
* ``FLASK_<KEY>``: any Flask setting, Flask's way (``FLASK_SECRET_KEY``,
  ``FLASK_SOLIDLOOP_STREAM_SECONDS=10``; values are read as JSON).
"""

from __future__ import annotations

import os

from flask import Flask, redirect, url_for
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import SolidLoop

from .agents import solidloop

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/solidloop_demo"

db = SQLAlchemy()


def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL)
    # The chat's user id lives in the signed session cookie: set FLASK_SECRET_KEY
    # anywhere but your own machine. Lax keeps the cookie off other sites' posts.
    app.config["SECRET_KEY"] = "dev only: set FLASK_SECRET_KEY"
    app.config["SESSION_COOKIE_SAMESITE"] = "Lax"
    app.config.from_prefixed_env()
    app.config.update(config or {})
    db.init_app(app)
    solidloop.init_app(app, db=db)

    from .chat import bp as chat

    app.register_blueprint(chat)
    app.add_url_rule("/", "home", lambda: redirect(url_for("chat.index")))
    return app


app = create_app()

__all__ = ["SolidLoop", "app", "create_app", "db", "solidloop"]
