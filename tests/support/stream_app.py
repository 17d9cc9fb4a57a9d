"""The app the stream-restart tests and bench/streaming_fanout.py serve under
gunicorn: the support app plus one view, ``/loops/<id>/events``, answering
``solidloop.sse_response(loop_id)`` (the host's own page of a loop's events).

``gunicorn 'tests.support.stream_app:create_app()'`` for the web process; its
workers run the support app (the agents are the support app's).
"""

from __future__ import annotations

from flask import Flask

from .support_app import create_app as create_support_app
from .support_app import solidloop


def create_app(**config) -> Flask:
    app = create_support_app(**config)

    @app.get("/loops/<int:loop_id>/events")
    def loop_events(loop_id: int):
        return solidloop.sse_response(loop_id)

    @app.get("/ping")
    def ping():
        return "ok"

    return app
