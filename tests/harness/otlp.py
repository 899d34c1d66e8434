"""A real OTLP receiver on loopback: OTLP/HTTP with protobuf, as a collector takes it.

It accepts ``POST /v1/traces`` (``application/x-protobuf``, plain, gzip or deflate), decodes
each body as opentelemetry-proto's ``ExportTraceServiceRequest`` and keeps the spans with their
resource's attributes; it answers as a collector does (an ``ExportTraceServiceResponse``), and
415 for a body that is not protobuf, 400 for one that does not decode; ``GET /stats`` says how
many exports and bytes came. ``keep=False`` (the
benchmark's) only counts what came; ``python -m tests.harness.otlp --port N --count-only`` is
that one as a process of its own (``make bench``'s traced target exports to it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.harness.procs import Proc
from tests.harness.waits import wait_until

KINDS = {
    ProtoSpan.SPAN_KIND_INTERNAL: "internal",
    ProtoSpan.SPAN_KIND_SERVER: "server",
    ProtoSpan.SPAN_KIND_CLIENT: "client",
    ProtoSpan.SPAN_KIND_PRODUCER: "producer",
    ProtoSpan.SPAN_KIND_CONSUMER: "consumer",
}
STATUSES = {Status.STATUS_CODE_UNSET: "unset", Status.STATUS_CODE_OK: "ok"}
STATUSES[Status.STATUS_CODE_ERROR] = "error"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it; ids in lower-case hex, as a traceparent has them."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str
    status: str
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int
    trace_state: str


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python: str, bool, int, float, or a list of them."""
    which = value.WhichOneof("value")
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which) if which else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def spans_of(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=KINDS.get(span.kind, str(span.kind)),
                        status=STATUSES.get(span.status.code, str(span.status.code)),
                        status_message=span.status.message,
                        attributes=attributes_of(span.attributes),
                        resource=resource,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        trace_state=span.trace_state,
                    )
                )
    return out


def _inflated(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


class Receiver:
    """The receiver (module docstring), serving in a thread of this process until closed."""

    def __init__(self, *, keep: bool = True, port: int = 0) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self.received_bytes = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                elif self.headers.get("Content-Type") != "application/x-protobuf":
                    self._answer(415, b"")
                else:
                    encoding = (self.headers.get("Content-Encoding") or "").lower()
                    self._answer(*receiver.take(_inflated(body, encoding)))

            def do_GET(self) -> None:
                if self.path != "/stats":
                    self._answer(404, b"")
                    return
                with receiver._lock:
                    stats = {"posts": receiver.posts, "bytes": receiver.received_bytes}
                self._answer(200, json.dumps(stats).encode())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """What ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set to (the exporter adds ``/v1/traces``)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, body: bytes) -> tuple[int, bytes]:
        """One export: (status, answer)."""
        with self._lock:
            self.posts += 1
            self.received_bytes += len(body)
        if not self.keep:
            return 200, ExportTraceServiceResponse().SerializeToString()
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except DecodeError:
            return 400, b""
        spans = spans_of(request)
        with self._lock:
            self.spans.extend(spans)
        return 200, ExportTraceServiceResponse().SerializeToString()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(
        self,
        found: Callable[[list[ReceivedSpan]], Any],
        what: str,
        *,
        logs: Iterable[Proc] = (),
    ) -> Any:
        """Until ``found`` (given every span so far) is truthy; what it returned."""
        return wait_until(lambda: found(self.received()), what=what, logs=logs)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def otlp_receiver(*, keep: bool = True) -> Iterator[Receiver]:
    receiver = Receiver(keep=keep)
    try:
        yield receiver
    finally:
        receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="An OTLP/HTTP receiver on loopback.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count-only", action="store_true", help="count exports, decode none")
    args = parser.parse_args()
    receiver = Receiver(keep=not args.count_only, port=args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    receiver.close()
    print(f"{receiver.posts} exports, {receiver.received_bytes} bytes, {len(receiver.spans)} spans")


if __name__ == "__main__":
    main()
