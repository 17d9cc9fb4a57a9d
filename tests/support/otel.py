"""The OpenTelemetry SDK as a host installs it (docs/guides/observability.md),
for the tracing tests: worker subprocesses export over OTLP/HTTP to the test's
receiver (tests/support/otlp_receiver.py); the test process itself records in
memory, and puts the global provider back after (the API allows setting it
once per process, so the fixture resets it the way the SDK's own tests do).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

#: Set in a worker subprocess's environment: the receiver's URL.
OTLP_ENDPOINT_ENV = "SOLIDLOOP_TEST_OTLP_ENDPOINT"


def install_otlp_sdk(endpoint: str) -> None:
    """The SDK with an OTLP/HTTP exporter, exporting each span as it ends (a
    SIGKILLed worker loses nothing it ended)."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": "solidloop-test-worker", "process.pid": os.getpid()}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)


def install_from_environment() -> None:
    endpoint = os.environ.get(OTLP_ENDPOINT_ENV)
    if endpoint:
        install_otlp_sdk(endpoint)


def set_global_provider(provider: object | None) -> None:
    """Replace the process's global tracer provider (None: back to none)."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    if provider is not None:
        trace.set_tracer_provider(provider)  # type: ignore[arg-type]


@contextlib.contextmanager
def spans_in_memory() -> Iterator[Any]:
    """The SDK as this process's tracer provider, exporting to memory; the
    exporter is yielded, and the global provider put back after."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_global_provider(provider)
    try:
        yield exporter
    finally:
        set_global_provider(None)
