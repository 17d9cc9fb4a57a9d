"""A real OTLP/HTTP trace receiver on 127.0.0.1 for the tracing tests.

It accepts ``POST /v1/traces`` bodies as the OpenTelemetry SDK's OTLP/HTTP
exporter sends them (protobuf, possibly gzipped), decodes them with
opentelemetry-proto, and keeps every span as a plain :class:`ReceivedSpan`.
Worker subprocesses export to it (tests/support/otel.py installs the SDK
there); the test reads what arrived.
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

#: Span kinds and status codes as the protocol numbers them.
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer",
         5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    status: str
    status_message: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"<{self.name} {self.span_id} parent={self.parent_span_id or '-'} "
                f"{self.status} pid={self.resource.get('process.pid')}>")


class Receiver:
    """The server, its spans, and the count of export requests it decoded."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or \
                        self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: any_value(kv.value)
                        for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=KINDS[span.kind],
                        status=STATUS[span.status.code], status_message=span.status.message,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                        resource=resource,
                        links=[(link.trace_id.hex(), link.span_id.hex())
                               for link in span.links]))
        with self._lock:
            self.spans.extend(spans)
            self.requests += 1

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, check: Any, *, timeout: float = 30.0, what: str = "spans") -> Any:
        """Poll until ``check()`` is truthy (a guard against a hang, not a speed test)."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; received: {self.spans}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
