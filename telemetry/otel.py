"""The OpenTelemetry side of :mod:`telemetry.tracing`: the SDK's provider, batching and OTLP/HTTP
exporter for one process, and the spans llmgw makes. Imported only once tracing is wanted.

A ``/v1`` request's span follows the GenAI semantic conventions: named ``{operation} {model}``
(``chat m1``), SERVER kind, with ``gen_ai.operation.name``, ``gen_ai.request.model`` (the model
as the client named it: an alias stays an alias), ``gen_ai.response.model`` (the catalog's name,
which is what the engine was asked for and answers with), ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.response.time_to_first_chunk`` and ``gen_ai.response.finish_reasons``; and ours,
``llmgw.*``: the request id, the upstream that served it and why routing chose it
(``llmgw.route.outcome``: affinity, cached, cold, spilled, least_loaded), the retries, the wait
for the model to start, where the token counts came from. Each attempt on an upstream is a
CLIENT child, named ``upstream {id}``, with ``server.address`` and ``server.port``; it ends when
it fails, or with the request once its answer is relayed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Mapping
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry import context, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

DEFAULT_SERVICE_NAME = "llmgw"
# The GenAI conventions' operation names, by the relay route's kind; others keep their kind.
OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
}
# Finish reasons a model gives (the conventions' gen_ai.response.finish_reasons); the others
# are the gateway's (a client gone, an upstream cut) and go to llmgw.finish_reason alone.
MODEL_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})
# Finish reasons that are a failure on our side of the request, whatever its HTTP status (a
# stream that broke after its 200).
FAILED_REASONS = frozenset({"upstream_error", "timeout", "interrupted", "error"})

_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = context.Context()


class Ended(Protocol):
    """What a request's span ends with: its usage row (``gateway.ledger.usage.Usage`` is one)."""

    status: int
    finish_reason: str
    model: str  # the catalog's name
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    source: str  # where the counts came from: engine, tokenized, estimated
    ttft_ms: float | None


def resource_of(process: str) -> Resource:
    """The process's resource: the standard variables' attributes, ``llmgw`` as the service's
    name where they give none, this process's role and pid."""
    resource = Resource.create({"llmgw.process": process, "process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


class Tracing:
    """One process's tracer: spans batched by the SDK's BatchSpanProcessor (a thread of its own
    exports them) to the OTLP/HTTP exporter, both configured by the standard variables."""

    def __init__(self, process: str) -> None:
        # Its exit is ours (telemetry.tracing.shutdown), not an atexit hook of its own.
        self.provider = TracerProvider(resource=resource_of(process), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("llmgw")

    def shutdown(self) -> None:
        self.provider.shutdown()

    def request(
        self,
        kind: str,
        path: str,
        request_id: str,
        clock_start: float,
        *,
        traceparent: str,
        tracestate: str,
    ) -> Request:
        return Request(
            self.tracer,
            kind,
            path,
            request_id=request_id,
            clock_start=clock_start,
            parent=_parent(traceparent, tracestate),
        )

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, AttributeValue]) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span(name, attributes=dict(attributes)) as span:
            yield span

    def current_trace_id(self) -> str | None:
        span_context = trace.get_current_span().get_span_context()
        return f"{span_context.trace_id:032x}" if span_context.is_valid else None


def _parent(traceparent: str, tracestate: str) -> context.Context:
    """The client's trace context (a root one when it sent none, or a malformed one)."""
    if not traceparent:
        return _ROOT
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, context=_ROOT)


class Request:
    """One ``/v1`` request's span and its attempts' (see the module docstring). Attributes are
    gathered as the request goes and set on each span once, as it ends: the SDK takes a lock
    and checks every value on each set, which cost more than the spans themselves."""

    def __init__(
        self,
        tracer: trace.Tracer,
        kind: str,
        path: str,
        *,
        request_id: str,
        clock_start: float,
        parent: context.Context,
    ) -> None:
        self.tracer = tracer
        self.operation = OPERATIONS.get(kind, kind)
        self.requested_model = ""
        # The span began when the request arrived, not when this object was made.
        began = time.time_ns() - int((time.perf_counter() - clock_start) * 1e9)
        self.span = tracer.start_span(
            self.operation, context=parent, kind=SpanKind.SERVER, start_time=began
        )
        self.attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": self.operation,
            "http.request.method": "POST",
            "url.path": path,
            "llmgw.request_id": request_id,
        }
        self.context = trace.set_span_in_context(self.span, _ROOT)
        # The current span of the task serving the request (so its log lines name the trace).
        # Never detached: the task ends with the request, and its context with it (the count
        # task that may finish the request runs in a copy, where a detach would fail).
        context.attach(self.context)
        self.attempt_span: trace.Span | None = None
        self.attempt_attributes: dict[str, AttributeValue] = {}
        self.attempts = 0

    def requested(self, model: str, *, stream: bool, max_tokens: int | None) -> None:
        self.requested_model = model
        self.attributes["gen_ai.request.model"] = model
        self.attributes["gen_ai.request.stream"] = stream
        if max_tokens is not None:
            self.attributes["gen_ai.request.max_tokens"] = max_tokens

    def attempt(self, upstream_id: str, base_url: str, model: str, outcome: str) -> bytes:
        self._end_attempt()  # the one before failed without saying so
        self.attempts += 1
        host, port = _address(base_url)
        self.attempt_attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": model,
            "server.address": host,
            "llmgw.upstream.id": upstream_id,
            "llmgw.route.outcome": outcome,
            "llmgw.attempt": self.attempts,
        }
        if port is not None:
            self.attempt_attributes["server.port"] = port
        # The request's span tells which upstream served it, and why: the last one tried.
        self.attributes["llmgw.upstream.id"] = upstream_id
        self.attributes["llmgw.route.outcome"] = outcome
        span = self.tracer.start_span(
            f"upstream {upstream_id}", context=self.context, kind=SpanKind.CLIENT
        )
        self.attempt_span = span
        return _trace_context_lines(span.get_span_context())

    def attempt_answered(self, status: int) -> None:
        self.attempt_attributes["http.response.status_code"] = status

    def attempt_failed(self, code: str, message: str) -> None:
        self.attempt_attributes["error.type"] = code
        self._end_attempt(Status(StatusCode.ERROR, message))

    def _end_attempt(self, status: Status | None = None) -> None:
        span, self.attempt_span = self.attempt_span, None
        if span is not None:
            span.set_attributes(self.attempt_attributes)
            if status is not None:
                span.set_status(status)
            span.end()

    def activation(self, seconds: float, outcome: str) -> None:
        self.attributes["llmgw.activation.wait_s"] = seconds
        self.attributes["llmgw.activation.outcome"] = outcome

    def error(self, code: str) -> None:
        self.attributes["error.type"] = code

    def finish(self, usage: Ended) -> None:
        status, reason = usage.status, usage.finish_reason
        failed = status >= 500 or reason in FAILED_REASONS
        failure = Status(StatusCode.ERROR, reason or str(status)) if failed else None
        self._end_attempt(failure)
        attributes = self.attributes
        attributes["http.response.status_code"] = status
        attributes["llmgw.finish_reason"] = reason
        if reason in MODEL_FINISH_REASONS:
            attributes["gen_ai.response.finish_reasons"] = [reason]
        if self.attempts:
            attributes["gen_ai.response.model"] = usage.model
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
            attributes["llmgw.usage.source"] = usage.source
            attributes["llmgw.retries"] = self.attempts - 1
        if usage.ttft_ms is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = usage.ttft_ms / 1000
        if failed:
            attributes.setdefault("error.type", reason or str(status))
        span = self.span
        if self.requested_model:
            span.update_name(f"{self.operation} {self.requested_model}")
        span.set_attributes(attributes)
        if failure is not None:
            span.set_status(failure)
        span.end()


@functools.lru_cache(maxsize=1024)
def _address(base_url: str) -> tuple[str, int | None]:
    """An upstream's host and port (``server.address``, ``server.port``)."""
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port


def _trace_context_lines(span_context: trace.SpanContext) -> bytes:
    """The ``traceparent`` (and ``tracestate``) header lines that carry ``span_context`` to the
    engine, as W3C Trace Context writes them (the propagator's format). The tracestate is the
    client's as the SDK parsed and re-serialized it (W3C's character set, no line breaks), so
    it is safe as a header line."""
    lines = (
        f"traceparent: 00-{span_context.trace_id:032x}-{span_context.span_id:016x}"
        f"-{span_context.trace_flags:02x}\r\n"
    )
    if span_context.trace_state:
        lines += f"tracestate: {span_context.trace_state.to_header()}\r\n"
    return lines.encode("ascii")
