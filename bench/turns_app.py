"""The app bench/turns.py's workers run: one agent, one no-op in-process tool.

Loaded as ``FLASK_APP='turns_app:create_app()'`` with bench/ on PYTHONPATH;
SOLIDLOOP_BENCH_DATABASE_URL and SOLIDLOOP_BENCH_LLM_URL come from the
environment, and SOLIDLOOP_BENCH_WIRE_LOG, when set, is SOLIDLOOP_WIRE_LOG;
SOLIDLOOP_BENCH_METRICS_PORT, when set, turns SOLIDLOOP_METRICS on with that port.
SOLIDLOOP_BENCH_TRACING=1 (``--tracing``) installs the OpenTelemetry SDK in
the worker: spans are made and batched as a host's would be, and dropped by
an exporter that sends nothing (:func:`set_tracing`).
"""

from __future__ import annotations

import os
import tempfile

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_solidloop import Agent, SolidLoop, Toolset

db = SQLAlchemy()
solidloop = SolidLoop()
tools = Toolset("bench")


@tools.tool
def noop(n: int) -> str:
    """Do nothing and say so."""
    return f"noop {n}"


@solidloop.agent("turns")
class Turns(Agent):
    system_prompt = "You call noop until told otherwise."
    mcps = [{"name": "bench", "toolset": tools}]
    max_steps = 100

    def llm(self) -> dict:
        return {"base_url": os.environ["SOLIDLOOP_BENCH_LLM_URL"], "model": "bench",
                "api_key_env": "SOLIDLOOP_BENCH_API_KEY", "read_timeout": 60}


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["SOLIDLOOP_BENCH_DATABASE_URL"]
    pool = int(os.environ.get("SOLIDLOOP_BENCH_POOL", "6"))
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": pool, "max_overflow": 2}
    if os.environ.get("SOLIDLOOP_BENCH_WIRE_LOG"):
        app.config["SOLIDLOOP_WIRE_LOG"] = os.environ["SOLIDLOOP_BENCH_WIRE_LOG"]
    if os.environ.get("SOLIDLOOP_BENCH_METRICS_PORT"):
        # bench/turns.py --metrics: metrics on, in a directory of this port's.
        port = int(os.environ["SOLIDLOOP_BENCH_METRICS_PORT"])
        app.config.update(SOLIDLOOP_METRICS=True, SOLIDLOOP_METRICS_PORT=port,
                          SOLIDLOOP_METRICS_DIR=os.path.join(
                              tempfile.gettempdir(), f"solidloop-bench-metrics-{port}"))
    db.init_app(app)
    solidloop.init_app(app, db=db)
    if os.environ.get("SOLIDLOOP_BENCH_TRACING") == "1":
        set_tracing(True)
    return app


def set_tracing(on: bool) -> None:
    """The OpenTelemetry SDK as the process's tracer provider (a
    BatchSpanProcessor over an exporter that drops every span), or none. The
    API lets a process set its provider once; the harness switches between
    builds, so this resets it as the SDK's own tests do."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    if not on:
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Dropped(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
