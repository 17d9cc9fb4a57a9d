"""The app the admin's browser tests serve under gunicorn (and their workers run):
the support app plus a streaming agent, the admin mounted at /admin with a
subject resolver, and a second mount at /closed with no ``authorize``.

``FLASK_APP='tests.support.admin_app:create_app()'`` for workers;
``gunicorn 'tests.support.admin_app:create_app()'`` for the web process.
"""

from __future__ import annotations

from flask import Flask

from flask_solidloop import Agent

from .support_app import calc, llm_settings, solidloop
from .support_app import create_app as create_support_app


@solidloop.agent("live")
class LiveAgent(Agent):
    """Streams its answers, so the admin has partial tokens to show."""

    system_prompt = "You answer at length."
    mcps = [{"name": "calc", "toolset": calc}]
    streaming = True

    def llm(self) -> dict:
        return llm_settings()


def subject_resolver(loop):
    state = loop.state or {}
    return {"url": state.get("subject_url", f"/users/{loop.subject_id}"),
            "label": state.get("subject_label")}


def create_app(**config) -> Flask:
    app = create_support_app(**config)
    app.register_blueprint(solidloop.admin_blueprint(
        authorize=lambda request: True, subject_resolver=subject_resolver),
        url_prefix="/admin")
    app.register_blueprint(solidloop.admin_blueprint(authorize=None, name="closed_admin"),
                           url_prefix="/closed")
    return app
